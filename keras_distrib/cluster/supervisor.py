"""Process supervision: start tasks, relay their output, stop them all.

`run_tasks` starts one process per task (each in its own process group, under
a guard, `keras_distrib.cluster._guard`, that ends the task's children and daemons when
the task exits and when this process dies, even by SIGKILL), prefixes every output line with the task
(`[worker 1] ...`), and stops everything at the first failure, at the
timeout, or when this process gets SIGTERM/SIGINT/SIGHUP. No process outlives it.
A SIGTERM to this process (a preemption: Slurm or Kubernetes stopping the
node) is passed on to the tasks, which get `grace_period` seconds to save a
backup and exit (kd's tasks exit with `RESTART_EXIT_CODE`, 42) before they
are killed. `keras_distrib.cluster.launcher` builds clusters on top of it.
"""

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

from keras_distrib import _early_signals
from keras_distrib import files
from keras_distrib.cluster import _guard
from keras_distrib.cluster import lost as lost_lib
from keras_distrib.cluster import network as network_lib
from keras_distrib import tf_logs

__all__ = [
    "ClusterResult",
    "RESTART_EXIT_CODE",
    "STOP_SIGNALS",
    "TaskResult",
    "TaskSpec",
    "ignore_stop_signals",
    "run_tasks",
    "signals_stop_the_cluster",
    "split_gpus",
    "stops_raise",
    "visible_gpus",
    "whole_lines",
]

GRACE_SECONDS = 5.0
# Signals to the launcher that stop the cluster, the tasks getting SIGTERM and
# the grace period to save: SIGTERM (a preemption, `scancel`), SIGINT
# (Ctrl-C) and SIGUSR1 (Slurm's `--signal=USR1@<seconds>` before a time limit).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
# What a task exits with after saving a backup on preemption: restart me.
# (TensorFlow's PreemptionCheckpointHandler exits with 42 outside Google's
# platforms too.) `keras_distrib.cluster.preemption` uses the same value.
RESTART_EXIT_CODE = 42
# What a task logs once its backup is written, just before it exits 42; the
# launcher reads it when the task is killed on its way out.
SAVED_MESSAGE = "Backed up for the preemption"
# What the launcher exits with when a task stopped on a configuration error
# that a rerun would meet again (the recipe's loop then does not rerun it).
CONFIG_EXIT_CODE = 2
# The errors of kd (last words of a task's traceback) that mean exactly that:
# the backup directory is another live run's, the backup is another run's, or
# its files are not the ones kd wrote.
_CONFIG_ERROR = re.compile(r"(Error|Exception): .*(is in use by another run: |does not match this "
                           r"run: |does not record what defines its run|fails its manifest check)")
# How long a parameter-server cluster's coordinator gets to report a lost
# ps task itself before the launcher stops the cluster.
PS_LOSS_WAIT = 30.0
# How long the launcher waits, once a task failed, for others that end with
# it, to name the one that ended first (`_first_cause`).
SETTLE_SECONDS = 0.5
_TAIL_LINES = 20
# A crash's faulthandler trace (every thread's Python stack) is kept whole up to this.
_TRACE_LINES = 200
# Signals that mean the task crashed in native code, and what each is. Python's
# faulthandler (PYTHONFAULTHANDLER, which the launcher sets) prints the
# task's Python stacks on each, starting with "Fatal Python error: ...".
CRASH_SIGNALS = {
    signal.SIGSEGV: "a segmentation fault: native code (TensorFlow, a library, an extension) "
                    "read or wrote memory it does not own",
    signal.SIGBUS: "a bus error: native code touched memory that has no backing (often a "
                   "memory-mapped file truncated under it, or /dev/shm full)",
    signal.SIGABRT: "an abort: native code stopped the process on a failed check (its message "
                    "is usually among the last lines)",
    signal.SIGILL: "an illegal instruction: native code built for another CPU (e.g. a "
                   "TensorFlow wheel using AVX instructions this CPU lacks), or a corrupt binary",
    signal.SIGFPE: "an arithmetic fault in native code (an integer division by zero)",
}
_CRASH_START = re.compile(r"^Fatal Python error: ")
# The variable that marks every process of one task (see `token_processes`).
TOKEN_VARIABLE = "KD_TASK_TOKEN"
# How often (seconds) the launcher looks whether a guard is stopped, and how
# long a stopped one is given before the launcher ends it and its task.
GUARD_CHECK_SECONDS = 0.5
# How long a task may stay stopped (SIGSTOP) before the launcher ends it.
STOPPED_TASK_SECONDS = 30.0
# Exit codes of a task ended by a stop signal before it handled it.
_STOPPED_CODES = tuple(code for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGKILL)
                       for code in (-sig, 128 + sig))


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


