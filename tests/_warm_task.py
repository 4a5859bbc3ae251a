"""A launched task that runs its script in a child of the warm interpreter.

`python -u _warm_task.py SCRIPT ARGS...`, started by kd's launcher in place
of `python -u SCRIPT ARGS...` (tests/_harness.py `run_cluster`): the script
runs forked from tests/_warm.py (TensorFlow already imported, about 5 CPU
seconds saved per task) with this process's environment, working directory,
stdin, stdout and stderr, and this process ends as the script ended (its exit
status, or killed by the same signal). The signals a task gets from its
launcher (SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2) are passed on to the
script's process group, and killing this process (SIGKILL included) kills
the script: the launcher's supervision sees one process, as with a fresh
task. Without $KD_TESTS_WARM_SOCKET, or where the warm interpreter answers
FRESH, this process becomes `python -u SCRIPT ARGS...` itself (exec).

Only the standard library: it starts in a few milliseconds.
"""

import json
import os
import signal
import socket
import sys

SOCKET_VARIABLE = "KD_TESTS_WARM_SOCKET"
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _exec_fresh(argv, ignored, pending):
    for signum in PASSED_ON:
        signal.signal(signum, signal.SIG_IGN if signum in ignored else signal.SIG_DFL)
    for signum in pending:  # arrived before the script could start: as if it had
        os.kill(os.getpid(), signum)
    os.execv(sys.executable, [sys.executable, "-u", *argv])


def _end_as(status):
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those cannot be caught
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


def main(argv):
    ignored = [s for s in PASSED_ON if signal.getsignal(s) == signal.SIG_IGN]
    env = dict(os.environ)
    path = env.pop(SOCKET_VARIABLE, None)
    if not path:
        os.execv(sys.executable, [sys.executable, "-u", *argv])
    pending, child = [], []

    def pass_on(signum, frame):
        if not child:
            pending.append(signum)
            return
        try:
            os.killpg(child[0], signum)
        except ProcessLookupError:
            pass

    for signum in PASSED_ON:
        signal.signal(signum, pass_on)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        connection.connect(path)
    except OSError:  # the warm interpreter is gone
        _exec_fresh(argv, ignored, pending)
    request = {"argv": argv, "env": env, "cwd": os.getcwd(), "ignored": ignored}
    socket.send_fds(connection, [json.dumps(request).encode()], [0, 1, 2])
    answers = connection.makefile("r")
    line = answers.readline()
    if line.startswith("FRESH"):
        _exec_fresh(argv, ignored, pending)
    if not line.startswith("PID "):
        print(f"_warm_task.py: the warm interpreter ended: {line!r}", file=sys.stderr)
        os._exit(1)
    child.append(int(line.split()[1]))
    for signum in pending:
        pass_on(signum, None)
    line = answers.readline()
    if not line.startswith("STATUS "):
        print(f"_warm_task.py: the warm interpreter ended: {line!r}", file=sys.stderr)
        os._exit(1)
    _end_as(int(line.split()[1]))


if __name__ == "__main__":
    main(sys.argv[1:])
