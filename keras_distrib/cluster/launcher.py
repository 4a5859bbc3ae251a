"""Launch a cluster: one process per task, each with its own TF_CONFIG.

`launch` (and `keras-distrib launch --workers N`) starts a whole cluster on
localhost: it picks free ports, writes each task's TF_CONFIG, splits the
GPUs, and runs the tasks under `keras_distrib.cluster.supervisor` (prefixed logs,
first failure stops all, timeout), restarting the whole cluster on fresh
ports up to `max_restarts` times.

The per-node agent of a cluster a cluster manager started (`keras-distrib
launch` without `--workers`) is `keras_distrib.cluster.node`: it runs this
node's tasks through the same checks (`requests`), restarts (`restarts`:
when, and after how long) and supervision.
"""

import json
import os
import sys

from keras_distrib import files
from keras_distrib.cluster import data_service
from keras_distrib.cluster import ports as ports_lib
from keras_distrib.cluster import requests
from keras_distrib.cluster import restarts
from keras_distrib.cluster import supervisor
from keras_distrib.cluster.ports import LaunchError  # noqa: F401 (public: kd.LaunchError)
from keras_distrib.cluster.ports import cluster_spec
from keras_distrib.cluster.requests import DEFAULT_GRACE_PERIOD
from keras_distrib import tf_logs
from keras_distrib.cluster.supervisor import ClusterResult  # noqa: F401 (public result type)
from keras_distrib.cluster.task_process import TaskResult  # noqa: F401

__all__ = [
    "ClusterResult",
    "LaunchError",
    "TaskResult",
    "launch",
]



def tf_config(spec, task_type, task_index):
    return json.dumps({"cluster": spec, "task": {"type": task_type, "index": task_index}})


def task_specs(spec, argv_for, *, ps, env, server_argv, evaluator=False, local=None, verbose=False):
    """One `TaskSpec` per task of `spec` (or of `local` labels), with its TF_CONFIG and GPU share."""
    base_env = tf_logs.task_environment(os.environ if env is None else env, verbose=verbose)
    base_env["PYTHONUNBUFFERED"] = "1"
    # A task that crashes in native code (SIGSEGV, SIGABRT, ...) prints its
    # Python stacks: the launcher reports them with the crash.
    base_env.setdefault("PYTHONFAULTHANDLER", "1")
    if "PYTHONPATH" in base_env:
        # An empty (or '.') entry means the working directory: a module there
        # would be imported before the real one (what -P keeps out).
        kept = [p for p in base_env["PYTHONPATH"].split(os.pathsep) if p not in ("", ".")]
        base_env["PYTHONPATH"] = os.pathsep.join(kept)
    trainers = [
        f"{t} {i}" for t in ("chief", "worker") for i in range(len(spec.get(t, ())))
        if not (ps and t == "chief") and (local is None or f"{t} {i}" in local)
    ]
    gpu_share = supervisor.split_gpus(supervisor.visible_gpus(base_env), trainers)
    specs = []
    for task_type, addresses in spec.items():
        for index in range(len(addresses)):
            if local is not None and f"{task_type} {index}" not in local:
                continue
            task_env = dict(base_env)
            task_env["TF_CONFIG"] = tf_config(spec, task_type, index)
            task_env["KD_TASK"] = f"{task_type} {index}"
            task_env["CUDA_VISIBLE_DEVICES"] = gpu_share.get(f"{task_type} {index}", "")
            # In a parameter-server cluster, worker and ps tasks run servers
            # that never exit on their own: the coordinator's exit ends the run.
            server = bool(ps) and task_type in ("worker", "ps")
            argv = server_argv if server else argv_for(task_type, index)
            specs.append(supervisor.TaskSpec(task_type, index, argv, task_env, watched=not server,
                                             vital=task_type == "ps"))
    if evaluator:
        # Outside the cluster spec, as TensorFlow's evaluator task: it reads
        # the chief's checkpoints and is stopped when training ends.
        task_env = dict(base_env)
        task_env["TF_CONFIG"] = tf_config(spec, "evaluator", 0)
        task_env["KD_TASK"] = "evaluator 0"
        task_env["CUDA_VISIBLE_DEVICES"] = ""
        specs.append(supervisor.TaskSpec("evaluator", 0, argv_for("evaluator", 0), task_env, follower=True))
    return specs


def run_once(argv_for, *, workers, ps=0, chief=False, timeout=None, env=None,
             sink=print, log_dir=None, server_argv=None, ports=None, evaluator=False,
             grace_period=None, verbose=False, network=requests.NetworkLevel(True), data_workers=0):
    """Starts one cluster and waits for it. See `launch` for the arguments.

    `argv_for(task_type, task_index)` gives each task's command line; with
    `ps` tasks, worker and ps tasks run `server_argv` instead and only the
    chief (the coordinator) runs the script. `network` is the launch's
    `requests.NetworkLevel`.
    """
    spec = cluster_spec(workers, ps=ps, chief=chief or bool(ps), ports=ports)
    specs = task_specs(spec, argv_for, ps=ps, env=env, server_argv=server_argv, evaluator=evaluator,
                        verbose=verbose)
    if data_workers:
        service, address = data_service.task_specs(data_workers, specs[0].env)
        for task in specs:
            task.env[data_service.SERVICE_ENV] = address
        specs = service + specs
    if not network.mode:
        sink(exposure_notice(spec))
    return supervisor.run_tasks(specs, timeout=timeout, sink=sink, log_dir=log_dir,
                                grace_period=grace_period, private_network=network.mode,
                                no_route_out=network.no_route_out)


