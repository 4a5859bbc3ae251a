"""Launch a cluster: one process per task, each with its own TF_CONFIG.

`launch` (and `keras-distrib launch --workers N`) starts a whole cluster on
localhost: it picks free ports, writes each task's TF_CONFIG, splits the
GPUs, and runs the tasks under `keras_distrib.cluster.supervisor` (prefixed logs,
first failure stops all, timeout), restarting the whole cluster on fresh
ports up to `max_restarts` times.

The per-node agent of a cluster a cluster manager started (`keras-distrib
launch` without `--workers`) is `keras_distrib.cluster.node`: it runs this
node's tasks through the same checks, restarts and supervision.
"""

import collections.abc
import importlib.util
import json
import os
import pickle
import shlex
import signal
import sys
import time

from keras_distrib.cluster import lost as lost_lib
from keras_distrib import files
from keras_distrib.cluster import ports as ports_lib
from keras_distrib.cluster import supervisor
from keras_distrib.cluster.ports import LaunchError  # noqa: F401 (public: kd.LaunchError)
from keras_distrib.cluster.ports import cluster_spec
from keras_distrib.cluster.ports import port_is_free
from keras_distrib import tf_logs
from keras_distrib import validation
from keras_distrib.cluster.supervisor import ClusterResult  # noqa: F401 (public result type)
from keras_distrib.cluster.supervisor import TaskResult  # noqa: F401

__all__ = [
    "ClusterResult",
    "LaunchError",
    "TaskResult",
    "launch",
]

# Seconds the tasks get to save and exit when the launcher is told to stop
# (a preemption); below Slurm's KillWait and Kubernetes' default grace (30 s).
DEFAULT_GRACE_PERIOD = 25.0
# Restarts wait RESTART_BACKOFF * 2**(n-1) seconds (at most RESTART_BACKOFF_MAX)
# after the n-th attempt in a row that failed on its own (`failed_on_its_own`)
# within RESTART_BACKOFF_MAX; a longer attempt, or one ended from outside,
# restarts at once.
RESTART_BACKOFF = 1.0
RESTART_BACKOFF_MAX = 60.0
MAX_RESTARTS = 1000
# `private_network=OFFLINE`: a namespace of their own, without a route out.
OFFLINE = "offline"


def tf_config(spec, task_type, task_index):
    return json.dumps({"cluster": spec, "task": {"type": task_type, "index": task_index}})


def _args_problems(args, script):
    if isinstance(args, (str, bytes)):
        try:
            example = shlex.split(os.fsdecode(args))
        except ValueError:  # unbalanced quotes
            example = [os.fsdecode(args)]
        return [
            f"`args`={args!r} is a string, which would be split into characters; pass a "
            f"list of arguments, e.g. `args`={example!r}"
        ]
    if not isinstance(args, (list, tuple)):
        return [f"`args`={args!r}: expected a list or tuple of arguments"]
    if script:
        bad = [a for a in args if isinstance(a, bool) or not isinstance(a, (str, int, float, os.PathLike))]
        if bad:
            return [
                f"`args` items {bad!r} are not command-line values; a script takes "
                "strings (or numbers and paths, converted with str())"
            ]
        return []
    try:
        pickle.dumps(tuple(args))
    except Exception as error:  # noqa: BLE001 - pickling raises many types
        return [
            f"`args` cannot be sent to the tasks ({type(error).__name__}: {error}); "
            "a function target takes picklable arguments"
        ]
    return []