@dataclasses.dataclass
class ClusterResult:
    """How a launched cluster ended: the failing task (if any) and all tasks."""

    returncode: int
    tasks: list
    failed: object = None
    timed_out: bool = False
    restarts: int = 0
    signalled: bool = False  # the launcher itself got SIGTERM/SIGINT (no restart)
    lost: list = dataclasses.field(default_factory=list)  # workers given up on (`min_workers`)


def whole_lines(sink):
    """`sink`, called by one thread at a time; `print` becomes a whole-line write and flush.

    The tasks' reader threads share the sink: each line reaches the
    launcher's output in one write, never merged with another task's (nor,
    through `srun`, with another node's agent: stdout is flushed per line).
    """
    if getattr(sink, "whole_lines", False):
        return sink
    lock = threading.Lock()

    def write(line):
        with lock:
            if sink is print:
                stream = sys.stdout
                stream.write(f"{line}\n")
                stream.flush()
            else:
                sink(line)

    write.whole_lines = True
    return write


def visible_gpus(env=None):
    """GPU ids this launcher may hand out: CUDA_VISIBLE_DEVICES, else nvidia-smi."""
    env = os.environ if env is None else env
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g for g in listed.split(",") if g.strip() and g.strip() != "-1"]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        output = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(output.splitlines()) if line.startswith("GPU ")]


def split_gpus(gpus, tasks):
    """Gives each training task its own contiguous share of `gpus`.

    Returns {task label: CUDA_VISIBLE_DEVICES value}; "" (CPU only) for every
    task when there are no GPUs or fewer GPUs than tasks.
    """
    if not gpus or len(gpus) < len(tasks):
        return {task: "" for task in tasks}
    share = len(gpus) // len(tasks)
    return {task: ",".join(gpus[i * share:(i + 1) * share]) for i, task in enumerate(tasks)}


def guarded(argv, netns=None):
    """`argv` started under `keras_distrib.cluster._guard`: none of the task's processes outlives it.

    The guard is run by file path with `-I -S` (isolated: neither the working
    directory nor PYTHONPATH is searched); it ends the task's children and
    daemons when the task exits and when this process dies, even by SIGKILL.
    """
    extra = ["--netns", str(netns)] if netns else []
    return [sys.executable, "-I", "-S", _guard.__file__, str(os.getpid()), *extra, *argv]


class _Task:
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
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def last_words(self, timeout):
        """The tail of the task's output once it has all been read (a task that has ended)."""
        self._reader.join(timeout=timeout)
        return list(self.tail)

    def finish(self):
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


def _stop(tasks, grace=GRACE_SECONDS, servers=()):
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


@dataclasses.dataclass
class TaskSpec:
    """One process to start: its task, command line and environment."""

    task_type: str
    task_index: int
    argv: list
    env: dict
    watched: bool = True  # False: its exit does not end the run (ps-cluster servers)
    follower: bool = False  # stopped (SIGTERM) when the other watched tasks end, e.g. an evaluator
    vital: bool = False  # unwatched, but its exit ends the run (a ps task holds variables)

    @property
    def label(self):
        return f"{self.task_type} {self.task_index}"


def _said_saved(result):
    return any(SAVED_MESSAGE in line for line in result.tail[-5:])


def _lost_peer_message(result, own_label, service_task):
    """kd's explanation when a task ended because the cluster lost another task, else None."""
    lost = lost_lib.lost_tasks("\n".join(result.tail), own_label, service_task)
    return f"[launcher] {lost_lib.lost_task_message(lost, own_label)}" if lost else None


def _ps_lost_message(task, code):
    return (f"[launcher] {task.label} server exited with code {code}: the parameter servers "
            "hold the model's variables, so training cannot go on without it. Restart the "
            "job (--max-restarts; training resumes from its backup).")


# How a task ends when something outside kills it (the kernel out of memory,
# a scheduler, a person): its peers then fail because it is gone.
_KILLED_FROM_OUTSIDE = (-signal.SIGKILL, -signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP)
# A crash ends its peers the same way: it is the cause, not they. Not SIGABRT:
# TensorFlow aborts a task whose peer was lost (its coordination agent's check).
_CRASHED = tuple(-signum for signum in CRASH_SIGNALS if signum != signal.SIGABRT)


