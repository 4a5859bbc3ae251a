"""The `keras-distrib` command: `launch` a local cluster, run the `demo`, `test` this
machine, print the `env`ironment, or `bench`mark."""

import argparse
import sys

from keras_distrib import launcher as launch_lib

__all__ = [
    "build_parser",
    "main",
]


def _launch(options):
    try:
        result = launch_lib.launch(
            options.script,
            workers=options.workers,
            ps=options.ps,
            chief=options.chief,
            args=options.args,
            max_restarts=options.max_restarts,
            timeout=options.timeout,
            log_dir=options.log_dir,
            verbose=options.verbose,
            evaluator=options.evaluator,
        )
    except launch_lib.LaunchError as error:
        print(f"keras-distrib launch: {error}", file=sys.stderr)
        return 2
    return result.returncode


def _demo(options):
    from keras_distrib import demo

    return demo.main(quick=options.quick, out=options.out, verbose=options.verbose)


def _test(options):
    from keras_distrib import selftest

    return selftest.main(workers=options.workers, verbose=options.verbose, timeout=options.timeout,
                         directory=options.dir)


def _env(options):
    from keras_distrib import environment

    return environment.main()


def build_parser():
    """The `keras-distrib` argument parser (launch, demo, bench)."""
    parser = argparse.ArgumentParser(
        prog="keras-distrib", description="Exact tf.distribute training for Keras 3."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    launch = commands.add_parser(
        "launch", help="run a script on a local cluster (one process per task)"
    )
    launch.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    launch.add_argument("--ps", type=int, default=0, help="parameter-server tasks")
    launch.add_argument("--chief", action="store_true", help="add a separate chief task")
    launch.add_argument("--max-restarts", type=int, default=0, help="restart the cluster up to K times")
    launch.add_argument("--timeout", type=float, default=None, help="seconds before everything is stopped")
    launch.add_argument("--log-dir", default=None, help="also write each task's log here")
    launch.add_argument("--evaluator", action="store_true",
                        help="also run the script as an `evaluator` task (e.g. kd.SidecarEvaluator)")
    launch.add_argument("--verbose", action="store_true",
                        help="keep TensorFlow's C++ start-up and INFO logs (hidden by default)")
    launch.add_argument("script", help="the Python script every task runs")
    launch.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    launch.set_defaults(run=_launch)

    demo = commands.add_parser("demo", help="show exact distributed training on this machine")
    demo.add_argument("--quick", action="store_true", help="fewer epochs (for tests)")
    demo.add_argument("--out", default="kd_demo_out", help="where checkpoints and logs go")
    demo.add_argument("--verbose", action="store_true",
                      help="show every stage's output: epochs, TensorFlow's logs, tracebacks")
    demo.set_defaults(run=_demo)

    test = commands.add_parser(
        "test", help="check this machine (or cluster) in a minute: devices, collectives, "
        "training against one device, sharding, chief-only checkpoints",
    )
    test.add_argument("--workers", type=int, default=2, help="local worker processes (default 2)")
    test.add_argument("--timeout", type=float, default=120, help="seconds for the worker processes")
    test.add_argument("--verbose", action="store_true",
                      help="show the worker processes' output and TensorFlow's logs")
    test.add_argument("--dir", default=None,
                      help="where the checkpoint check writes inside a TF_CONFIG cluster "
                      "(shared storage); a temporary directory by default")
    test.set_defaults(run=_test)

    env = commands.add_parser(
        "env", help="versions, devices, cluster source and the strategy 'auto' picks (for bug reports)"
    )
    env.set_defaults(run=_env)

    commands.add_parser(
        "bench", help="steps/second of plain Keras, kd fit and kd.TrainLoop, as ratios "
        "([--model mlp|cnn] [--replicas N] [--steps S] [--repeats R] [--json PATH])",
    )
    return parser


def main(argv=None):
    """Runs the `keras-distrib` command line; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        # The benchmark has its own options (see `keras-distrib bench --help`).
        from keras_distrib import bench

        return bench.main(argv[1:])
    options = build_parser().parse_args(argv)
    return options.run(options)


if __name__ == "__main__":
    sys.exit(main())
