"""Files that survive faults: atomic writes, Keras's permissions, owner locks, scratch space.

Every kd writer goes through this module, so three rules hold everywhere:

- A file appears complete or not at all: it is written under a temporary
  name in its destination folder and renamed into place.
- Files and directories end up with the permissions Keras (`open`,
  `os.makedirs`) would give them, `0o666` / `0o777` less the umask, even
  though the temporary names are created private (`0o600` / `0o700`) and
  a rename keeps the mode.
- A directory that a run owns is locked (`DirectoryLock`): a second live
  run is refused, a lock left by a dead run is taken over (and logged).
  Temporary entries (`.tmp-kd-*`) and scratch directories (`kd-scratch-*`)
  carry their owner's host and pid, so a writer removes its own leftovers
  and those of dead processes, never another live run's.
"""

import atexit
import datetime
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import stat
import tempfile
import threading

__all__ = [
    "DirectoryInUseError",
    "DirectoryLock",
    "ScratchError",
    "UnsafeLockError",
    "atomic_write_text",
    "host_tag",
    "make_scratch",
    "process_alive",
    "process_start_ticks",
    "publish",
    "remove_dead_staging",
    "remove_scratch",
    "share_like_keras",
    "staging_directory",
    "staging_file",
    "umask",
]

logger = logging.getLogger("keras_distrib")

LOCK_NAME = ".kd-lock.json"
STAGING_PREFIX = ".tmp-kd-"
SCRATCH_PREFIX = "kd-scratch-"


# Permissions.


def umask():
    """This process's umask, read without changing it where possible."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    # Elsewhere the only way to read it is to set it; set it straight back.
    current = os.umask(0o022)
    os.umask(current)
    return current


def share_like_keras(path):
    """Gives `path` the mode a plain `open` or `os.makedirs` would have given it.

    `tempfile` creates private files (0o600) and directories (0o700); after
    a rename they would stay unreadable to a serving job under another user.
    Directories are walked: every entry gets the mode of its kind.
    """
    mask = umask()
    if os.path.isdir(path) and not os.path.islink(path):
        os.chmod(path, 0o777 & ~mask)
        for root, folders, names in os.walk(path):
            for folder in folders:
                os.chmod(os.path.join(root, folder), 0o777 & ~mask)
            for name in names:
                os.chmod(os.path.join(root, name), 0o666 & ~mask)
    else:
        os.chmod(path, 0o666 & ~mask)


# Owners: this host and process, and whether another process still runs.


def host_tag():
    """A short, filename-safe tag of this host (8 hex digits)."""
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def process_start_ticks(pid):
    """When `pid` started (clock ticks since boot), or None if unknown.

    Stored next to a pid so that a pid reused by an unrelated process is not
    mistaken for the owner.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def process_alive(pid, start_ticks=None):
    """Whether process `pid` (of this host) still runs, and is the same process."""
    try:
        pid = int(pid)
        os.kill(pid, 0)
    except (ValueError, TypeError, OverflowError, ProcessLookupError):
        return False
    except PermissionError:
        pass  # It exists, under another user.
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False  # A zombie has finished.
    except OSError:
        return False  # It ended between the two looks (ENOENT or ESRCH).
    except IndexError:
        pass
    if start_ticks is not None:
        ticks = process_start_ticks(pid)
        if ticks is not None and ticks != int(start_ticks):
            return False
    return True


def _owner_tag():
    """`<host>-<pid>-<start ticks>`: who made a staging entry or scratch directory."""
    return f"{host_tag()}-{os.getpid()}-{process_start_ticks(os.getpid()) or 0}"


def own_scratch_prefix():
    """The name every scratch directory of this process starts with (see `make_scratch`)."""
    return f"{SCRATCH_PREFIX}{_owner_tag()}-"


