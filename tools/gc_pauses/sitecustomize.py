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


if _LOG:
    import gc

    gc.callbacks.append(_on_collection)
if os.environ.get("GC_PAUSES_NO_AUTOTUNE") == "1":
    sys.meta_path.insert(0, _AutotuneOff())
