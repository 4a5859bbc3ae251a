"""Start a local cluster: one process per task, each with its own TF_CONFIG.

The launcher picks free ports, starts every task, prefixes each output line
with the task (`[worker 1] ...`), stops everything at the first failure or
at the timeout, and can restart the whole cluster. No process outlives it.
"""

import contextlib
import ctypes
import dataclasses
import json
import os
import shutil
import signal
import socket
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


def port_is_free(port):
    """Whether `port` can be bound on localhost right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("localhost", port))
        except OSError:
            return False
    return True


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


def validate(workers, ps, chief, max_restarts, timeout, ports=None):
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
    if ports is not None and not problems:
        needed = workers + ps + (1 if (chief or ps) else 0)
        if len(ports) != needed:
            problems.append(
                f"`ports` lists {len(ports)} port(s) but the cluster has {needed} "
                "task(s); give one port per task, or leave `ports` out to pick free ones"
            )
        taken = [p for p in ports if not port_is_free(p)]
        if taken:
            problems.append(
                f"`ports` {taken} already in use on localhost; stop what listens "
                "there, or leave `ports` out to pick free ones"
            )
    if problems:
        raise LaunchError("Invalid launch request:\n  - " + "\n  - ".join(problems))


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
             sink=print, log_dir=None, server_argv=None, ports=None):
    """Starts one cluster and waits for it. See `launch` for the arguments.

    `argv_for(task_type, task_index)` gives each task's command line; with
    `ps` tasks, worker and ps tasks run `server_argv` instead and only the
    chief (the coordinator) runs the script.
    """
    spec = cluster_spec(workers, ps=ps, chief=chief or bool(ps), ports=ports)
    tasks = []
    base_env = dict(os.environ if env is None else env)
    base_env["PYTHONUNBUFFERED"] = "1"
    trainers = [
        f"{t} {i}" for t in ("chief", "worker") for i in range(len(spec.get(t, ())))
        if not (ps and t == "chief")
    ]
    gpu_share = split_gpus(visible_gpus(base_env), trainers)
    started = time.monotonic()
    timed_out = False
    try:
        for task_type, addresses in spec.items():
            for index in range(len(addresses)):
                task_env = dict(base_env)
                task_env["TF_CONFIG"] = tf_config(spec, task_type, index)
                task_env["KD_TASK"] = f"{task_type} {index}"
                task_env["CUDA_VISIBLE_DEVICES"] = gpu_share.get(f"{task_type} {index}", "")
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
        reported = set()
        while True:
            codes = [t.process.poll() for t in tasks]
            failures = [
                t for t, code in zip(tasks, codes) if code not in (None, 0) and t in watched
            ]
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


@contextlib.contextmanager
def _signals_stop_the_cluster():
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


def _script_argv(script, args):
    return lambda task_type, index: [sys.executable, "-u", script, *args]


def launch(target, *, workers=2, ps=0, chief=False, args=(), max_restarts=0,
           timeout=None, log_dir=None, env=None, sink=print, ports=None):
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
        ports: Explicit localhost ports, one per task (chief, workers, ps);
            free ones are picked when `None`. The first attempt only.

    Returns:
        A `ClusterResult`; for a function target, `.values` maps each task
        label to its return value.

    Raises:
        LaunchError: invalid arguments (nothing is started).
    """
    validate(workers, ps, chief, max_restarts, timeout, ports)
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
            with _signals_stop_the_cluster():
                result = run_once(
                    argv_for, workers=workers, ps=ps, chief=chief, timeout=timeout,
                    env=env, sink=sink, log_dir=log_dir, server_argv=server_argv,
                    ports=ports if attempt == 0 else None,
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


_LOCAL_SERVERS = []


def local_cluster(workers=2, ps=1, *, worker_threads=None):
    """Starts an in-process cluster of `tf.distribute.Server`s.

    For trying parameter-server training in one process, as TensorFlow's
    guide does: this process becomes the coordinator of `workers` worker and
    `ps` parameter servers on free localhost ports.

    Args:
        workers: Worker servers (>= 1).
        ps: Parameter servers (>= 1).
        worker_threads: Inter-op threads of each worker; the default leaves
            room for the coordinator's calls (fewer hang on 2 cores).

    Returns:
        A `tf.distribute.cluster_resolver.SimpleClusterResolver` to pass to
        `kd.make_strategy("parameter_server", cluster_resolver=...)`.

    Raises:
        LaunchError: invalid counts.
    """
    import tensorflow as tf

    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise LaunchError(f"`workers`={workers!r}: expected a whole number >= 1")
    if isinstance(ps, bool) or not isinstance(ps, int) or ps < 1:
        raise LaunchError(f"`ps`={ps!r}: a parameter-server cluster needs at least 1 ps")
    spec = tf.train.ClusterSpec(cluster_spec(workers, ps=ps))
    worker_config = tf.compat.v1.ConfigProto()
    worker_config.inter_op_parallelism_threads = worker_threads or max(4, workers + 2)
    for task_type, count, config in (("worker", workers, worker_config), ("ps", ps, None)):
        for index in range(count):
            _LOCAL_SERVERS.append(
                tf.distribute.Server(
                    spec, job_name=task_type, task_index=index, config=config,
                    protocol="grpc", start=True,
                )
            )
    return tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")
