"""A warm interpreter that runs test scripts in forked children (tests/_harness.py).

Importing TensorFlow, Keras and kd costs about 5 CPU seconds, and the suite
starts a fresh interpreter for every device layout: on a 2-core machine the
imports were over half of the suite's CPU time. This process imports them
once, without initializing TensorFlow's runtime (a child still chooses its
own device layout), then forks a child per request that runs the script as
`python -u script args...` would: its own session (process group), its own
environment, argv, working directory and `__main__`, its output on the
requester's pipe, and its exit status sent back.

A child ends as the interpreter would end the script (its threads joined,
its atexit functions run, its output flushed, the same exit status) but
skips the interpreter's teardown: a final garbage collection over every
TensorFlow and Keras object, then freeing them one by one. A child that
only starts a strategy took 1.3 to 2.0 s to be answered, its teardown
nearly all of it, and takes 0.1 s without. The objects imported here are
frozen out of the garbage collector (`gc.freeze`) before the first fork, so
a child's collections do not walk (and copy) them.

Protocol on the socket given as argv[1] (a file descriptor): a request is one
JSON line `{"argv": [...], "env": {...}, "cwd": ...}` sent with the output
pipe's descriptor (SCM_RIGHTS); the answer is a line `PID n`, then, when the
child has ended, `STATUS n` (a `os.waitpid` status). End of input ends this
process.
"""

import atexit
import gc
import json
import os
import runpy
import signal
import socket
import sys
import threading
import traceback


def _receive(channel):
    """(request, output descriptor), or (None, None) at the end of input."""
    data, descriptors, _, _ = socket.recv_fds(channel, 1 << 20, 1)
    if not data:
        return None, None
    return json.loads(data), descriptors[0]


def _run_child(request, output):
    """In the forked child: become `python -u argv...` and run the script."""
    os.setsid()
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = _run_script(script)
    threading._shutdown()  # the interpreter's own first step at exit: join non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # replaced, or closed, by the script
            pass
    return code


def _run_script(script):
    """Runs `script` as `__main__`; the exit status `python script` would end with.

    0-255, or -SIGINT for an uncaught KeyboardInterrupt (Python then ends by that signal).
    """
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return (exit_.code or 0) & 0xFF  # sys.exit(-1) ends with 255, as in Python
        print(exit_.code, file=sys.stderr)
        return 1
    except BaseException as error:
        sys.excepthook(*sys.exc_info())
        return -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1
    return 0


def main(descriptor):
    # The runtime must still be free: each child picks its device layout.
    from tensorflow.python.eager import context

    assert not context.context()._initialized, "TensorFlow initialized before the fork"
    channel = socket.socket(fileno=descriptor)
    gc.freeze()
    while True:
        request, output = _receive(channel)
        if request is None:
            return 0
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                channel.close()
                code = _run_child(request, output)
            except BaseException:
                traceback.print_exc()
            finally:
                if code < 0:  # an uncaught KeyboardInterrupt: end by SIGINT, as Python does
                    signal.signal(-code, signal.SIG_DFL)
                    os.kill(os.getpid(), -code)
                os._exit(code)
        os.close(output)
        channel.sendall(f"PID {pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        channel.sendall(f"STATUS {status}\n".encode())


if __name__ == "__main__":
    import keras  # noqa: F401

    import keras_distrib as kd

    # TensorFlow, Keras and kd: the cost shared (each public name loads its
    # module at first use; kd.testing is for the test process, not scripts).
    for name in kd.__all__:
        if name != "testing":
            getattr(kd, name)

    sys.exit(main(int(sys.argv[1])))