def exposure_notice(spec):
    """The one line a local launch with `private_network=False` prints: what is open, and the fix."""
    ports = sorted(int(address.rpartition(":")[2]) for addresses in spec.values()
                   for address in addresses)
    return (f"[launcher] note: the tasks' TensorFlow servers listen on every interface at "
            f"port(s) {', '.join(map(str, ports))}, without authentication: anyone who reaches this "
            "host there can run code as this user. Without --network open "
            "(kd.launch(private_network=False)) kd keeps them in a network namespace of their own; "
            "else firewall those ports.")


def _script_argv(script, args):
    return lambda task_type, index: [sys.executable, "-u", script, *args]


def resolve_target(target, args):
    """`(argv_for, values_dir)` for a script path or an importable function."""
    from keras_distrib.cluster import _task_entry

    spec = requests.checked_target(target)
    if spec is None:
        return _script_argv(target, [str(a) for a in args]), None
    values_dir = files.make_scratch("launch")
    return _task_entry.argv_factory(spec, args, values_dir), values_dir


SERVER_ARGV = [sys.executable, "-u", "-P", "-m", "keras_distrib.cluster._task_entry", "--server"]


def with_values(values_dir, run):
    """`run()`'s result; with `values_dir` (a function target), the tasks' return values too.

    The directory is removed in any case.
    """
    try:
        result = run()
        if values_dir is not None:
            result.values = _task_entry_values(values_dir)
        return result
    finally:
        if values_dir is not None:
            files.remove_scratch(values_dir)