def _owned_by_dead_process(name, prefix):
    """Whether entry `name` (`<prefix><owner tag>-...`) belongs to a dead process here.

    Entries of other hosts or of unknown form are never claimed.
    """
    parts = name[len(prefix):].split("-")
    if len(parts) < 3 or parts[0] != host_tag() or not (parts[1].isdigit() and parts[2].isdigit()):
        return False
    pid, ticks = int(parts[1]), int(parts[2])
    if pid == os.getpid():
        return False
    return not process_alive(pid, ticks or None)


# Atomic writes.


def staging_directory(directory, name):
    """A new private directory in `directory` for building entry `name`."""
    return tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{_owner_tag()}-{name}-", dir=directory)


def staging_file(directory, suffix=""):
    """A new private, empty file in `directory`; returns its path."""
    handle, path = tempfile.mkstemp(prefix=f"{STAGING_PREFIX}{_owner_tag()}-", suffix=suffix,
                                    dir=directory)
    os.close(handle)
    return path


def publish(staging, final):
    """Renames a finished staging entry into place with Keras's permissions."""
    share_like_keras(staging)
    os.replace(staging, final)


def atomic_write_text(path, text):
    """Writes `text` to `path` so that readers see the old or the new file, whole."""
    temp = staging_file(os.path.dirname(path) or ".")
    try:
        with open(temp, "w") as f:
            f.write(text)
        publish(temp, path)
    finally:
        if os.path.exists(temp):
            os.remove(temp)


def remove_dead_staging(directory):
    """Removes staging entries of this process and of dead processes on this host.

    Another live run's entries (and anything not named by kd) are kept.
    Returns the names removed.
    """
    removed = []
    if not os.path.isdir(directory):
        return removed
    for name in os.listdir(directory):
        if not name.startswith(STAGING_PREFIX):
            continue
        mine = name.startswith(f"{STAGING_PREFIX}{_owner_tag()}-")
        if mine or _owned_by_dead_process(name, STAGING_PREFIX):
            path = os.path.join(directory, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass
            removed.append(name)
    return removed


# Scratch directories (non-chief writers).

_scratch_lock = threading.Lock()
_live_scratch = set()


def _remove_live_scratch():
    for path in list(_live_scratch):
        shutil.rmtree(path, ignore_errors=True)
        _live_scratch.discard(path)


atexit.register(_remove_live_scratch)


class ScratchError(OSError):
    """The temporary directory (TMPDIR) cannot hold kd's scratch space."""


def _scratch_error(parent, error):
    reason = error.strerror or str(error)
    named = os.environ.get("TMPDIR")
    where = (f"TMPDIR={named!r}" if named else f"the temporary directory {parent!r} "
             "(TMPDIR is not set)")
    fix = ("Free space there" if error.errno in (errno.ENOSPC, errno.EDQUOT)
           else "Make it writable")
    return ScratchError(
        error.errno,
        f"kd cannot make its scratch space in {where}: {reason}. {fix}, or point TMPDIR at "
        "a writable directory with space (e.g. `export TMPDIR=/scratch/$USER` before the "
        "launch; each task inherits it).",
    )


_tmpdir_warned = set()


def _warn_if_tmpdir_skipped(parent):
    """Python quietly falls back to /tmp when TMPDIR is unusable: say so, once."""
    named = os.environ.get("TMPDIR")
    if not named or named in _tmpdir_warned or os.path.realpath(named) == os.path.realpath(parent):
        return
    _tmpdir_warned.add(named)
    try:
        probe = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}probe-", dir=named)
        try:
            with open(os.path.join(probe, ".probe"), "wb") as f:
                f.write(b"kd")
            reason = "unusable"
        finally:
            shutil.rmtree(probe, ignore_errors=True)
    except OSError as error:
        reason = error.strerror or str(error)
    logger.warning("TMPDIR=%r is not usable (%s); temporary files go to %s instead. Free "
                   "space there or point TMPDIR at a writable directory.", named, reason, parent)


