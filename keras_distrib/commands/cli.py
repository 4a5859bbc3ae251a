"""The `keras-distrib` command: `launch` a cluster, print its `tf-config`, run the `demo`,
`test` this machine, print the `env`ironment, or `bench`mark (`bench --network`:
worker processes over a link with latency; `bench --first-step`: the wait
before the first step).

`launch --workers N` starts a local cluster; `launch` without `--workers`
under `srun` or in a Kubernetes Job is the per-node agent
(`keras_distrib.cluster.node.launch_node`). `tf-config` prints the cluster kd
finds here, as TF_CONFIG, and where it found it.

`launch` and `tf-config` load no TensorFlow (the launcher starts in a
fraction of a second, its tasks load what they need); the other commands
load it first, its start-up notices hidden.
"""

import argparse
import importlib
import json
import os
import sys

from keras_distrib.cluster import info as cluster_lib
from keras_distrib.cluster import sources as cluster_sources
from keras_distrib.cluster import stop_signals
from keras_distrib.cluster import launcher as launch_lib
from keras_distrib.cluster import requests as launch_requests
from keras_distrib.cluster import node as node_lib
from keras_distrib import tf_logs
from keras_distrib import validation

__all__ = [
    "build_parser",
    "main",
]

# The commands that load TensorFlow (`launch` and `tf-config` do not).
_WITH_TENSORFLOW = ("bench", "demo", "env", "test")
_NETWORK_HELP = ("the worker processes' network: 'auto' (the default) the most private this "
                 "machine allows, said in one line; 'private' a network namespace of their own, "
                 "so no other host or user reaches TensorFlow's unauthenticated ports, with a "
                 "route out through slirp4netns or pasta (refused without both); 'offline' the namespace "
                 "without the route out; 'open' this host's network, ports open to it")


def _per_node(value):
    if value == "gpu":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or 'gpu', got {value!r}") from None


def _in_cluster_manager():
    return bool(os.environ.get("TF_CONFIG", "").strip()
                or cluster_sources.in_slurm_step(os.environ)
                or os.environ.get("KD_NUM_PODS", "").strip())


def _launch(options):
    agent = options.workers is None and _in_cluster_manager()
    try:
        if agent:
            if options.min_workers is not None:
                raise launch_lib.LaunchError(
                    "`--min-workers` is for a local cluster (`--workers N`): under Slurm or "
                    "Kubernetes the job's recipe starts the survivors again "
                    "(docs/guides/slurm.md, docs/guides/kubernetes.md)."
                )
            if options.data_workers:
                raise launch_lib.LaunchError(
                    "`--data-workers` starts a tf.data service beside a local cluster "
                    "(`--workers N`); under Slurm or Kubernetes the job's recipe starts the "
                    "dispatcher and data workers (docs/guides/data-service.md)."
                )
            if options.chief or options.evaluator or options.network is not None:
                raise launch_lib.LaunchError(
                    "`--chief`, `--evaluator` and `--network` describe a local cluster; the per-node agent "
                    "takes its cluster from Slurm or Kubernetes (use `--ps M` for parameter servers)."
                )
            result = node_lib.launch_node(
                options.script, per_node=options.per_node or 1, ps=options.ps,
                args=options.args, max_restarts=options.max_restarts, timeout=options.timeout,
                log_dir=options.log_dir, grace_period=options.grace_period,
                verbose=options.verbose,
            )
        else:
            if options.per_node is not None:
                raise launch_lib.LaunchError(
                    "`--per-node` is for the per-node agent under srun or a Kubernetes Job; "
                    "on one machine give `--workers N`."
                )
            result = launch_lib.launch(
                options.script,
                workers=2 if options.workers is None else options.workers,
                ps=options.ps or 0,
                chief=options.chief,
                args=options.args,
                max_restarts=options.max_restarts,
                timeout=options.timeout,
                log_dir=options.log_dir,
                evaluator=options.evaluator,
                grace_period=options.grace_period,
                verbose=options.verbose,
                min_workers=options.min_workers,
                data_workers=options.data_workers,
                private_network=launch_requests.NETWORK_OPTIONS[options.network or "auto"],
            )
    except launch_lib.LaunchError as error:
        return _refuse("launch", [str(error)])
    stop_signals.ignore_stop_signals()
    return result.returncode


