"""Ports and port locks of a launch on this host, and `LaunchError`.

`launch` picks free ports (`pick_ports`, `cluster_spec`), checks the ones
it is given (`port_problems`, `port_is_free`) and holds a lock per port
while it runs (`reserve_ports`, in this user's private `lock_directory`),
so a second launch on this host fails at once, naming the port and the
launch that holds it. `LaunchError` (kd.LaunchError) is every invalid
launch request's error, these checks' included.
"""

import contextlib
import errno
import fcntl
import os
import socket
import stat
import tempfile

import portpicker

from keras_distrib import validation

__all__ = [
    "LaunchError",
    "cluster_spec",
    "lock_directory",
    "open_lock",
    "pick_ports",
    "port_is_free",
    "port_problems",
    "reserve_ports",
]


class LaunchError(ValueError):
    """The launch request is invalid; nothing was started."""


def pick_ports(count):
    """`count` distinct free TCP ports on localhost."""
    ports = []
    while len(ports) < count:
        port = portpicker.pick_unused_port()
        if port not in ports:
            ports.append(port)
    return ports


def port_is_free(port):
    """Whether `port` can be bound on localhost right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("localhost", port))
        except OSError:
            return False
    return True


def cluster_spec(workers, ps=0, chief=False, ports=None):
    """A `{"worker": ["localhost:p", ...], ...}` cluster dict on localhost."""
    counts = {"chief": 1 if chief else 0, "worker": workers, "ps": ps}
    ports = list(ports) if ports is not None else pick_ports(sum(counts.values()))
    spec = {}
    for task_type in ("chief", "worker", "ps"):
        if counts[task_type]:
            spec[task_type] = [f"localhost:{ports.pop(0)}" for _ in range(counts[task_type])]
    return spec


def lock_directory():
    """This user's private directory for kd's port locks (created 0700; checked).

    Raises:
        LaunchError: the path is not a directory of this user's that only
            this user can write (naming it, and the fix).
    """
    path = os.path.join(tempfile.gettempdir(), f"kd-locks-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as error:
        raise LaunchError(f"Cannot create kd's lock directory {path!r} ({error.strerror}); "
                          "point TMPDIR at a writable directory.") from None
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        what = ("a symbolic link" if stat.S_ISLNK(info.st_mode) else
                "not a directory" if not stat.S_ISDIR(info.st_mode) else
                f"owned by uid {info.st_uid}" if info.st_uid != os.getuid() else
                f"writable by others (mode {stat.S_IMODE(info.st_mode):o})")
        raise LaunchError(
            f"kd's lock directory {path!r} is {what}: another user could block or fake this "
            "user's port locks. Remove it (kd creates it again, private), or point TMPDIR elsewhere.")
    return path


def open_lock(path):
    """An fd of the regular lock file at `path`, created if missing; refuses anything else."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o600)
    except OSError as error:
        raise LaunchError(f"Cannot open the port lock {path!r} ({error.strerror}): remove "
                          "whatever is there (kd writes a plain file).") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise LaunchError(f"The port lock {path!r} is not a regular file (a FIFO, socket or "
                          "device): kd did not write it. Remove it and launch again.")
    return fd


@contextlib.contextmanager
def reserve_ports(ports):
    """Holds a lock per port of `ports` (this host) while the launch runs.

    The free-port check cannot see a second launch started at the same
    moment: its tasks bind the ports seconds later. A lock file per port
    (`kd-port-<port>.lock` in this user's private directory, `lock_directory`;
    removed when released, and released when this process ends, however it
    ends) lets the second launch fail at once, naming the port and the
    launch that holds it. Another user's launch is not seen (their locks are
    private); the bind check still applies.

    Raises:
        LaunchError: another kd launch of this user holds one of `ports`, or
            a lock's path holds something kd did not write.
    """
    held = []
    try:
        folder = lock_directory() if ports else None
        for port in ports or ():
            path = os.path.join(folder, f"kd-port-{port}.lock")
            while True:
                fd = open_lock(path)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as error:
                    holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
                    os.close(fd)
                    if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise LaunchError(f"Cannot lock {path!r} ({error.strerror}).") from None
                    raise LaunchError(
                        f"Invalid launch request:\n  - `ports`: port {port} is taken by another kd "
                        f"launch on this host (pid {holder}, lock {path}); its task would fail "
                        "with 'Could not start gRPC server'. Wait for that launch to end, give "
                        "other ports, or leave `ports` out to pick free ones."
                    ) from None
                # The holder before us may have removed the file while we opened it.
                try:
                    same = os.stat(path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    break
                os.close(fd)
            held.append((fd, path))
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        for fd, path in held:
            try:
                os.unlink(path)  # while held: a waiting launch then sees another file
            except OSError:
                pass
            os.close(fd)


def port_problems(ports):
    """The problems with a launch's `ports` argument, as a list of messages."""
    if isinstance(ports, (str, bytes)) or not isinstance(ports, (list, tuple)):
        return [f"`ports`={ports!r}: expected a list of port numbers, one per task"]
    problems = []
    bad = [p for p in ports if not validation.is_whole(p, 1) or p > 65535]
    if bad:
        problems.append(f"`ports` {bad}: expected whole numbers in 1..65535")
    repeated = sorted({p for p in ports if ports.count(p) > 1 and p not in bad})
    if repeated:
        problems.append(
            f"`ports` lists {repeated} more than once; every task needs its own port "
            "(the second server would fail with 'Could not start gRPC server')"
        )
    return problems
