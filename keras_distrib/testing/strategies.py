"""Where `assert_parity` trains: strategies in this process, and in processes of their own.

A process holds one device layout and one collective group: one device,
mirrored and central storage run here on logical CPU devices; multi-worker
and parameter-server strategies run in processes `kd.launch` starts
(`run_in_cluster`).
"""

import os

from keras_distrib import _keras_compat
from keras_distrib import report
from keras_distrib import validation
from keras_distrib.cluster import devices
from keras_distrib.cluster import launcher
from keras_distrib.cluster import strategies

__all__ = [
    "ClusterError",
    "IN_CLUSTER",
    "IN_PROCESS",
    "STRATEGIES",
    "cpu_devices",
    "local_strategy",
    "run_in_cluster",
    "task_entry",
]

IN_PROCESS = ("one_device", "mirrored", "central_storage")
"""The strategies `assert_parity` runs in this process, on logical CPU devices."""
IN_CLUSTER = ("multi_worker", "parameter_server")
STRATEGIES = IN_PROCESS + IN_CLUSTER
"""Every strategy name `assert_parity` takes: `IN_PROCESS`, then `"multi_worker"` and `"parameter_server"`."""


def task_entry():
    """`keras_distrib.cluster._task_entry`, the module a launched task runs."""
    # Imported when used: `keras_distrib.cluster._task_entry` is also the module that
    # launched tasks run with `python -m`, and importing it with the package
    # makes Python warn in every task (runpy's "found in sys.modules").
    from keras_distrib.cluster import _task_entry as module

    return module


def cpu_devices(count):
    """`count` logical CPU devices in this process, split now if TF allows."""
    if strategies._configured_cpu_count() < count:
        try:
            devices.virtual_devices(count)
        except RuntimeError as error:
            raise RuntimeError(
                f"{count} replicas need {count} logical CPU devices, and TensorFlow "
                f"already started this process's devices with "
                f"{strategies._configured_cpu_count()}. Split the CPU before anything "
                "touches TensorFlow: load kd.testing as a pytest plugin (`pytest -p "
                "keras_distrib.testing --kd-devices N`, or `pytest_plugins = "
                "['keras_distrib.testing']` in conftest.py), or call "
                "kd.virtual_devices(N) at the top of your script."
            ) from error
    return [f"/device:CPU:{i}" for i in range(count)]


def local_strategy(kind, *, replicas=2):
    """A strategy of `kind` in this process, on logical CPU devices.

    Args:
        kind: `"one_device"`, `"mirrored"` or `"central_storage"`.
        replicas: Replicas of `"mirrored"` and `"central_storage"`.

    Returns:
        A `tf.distribute.Strategy`.

    Raises:
        ValueError: an unknown `kind` or `replicas`.
        RuntimeError: TensorFlow started its devices with fewer CPU devices
            than `replicas` (the message says how to split them in time).

    Examples:
        >>> from keras_distrib import testing
        >>> testing.local_strategy("one_device").num_replicas_in_sync
        1
    """
    if kind not in IN_PROCESS:
        raise ValueError(
            f"`kind`={kind!r} does not run in this process. Expected one of "
            f"{list(IN_PROCESS)}; for {list(IN_CLUSTER)} use run_in_cluster()."
        )
    if not validation.is_whole(replicas, 1):
        raise ValueError(f"`replicas`={replicas!r}: expected a whole number >= 1.")
    if kind == "one_device":
        return strategies.make_strategy("one_device", devices=cpu_devices(1)[:1])
    if kind == "mirrored":
        # Several MirroredStrategy objects share a process here (one per test,
        # per assert_parity call): each gets collective keys of its own.
        return _keras_compat.isolated_mirrored_strategy(cpu_devices(replicas)[:replicas])
    return strategies.make_strategy(kind, devices=cpu_devices(replicas)[:replicas])


_ERROR_MARK = "kd.testing error: "


class ClusterError(AssertionError):
    """A process started by `run_in_cluster` failed (an `AssertionError`, so pytest reports it).

    Args:
        message: The whole report: the error in one line, then the
            process's last lines of output.
        summary: The error in one line (also `self.summary`).
    """

    def __init__(self, message, summary):
        super().__init__(message)
        self.summary = summary


def _cluster_task(kind, workers, spec, args):
    """What each launched process runs: `fn(strategy, *args)` (see run_in_cluster)."""
    from keras_distrib.cluster import inprocess as inprocess_cluster

    try:
        function = task_entry()._resolve(spec)
        if kind == "parameter_server":
            # This process is the coordinator of its own cluster, not a task
            # of the launcher's one-process cluster.
            os.environ.pop("TF_CONFIG", None)
            resolver = inprocess_cluster.local_cluster(workers=workers, ps=1)
            strategy = strategies.make_strategy("parameter_server", cluster_resolver=resolver)
        else:
            strategy = strategies.make_strategy("multi_worker")
        return function(strategy, *args)
    except Exception as error:
        # One line for the caller's message; the traceback follows in the output.
        print(_ERROR_MARK + report.error_line(error), flush=True)
        raise


def run_in_cluster(fn, *args, kind="multi_worker", workers=2, timeout=300):
    """Runs `fn(strategy, *args)` under a strategy that needs other processes.

    Args:
        fn: An importable function (module level in a .py file).
        *args: Picklable arguments.
        kind: `"multi_worker"`: `workers` processes on localhost, each
            calling `fn` under `MultiWorkerMirroredStrategy` (one replica
            each). `"parameter_server"`: one fresh process, the coordinator
            of an in-process cluster of `workers` workers and 1 ps, calling
            `fn` once under `ParameterServerStrategy`.
        workers: Worker count.
        timeout: Seconds before every process is stopped.

    Returns:
        `{"worker 0": value, ...}` for `"multi_worker"`; `fn`'s value for
        `"parameter_server"`.

    Raises:
        ValueError: a bad `kind`, or `fn` cannot be imported elsewhere.
        ClusterError: (an `AssertionError`) a process failed or timed out;
            the message starts with its error in one line, then its last
            lines of output.
    """
    if kind not in IN_CLUSTER:
        raise ValueError(f"`kind`={kind!r}: expected one of {list(IN_CLUSTER)}.")
    spec = task_entry().function_spec(fn)
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPUs only: see the module docstring
    lines = []
    result = launcher.launch(
        _cluster_task, workers=workers if kind == "multi_worker" else 1,
        args=(kind, workers, spec, tuple(args)), timeout=timeout, env=env, sink=lines.append,
    )
    if result.returncode != 0:
        errors = [line for line in lines if _ERROR_MARK in line]
        if errors:
            label, _, error = errors[0].partition(_ERROR_MARK)
            summary = f"{label.strip('[] ')}: {error}"
        elif result.timed_out:
            summary = f"timed out after {timeout:g} s"
        else:
            summary = f"exit code {result.returncode}"
        raise ClusterError(
            f"{spec} under {kind} failed: {summary}\nLast lines of its output:\n"
            + "\n".join(lines[-15:]), summary,
        )
    if kind == "parameter_server":
        return result.values["worker 0"]
    return result.values