def validate(workers, ps, chief, max_restarts, timeout, ports=None, *, args=(), script=True,
             env=None, log_dir=None, sink=print, evaluator=False, verbose=False):
    """Raises `LaunchError` listing every invalid launch argument (nothing is started)."""
    problems = []
    if not validation.is_whole(workers, 1):
        problems.append(f"`workers`={workers!r}: expected a whole number >= 1")
    if not validation.is_whole(ps, 0):
        problems.append(f"`ps`={ps!r}: expected a whole number >= 0")
    if not isinstance(chief, bool):
        problems.append(f"`chief`={chief!r}: expected True or False")
    elif ps and chief:
        problems.append(
            "`chief` with `ps`: in a parameter-server cluster the script itself "
            "is the coordinator (chief); drop `chief`"
        )
    if not validation.is_whole(max_restarts, 0) or max_restarts > MAX_RESTARTS:
        problems.append(f"`max_restarts`={max_restarts!r}: expected a whole number in "
                        f"0..{MAX_RESTARTS} (each restart waits up to {RESTART_BACKOFF_MAX:g}s "
                        "after a quick failure)")
    if timeout is not None and not validation.is_seconds(timeout):
        problems.append(
            f"`timeout`={timeout!r}: expected a finite number of seconds > 0, or None for "
            "no limit"
        )
    problems.extend(_args_problems(args, script))
    if env is not None and (
        not isinstance(env, collections.abc.Mapping)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        problems.append(
            f"`env` must map names to strings (like os.environ), got {type(env).__name__}"
            + (f" with non-string entries {[k for k, v in env.items() if not isinstance(v, str)]}"
               if isinstance(env, collections.abc.Mapping) else "")
        )
    if log_dir is not None:
        if not isinstance(log_dir, (str, os.PathLike)) or not os.fspath(log_dir):
            problems.append(f"`log_dir`={log_dir!r}: expected a directory path, or None")
        elif os.path.exists(log_dir) and not os.path.isdir(log_dir):
            problems.append(f"`log_dir`={os.fspath(log_dir)!r} is a file; give a directory")
    if not isinstance(evaluator, bool):
        problems.append(f"`evaluator`={evaluator!r}: expected True or False")
    if not isinstance(verbose, bool):
        problems.append(f"`verbose`={verbose!r}: expected True or False")
    if not callable(sink):
        problems.append(f"`sink`={sink!r}: expected a callable taking one line (like print)")
    if ports is not None:
        port_problems = ports_lib.port_problems(ports)
        problems.extend(port_problems)
        counts_valid = (validation.is_whole(workers, 1) and validation.is_whole(ps, 0)
                        and isinstance(chief, bool))
        if not port_problems and counts_valid:
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
             grace_period=None, verbose=False, private_network=True):
    """Starts one cluster and waits for it. See `launch` for the arguments.

    `argv_for(task_type, task_index)` gives each task's command line; with
    `ps` tasks, worker and ps tasks run `server_argv` instead and only the
    chief (the coordinator) runs the script.
    """
    spec = cluster_spec(workers, ps=ps, chief=chief or bool(ps), ports=ports)
    specs = task_specs(spec, argv_for, ps=ps, env=env, server_argv=server_argv, evaluator=evaluator,
                        verbose=verbose)
    if not private_network:
        sink(exposure_notice(spec))
    return supervisor.run_tasks(specs, timeout=timeout, sink=sink, log_dir=log_dir,
                                grace_period=grace_period, private_network=private_network)


def exposure_notice(spec):
    """The one line a local launch with `private_network=False` prints: what is open, and the fix."""
    ports = sorted(int(address.rpartition(":")[2]) for addresses in spec.values()
                   for address in addresses)
    return (f"[launcher] note: the tasks' TensorFlow servers listen on every interface at "
            f"port(s) {', '.join(map(str, ports))}, without authentication: anyone who reaches this "
            "host there can run code as this user. Without --no-private-network "
            "(kd.launch(private_network=False)) kd keeps them in a network namespace of their own; "
            "else firewall those ports.")


def _script_argv(script, args):
    return lambda task_type, index: [sys.executable, "-u", script, *args]


def _grace_problems(grace_period):
    if grace_period is None or validation.is_seconds(grace_period, zero=True):
        return []
    return [f"`grace_period`={grace_period!r}: expected a finite number of seconds >= 0"]


def resolve_target(target, args):
    """`(argv_for, values_dir)` for a script path or an importable function."""
    from keras_distrib.cluster import _task_entry

    spec = _checked_target(target)
    if spec is None:
        return _script_argv(target, [str(a) for a in args]), None
    values_dir = files.make_scratch("launch")
    return _task_entry.argv_factory(spec, args, values_dir), values_dir


def _checked_target(target):
    """None for a script that exists; a function's `"module:name"` spec whose module is found.

    Raises:
        LaunchError: no such script, or a function no task could import.
    """
    from keras_distrib.cluster import _task_entry

    if isinstance(target, str) and ":" not in target:
        if not os.path.isfile(target):
            raise LaunchError(
                f"`target`={target!r} is not a file. Pass the path of a Python "
                "script, a function, or 'package.module:function'."
            )
        return None
    try:
        spec = _task_entry.function_spec(target)
    except ValueError as error:
        raise LaunchError(str(error)) from None
    module = spec.split(":", 1)[0]
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise LaunchError(
            f"`target`={target!r}: module {module!r} cannot be found on sys.path, so no "
            "task could import it. Check the spelling, or pass a script path."
        )
    return spec


