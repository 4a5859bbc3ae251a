"""Process supervision: start a cluster's tasks, watch them, stop them all.

`run_tasks` starts one process per task (`keras_distrib.cluster.task_process`:
each in its own process group, under a guard that ends the task's children
and daemons when the task exits and when this process dies, even by
SIGKILL; every output line prefixed with the task, `[worker 1] ...`), and
stops everything at the first failure, at the timeout, or when this process
gets a stop signal (`keras_distrib.cluster.stop_signals`). No process
outlives it. A SIGTERM to this process (a preemption: Slurm or Kubernetes
stopping the node) is passed on to the tasks, which get `grace_period`
seconds to save a backup and exit (kd's tasks exit with
`failures.RESTART_EXIT_CODE`, 42) before they are killed. The run is one
object, `_Run`, with its state named; `keras_distrib.cluster.failures` names
the task that ended it and says why, and a local cluster's tasks may run in
a network of their own (`keras_distrib.cluster.network`).
`keras_distrib.cluster.launcher` builds clusters on top of it.
"""

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

from keras_distrib import files
from keras_distrib.cluster import failures
from keras_distrib.cluster import network as network_lib
from keras_distrib.cluster import stop_signals
from keras_distrib.cluster.task_process import Task
from keras_distrib.cluster.task_process import stop_all

__all__ = [
    "ClusterResult",
    "TaskSpec",
    "run_tasks",
    "split_gpus",
    "visible_gpus",
    "whole_lines",
]

GRACE_SECONDS = 5.0
# How long a parameter-server cluster's coordinator gets to report a lost
# ps task itself before the launcher stops the cluster.
PS_LOSS_WAIT = 30.0


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
    network: str = None  # a local launch's: "private", "offline" or "open"


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
    exit_note: str = ""  # what the launcher adds when an unwatched task exits (why the run goes on)

    @property
    def label(self):
        return f"{self.task_type} {self.task_index}"



def run_tasks(specs, *, timeout=None, sink=print, log_dir=None, grace_period=None,
              private_network=False, no_route_out=None):
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
    from nowhere else. `no_route_out`: where they have no route out, the
    advice a failure on a network error ends with.
    """
    scratch, specs = _own_temporary_directories(specs)
    try:
        network = network_lib.PrivateNetwork(outbound=private_network is True) if private_network else None
        try:
            return _Run(specs, timeout=timeout, sink=sink, log_dir=log_dir,
                        grace_period=grace_period, netns=network and network.pid,
                        no_route_out=no_route_out).run()
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

    def __init__(self, specs, *, timeout, sink, log_dir, grace_period, netns, no_route_out=None):
        self.specs = specs
        self.timeout = timeout
        self.sink = whole_lines(sink)
        self.log_dir = log_dir
        self.netns = netns
        self.no_route_out = no_route_out
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
            stop_signals.raise_from_now()
            self._start()
            while not self._look():
                time.sleep(0.05)
        except SystemExit as stop:
            self._stopped_by(stop.code)
        finally:
            stop_signals.stop_raising()
            with stop_signals.signals_ignored():
                # The tasks are being stopped (and given the grace period to save):
                # a second signal must not cut that short.
                stop_all(self.tasks, self.stop_grace,
                         servers=[t for t, spec in zip(self.tasks, self.specs) if not spec.watched])
        return self._result([t.finish() for t in self.tasks])

    def _start(self):
        for spec in self.specs:
            log_path = None
            if self.log_dir:
                os.makedirs(self.log_dir, exist_ok=True)
                log_path = os.path.join(self.log_dir, f"{spec.task_type}_{spec.task_index}.log")
            self.tasks.append(Task(spec.task_type, spec.task_index, spec.argv, spec.env,
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
        codes = [failures.exit_code(t, stopped_followers) for t in self.tasks]
        if not self.watched:
            return self._servers_ended(codes)
        failed = [t for t, code in zip(self.tasks, codes)
                  if code not in (None, 0) and t in self.watched]
        self._report_servers(codes)
        if failed:
            self.failed = failures.first_cause(self.watched, failed, stopped_followers)
            if self.failed.process.returncode == failures.RESTART_EXIT_CODE:
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
                self.sink(failures.ps_lost_message(task, code))
                self.lost_ps = self.lost_ps or (task, time.monotonic())
            else:
                # A parameter-server cluster's coordinator retries the steps of
                # a lost worker elsewhere: report it, keep the cluster running.
                note = next(spec.exit_note for t, spec in zip(self.tasks, self.specs) if t is task)
                self.sink(f"[launcher] {task.label} server exited with code {code}; "
                          + (note or "the coordinator carries on without it"))

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
                      f"{stop_signals.save_time(code - 128, self.grace)}")

    def _result(self, results):
        """The `ClusterResult` of the ended tasks' `results`, with what the launcher says of it."""
        if self.signalled is not None:
            code = failures.stopped_code(self.signalled, results)
            self.sink("[launcher] stopped; exit codes: "
                      + ", ".join(f"{r.label}={r.returncode}" for r in results))
            return ClusterResult(code, results, signalled=True)
        if self.timed_out:
            # Which tasks ran when the time was up (stopping them changed their codes since).
            self.sink(f"[launcher] timeout after {self.timeout:g}s; still running: "
                      f"{', '.join(self.running) or 'none'}")
            return ClusterResult(124, results, timed_out=True)
        if self.failed is not None:
            result = next(r for r in results if r.label == self.failed.label)
            code, lines = failures.failure_report(result, results, no_route_out=self.no_route_out)
            for line in lines:
                self.sink(line)
            return ClusterResult(code, results, failed=result)
        return ClusterResult(0, results)
