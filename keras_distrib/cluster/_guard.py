"""The guard between the launcher and one task: no process of the task outlives it.

`python -I -S _guard.py LAUNCHER_PID ARGV...` (started by
`keras_distrib.cluster.task_process`, by file path so that nothing of the working
directory is imported) starts the task `ARGV` in its own process group and
waits. It is the task's "subreaper" (Linux `PR_SET_CHILD_SUBREAPER`): a
daemon the task starts (double fork, `setsid`) is re-parented to the guard
instead of to init, so the guard still sees it. The guard ends every
descendant when

- the task exits (a daemon it left behind gets SIGTERM, then SIGKILL),
- the launcher dies, even by SIGKILL (`PR_SET_PDEATHSIG` sends the guard
  SIGUSR2), or asks for it with SIGUSR2 before its final SIGKILL,

and exits with the task's status (a task killed by signal N: the guard
kills itself with N). SIGTERM/SIGINT/SIGHUP reach the task (through the
process group, or from Slurm) and the task saves and exits; the guard
ignores them. The task starts with SIGUSR1 ignored (kd's backup handler
takes it over): Slurm's warning goes to every process of the step, and the
launcher passes it on as SIGTERM.

`_guard.py --hold-netns` and `_guard.py --die-with-parent PID ARGV...`
serve `network.PrivateNetwork`: the first keeps the tasks' network
namespace, the second starts its route out (pasta).

Only the standard library, no keras_distrib import: it starts in ~20 ms.
"""

import ctypes
import os
import resource
import signal
import sys
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
# What the launcher's death (or its request) sends the guard.
STOP_SIGNAL = signal.SIGUSR2
# Signals the guard ignores: they reach the task itself (its process group,
# or Slurm signalling every process of the step), which saves and exits.
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
# Seconds a leftover daemon gets between SIGTERM and SIGKILL.
DAEMON_GRACE = 2.0


def _prctl(option, value):
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(root):
    """Pids of every live descendant of `root` (read from /proc)."""
    children = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] == "Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(name))
    found, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            found.append(pid)
            todo.append(pid)
    return found


def _signal_all(signum):
    pids = descendants(os.getpid())
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass
    return pids


def _reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_everything(grace):
    """SIGTERM every descendant, SIGKILL what is left after `grace` seconds."""
    if grace > 0 and _signal_all(signal.SIGTERM):
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            _reap()
            if not descendants(os.getpid()):
                return
            time.sleep(0.05)
    for _ in range(50):  # new forks may appear while killing
        _reap()
        if not _signal_all(signal.SIGKILL):
            return
        time.sleep(0.02)


# Private network namespace (`launch(private_network=True)`); `setns_fd` is
# also the network benchmark's (`keras_distrib.commands.bench_network`).
_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
_MS_BIND, _MS_REC, _MS_SLAVE = 0x1000, 0x4000, 0x80000
RESOLV_CONF = "/etc/resolv.conf"
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def _libc_call(name, *args):
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{name}: {os.strerror(error)}")


def setns_fd(fd, kind):
    """Moves the calling thread into the namespace open as `fd`, of `kind` (`CLONE_NEWNET`, ...).

    Raises:
        OSError: the kernel refused (its errno and message).
    """
    _libc_call("setns", fd, kind)


def _loopback_up():
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock, _SIOCGIFFLAGS, request)[:18])[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))


def hold_network_namespace(resolv_conf=None):
    """Creates a network namespace with only loopback, says READY, and keeps it until stdin closes.

    Root (CAP_SYS_ADMIN) makes a plain one; another user a user namespace
    too (mapped to the same uid), where the kernel allows it. With
    `resolv_conf` (a file), also a mount namespace in which that file is
    /etc/resolv.conf: this host's names the resolver on its own loopback
    (systemd-resolved's 127.0.0.53), which the namespace cannot reach.
    """
    uid, gid = os.getuid(), os.getgid()
    mounts = _CLONE_NEWNS if resolv_conf else 0
    try:
        _libc_call("unshare", CLONE_NEWNET | mounts)
    except OSError:
        _libc_call("unshare", _CLONE_NEWUSER | CLONE_NEWNET | mounts)
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                           ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    if resolv_conf:
        # Mounts of this host still reach the namespace; its own never reach the host.
        _libc_call("mount", None, b"/", None, ctypes.c_ulong(_MS_REC | _MS_SLAVE), None)
        _libc_call("mount", os.fsencode(resolv_conf), os.fsencode(os.path.realpath(RESOLV_CONF)),
                   None, ctypes.c_ulong(_MS_BIND), None)
    _loopback_up()
    print("READY", flush=True)
    sys.stdin.read()  # until the launcher closes it (or dies)