def make_scratch(label, parent=None):
    """A private temporary directory that does not outlive this process.

    It is removed by `remove_scratch`, or at interpreter exit; a process
    killed outright (SIGKILL, OOM) cannot clean up, so every call also
    removes the scratch directories of dead processes of this host.

    Args:
        label: A short name for the directory, e.g. `"worker1"`.
        parent: Where to make it; the temporary directory (TMPDIR) by default.

    Returns:
        The directory's path.

    Raises:
        ScratchError: (an `OSError`) the temporary directory is full, not
            writable or missing; the message names TMPDIR and the fix.
    """
    if parent is None:
        try:
            parent = tempfile.gettempdir()
        except OSError as error:  # no usable temporary directory at all
            raise _scratch_error(os.environ.get("TMPDIR", "/tmp"), error) from None
        _warn_if_tmpdir_skipped(parent)
    try:
        for name in os.listdir(parent):
            if name.startswith(SCRATCH_PREFIX) and _owned_by_dead_process(name, SCRATCH_PREFIX):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
                logger.info("Removed %s, scratch space of a process that no longer runs.",
                            os.path.join(parent, name))
    except OSError:
        pass
    safe = "".join(c for c in str(label) if c.isalnum()) or "kd"
    path = None
    try:
        path = tempfile.mkdtemp(prefix=f"{own_scratch_prefix()}{safe}-", dir=parent)
        # A full disk still lets a directory be made; a first write fails.
        probe = os.path.join(path, ".probe")
        with open(probe, "wb") as f:
            f.write(b"kd")
        os.remove(probe)
    except OSError as error:
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)
        raise _scratch_error(parent, error) from None
    with _scratch_lock:
        _live_scratch.add(path)
    return path


def remove_scratch(path):
    """Removes a directory made by `make_scratch` (ignored if already gone)."""
    shutil.rmtree(path, ignore_errors=True)
    with _scratch_lock:
        _live_scratch.discard(path)


# Directory locks.


class DirectoryInUseError(RuntimeError):
    """Another live run holds the directory's lock."""


# What a lock path that is not a plain file is, and why kd does not use it.
_NOT_A_LOCK_FILE = {
    stat.S_IFLNK: ("a symbolic link", " (writing through a link would overwrite its target)"),
    stat.S_IFDIR: ("a directory", ""),
    stat.S_IFIFO: ("a FIFO (a named pipe)", " (opening a FIFO waits for a reader; no lock is held in one)"),
    stat.S_IFSOCK: ("a socket", ""),
    stat.S_IFCHR: ("a character device", " (writing would reach the device)"),
    stat.S_IFBLK: ("a block device", " (writing would reach the device)"),
}


class UnsafeLockError(RuntimeError):
    """The lock file's path holds something kd did not write (a symbolic link, a directory)."""


_held_lock = threading.Lock()
_held = {}  # real path of a lock file -> its open, flock-ed file descriptor


def _read_owner(path):
    try:
        with open(path) as f:
            owner = json.load(f)
        return owner if isinstance(owner, dict) else None
    except (OSError, ValueError):
        return None


def _describe(owner):
    if not owner:
        return "an unknown process"
    return (f"pid {owner.get('pid')} on host {owner.get('host')!r}, started "
            f"{owner.get('started', 'at an unknown time')}")


def _owner_alive(owner):
    """Whether the process a lock file names still runs (False if unknown)."""
    if not owner or owner.get("host") != socket.gethostname():
        return owner is not None  # Another host's process cannot be checked: assume it runs.
    return process_alive(owner.get("pid"), owner.get("ticks"))


