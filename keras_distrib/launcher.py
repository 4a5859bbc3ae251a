"""Start a local cluster: one process per task, each with its own TF_CONFIG.

The launcher picks free ports, starts every task, prefixes each output line
with the task (`[worker 1] ...`), stops everything at the first failure or
at the timeout, and can restart the whole cluster. No process outlives it.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import portpicker

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


def cluster_spec(workers, ps=0, chief=False, ports=None):
    """A `{"worker": ["localhost:p", ...], ...}` cluster dict on localhost."""
    counts = {"chief": 1 if chief else 0, "worker": workers, "ps": ps}
    ports = list(ports) if ports is not None else pick_ports(sum(counts.values()))
    spec = {}
    for task_type in ("chief", "worker", "ps"):
        if counts[task_type]:
            spec[task_type] = [f"localhost:{ports.pop(0)}" for _ in range(counts[task_type])]
    return spec


def tf_config(spec, task_type, task_index):
    return json.dumps({"cluster": spec, "task": {"type": task_type, "index": task_index}})


def validate(workers, ps, chief, max_restarts, timeout):
    problems = []
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        problems.append(f"`workers`={workers!r}: expected a whole number >= 1")
    if isinstance(ps, bool) or not isinstance(ps, int) or ps < 0:
        problems.append(f"`ps`={ps!r}: expected a whole number >= 0")
    if ps and chief:
        problems.append(
            "`chief` with `ps`: in a parameter-server cluster the script itself "
            "is the coordinator (chief); drop `chief`"
        )
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        problems.append(f"`max_restarts`={max_restarts!r}: expected a whole number >= 0")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        problems.append(f"`timeout`={timeout!r}: expected seconds > 0, or None")
    if problems:
        raise LaunchError("Invalid launch request:\n  - " + "\n  - ".join(problems))


class _Task:
    def __init__(self, task_type, task_index, argv, env, sink, log_path):
        self.task_type = task_type
        self.task_index = task_index
        self.tail = []
        self._sink = sink
        self._log = open(log_path, "a") if log_path else None
        self.process = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
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
            self.tail = (self.tail + [line])[-_TAIL_LINES:]
            if self._log:
                self._log.write(line + "\n")
                self._log.flush()
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


def run_once(argv_for, *, workers, ps=0, chief=False, timeout=None, env=None,
             sink=print, log_dir=None, server_argv=None):
    """Starts one cluster and waits for it. See `launch` for the arguments.

    `argv_for(task_type, task_index)` gives each task's command line; with
    `ps` tasks, worker and ps tasks run `server_argv` instead and only the
    chief (the coordinator) runs the script.
    """
    spec = cluster_spec(workers, ps=ps, chief=chief or bool(ps))
    tasks = []
    base_env = dict(os.environ if env is None else env)
    base_env.setdefault("CUDA_VISIBLE_DEVICES", "")
    base_env["PYTHONUNBUFFERED"] = "1"
    started = time.monotonic()
    timed_out = False
    try:
        for task_type, addresses in spec.items():
            for index in range(len(addresses)):
                task_env = dict(base_env)
                task_env["TF_CONFIG"] = tf_config(spec, task_type, index)
                task_env["KD_TASK"] = f"{task_type} {index}"
                if ps and task_type in ("worker", "ps"):
                    argv = server_argv
                else:
                    argv = argv_for(task_type, index)
                log_path = None
                if log_dir:
                    os.makedirs(log_dir, exist_ok=True)
                    log_path = os.path.join(log_dir, f"{task_type}_{index}.log")
                tasks.append(_Task(task_type, index, argv, task_env, sink, log_path))
        # In a parameter-server cluster the servers never exit on their own:
        # the coordinator's exit ends the run.
        watched = [t for t in tasks if not (ps and t.task_type in ("worker", "ps"))]
        failed = None
        while True:
            codes = [t.process.poll() for t in tasks]
            failures = [
                t for t, code in zip(tasks, codes) if code not in (None, 0)
            ]
            if failures:
                failed = failures[0]
                break
            if all(t.process.poll() == 0 for t in watched):
                break
            if timeout is not None and time.monotonic() - started > timeout:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        _stop(tasks)
    results = [t.finish() for t in tasks]
    if timed_out:
        running = [r.label for r, t in zip(results, tasks) if t.label and r.returncode in (None, -9, -15)]
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


def _script_argv(script, args):
    return lambda task_type, index: [sys.executable, "-u", script, *args]


def launch(target, *, workers=2, ps=0, chief=False, args=(), max_restarts=0,
           timeout=None, log_dir=None, env=None, sink=print):
    """Runs `target` on a local cluster and returns a `ClusterResult`.

    Args:
        target: A script path, or an importable function given as a callable
            or as `"package.module:function"`; a function is called with
            `*args` in every task and its return value is collected.
        workers: Worker processes (>= 1).
        ps: Parameter-server tasks; then workers run servers and `target`
            runs once, as the coordinator.
        chief: Add a separate chief task.
        args: Command-line arguments (script) or positional arguments
            (function).
        max_restarts: Restart the whole cluster on fresh ports up to this
            many times after a failure.
        timeout: Seconds for each attempt; `None` for no limit.
        log_dir: Also write each task's output to `DIR/<type>_<index>.log`.
        env: Environment for the tasks (this process's by default).
        sink: Where prefixed output lines go (`print` by default).

    Returns:
        A `ClusterResult`; for a function target, `.values` maps each task
        label to its return value.

    Raises:
        LaunchError: invalid arguments (nothing is started).
    """
    validate(workers, ps, chief, max_restarts, timeout)
    from keras_distrib import _task_entry

    values_dir = None
    if isinstance(target, str) and ":" not in target:
        if not os.path.isfile(target):
            raise LaunchError(
                f"`target`={target!r} is not a file. Pass the path of a Python "
                "script, a function, or 'package.module:function'."
            )
        argv_for = _script_argv(target, [str(a) for a in args])
    else:
        spec = _task_entry.function_spec(target)
        import tempfile

        values_dir = tempfile.mkdtemp(prefix="kd_launch_")
        argv_for = _task_entry.argv_factory(spec, args, values_dir)
    server_argv = [sys.executable, "-u", "-m", "keras_distrib._task_entry", "--server"]
    try:
        attempt = 0
        while True:
            result = run_once(
                argv_for, workers=workers, ps=ps, chief=chief, timeout=timeout,
                env=env, sink=sink, log_dir=log_dir, server_argv=server_argv,
            )
            result.restarts = attempt
            if result.returncode == 0 or attempt >= max_restarts:
                break
            attempt += 1
            sink(f"[launcher] restarting the cluster ({attempt}/{max_restarts})")
        if values_dir is not None:
            result.values = _task_entry.collect_values(values_dir)
        return result
    finally:
        if values_dir is not None:
            import shutil

            shutil.rmtree(values_dir, ignore_errors=True)