SERVER_ARGV = [sys.executable, "-u", "-P", "-m", "keras_distrib.cluster._task_entry", "--server"]


def _with_values(values_dir, run):
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


def run_attempts(run, *, max_restarts, sink, what, values_dir=None):
    """Runs `run(attempt)` until it succeeds, is signalled, or restarts run out.

    With `values_dir`, see `_with_values`.
    """

    def attempts():
        attempt, quick = 0, 0
        while True:
            started = time.monotonic()
            with supervisor.signals_stop_the_cluster():
                result = run(attempt)
            result.restarts = attempt
            if result.returncode == 0 or result.signalled or attempt >= max_restarts:
                return result
            attempt += 1
            # A failure soon after the start would fail again at once: back off.
            quick = (quick + 1 if time.monotonic() - started < RESTART_BACKOFF_MAX
                     and failed_on_its_own(result) else 0)
            wait = min(RESTART_BACKOFF * 2 ** (quick - 1), RESTART_BACKOFF_MAX) if quick else 0.0
            sink(f"[launcher] restarting {what} ({attempt}/{max_restarts})"
                 + (f" in {wait:g}s" if wait else ""))
            with supervisor.signals_stop_the_cluster():
                try:
                    with supervisor.stops_raise():
                        time.sleep(wait)
                except SystemExit as stop:
                    result.signalled = True
                    result.returncode = stop.code
                    return result

    return _with_values(values_dir, attempts)


def script_target(target):
    """`target` as a string or callable, and whether it is a script."""
    if isinstance(target, os.PathLike):
        target = os.fspath(target)
    return target, isinstance(target, str) and ":" not in target


def _check_private_network(private_network):
    if not (isinstance(private_network, bool) or private_network == OFFLINE):
        raise LaunchError(f"Invalid launch request:\n  - `private_network`={private_network!r}: "
                          f"expected True (the default), {OFFLINE!r} or False")
    if private_network:
        try:
            supervisor.PrivateNetwork(outbound=private_network is True).close()
        except OSError as error:
            raise LaunchError(str(error)) from None


def check_grace_period(grace_period):
    problems = _grace_problems(grace_period)
    if problems:
        raise LaunchError("Invalid launch request:\n  - " + "\n  - ".join(problems))