def join_network_namespace(holder):
    """Moves this process into the namespaces `holder` keeps: user (first), mount, network.

    The working directory is kept (joining a mount namespace resets it).
    Returns False if the holder has ended (the launcher is stopping the run).
    """
    cwd = os.getcwd()
    for kind, flag in (("user", _CLONE_NEWUSER), ("mnt", _CLONE_NEWNS), ("net", CLONE_NEWNET)):
        target = f"/proc/{holder}/ns/{kind}"
        try:
            if os.stat(target).st_ino == os.stat(f"/proc/self/ns/{kind}").st_ino:
                continue
            fd = os.open(target, os.O_RDONLY)
        except (FileNotFoundError, ProcessLookupError):  # it ended while we looked
            return False
        try:
            setns_fd(fd, flag)
        finally:
            os.close(fd)
    os.chdir(cwd)
    return True


def exec_dying_with_parent(parent, argv):
    """Becomes `argv`, which the kernel kills (SIGKILL) when `parent` dies, even by SIGKILL.

    For a helper that cannot tie its own lifetime to the launcher (pasta has
    no `--exit-fd` as slirp4netns has). Signals this interpreter ignores
    (SIGPIPE, SIGXFSZ) get their default action back: pasta refuses to start
    with SIGPIPE ignored.
    """
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:  # it died before the line above
        os._exit(128 + signal.SIGKILL)
    for signum in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(signum, signal.SIG_DFL)
    os.execv(argv[0], argv)


def main(argv):
    if argv[:1] == ["--hold-netns"]:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        return hold_network_namespace(*argv[1:2])
    if argv[:1] == ["--die-with-parent"]:
        return exec_dying_with_parent(int(argv[1]), argv[2:])
    launcher = int(argv[0])
    command = argv[1:]
    if command[:1] == ["--netns"]:
        if not join_network_namespace(int(command[1])):
            os._exit(128 + STOP_SIGNAL)  # the run is ending: nothing to start
        command = command[2:]
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)

    def stop(signum, frame):
        end_everything(0)
        os._exit(128 + STOP_SIGNAL)

    signal.signal(STOP_SIGNAL, stop)
    _prctl(_PR_SET_PDEATHSIG, int(STOP_SIGNAL))
    if os.getppid() != launcher:  # the launcher died before the line above
        os._exit(128 + STOP_SIGNAL)
    # Passed on to the task through the process group; the guard waits on.
    # SIGUSR1: Slurm's warning before a time limit (`--signal=USR1@<s>`) goes
    # to every process of the job step, the guard included; the task saves.
    for signum in PASSED_ON:
        signal.signal(signum, signal.SIG_IGN)
    # Blocked across the fork: a SIGTERM the launcher sends the group while
    # the child still has the guard's SIG_IGN would be discarded, and the
    # task would run on until the grace period ran out. Blocked, it waits
    # (Linux keeps a blocked signal pending even while it is ignored) and
    # reaches the task once the child restored its default action.
    signal.pthread_sigmask(signal.SIG_BLOCK, PASSED_ON)
    task = os.fork()
    if task == 0:
        for signum in (*PASSED_ON, STOP_SIGNAL):
            if signum != signal.SIGUSR1:
                signal.signal(signum, signal.SIG_DFL)
        # SIGUSR1 stays ignored into the task: Slurm's warning (sent to every
        # process of the step) must not kill a task still starting, before
        # kd's handler is installed (exit 138); the launcher, warned too,
        # passes SIGTERM on.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, PASSED_ON)
        try:
            os.execvp(command[0], command)
        except OSError as error:
            print(f"[launcher] cannot start {command[0]!r}: {error}", file=sys.stderr, flush=True)
            os._exit(127)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PASSED_ON)  # the guard's pending ones: ignored
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == task:
            break
    end_everything(DAEMON_GRACE)
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
        try:  # the task may have dumped core; the guard must not add its own
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        except (ValueError, OSError):
            pass
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)  # a signal that does not kill (e.g. SIGCHLD)
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main(sys.argv[1:])
