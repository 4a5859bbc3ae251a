"""Process supervision: start tasks, relay their output, stop them all.

`run_tasks` starts one process per task (each in its own process group, and
killed if this process dies), prefixes every output line with the task
(`[worker 1] ...`), and stops everything at the first failure, at the
timeout, or when this process gets SIGTERM/SIGINT. No process outlives it.
`keras_distrib.launcher` builds clusters on top of it.
"""

import contextlib
import ctypes
import dataclasses
import os
import shutil
import signal
import subprocess
import threading
import time

from keras_distrib import tf_logs

__all__ = [
    "ClusterResult",
    "TaskResult",
    "TaskSpec",
    "run_tasks",
    "signals_stop_the_cluster",
    "split_gpus",
    "visible_gpus",
]

GRACE_SECONDS = 5.0
_TAIL_LINES = 20


@dataclasses.dataclass
class TaskResult:
    """How one task ended."""

    task_type: str
    task_index: int
    returncode: object  # int, or None if it was still running when stopped
    tail: list

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


def _die_with_parent():
    """In the child: get SIGKILL if the launcher dies, even by SIGKILL (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _Task:
    def __init__(self, task_type, task_index, argv, env, sink, log_path):
        self.task_type = task_type
        self.task_index = task_index
        self.tail = []
        self._sink = sink
        # TensorFlow's start-up notices, repeated by every task (see tf_logs).
        self._hide_notices = tf_logs.hides_notices(env)
        self._log = open(log_path, "a") if log_path else None
        self.process = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            text=True,
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
            self.tail = (self.tail + [line])[-_TAIL_LINES:]
            self._sink(prefix + line)
        self.process.stdout.close()

    def signal_group(self, signum):
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def finish(self):
        self._reader.join(timeout=5)
        if self._log:
            self._log.close()
        return TaskResult(self.task_type, self.task_index, self.process.poll(), list(self.tail))


def _stop(tasks, grace=GRACE_SECONDS):
    """SIGTERM every live task's process group, then SIGKILL after `grace`."""
    live = [t for t in tasks if t.process.poll() is None]
    for task in live:
        task.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for task in live:
        try:
            task.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for task in tasks:
        # The group may hold grandchildren even after the leader exited.
        task.signal_group(signal.SIGKILL)
        try:
            task.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass


@dataclasses.dataclass
class TaskSpec:
    """One process to start: its task, command line and environment."""

    task_type: str
    task_index: int
    argv: list
    env: dict
    watched: bool = True  # False: its exit does not end the run (ps-cluster servers)
    follower: bool = False  # stopped (SIGTERM) when the other watched tasks end, e.g. an evaluator

    @property
    def label(self):
        return f"{self.task_type} {self.task_index}"


def run_tasks(specs, *, timeout=None, sink=print, log_dir=None):
    """Starts every task, waits, and stops them all; returns a `ClusterResult`.

    The run ends when every watched task exited 0, when a watched task
    fails (the others are stopped: SIGTERM, then SIGKILL after
    `GRACE_SECONDS`), or at `timeout` seconds (exit code 124). Followers
    (an evaluator) get SIGTERM once every other watched task exited 0, and
    the run waits for them to finish.
    """
    tasks = []
    started = time.monotonic()
    timed_out = False
    failed = None
    try:
        for spec in specs:
            log_path = None
            if log_dir:
                os.makedirs(log_dir, exist_ok=True)
                log_path = os.path.join(log_dir, f"{spec.task_type}_{spec.task_index}.log")
            tasks.append(_Task(spec.task_type, spec.task_index, spec.argv, spec.env, sink, log_path))
        watched = [t for t, spec in zip(tasks, specs) if spec.watched]
        followers = [t for t, spec in zip(tasks, specs) if spec.follower]
        leaders = [t for t in watched if t not in followers]
        told_followers = False
        reported = set()
        while True:
            codes = [t.process.poll() for t in tasks]
            failures = [t for t, code in zip(tasks, codes) if code not in (None, 0) and t in watched]
            for task, code in zip(tasks, codes):
                # A parameter-server cluster's coordinator retries the steps of
                # a lost worker elsewhere: report it, keep the cluster running.
                if code is not None and task not in watched and task.label not in reported:
                    reported.add(task.label)
                    sink(f"[launcher] {task.label} server exited with code {code}; "
                         "the coordinator carries on without it")
            if failures:
                failed = failures[0]
                break
            if all(t.process.poll() == 0 for t in watched):
                break
            if followers and not told_followers and all(t.process.poll() == 0 for t in leaders):
                told_followers = True
                sink("[launcher] training ended; stopping " + ", ".join(t.label for t in followers))
                for task in followers:
                    task.signal_group(signal.SIGTERM)
            if timeout is not None and time.monotonic() - started > timeout:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        _stop(tasks)
    results = [t.finish() for t in tasks]
    if timed_out:
        running = [r.label for r in results if r.returncode in (None, -9, -15)]
        sink(f"[launcher] timeout after {timeout:g}s; still running: {', '.join(running) or 'none'}")
        return ClusterResult(124, results, timed_out=True)
    if failed is not None:
        result = next(r for r in results if r.label == failed.label)
        code = result.returncode if result.returncode is not None else 1
        code = code if code > 0 else 128 - code  # killed by a signal
        sink(f"[launcher] {result.label} exited with code {result.returncode}; stopped the others. Last lines:")
        for line in result.tail:
            sink(f"[launcher]   {line}")
        return ClusterResult(code, results, failed=result)
    return ClusterResult(0, results)


@contextlib.contextmanager
def signals_stop_the_cluster():
    """SIGTERM/SIGINT to the launcher unwind it, so its `finally` stops every task."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


