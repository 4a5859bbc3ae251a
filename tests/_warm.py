"""A warm interpreter that runs test scripts in forked children (tests/_harness.py).

Importing TensorFlow, Keras and kd costs about 5 CPU seconds, and the suite
starts a fresh interpreter for every device layout: on a 2-core machine the
imports were over half of the suite's CPU time. This process imports them
once, without initializing TensorFlow's runtime (a child still chooses its
own device layout), then forks a child per request that runs the script as
`python -u script args...` would: its own session (process group), its own
environment, argv, working directory and `__main__`, its output on the
requester's pipe, and its exit status sent back.

Protocol on the socket given as argv[1] (a file descriptor): a request is one
JSON line `{"argv": [...], "env": {...}, "cwd": ...}` sent with the output
pipe's descriptor (SCM_RIGHTS); the answer is a line `PID n`, then, when the
child has ended, `STATUS n` (a `os.waitpid` status). End of input ends this
process.
"""

import json
import os
import runpy
import signal
import socket
import sys


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
    runpy.run_path(script, run_name="__main__")


def main(descriptor):
    # The runtime must still be free: each child picks its device layout.
    from tensorflow.python.eager import context

    assert not context.context()._initialized, "TensorFlow initialized before the fork"
    channel = socket.socket(fileno=descriptor)
    while True:
        request, output = _receive(channel)
        if request is None:
            return 0
        pid = os.fork()
        if pid == 0:
            channel.close()
            _run_child(request, output)
            return 0  # the interpreter then ends as a script's would (atexit, threads, flush)
        os.close(output)
        channel.sendall(f"PID {pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        channel.sendall(f"STATUS {status}\n".encode())


if __name__ == "__main__":
    import keras_distrib  # noqa: F401  (TensorFlow, Keras and kd: the cost shared)
    import keras  # noqa: F401

    sys.exit(main(int(sys.argv[1])))
