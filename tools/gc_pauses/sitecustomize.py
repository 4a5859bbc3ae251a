"""Logs every full garbage collection's wall and CPU time, in any Python process started with
this directory first on PYTHONPATH (a diagnostic for the test suite's idle time, not part of kd).

    GC_PAUSES_LOG=/tmp/gc.txt PYTHONPATH=tools/gc_pauses python -m pytest -n 0 -q TEST
    awk '{wall += $3; cpu += $4} END {print wall, cpu}' /tmp/gc.txt

One line per generation-2 collection: pid, thread, wall seconds, CPU seconds of the process,
and the pytest test running (PYTEST_CURRENT_TEST), or `-` outside one.
A collection whose wall time far exceeds its CPU time waited on something: on TensorFlow 2.21
a tf.data iterator freed by the collector, whose destructor waits for the input pipeline's
autotuning thread to wake up (seen: 1 to 40 s). `GC_PAUSES_NO_AUTOTUNE=1` turns tf.data's
autotuning off in every `tf.data.Options()` (Keras's own pipelines included), the contrast that
shows the wait is that thread's.

`GC_PAUSES_PROCESSES=/tmp/p.txt` logs each Python process's own CPU and wall seconds as it
exits normally: pid, CPU, wall, whether it imported TensorFlow, the test that started it (the
environment it inherited), its script and first argument. A forked child (the tests' warm
interpreter's) inherits no start time and is not logged; a killed process is not either.
"""

import importlib.abc
import os
import sys
import threading
import time

_LOG = os.environ.get("GC_PAUSES_LOG")
_started = {}


def _on_collection(phase, info):
    if info["generation"] != 2:
        return
    if phase == "start":
        _started["wall"], _started["cpu"] = time.time(), time.process_time()
        return
    wall = time.time() - _started["wall"]
    cpu = time.process_time() - _started["cpu"]
    with open(_LOG, "a") as log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "-").split(" ")[0]
        log.write(f"{os.getpid()} {threading.current_thread().name} {wall:.2f} {cpu:.2f} {test}\n")


class _AutotuneOff(importlib.abc.MetaPathFinder):
    """Patches tf.data.Options once TensorFlow has defined it (at the next import after)."""

    done = False

    def find_spec(self, name, path, target=None):
        module = sys.modules.get("tensorflow.python.data.ops.options")
        if not self.done and module is not None and hasattr(module, "Options"):
            self.done = True
            original = module.Options.__init__

            def without_autotune(options, *args, **kwargs):
                original(options, *args, **kwargs)
                options.autotune.enabled = False

            module.Options.__init__ = without_autotune
        return None


_PROCESSES = os.environ.get("GC_PAUSES_PROCESSES")


def _log_process(started_wall):
    if os.getpid() != _started["pid"]:
        return  # a forked child
    times = os.times()
    test = os.environ.get("PYTEST_CURRENT_TEST", "-").split(" ")[0]
    script = " ".join(os.path.basename(a) for a in sys.argv[:2]) or "-"
    with open(_PROCESSES, "a") as log:
        log.write(f"{os.getpid()} {times.user + times.system:.2f} {time.time() - started_wall:.2f} "
                  f"{int('tensorflow' in sys.modules)} {test} {script}\n")


if _PROCESSES:
    import atexit

    _started["pid"] = os.getpid()
    atexit.register(_log_process, time.time())
if _LOG:
    import gc

    gc.callbacks.append(_on_collection)
if os.environ.get("GC_PAUSES_NO_AUTOTUNE") == "1":
    sys.meta_path.insert(0, _AutotuneOff())
