"""One task's process, as the launcher sees it: started under its guard, read, watched, stopped.

`Task` starts a task's command under `keras_distrib.cluster._guard` (in a
process group of its own, marked with a token every process of the task
inherits), relays each output line with the task's prefix, keeps its last
lines and a crash's faulthandler trace, notices a guard killed or stopped on
its own and a task that stays stopped (SIGSTOP), and ends them; `stop_all`
ends a run's tasks, given a grace period to save. `keras_distrib.cluster.supervisor`
runs a cluster of them.
"""

import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

from keras_distrib.cluster import _guard
from keras_distrib import tf_logs

__all__ = [
    "Task",
    "TaskResult",
    "end_token_processes",
    "guarded",
    "stop_all",
    "token_processes",
]

_TAIL_LINES = 20
# A crash's faulthandler trace (every thread's Python stack) is kept whole up to this.
_TRACE_LINES = 200
# How faulthandler's report of a crash begins (`failures.CRASH_SIGNALS`).
_CRASH_START = re.compile(r"^Fatal Python error: ")
# The variable that marks every process of one task (see `token_processes`).
TOKEN_VARIABLE = "KD_TASK_TOKEN"
# How often (seconds) the launcher looks whether a guard is stopped, and how
# long a stopped one is given before the launcher ends it and its task.
GUARD_CHECK_SECONDS = 0.5
# How long a task may stay stopped (SIGSTOP) before the launcher ends it.
STOPPED_TASK_SECONDS = 30.0


def guarded(argv, netns=None):
    """`argv` started under `keras_distrib.cluster._guard`: none of the task's processes outlives it.

    The guard is run by file path with `-I -S` (isolated: neither the working
    directory nor PYTHONPATH is searched); it ends the task's children and
    daemons when the task exits and when this process dies, even by SIGKILL.
    """
    extra = ["--netns", str(netns)] if netns else []
    return [sys.executable, "-I", "-S", _guard.__file__, str(os.getpid()), *extra, *argv]


@dataclasses.dataclass
class TaskResult:
    """How one task ended."""

    task_type: str
    task_index: int
    returncode: object  # int, or None if it was still running when stopped
    tail: list
    guard_fault: object = None  # what happened to the task's guard, when it failed on its own
    crash_trace: list = dataclasses.field(default_factory=list)  # faulthandler's lines, if it crashed
    stop_fault: object = None  # why the launcher ended it, when it stayed stopped (SIGSTOP)

    @property
    def label(self):
        return f"{self.task_type} {self.task_index}"