class DirectoryLock:
    """The owner file of a directory: one live run at a time writes there.

    The lock file `.kd-lock.json` names its owner (pid, host, start time)
    and is held with `flock`, which the kernel releases when the owner
    dies, however it dies. A lock file whose owner is gone is taken over,
    and that is logged. A process is one run: every `DirectoryLock` of one
    directory in a process shares the process's hold, and `release` (e.g.
    at the end of training) ends it for all of them.

    Args:
        directory: The directory to own (created if missing).
        what: What the directory holds, for messages (e.g. `"backup"`).
    """

    def __init__(self, directory, what="checkpoint"):
        self.directory = os.fspath(directory)
        self.path = os.path.join(self.directory, LOCK_NAME)
        self.what = what

    @property
    def _key(self):
        return os.path.realpath(self.path)

    @property
    def held(self):
        """Whether this process holds the directory's lock."""
        with _held_lock:
            return self._key in _held

    def acquire(self):
        """Takes the lock (a no-op if this process holds it already).

        Raises:
            DirectoryInUseError: another live process holds it.
        """
        os.makedirs(self.directory, exist_ok=True)
        with _held_lock:
            if self._key not in _held:
                _held[self._key] = self._take()
        return self

    def _check_regular(self, mode=None):
        """Refuses a lock path that is a symbolic link, a directory, a FIFO, a socket or a device."""
        if mode is None:
            try:
                mode = os.lstat(self.path).st_mode
            except FileNotFoundError:
                return
        if stat.S_ISREG(mode):
            return
        kind, why = _NOT_A_LOCK_FILE.get(stat.S_IFMT(mode), ("not a regular file", ""))
        raise UnsafeLockError(
            f"The lock file {self.path!r} of the {self.what} directory is {kind}; kd writes its "
            f"lock there as a plain file and follows nothing{why}. Remove {self.path!r} (it is "
            "not kd's), then run again."
        )

    def _open(self):
        self._check_regular()
        try:
            # O_NONBLOCK: a FIFO put there since the check must not block the open.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                self._check_regular()  # replaced since the check: name it
            raise
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            self._check_regular(mode)
        return fd

    def _take(self):
        for _ in range(10):
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(fd)
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    return self._take_without_flock(error)
                self._refuse(_read_owner(self.path))
            # A releasing owner may have unlinked the file we opened: then
            # the lock that counts is the new file at the path; start over.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                try:
                    self._write_owner(fd, _read_owner(self.path))
                except OSError:
                    os.close(fd)  # e.g. a full disk: the caller names it
                    raise
                return fd
            os.close(fd)
        raise DirectoryInUseError(f"Could not lock {self.path!r}: it keeps being replaced.")

    def _take_without_flock(self, error):
        """Where `flock` is unsupported: the owner file alone, checked by pid."""
        owner = _read_owner(self.path)
        if owner and _owner_alive(owner) and not self._is_me(owner):
            self._refuse(owner)
        fd = self._open()
        logger.debug("flock unavailable on %s (%s); using the owner file alone.", self.path, error)
        self._write_owner(fd, owner)
        return fd

    @staticmethod
    def _is_me(owner):
        return owner.get("host") == socket.gethostname() and owner.get("pid") == os.getpid()

    def _refuse(self, owner):
        fix = ("Stop that run first, or give this run another directory.")
        if owner and owner.get("host") != socket.gethostname():
            fix += (f" If that run has ended (it ran on another host, so this one cannot check), "
                    f"delete {self.path!r}.")
        raise DirectoryInUseError(
            f"The {self.what} directory {self.directory!r} is in use by another run: "
            f"{_describe(owner)} (lock file {self.path!r}). Two runs writing one directory "
            f"would delete or overwrite each other's checkpoints, and one would resume from "
            f"the other's. {fix}"
        )

    def _write_owner(self, fd, previous):
        if previous and not self._is_me(previous):
            logger.warning(
                "Took over the lock of %s %r left by %s, which no longer runs.",
                self.what, self.directory, _describe(previous),
            )
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "ticks": process_start_ticks(os.getpid()),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(owner).encode(), 0)
        os.fsync(fd)
        try:
            os.fchmod(fd, 0o666 & ~umask())
        except OSError:
            pass  # Another user's file taken over: its mode is theirs to set.

    def release(self):
        """Gives the lock back and removes the lock file (if this process holds it)."""
        with _held_lock:
            fd = _held.pop(self._key, None)
        if fd is None:
            return
        try:
            os.remove(self.path)
        except OSError:
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass
        os.close(fd)

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _release_all():
    with _held_lock:
        entries = list(_held.items())
        _held.clear()
    for path, fd in entries:
        try:
            os.remove(path)
        except OSError:
            pass
        os.close(fd)


atexit.register(_release_all)