def _first_cause(watched, seen, stopped_followers=()):
    """The failed task to report, once `seen` failed: the one whose end ended the others.

    A task's death ends its peers within moments (their collectives fail),
    and the order the launcher sees their exits in is not always the order
    they died in (a killed task's end can reach it after its peers'). So it
    waits up to `SETTLE_SECONDS` for the others to end, then names a task
    that saved for a restart (exit 42: the others are saving the same
    step), else one that crashed (SIGSEGV, SIGBUS, SIGILL, SIGFPE) or
    was killed from outside (SIGKILL, SIGTERM, SIGINT, SIGHUP),
    else one whose last lines do not say the cluster lost a peer (a survivor's
    collective or heartbeat error names the task it lost), then one that
    such lines name, else the first it saw fail, in task order.
    """
    deadline = time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < deadline and any(t.process.poll() is None for t in watched):
        time.sleep(0.05)

    def code(task):
        return _exit_code(task, stopped_followers)

    failures = [t for t in watched if code(t) not in (None, 0)]
    host = lost_lib.service_task(t.task_type for t in watched)
    read_by = time.monotonic() + 1.0  # their output, read to its end: a second at most in all
    lost_by = {}
    for task in failures:
        words = task.last_words(timeout=max(0.0, read_by - time.monotonic()))
        lost_by[task.label] = lost_lib.lost_tasks("\n".join(words), task.label, host)
    named_lost = {name for names in lost_by.values() for name in names}
    # min() keeps the first of equals: task order.
    return min(failures, key=lambda t: (code(t) != RESTART_EXIT_CODE,
                                        code(t) not in _KILLED_FROM_OUTSIDE + _CRASHED,
                                        bool(lost_by[t.label]), t.label not in named_lost,
                                        t not in seen))


def _exit_code(task, stopped_followers=()):
    """The task's exit code (None while it runs).

    A follower the launcher stopped ended as asked (0), whether its own
    handler ran (exit 0) or the SIGTERM came as it was already on its way
    out, after its handler was gone (-15).
    """
    ended = task.process.poll()
    return 0 if task in stopped_followers and ended == -signal.SIGTERM else ended


def run_tasks(specs, *, timeout=None, sink=print, log_dir=None, grace_period=None,
              private_network=False):
    """Starts every task, waits, and stops them all; returns a `ClusterResult`.

    The run ends when every watched task exited 0, when a watched task
    fails (the others are stopped: SIGTERM, then SIGKILL after
    `GRACE_SECONDS`), or at `timeout` seconds (exit code 124). Followers
    (an evaluator) get SIGTERM once every other watched task exited 0, and
    the run waits for them to finish. A vital task (a ps server) that exits
    ends the run too, once the others had `PS_LOSS_WAIT` seconds to report it.

    When this process gets SIGTERM/SIGINT (inside `signals_stop_the_cluster`)
    the tasks get SIGTERM and `grace_period` seconds (default
    `GRACE_SECONDS`) to save and exit; the result's code is
    `RESTART_EXIT_CODE` if a task saved for a restart, else 128 + signal.

    With `private_network` (True, or "offline" for no route out), the tasks
    run in one network namespace of their own (`network.PrivateNetwork`): reachable
    from nowhere else.
    """
    scratch, specs = _own_temporary_directories(specs)
    try:
        network = network_lib.PrivateNetwork(outbound=private_network is True) if private_network else None
        try:
            return _Run(specs, timeout=timeout, sink=sink, log_dir=log_dir,
                        grace_period=grace_period, netns=network and network.pid).run()
        finally:
            if network is not None:
                network.close()
    finally:
        files.remove_scratch(scratch)


def _own_temporary_directories(specs):
    """`(scratch, specs)`: each task's TMPDIR a directory of its own in `scratch`.

    Removed with every task's temporary files once the tasks have ended: a
    task killed outright (SIGKILL, or ended after a SIGSTOP) cannot remove
    its own (TensorFlow's AutoGraph writes a file per converted function).
    Under the tasks' TMPDIR (else this process's).
    """
    environ = os.environ if not specs or specs[0].env is None else specs[0].env
    scratch = files.make_scratch("tasks", parent=environ.get("TMPDIR") or None)
    own = []
    for spec in specs:
        folder = os.path.join(scratch, f"{spec.task_type}_{spec.task_index}")
        os.mkdir(folder, 0o700)
        env = dict(os.environ if spec.env is None else spec.env, TMPDIR=folder)
        own.append(dataclasses.replace(spec, env=env))
    return scratch, own


