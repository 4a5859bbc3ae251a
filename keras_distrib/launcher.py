"""Launch a local cluster: one process per task, each with its own TF_CONFIG.

`launch` (and `keras-distrib launch`) picks free ports, writes each task's
TF_CONFIG, splits the GPUs, and runs the tasks under
`keras_distrib.supervisor` (prefixed logs, first failure stops all, timeout),
restarting the whole cluster on fresh ports up to `max_restarts` times.
"""

import json
import os
import shutil
import socket
import sys
import tempfile

import portpicker

from keras_distrib import supervisor
from keras_distrib import tf_logs
from keras_distrib.supervisor import ClusterResult  # noqa: F401 (public result type)
from keras_distrib.supervisor import TaskResult  # noqa: F401

__all__ = ["ClusterResult", "LaunchError", "TaskResult", "launch"]


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


def _task_specs(spec, argv_for, *, ps, env, server_argv, verbose=False):
    """One `TaskSpec` per task of `spec`, with its TF_CONFIG and GPU share."""
    base_env = tf_logs.task_environment(os.environ if env is None else env, verbose=verbose)
    base_env["PYTHONUNBUFFERED"] = "1"
    trainers = [
        f"{t} {i}" for t in ("chief", "worker") for i in range(len(spec.get(t, ())))
        if not (ps and t == "chief")
    ]
    gpu_share = supervisor.split_gpus(supervisor.visible_gpus(base_env), trainers)
    specs = []
    for task_type, addresses in spec.items():
        for index in range(len(addresses)):
            task_env = dict(base_env)
            task_env["TF_CONFIG"] = tf_config(spec, task_type, index)
            task_env["KD_TASK"] = f"{task_type} {index}"
            task_env["CUDA_VISIBLE_DEVICES"] = gpu_share.get(f"{task_type} {index}", "")
            # In a parameter-server cluster, worker and ps tasks run servers
            # that never exit on their own: the coordinator's exit ends the run.
            server = bool(ps) and task_type in ("worker", "ps")
            argv = server_argv if server else argv_for(task_type, index)
            specs.append(supervisor.TaskSpec(task_type, index, argv, task_env, watched=not server))
    return specs


def run_once(argv_for, *, workers, ps=0, chief=False, timeout=None, env=None,
             sink=print, log_dir=None, server_argv=None, ports=None, verbose=False):
    """Starts one cluster and waits for it. See `launch` for the arguments.

    `argv_for(task_type, task_index)` gives each task's command line; with
    `ps` tasks, worker and ps tasks run `server_argv` instead and only the
    chief (the coordinator) runs the script.
    """
    spec = cluster_spec(workers, ps=ps, chief=chief or bool(ps), ports=ports)
    specs = _task_specs(spec, argv_for, ps=ps, env=env, server_argv=server_argv, verbose=verbose)
    return supervisor.run_tasks(specs, timeout=timeout, sink=sink, log_dir=log_dir)


def _script_argv(script, args):
    return lambda task_type, index: [sys.executable, "-u", script, *args]


def launch(target, *, workers=2, ps=0, chief=False, args=(), max_restarts=0,
           timeout=None, log_dir=None, env=None, sink=print, ports=None, verbose=False):
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
        verbose: Keep TensorFlow's C++ start-up and INFO logs in the tasks'
            output. By default the tasks run with `TF_CPP_MIN_LOG_LEVEL=2`
            and TensorFlow's start-up notices are dropped from their output
            (`keras_distrib.tf_logs`); a `TF_CPP_MIN_LOG_LEVEL` already in
            `env` is kept either way. `log_dir` files keep every line.

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
        values_dir = tempfile.mkdtemp(prefix="kd_launch_")
        argv_for = _task_entry.argv_factory(spec, args, values_dir)
    server_argv = [sys.executable, "-u", "-m", "keras_distrib._task_entry", "--server"]
    try:
        attempt = 0
        while True:
            with supervisor.signals_stop_the_cluster():
                result = run_once(
                    argv_for, workers=workers, ps=ps, chief=chief, timeout=timeout,
                    env=env, sink=sink, log_dir=log_dir, server_argv=server_argv,
                    ports=ports if attempt == 0 else None, verbose=verbose,
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
            shutil.rmtree(values_dir, ignore_errors=True)