def launch(target, *, workers=2, ps=0, chief=False, args=(), max_restarts=0,
           timeout=None, log_dir=None, env=None, sink=print, ports=None, evaluator=False,
           grace_period=DEFAULT_GRACE_PERIOD, verbose=False, private_network=requests.AUTO,
           min_workers=None, data_workers=0):
    """Runs `target` on a local cluster and returns a `ClusterResult`.

    Each task gets free ports (or `ports`) and its TF_CONFIG. Every output
    line is prefixed with its task (`[worker 1] ...`) and passed to `sink`
    (and to `log_dir`). The first failure stops the others; of tasks that
    end within half a second of each other, the one named is a task that
    saved for a restart, else one killed from outside, else the one whose
    death the others' last lines report. The cluster is restarted up to
    `max_restarts` times on fresh ports (a restart after a quick failure
    waits 1 s, 2 s, 4 s ... at most 60 s); `timeout` stops everything and
    names the tasks that were running. Each task runs under a small guard
    process: its children and daemons end with it, and when the launcher
    dies (even by SIGKILL); a guard killed or stopped on its own is noticed
    within about a second. A task that stops on a backup directory in use
    by another run, or on a backup of another run, ends the launch with
    exit code 2 (a rerun would fail alike); a stop signal that arrives
    while the tasks start gives 42 (restart). By default one line at launch
    says which network the tasks got; with `private_network=False`, one
    line names the tasks' open ports and the fix. A temporary
    directory (TMPDIR) that is full or not writable is named in the error,
    with the fix.

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
            many times after a failure (a task that saved a backup on
            preemption exits with 42, which also restarts it).
        timeout: Seconds for each attempt; `None` for no limit.
        log_dir: Also write each task's output to `DIR/<type>_<index>.log`.
        env: Environment for the tasks (this process's by default).
        sink: Where prefixed output lines go (`print` by default).
        ports: Explicit localhost ports, one per task (chief, workers, ps);
            free ones are picked when `None`. The first attempt only. A
            second kd launch on this host given one of the same ports while
            this one runs is refused at once, naming the port.
        evaluator: Also run `target` as an `evaluator` task (TF_CONFIG task
            type "evaluator", outside the cluster spec), e.g. a
            `kd.SidecarEvaluator`; it gets SIGTERM when training ends and
            the run waits for it.
        grace_period: When this process gets SIGTERM or SIGINT, the seconds
            (25 by default) the tasks get (after the same signal) to save and exit before
            they are killed. The run then ends without a restart.
        verbose: Keep TensorFlow's C++ start-up and INFO logs in the tasks'
            output. By default the tasks run with `TF_CPP_MIN_LOG_LEVEL=2`
            and TensorFlow's start-up notices are dropped from their output
            (`keras_distrib.tf_logs`); a `TF_CPP_MIN_LOG_LEVEL` already in
            `env` is kept either way. `log_dir` files keep every line.
        private_network: `"auto"` (default): the most private network this
            host allows, said in one line at launch: True where it can be
            made, else `"offline"` (the line says why, and a task that fails
            on a network error is told how to get a route out); where no
            network namespace can be made at all (no root, no unprivileged
            user namespaces, a container's seccomp profile) the launch is
            refused (`NoPrivateNetwork`), never run open unasked. True: run
            the tasks in a network namespace of their own
            (`network.PrivateNetwork`), one per attempt. TensorFlow's
            servers listen on every interface and have no authentication;
            there no other host, user or network namespace reaches their
            ports, while the tasks still open connections out (downloads,
            remote storage) through `slirp4netns`, else `pasta`; this host
            itself is `10.0.2.2` from the tasks. Needs root or unprivileged
            user namespaces, and slirp4netns or pasta (refused without
            them, saying what to install). `"offline"`: the namespace
            without a route out (neither needed). False: the tasks share this host's
            network, their ports open to it (one line at launch names
            them).
        min_workers: Elastic training. When a worker still fails after
            `max_restarts` restarts (its node gone, say), go on without it:
            the cluster starts again with one worker fewer (and
            `max_restarts` restarts again), as long as at least
            `min_workers` remain; training resumes from the last backup,
            and kd's model does not depend on the worker count. `None`
            (default): the run ends with the failure.
        data_workers: Also run a tf.data service: a dispatcher and this
            many data workers, each a process beside the training tasks (in
            the same private network); the training tasks find its address
            in `KD_DATA_SERVICE`, which `kd.data.serve` reads. A data worker
            that exits is reported and the run goes on; they are stopped
            when training ends. 0 (default): none.

    Returns:
        A `ClusterResult` (`lost` lists the workers given up on, in order;
        `network` the network the tasks got: "private", "offline" or
        "open"); for a function target, `.values` maps each task label to
        its return value.

    Raises:
        LaunchError: invalid arguments, `ports` held by another kd launch
            on this host, or a private network that cannot be made here
            (nothing is started).

    Examples:
        >>> import keras_distrib as kd
        >>> result = kd.launch("train.py", workers=2, args=["--epochs", "3"])  # doctest: +SKIP
        >>> result.returncode  # doctest: +SKIP
        0
    """
    target, script = requests.script_target(target)
    requests.validate(workers, ps, chief, max_restarts, timeout, ports, args=args, script=script,
                      env=env, log_dir=log_dir, sink=sink, evaluator=evaluator, verbose=verbose)
    requests.check_grace_period(grace_period)
    requests.check_min_workers(min_workers, workers, ps)
    requests.check_data_workers(data_workers)
    # Before a private network is tried: nothing starts for a bad target.
    requests.checked_target(target)
    network = requests.check_private_network(private_network)
    with ports_lib.reserve_ports(ports):
        if network.note:  # once the launch goes ahead
            sink(network.note)
        result = _launch_attempts(target, args, workers=workers, ps=ps, chief=chief,
                                  timeout=timeout, env=env, sink=sink, log_dir=log_dir,
                                  ports=ports, evaluator=evaluator, grace_period=grace_period,
                                  verbose=verbose, network=network,
                                  max_restarts=max_restarts, min_workers=min_workers,
                                  data_workers=data_workers)
    result.network = network.name
    return result


def _launch_attempts(target, args, *, workers, ps, chief, timeout, env, sink, log_dir, ports,
                     evaluator, grace_period, verbose, network, max_restarts,
                     min_workers=None, data_workers=0):
    argv_for, values_dir = resolve_target(target, args)

    def elastic():
        lost = []
        while True:
            count = workers - len(lost)
            result = restarts.run_attempts(
                lambda attempt: run_once(
                    argv_for, workers=count, ps=ps, chief=chief, timeout=timeout,
                    env=env, sink=sink, log_dir=log_dir, server_argv=SERVER_ARGV,
                    ports=ports if attempt == 0 and not lost else None, evaluator=evaluator,
                    grace_period=grace_period, verbose=verbose, network=network,
                    data_workers=data_workers,
                ),
                max_restarts=max_restarts, sink=sink, what="the cluster",
            )
            worker = restarts.lost_worker(result) if min_workers is not None else None
            if worker is not None and count - 1 < min_workers:
                sink(f"[launcher] {worker.label} failed {max_restarts + 1} time(s) in a row, and "
                     f"going on without it would leave {count - 1} worker(s), fewer than "
                     f"`min_workers`={min_workers}: the run ends here (exit code "
                     f"{result.returncode}). Its backup is kept; lower --min-workers, or fix what "
                     f"ends {worker.label}, and launch again to resume.")
            if worker is None or count - 1 < min_workers:
                result.lost = lost
                return result
            # Elastic: the worker failed through every restart; the survivors
            # go on from the last backup (renumbered 0..count-2).
            lost.append(worker.label)
            sink(f"[launcher] {worker.label} failed {max_restarts + 1} time(s) in a row: going on "
                 f"with {count - 1} worker(s) from the last backup (`min_workers`={min_workers})")

    return with_values(values_dir, elastic)


def _task_entry_values(values_dir):
    from keras_distrib.cluster import _task_entry

    return _task_entry.collect_values(values_dir)