def launch(target, *, workers=2, ps=0, chief=False, args=(), max_restarts=0,
           timeout=None, log_dir=None, env=None, sink=print, ports=None, evaluator=False,
           grace_period=DEFAULT_GRACE_PERIOD, verbose=False, private_network=True,
           min_workers=None):
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
    while the tasks start gives 42 (restart). Without `private_network`, one
    line at launch names the tasks' open ports and the fix. A temporary
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
        private_network: True (default): run the tasks in a network namespace
            of their own (`supervisor.PrivateNetwork`), one per attempt.
            TensorFlow's servers listen on every interface and have no
            authentication; there no other host, user or network namespace
            reaches their ports, while the tasks still open connections out
            (downloads, remote storage) through `slirp4netns`; this host
            itself is `10.0.2.2` from the tasks. Needs root or unprivileged
            user namespaces, and slirp4netns (a launch without them is
            refused, saying what to install). `"offline"`: the namespace
            without a route out (no slirp4netns needed). False: the tasks
            share this host's network, their ports open to it (one line at
            launch names them).
        min_workers: Elastic training. When a worker still fails after
            `max_restarts` restarts (its node gone, say), go on without it:
            the cluster starts again with one worker fewer (and
            `max_restarts` restarts again), as long as at least
            `min_workers` remain; training resumes from the last backup,
            and kd's model does not depend on the worker count. `None`
            (default): the run ends with the failure.

    Returns:
        A `ClusterResult` (`lost` lists the workers given up on, in order);
        for a function target, `.values` maps each task
        label to its return value.

    Raises:
        LaunchError: invalid arguments, or `ports` held by another kd launch
            on this host (nothing is started).

    Example:
        >>> import keras_distrib as kd
        >>> result = kd.launch("train.py", workers=2, args=["--epochs", "3"])  # doctest: +SKIP
        >>> result.returncode  # doctest: +SKIP
        0
    """
    target, script = script_target(target)
    validate(workers, ps, chief, max_restarts, timeout, ports, args=args, script=script,
             env=env, log_dir=log_dir, sink=sink, evaluator=evaluator, verbose=verbose)
    check_grace_period(grace_period)
    _check_min_workers(min_workers, workers, ps)
    _checked_target(target)  # before a private network is tried: nothing starts for a bad target
    _check_private_network(private_network)
    with ports_lib.reserve_ports(ports):
        return _launch_attempts(target, args, workers=workers, ps=ps, chief=chief,
                                timeout=timeout, env=env, sink=sink, log_dir=log_dir,
                                ports=ports, evaluator=evaluator, grace_period=grace_period,
                                verbose=verbose, private_network=private_network,
                                max_restarts=max_restarts, min_workers=min_workers)


def _check_min_workers(min_workers, workers, ps):
    if min_workers is None:
        return
    problem = None
    if not validation.is_whole(min_workers, 1):
        problem = f"`min_workers`={min_workers!r}: expected a whole number >= 1, or None"
    elif validation.is_whole(workers, 1) and min_workers > workers:
        problem = (f"`min_workers`={min_workers} is more than the {workers} workers launched; "
                   f"give at most {workers}")
    elif ps:
        problem = (f"`min_workers`={min_workers} with `ps`={ps}: a parameter-server cluster's "
                   "coordinator already carries on without a lost worker (its steps run on the "
                   "others); drop `min_workers`")
    if problem:
        raise LaunchError("Invalid launch request:\n  - " + problem)


def failed_on_its_own(result):
    """Whether an attempt failed by a task's own doing (a crash loop backs off), not from outside.

    From outside: the failing task was killed by a signal sent to it (SIGKILL,
    SIGTERM, SIGINT, SIGHUP), stayed stopped, lost its guard, saved for a
    restart (exit 42), or said the cluster lost a peer. A restart then meets
    no error of its own: it goes at once (a chaos soak of faults every 20-60 s
    waited 1, 2, 4 ... 60 s after each, 243 s of the 357 s lost).
    """
    failed = result.failed
    if result.timed_out or failed is None:
        return True
    if (failed.returncode in (supervisor.RESTART_EXIT_CODE, -signal.SIGKILL, -signal.SIGTERM,
                              -signal.SIGINT, -signal.SIGHUP)
            or failed.stop_fault or failed.guard_fault):
        return False
    return not lost_lib.lost_tasks("\n".join(failed.tail), failed.label,
                                   lost_lib.service_task(t.task_type for t in result.tasks))


def lost_worker(result):
    """The worker a failed attempt is pinned on (`TaskResult`), or None.

    A worker that exited with an error (or was killed) and was the first
    task to fail; not a preemption's save (exit 42), a timeout or a stop.
    """
    failed = result.failed
    if (result.returncode == 0 or result.signalled or result.timed_out or failed is None
            or failed.task_type != "worker" or failed.returncode == supervisor.RESTART_EXIT_CODE):
        return None
    return failed


def _launch_attempts(target, args, *, workers, ps, chief, timeout, env, sink, log_dir, ports,
                     evaluator, grace_period, verbose, private_network, max_restarts,
                     min_workers=None):
    argv_for, values_dir = resolve_target(target, args)

    def elastic():
        lost = []
        while True:
            count = workers - len(lost)
            result = run_attempts(
                lambda attempt: run_once(
                    argv_for, workers=count, ps=ps, chief=chief, timeout=timeout,
                    env=env, sink=sink, log_dir=log_dir, server_argv=SERVER_ARGV,
                    ports=ports if attempt == 0 and not lost else None, evaluator=evaluator,
                    grace_period=grace_period, verbose=verbose, private_network=private_network,
                ),
                max_restarts=max_restarts, sink=sink, what="the cluster",
            )
            worker = lost_worker(result) if min_workers is not None else None
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

    return _with_values(values_dir, elastic)


def _task_entry_values(values_dir):
    from keras_distrib.cluster import _task_entry

    return _task_entry.collect_values(values_dir)
