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

Clients connect to the listening Unix socket (SOCK_SEQPACKET) whose
descriptor is argv[1] (bound by the harness), one connection per script:
the harness itself, and the tasks kd's launcher starts as
tests/_warm_task.py. A request is one JSON message `{"argv": [...], "env":
{...}, "cwd": ..., "ignored": [signal numbers]}` sent with the output pipe's
descriptor, or a task's stdin, stdout and stderr (SCM_RIGHTS). The answer is
`FRESH` when the environment differs in what is read at import (the client
then starts a fresh interpreter), else a line `PID n`, then, when the child
has ended, `STATUS n` (an `os.waitpid` status). Children run at the same
time; a client that goes away first (killed) takes its child's process group
with it. The end of input on the descriptor argv[2] ends this process and
kills the children left.
"""

import atexit
import gc
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import tempfile
import threading
import traceback


def _receive(connection):
    """(request, descriptors), or (None, []) when the client sent nothing."""
    data, descriptors, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    if not data:
        return None, descriptors
    return json.loads(data), descriptors


def _read_at_import(env):
    """What modules imported here read from the environment at their import, read from `env`.

    TensorFlow imports matplotlib, which takes its backend from MPLBACKEND
    then: a Jupyter kernel's (ipykernel sets it to its inline backend where
    unset) is applied as a fresh import would apply it. The other variables
    read at import are compared instead (`IMPORT_TIME`: FRESH where they differ).
    """
    matplotlib = sys.modules.get("matplotlib")
    if matplotlib is not None and env.get("MPLBACKEND"):
        matplotlib.rcParams["backend"] = env["MPLBACKEND"]


def _run_child(request, descriptors):
    """In the forked child: become `python -u argv...` and run the script.

    `descriptors` become the child's stdout and stderr (one: both), or its
    stdin, stdout and stderr (three: a launched task's own).
    """
    os.setsid()
    targets = {1: (1, 2), 2: (1, 2), 3: (0, 1, 2)}[len(descriptors)]
    for index, target in enumerate(targets):
        os.dup2(descriptors[min(index, len(descriptors) - 1)], target)
    for descriptor in descriptors:
        if descriptor not in targets:
            os.close(descriptor)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in request.get("ignored", ()):  # as the task was started (kd's launcher: SIGUSR1)
        signal.signal(signum, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(request["env"])
    _read_at_import(os.environ)
    tempfile.tempdir = None  # chosen at first use from TMPDIR, as in a fresh interpreter
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


# Environment variables TensorFlow, Keras, kd or Python read while they
# import: a request whose values differ from this process's is answered
# FRESH (the client then starts a fresh interpreter).
IMPORT_TIME = ("TF_", "KERAS_", "CUDA_", "XLA_", "PYTHON", "OMP_", "MKL_", "LD_")


def _import_time(env):
    """The variables of `env` read while TensorFlow, Keras, kd or Python import.

    TF_CONFIG is read when a strategy is made, not at import, and
    PYTHONUNBUFFERED is left out (this interpreter runs with `-u`, as every
    task does); PYTHONPATH is compared without the empty and '.' entries
    the launcher drops.
    """
    kept = {k: v for k, v in env.items()
            if k.startswith(IMPORT_TIME) and k not in ("TF_CONFIG", "PYTHONUNBUFFERED")}
    if "PYTHONPATH" in kept:
        kept["PYTHONPATH"] = os.pathsep.join(p for p in kept["PYTHONPATH"].split(os.pathsep)
                                             if p not in ("", "."))
    return kept


class _Server:
    """Forks a child per request and answers each client on its own connection.

    The children run at the same time (a cluster's tasks). A client that goes
    away before its child ended (killed, even by SIGKILL) takes the child's
    process group with it.
    """

    def __init__(self, listener, control):
        self.listener = listener
        self.control = control
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, ("accept", None))
        self.selector.register(control, selectors.EVENT_READ, ("control", None))
        self.children = {}  # pid -> (connection, pidfd)
        self.waiting = set()  # connections whose request has not come yet
        self.import_time = _import_time(os.environ)

    def serve(self):
        while True:
            for key, _ in self.selector.select():
                kind, value = key.data
                if kind == "control":
                    return self.end()
                if kind == "accept":
                    try:
                        connection, _ = self.listener.accept()
                    except OSError:  # the client went away before it was accepted
                        continue
                    self.waiting.add(connection)
                    self.selector.register(connection, selectors.EVENT_READ, ("request", connection))
                elif kind == "request":
                    self.waiting.discard(value)
                    self.selector.unregister(value)
                    self.start(value)
                elif kind == "ended":
                    self.reap(value)
                elif kind == "client" and not _receives(value[0]):  # the client went away first
                    _kill_group(value[1])

    def start(self, connection):
        try:
            request, descriptors = _receive(connection)
        except OSError:  # the client went away while it sent its request
            request, descriptors = None, []
        if request is None or _import_time(request["env"]) != self.import_time:
            for descriptor in descriptors:
                os.close(descriptor)
            if request is not None:
                _send(connection, b"FRESH\n")
            connection.close()
            return
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                self.close_in_child(connection)
                code = _run_child(request, descriptors)
            except BaseException:
                traceback.print_exc()
            finally:
                if code < 0:  # an uncaught KeyboardInterrupt: end by SIGINT, as Python does
                    signal.signal(-code, signal.SIG_DFL)
                    os.kill(os.getpid(), -code)
                os._exit(code)
        for descriptor in descriptors:
            os.close(descriptor)
        pidfd = os.pidfd_open(pid)
        self.children[pid] = (connection, pidfd)
        self.selector.register(pidfd, selectors.EVENT_READ, ("ended", pid))
        self.selector.register(connection, selectors.EVENT_READ, ("client", (connection, pid)))
        if not _send(connection, f"PID {pid}\n".encode()):
            _kill_group(pid)  # reaped when it has ended, as any child

    def reap(self, pid):
        connection, pidfd = self.children.pop(pid)
        _, status = os.waitpid(pid, 0)
        self.selector.unregister(pidfd)
        self.selector.unregister(connection)
        os.close(pidfd)
        _kill_group(pid)  # what the script left in its group
        _send(connection, f"STATUS {status}\n".encode())
        connection.close()

    def close_in_child(self, connection):
        """The child keeps none of the server's descriptors (a client sees its own end only)."""
        self.selector.close()
        for sock in (self.listener, self.control, connection, *self.waiting):
            sock.close()
        for other, pidfd in self.children.values():
            other.close()
            os.close(pidfd)

    def end(self):
        for pid in list(self.children):
            _kill_group(pid)
        for pid in list(self.children):
            os.waitpid(pid, 0)
        return 0


# A client can be killed at any moment (a launcher ends its tasks, a test its
# processes). The server outlives it: a socket whose peer closed with an answer
# unread raises ECONNRESET here, which once ended this process and failed every
# later script of that pytest worker.
def _send(connection, data):
    """True when `data` was sent; False when the client has gone away."""
    try:
        connection.sendall(data)
        return True
    except OSError:
        return False


def _receives(connection):
    """True while the client is connected (it sends nothing after its request)."""
    try:
        return bool(connection.recv(1024))
    except OSError:
        return False


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main(listener, control):
    # The runtime must still be free: each child picks its device layout.
    from tensorflow.python.eager import context

    assert not context.context()._initialized, "TensorFlow initialized before the fork"
    gc.freeze()
    return _Server(socket.socket(fileno=listener), socket.socket(fileno=control)).serve()


if __name__ == "__main__":
    import keras  # noqa: F401

    import keras_distrib as kd

    # TensorFlow, Keras and kd: the cost shared (each public name loads its
    # module at first use; kd.testing is for the test process, not scripts).
    for name in kd.__all__:
        if name != "testing":
            getattr(kd, name)

    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