class _Run:
    """One run of the tasks, watched until it ends: what started, how each ended, why it stopped.

    `run()` starts every task, looks at them every 50 ms (`_look`) until
    the run is over, stops them all (given `stop_grace` seconds) and returns
    the `ClusterResult`.
    """

    def __init__(self, specs, *, timeout, sink, log_dir, grace_period, netns):
        self.specs = specs
        self.timeout = timeout
        self.sink = whole_lines(sink)
        self.log_dir = log_dir
        self.netns = netns
        self.grace = GRACE_SECONDS if grace_period is None else grace_period
        self.started = time.monotonic()
        self.tasks = []
        # Kinds of task (set once they are started).
        self.watched = self.followers = self.leaders = self.vital = []
        # What happened.
        self.timed_out = False
        self.running = []  # the labels still running when the time was up
        self.failed = None  # the task whose end ends the run
        self.signalled = None  # 128 + the signal that stopped the launcher
        self.lost_ps = None  # (a vital task that exited, when it was seen)
        self.reported = set()  # servers whose exit was reported
        self.told_followers = False
        self.stop_grace = GRACE_SECONDS  # seconds the tasks get to end when stopped

    def run(self):
        """Starts, watches and stops the tasks; returns the `ClusterResult`."""
        try:
            # A signal kept while kd started or the launch was made ready: nothing runs yet.
            _raise_stops_from_now()
            self._start()
            while not self._look():
                time.sleep(0.05)
        except SystemExit as stop:
            self._stopped_by(stop.code)
        finally:
            _raising[0] = False
            with _signals_ignored():
                # The tasks are being stopped (and given the grace period to save):
                # a second signal must not cut that short.
                _stop(self.tasks, self.stop_grace,
                      servers=[t for t, spec in zip(self.tasks, self.specs) if not spec.watched])
        return self._result([t.finish() for t in self.tasks])

    def _start(self):
        for spec in self.specs:
            log_path = None
            if self.log_dir:
                os.makedirs(self.log_dir, exist_ok=True)
                log_path = os.path.join(self.log_dir, f"{spec.task_type}_{spec.task_index}.log")
            self.tasks.append(_Task(spec.task_type, spec.task_index, spec.argv, spec.env,
                                    self.sink, log_path, self.netns))
        pairs = list(zip(self.tasks, self.specs))
        self.watched = [t for t, spec in pairs if spec.watched]
        self.followers = [t for t, spec in pairs if spec.follower]
        self.leaders = [t for t in self.watched if t not in self.followers]
        self.vital = [t for t, spec in pairs if spec.vital]

    def _look(self):
        """One look at the tasks; True when the run is over."""
        for task in self.tasks:
            task.check_guard()
        stopped_followers = self.followers if self.told_followers else []
        codes = [_exit_code(t, stopped_followers) for t in self.tasks]
        if not self.watched:
            return self._servers_ended(codes)
        failures = [t for t, code in zip(self.tasks, codes)
                    if code not in (None, 0) and t in self.watched]
        self._report_servers(codes)
        if failures:
            self.failed = _first_cause(self.watched, failures, stopped_followers)
            if self.failed.process.returncode == RESTART_EXIT_CODE:
                # It saved for a preemption; the others are saving the same step.
                self.stop_grace = self.grace
            return True
        if self.lost_ps and time.monotonic() - self.lost_ps[1] > PS_LOSS_WAIT:
            self.failed = self.lost_ps[0]
            return True
        if all(code == 0 for t, code in zip(self.tasks, codes) if t in self.watched):
            return True
        if self.followers and not self.told_followers \
                and all(t.process.poll() == 0 for t in self.leaders):
            self.told_followers = True
            self.sink("[launcher] training ended; stopping "
                      + ", ".join(t.label for t in self.followers))
            for task in self.followers:
                task.signal_group(signal.SIGTERM)
        return self._out_of_time()

    def _servers_ended(self, codes):
        # A node that runs only servers (a per-node agent's ps and
        # worker tasks): they end once the coordinator is gone.
        if all(code is not None for code in codes):
            self.failed = next((t for t, code in zip(self.tasks, codes) if code != 0), None)
            return True
        return self._out_of_time()

    def _report_servers(self, codes):
        for task, code in zip(self.tasks, codes):
            if code is None or task in self.watched or task.label in self.reported:
                continue
            self.reported.add(task.label)
            if task in self.vital:
                self.sink(_ps_lost_message(task, code))
                self.lost_ps = self.lost_ps or (task, time.monotonic())
            else:
                # A parameter-server cluster's coordinator retries the steps of
                # a lost worker elsewhere: report it, keep the cluster running.
                self.sink(f"[launcher] {task.label} server exited with code {code}; "
                          "the coordinator carries on without it")

    def _out_of_time(self):
        if self.timeout is not None and time.monotonic() - self.started > self.timeout:
            self.timed_out = True
            self.running = [t.label for t in self.tasks if t.process.poll() is None]
            return True
        return False

    def _stopped_by(self, code):
        # SIGTERM/SIGINT to the launcher (see signals_stop_the_cluster): pass
        # it on, and give the tasks time to save (a preemption's grace).
        self.signalled = code
        self.stop_grace = self.grace
        name = signal.Signals(code - 128).name
        if not self.tasks:
            self.sink(f"[launcher] got {name} before any task started; none runs")
        else:
            self.sink(f"[launcher] got {name}; passing SIGTERM on, "
                      f"{_save_time(code - 128, self.grace)}")

    def _result(self, results):
        """The `ClusterResult` of the ended tasks' `results`, with what the launcher says of it."""
        sink, timeout = self.sink, self.timeout
        signalled, timed_out, running, failed = self.signalled, self.timed_out, self.running, self.failed
        if signalled is not None:
            codes = [r.returncode for r in results]
            # A task that saved may still be killed on its way out (Slurm ends the
            # step once another node's task exited 42): its last words count.
            saved = RESTART_EXIT_CODE in codes or any(_said_saved(r) for r in results)
            # A task the warning signal ended before it could handle it (still
            # starting: no backup callback yet) lost nothing a restart would not
            # redo: ask for the restart, not a failure. A SIGTERM is a stop
            # (scancel, `kill`): 128 + 15 unless a task saved.
            stopped = [c for c in codes if c in (0, None) or c in _STOPPED_CODES]
            restart = signalled - 128 == signal.SIGUSR1 and len(stopped) == len(codes)
            code = RESTART_EXIT_CODE if saved or restart else signalled
            sink(f"[launcher] stopped; exit codes: " + ", ".join(f"{r.label}={r.returncode}" for r in results))
            return ClusterResult(code, results, signalled=True)
        if timed_out:
            # Which tasks ran when the time was up (stopping them changed their codes since).
            sink(f"[launcher] timeout after {timeout:g}s; still running: {', '.join(running) or 'none'}")
            return ClusterResult(124, results, timed_out=True)
        if failed is not None:
            result = next(r for r in results if r.label == failed.label)
            code = result.returncode if result.returncode is not None else 1
            code = code if code > 0 else 128 - code  # killed by a signal
            for line in _failure_report(result):
                sink(line)
            if result.returncode == 1 and any(_CONFIG_ERROR.search(line) for line in result.tail):
                code = CONFIG_EXIT_CODE
                sink(f"[launcher] {result.label} stopped on a configuration error that a rerun would "
                     f"meet again (see above): exit {CONFIG_EXIT_CODE}.")
            if result.guard_fault:
                sink(f"[launcher] {result.label} failed because {result.guard_fault}. kd's guard "
                     "ends a task's processes when the task or the launcher ends; stop the launcher "
                     "or the task, not the guard.")
            elif result.stop_fault:
                sink(f"[launcher] {result.label} failed because {result.stop_fault}. {lost_lib.ADVICE}")
            elif result.returncode is not None and result.returncode < 0:
                sink(f"[launcher] {_signal_explanation(result.label, -result.returncode)} "
                     f"{lost_lib.ADVICE}")
            explanation = _lost_peer_message(
                result, result.label, lost_lib.service_task(r.task_type for r in results))
            if explanation:
                sink(explanation)
            return ClusterResult(code, results, failed=result)
        return ClusterResult(0, results)