def _tf_config(options):
    try:
        if options.per_node is not None or options.ps is not None:
            source, spec, local = node_lib.node_tasks(options.per_node or 1, options.ps)
            tasks = []
            for label in local:
                task_type, index = label.split()
                tasks.append({"task": label, "TF_CONFIG": {
                    "cluster": spec, "task": {"type": task_type, "index": int(index)}}})
            report = {"source": source, "tasks": tasks}
        else:
            info = cluster_lib.cluster_info()
            report = {"source": info.source, "task": info.label or None, "TF_CONFIG": info.tf_config}
    except (cluster_lib.ClusterConfigError, launch_lib.LaunchError) as error:
        return _refuse("tf-config", [str(error)])
    if options.export:
        config = report.get("TF_CONFIG") if "tasks" not in report else (
            report["tasks"][0]["TF_CONFIG"] if len(report["tasks"]) == 1 else None)
        if config is None and report.get("source") is not None:
            print("keras-distrib tf-config: --export needs exactly one task here", file=sys.stderr)
            return 2
        print("export TF_CONFIG=" + ("''" if config is None else "'" + json.dumps(config) + "'"))
        return 0
    print(json.dumps(report, indent=None if options.compact else 2))
    return 0


def _refuse(command, problems):
    """Says why `command` cannot run, in one sentence on stderr; returns exit code 2.

    A listed request ("Invalid launch request:" and a line per problem)
    becomes one line, its problems joined by semicolons.
    """
    lines = [line.strip() for problem in problems for line in problem.splitlines() if line.strip()]
    head = [line for line in lines if not line.startswith("- ")]
    items = [line[2:] for line in lines if line.startswith("- ")]
    text = "; ".join(head).rstrip(":") + (": " if head and items else "") + "; ".join(items)
    print(f"keras-distrib {command}: {text.rstrip('.')}.", file=sys.stderr)
    return 2


def _demo(options):
    from keras_distrib.commands import demo

    problem = validation.output_path_problem("--out", options.out, directory=True)
    if problem is None:
        try:
            os.makedirs(options.out, exist_ok=True)
        except OSError as error:  # a file system that refuses what the permissions allow (/proc)
            problem = (f"`--out`={os.path.abspath(options.out)!r} cannot be made ({error.strerror}): "
                       "give a path this user can write")
    if problem:
        return _refuse("demo", [problem])
    return demo.main(quick=options.quick, out=options.out, verbose=options.verbose,
                     network=options.network)


def _test(options):
    from keras_distrib.commands import selftest

    problems = []
    if options.workers < 1:
        problems.append(f"`--workers`={options.workers}: expected a whole number >= 1")
    if not validation.is_seconds(options.timeout):
        problems.append(f"`--timeout`={options.timeout:g}: expected a finite number of seconds > 0")
    if options.dir is not None:
        problems += filter(None, [validation.output_path_problem("--dir", options.dir, directory=True)])
    try:
        cluster_lib.cluster_info()
    except cluster_lib.ClusterConfigError as error:
        problems.append(str(error))
    if problems:
        return _refuse("test", problems)
    return selftest.main(workers=options.workers, verbose=options.verbose, timeout=options.timeout,
                         directory=options.dir, gpu=options.gpu, network=options.network)


def _env(options):
    from keras_distrib.commands import environment

    return environment.main()