class Task:
    """One task's process under its guard: its output relayed and kept, its guard and stops watched."""

    def __init__(self, task_type, task_index, argv, env, sink, log_path, netns=None):
        self.task_type = task_type
        self.task_index = task_index
        self.tail = []
        self.crash_trace = []
        self._sink = sink
        # TensorFlow's start-up notices, repeated by every task (see tf_logs).
        self._hide_notices = tf_logs.hides_notices(env)
        self._log = open(log_path, "a") if log_path else None
        self._sink_broken = None
        # Every process of the task inherits it: found again if its guard is lost.
        self.token = f"{os.getpid()}-{uuid.uuid4().hex}"
        self.guard_fault = None
        self.stop_fault = None  # why the launcher ended a task that stayed stopped
        self._task_pid = None
        self._task_stopped_since = None
        self._stopped_since = None
        self._checked_at = 0.0
        self._exit_checked = False
        self.process = subprocess.Popen(
            guarded(argv, netns),
            env={**(os.environ if env is None else env), TOKEN_VARIABLE: self.token},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            # Bytes that are not UTF-8 are shown escaped (`\xff`), never stop the reader.
            encoding="utf-8",
            errors="backslashreplace",
            bufsize=1,
        )
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    @property
    def label(self):
        return f"{self.task_type} {self.task_index}"

    def _pump(self):
        prefix = f"[{self.label}] "
        for line in self.process.stdout:
            line = line.rstrip("\n")
            if self._log:
                self._log.write(line + "\n")
                self._log.flush()
            if self._hide_notices and tf_logs.is_startup_notice(line):
                continue
            if self.crash_trace or _CRASH_START.match(line):
                # faulthandler's report: kept whole (the tail keeps what came before).
                if len(self.crash_trace) < _TRACE_LINES:
                    self.crash_trace.append(line)
            else:
                self.tail = (self.tail + [line])[-_TAIL_LINES:]
            if self._sink_broken is None:
                try:
                    self._sink(prefix + line)
                except Exception as error:  # noqa: BLE001 - e.g. BrokenPipeError under `| head`
                    # Keep reading: a task blocked on a full pipe would never end.
                    self._sink_broken = error
        self.process.stdout.close()

    def check_guard(self):
        """Notices a guard that was killed or stopped on its own, and ends its task's processes.

        Returns True when the guard failed (its task's processes are then ended here).
        """
        if self.guard_fault is not None or self._exit_checked:
            return self.guard_fault is not None
        code = self.process.poll()
        if code is None:
            now = time.monotonic()
            if now - self._checked_at < GUARD_CHECK_SECONDS:
                return False
            self._checked_at = now
            if _process_state(self.process.pid) not in ("T", "t"):
                self._stopped_since = None
                self._check_task_stopped(now)
                return False
            self._stopped_since = self._stopped_since or now
            if now - self._stopped_since < GUARD_CHECK_SECONDS:
                return False
            self.process.kill()  # SIGKILL ends a stopped process too
            self.process.wait(timeout=10)
            ended = end_token_processes(self.token)
            self.guard_fault = (f"its guard (pid {self.process.pid}) was stopped (SIGSTOP or a "
                                f"debugger), so nothing watched the task; the launcher ended the "
                                f"guard and the task's {ended} process(es)")
            return True
        self._exit_checked = True
        ended = end_token_processes(self.token)
        if ended and code < 0:
            # The guard died by a signal while its task ran: the signal was the guard's, not the task's.
            self.guard_fault = (f"its guard (pid {self.process.pid}) was killed by signal {-code} "
                                f"while the task still ran; the launcher ended the task's {ended} "
                                "process(es)")
            return True
        return False

    def _check_task_stopped(self, now):
        """Ends a task that stays stopped (SIGSTOP) for `STOPPED_TASK_SECONDS`.

        Its peers' collectives would wait for it (or, once they finished, the
        launcher would), and nothing else ends a stopped process. A debugger's
        stop (state `t`) is left alone.
        """
        if self._task_pid is None:
            self._task_pid = _first_child(self.process.pid)
        if self._task_pid is None or _process_state(self._task_pid) != "T":
            self._task_stopped_since = None
            return
        self._task_stopped_since = self._task_stopped_since or now
        if now - self._task_stopped_since < STOPPED_TASK_SECONDS:
            return
        self.stop_fault = (f"it stayed stopped (SIGSTOP) for {STOPPED_TASK_SECONDS:g}s (pid "
                           f"{self._task_pid}), holding up the cluster; the launcher ended it. "
                           "Send SIGCONT to resume a task, or SIGTERM to stop it with a backup")
        try:
            os.kill(self._task_pid, signal.SIGKILL)  # the guard then ends the rest and exits
        except ProcessLookupError:
            pass

    def stop_guard(self):
        """Asks the guard to end every process of the task (daemons included)."""
        if self.process.poll() is None:
            try:
                os.kill(self.process.pid, _guard.STOP_SIGNAL)
            except ProcessLookupError:
                pass

    def signal_group(self, signum):
        """Sends `signum` to the task's process group (the guard and the task), if it still runs."""
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def last_words(self, timeout):
        """The tail of the task's output once it has all been read (a task that has ended)."""
        self._reader.join(timeout=timeout)
        return list(self.tail)

    def finish(self):
        """The `TaskResult` of the ended task, once its output is read and its log closed."""
        self._reader.join(timeout=5)
        if self._log:
            self._log.close()
        return TaskResult(self.task_type, self.task_index, self.process.poll(), list(self.tail),
                          self.guard_fault, list(self.crash_trace), self.stop_fault)


def _first_child(pid):
    """The first child of `pid` (the guard's task), or None."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def _process_state(pid):
    """The state letter of `/proc/<pid>/stat` (R, S, T, Z...), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def token_processes(token):
    """Pids of this user's live processes whose environment holds the task's token."""
    needle = f"{TOKEN_VARIABLE}={token}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
        except OSError:  # gone, or another user's
            continue
        if _process_state(name) not in (None, "Z"):
            found.append(int(name))
    return found


def end_token_processes(token):
    """SIGKILLs every process holding the task's token (daemons included); returns how many."""
    ended = set()
    for _ in range(20):  # new forks may appear while killing
        pids = token_processes(token)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                ended.add(pid)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)
    return len(ended)


def stop_all(tasks, grace, servers=()):
    """SIGTERM every live task's process group, then SIGKILL after `grace`.

    `servers` (a parameter-server cluster's ps and worker servers) serve on
    after SIGTERM, for the coordinator's final backup: the grace waits for
    the other tasks only, then SIGKILL ends the servers too.
    """
    live = [t for t in tasks if t.process.poll() is None]
    for task in live:
        task.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for task in live:
        if task in servers:
            continue
        try:
            task.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for task in tasks:
        task.stop_guard()
    for task in tasks:
        try:
            task.process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass
        # The group may hold grandchildren even after the leader exited.
        task.signal_group(signal.SIGKILL)
        try:
            task.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    for task in tasks:
        # A guard killed on its own left its task's daemons to init: found by token.
        end_token_processes(task.token)