def _signal_name(signum):
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _failure_report(result):
    """The launcher's lines about the failed task: how it ended, its last lines, a crash's trace."""
    label, code = result.label, result.returncode
    signum = -code if isinstance(code, int) and code < 0 else None
    if signum in CRASH_SIGNALS:
        lines = [f"[launcher] {label} crashed: {_signal_name(signum)} (signal {signum}, "
                 f"{CRASH_SIGNALS[signum]}); stopped the others. Last lines:"]
    else:
        lines = [f"[launcher] {label} exited with code {code}; stopped the others. Last lines:"]
    lines += [f"[launcher]   {line}" for line in result.tail]
    if result.crash_trace:
        lines.append(f"[launcher] {label}'s faulthandler trace (its Python threads when it "
                     "stopped, most recent call first):")
        lines += [f"[launcher]   {line}" for line in result.crash_trace]
    elif signum in CRASH_SIGNALS:
        lines.append(f"[launcher] {label} printed no faulthandler trace (it ran with "
                     "PYTHONFAULTHANDLER unset or empty, or crashed before Python started).")
    return lines


def _signal_explanation(label, signum):
    """Why a task a signal ended may have ended (a crash is told by `_failure_report`)."""
    if signum in CRASH_SIGNALS:
        return (f"{label} crashed in native code ({_signal_name(signum)}): its Python stacks "
                "above show where; a rerun from the backup may pass if the crash is rare.")
    if signum == signal.SIGKILL:
        return (f"{label} was killed by signal 9 (SIGKILL: out of memory (the kernel's OOM "
                "killer; `dmesg` says so), a preemption without grace, or by hand).")
    if signum == signal.SIGTERM:
        return (f"{label} was killed by signal 15 (SIGTERM: a stop request, from `kill`, a "
                "cluster manager or a preemption, that ended it before it could save; kd's "
                "BackupAndRestore saves and exits 42 on SIGTERM once training has begun).")
    return (f"{label} was killed by signal {signum} ({_signal_name(signum)}: sent by another "
            "process or by hand).")