def build_parser():
    """The `keras-distrib` argument parser (launch, tf-config, demo, bench)."""
    parser = argparse.ArgumentParser(
        prog="keras-distrib", description="Exact tf.distribute training for Keras 3."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    launch = commands.add_parser(
        "launch", help="run a script on a local cluster (--workers N), or as the per-node "
        "agent of a Slurm/Kubernetes job (no --workers)",
        description="Runs SCRIPT on a local cluster of --workers processes (free ports, a "
        "TF_CONFIG per task, logs prefixed by task), or, without --workers under srun or in a "
        "Kubernetes pod, this node's --per-node tasks (the per-node agent). The first failure "
        "stops the other tasks. SIGTERM, SIGINT and SIGUSR1 to the launcher give the tasks "
        "SIGTERM and --grace-period seconds to save.",
        epilog="exit codes: 0 trained; 42 the tasks saved for a restart (a preemption); 2 a "
        "configuration error of kd (the arguments, the cluster's variables, a taken port, a "
        "node name that does not resolve), which a rerun would meet again; else the failing "
        "task's own code.",
    )
    launch.add_argument("--workers", type=int, default=None,
                        help="worker processes of a local cluster (default 2; without it under "
                        "srun or a Kubernetes Job, start this node's tasks)")
    launch.add_argument("--per-node", type=_per_node, default=None,
                        help="agent: tasks on this node, a number or 'gpu' (one per GPU; default 1)")
    launch.add_argument("--ps", type=int, default=None, help="parameter-server tasks")
    launch.add_argument("--chief", action="store_true", help="add a separate chief task")
    launch.add_argument("--max-restarts", type=int, default=0,
                        help="restart the cluster up to K times (0..1000; quick failures back off)")
    launch.add_argument("--min-workers", type=int, default=None,
                        help="elastic: a worker that fails through every restart is given up "
                        "on and the others go on from the last backup, down to M workers")
    launch.add_argument("--data-workers", type=int, default=0,
                        help="also run a tf.data service: a dispatcher and N data worker "
                        "processes beside the training tasks (KD_DATA_SERVICE; kd.data.serve)")
    launch.add_argument("--timeout", type=float, default=None, help="seconds before everything is stopped")
    launch.add_argument("--log-dir", default=None, help="also write each task's log here")
    launch.add_argument("--grace-period", type=float, default=launch_requests.DEFAULT_GRACE_PERIOD,
                        help="seconds the tasks get to save and exit when the launcher gets "
                        "SIGTERM (a preemption; default %(default)g); kd's tasks then exit 42")
    launch.add_argument("--evaluator", action="store_true",
                        help="also run the script as an `evaluator` task (e.g. kd.SidecarEvaluator)")
    launch.add_argument("--verbose", action="store_true",
                        help="keep TensorFlow's C++ start-up and INFO logs (hidden by default)")
    launch.add_argument("--network", choices=tuple(launch_requests.NETWORK_OPTIONS), default=None,
                        help="local cluster: " + _NETWORK_HELP)
    launch.add_argument("--private-network", dest="network", action="store_const",
                        const="private", help="the same as --network private")
    launch.add_argument("--no-private-network", dest="network", action="store_const",
                        const="open", help="the same as --network open")
    launch.add_argument("script", help="the Python script every task runs")
    launch.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    launch.set_defaults(run=_launch)

    tf_config = commands.add_parser(
        "tf-config", help="print the cluster kd finds here (TF_CONFIG, Slurm, Kubernetes, TPU) "
        "as TF_CONFIG, with its source",
        description="Prints the cluster kd finds here (TF_CONFIG, a Slurm step, a Kubernetes "
        "Indexed Job or JobSet, a TPU pod) as TF_CONFIG, with where it found it: the first "
        "thing to check on a new cluster.",
    )
    tf_config.add_argument("--per-node", type=_per_node, default=None,
                           help="as `launch --per-node`: the TF_CONFIG of each of this node's tasks")
    tf_config.add_argument("--ps", type=int, default=None, help="as `launch --ps`")
    tf_config.add_argument("--export", action="store_true", help="print `export TF_CONFIG='...'`")
    tf_config.add_argument("--compact", action="store_true", help="one line of JSON")
    tf_config.set_defaults(run=_tf_config)

    demo = commands.add_parser(
        "demo", help="show exact distributed training on this machine",
        description="One device against kd on 2 replicas, kd on 2 launched worker processes "
        "and kd.TrainLoop, with plain Keras's results under the same strategy beside them "
        "(CPU only, no download).",
    )
    demo.add_argument("--quick", action="store_true", help="fewer epochs (for tests)")
    demo.add_argument("--out", default="kd_demo_out", help="where checkpoints and logs go")
    demo.add_argument("--verbose", action="store_true",
                      help="show every stage's output: epochs, TensorFlow's logs, tracebacks")
    demo.add_argument("--network", choices=tuple(launch_requests.NETWORK_OPTIONS), default="auto", help=_NETWORK_HELP)
    demo.set_defaults(run=_demo)

    test = commands.add_parser(
        "test", help="check this machine (or cluster) in a minute: devices, collectives, "
        "training against one device, sharding, chief-only checkpoints",
        description="A pass/fail self-check of this machine, in about a minute: devices, "
        "collectives, training against one device, data sharding, chief-only checkpoints. "
        "Run on every task of a cluster (TF_CONFIG set, as for training), each task checks "
        "the real cluster and prints its own table.",
    )
    test.add_argument("--workers", type=int, default=2, help="local worker processes (default 2)")
    test.add_argument("--timeout", type=float, default=120, help="seconds for the worker processes")
    test.add_argument("--verbose", action="store_true",
                      help="show the worker processes' output and TensorFlow's logs")
    test.add_argument("--dir", default=None,
                      help="where the checkpoint check writes inside a TF_CONFIG cluster "
                      "(shared storage); a temporary directory by default")
    test.add_argument("--gpu", action="store_true",
                      help="check the GPU path instead: one GPU split into 2 logical GPUs (or 2 GPUs), "
                      "an NCCL all-reduce, and training against one GPU in float32, mixed_float16 "
                      "and with jit_compile=True (a few minutes; exit code 2 without a GPU)")
    test.add_argument("--network", choices=tuple(launch_requests.NETWORK_OPTIONS), default="auto", help=_NETWORK_HELP)
    test.set_defaults(run=_test)

    env = commands.add_parser(
        "env", help="versions, devices, cluster source and the strategy 'auto' picks (for bug reports)",
        description="Prints what a bug report needs: versions, devices, where the cluster "
        "comes from, and the strategy kd.make_strategy('auto') picks.",
    )
    env.set_defaults(run=_env)

    commands.add_parser(
        "bench", help="steps/second of plain Keras, kd fit and kd.TrainLoop, as ratios "
        "([--model mlp|cnn|cnn_bn] [--replicas N] [--steps S] [--repeats R] [--json PATH]); "
        "with --network, of kd fit, tf-keras fit and TensorFlow's tutorial loop on worker processes "
        "joined by a link with latency ([--workers 2,4] [--delays 0,1,5] [--link auto|veth|relay] "
        "[--steps S] [--repeats R] [--timeout S] [--json PATH]; root); with --first-step, CPU "
        "seconds and wall time to the first step of kd and Keras 3 in fresh processes "
        "([--models mlp,cnn,resnet9,...] [--frameworks keras,kd,...] [--repeats R] [--before PATH] "
        "[--profile] [--json PATH])",
    )
    return parser


def _frameworks_problem():
    """Loads TensorFlow (its notices hidden) and Keras, and checks their versions; None, or why not.

    A command that needs them ends on a missing or refused one with one
    sentence, not a traceback.
    """
    try:
        tf_logs.import_tensorflow()
        import keras  # noqa: F401
    except ImportError as error:
        name = (getattr(error, "name", None) or "").partition(".")[0]
        if isinstance(error, ModuleNotFoundError) and name in ("tensorflow", "keras"):
            return (f"{name} is not installed in this Python ({sys.executable}), and the command "
                    f"needs it: reinstall keras_distrib (`pip install -e .` in its checkout), which "
                    f"installs the tested version")
        return (f"TensorFlow or Keras does not load in this Python ({sys.executable}: "
                f"{type(error).__name__}: {error}): reinstall them (`pip install -e .` in kd's "
                "checkout installs the tested versions)")
    try:
        importlib.import_module("keras_distrib._keras_compat")  # refuses an untested version
    except ImportError as error:
        return str(error)
    return None


def main(argv=None):
    """Runs the `keras-distrib` command line; returns the exit code.

    A user's mistake or a missing component ends with one sentence on
    stderr and exit code 2 (argparse's usage errors included), never a
    traceback.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in _WITH_TENSORFLOW:
        # Before the command's modules: TensorFlow's notices hidden.
        problem = _frameworks_problem()
        if problem:
            return _refuse(argv[0], [problem])
    if argv[:1] == ["bench"] and "--network" in argv[1:]:
        # Worker processes over a link with latency (`keras-distrib bench --network --help`).
        from keras_distrib.commands import bench_network

        return bench_network.main([arg for arg in argv[1:] if arg != "--network"])
    if argv[:1] == ["bench"] and "--first-step" in argv[1:]:
        # The wait before the first step, kd against Keras 3 (`keras-distrib bench --first-step --help`).
        from keras_distrib.commands import bench_first_step

        return bench_first_step.main([arg for arg in argv[1:] if arg != "--first-step"])
    if argv[:1] == ["bench"]:
        # The benchmark has its own options (see `keras-distrib bench --help`).
        from keras_distrib.commands import bench

        return bench.main(argv[1:])
    options = build_parser().parse_args(argv)
    return options.run(options)


if __name__ == "__main__":
    sys.exit(main())