def _slurm_kill_wait():
    """Slurm's KillWait in seconds (SIGTERM to SIGKILL), or None where it cannot be read."""
    try:
        done = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                              timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"^KillWait\s*=\s*(\d+)", done.stdout, re.M)
    return int(match.group(1)) if match else None


def _save_time(signum, grace):
    """What the tasks have to save: the grace period, or less where Slurm's SIGTERM kills sooner."""
    if signum == signal.SIGTERM and os.environ.get("SLURM_JOB_ID"):
        # Slurm's SIGTERM (scancel, the time limit) comes with SIGKILL KillWait seconds later.
        kill_wait = _slurm_kill_wait()
        if kill_wait is None:
            return (f"the tasks have until Slurm's SIGKILL to save and exit (KillWait seconds "
                    f"after its SIGTERM, 30 by default; --grace-period {grace:g}s)")
        return (f"the tasks have {min(grace, kill_wait):g}s to save and exit (Slurm's KillWait: "
                f"SIGKILL {kill_wait}s after its SIGTERM)")
    return f"the tasks have {grace:g}s to save and exit"


@contextlib.contextmanager
def _signals_ignored():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def ignore_stop_signals():
    """After the run: the exit code is decided, a late signal must not change it.

    Under `srun --kill-on-bad-exit=1`, the first node's agent to exit 42
    makes Slurm send SIGTERM to the others, which are then exiting 42 too.
    """
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


# Whether a stop signal raises SystemExit now (main thread only; see signals_stop_the_cluster).
_raising = [False]


def _raise_stops_from_now():
    """From here a stop signal raises SystemExit; one kept before raises at once."""
    _raising[0] = True
    early = _early_signals.take()
    if early is not None:
        raise SystemExit(128 + early)


@contextlib.contextmanager
def stops_raise():
    """Within: a stop signal raises SystemExit, a kept one first (a restart's wait)."""
    try:
        _raise_stops_from_now()
        yield
    finally:
        _raising[0] = False


@contextlib.contextmanager
def signals_stop_the_cluster():
    """A signal of `STOP_SIGNALS` to the launcher unwinds it, so its `finally` stops every task.

    The tasks then get SIGTERM and the grace period to save (SIGUSR1 is
    Slurm's warning before a time limit, `--signal=USR1@<seconds>`). The
    signal raises only inside `_Run.run`'s `try` (or `stops_raise`); one
    that comes before, while the launch is made ready (ports, task specs, a
    private network), is kept, and `_Run.run` acts on it first: no task
    starts, and the result says what a signal while starting says.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        if _raising[0]:
            raise SystemExit(128 + signum)
        _early_signals.keep(signum)

    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


