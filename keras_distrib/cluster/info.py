"""Who am I in the cluster: TF_CONFIG, Slurm, Kubernetes or TPU; the chief; where to write.

`cluster_info()` reads TF_CONFIG when it is set, else the cluster manager's
environment (`keras_distrib.cluster.sources`: Slurm, Kubernetes Indexed Jobs
and JobSets, TPU pods), so a script needs no change between a laptop and a
cluster. Every file writer in keras_distrib asks this module for its
directory, so the rule "only the chief's files persist" lives in one place.
"""

import contextlib
import dataclasses
import json
import os
import types

from keras_distrib.cluster import sources as cluster_sources
from keras_distrib import validation
from keras_distrib.cluster.sources import ClusterConfigError
from keras_distrib import files

__all__ = [
    "ClusterConfigError",
    "ClusterInfo",
    "SOURCES",
    "chief_verbose",
    "cluster_info",
    "cluster_resolver",
    "from_placement",
    "is_chief",
    "parse_tf_config",
    "writer_directory",
]

SOURCES = ("tf_config", "slurm", "kubernetes", "tpu")
"""Where `cluster_info()` can find the cluster (`ClusterInfo.source`; `None`: a single process)."""

TASK_TYPES = ("chief", "worker", "ps", "evaluator")
TRAINING_TASK_TYPES = ("chief", "worker")


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """This process's place in the cluster, from TF_CONFIG or a cluster manager.

    Attributes:
        task_type: `"chief"`, `"worker"`, `"ps"`, `"evaluator"`, or `None`
            when there is no cluster (a single process).
        task_index: Index of this task among tasks of its type.
        num_workers: Number of processes that train (chief + workers), 1 for
            a single process.
        is_chief: Whether this process writes checkpoints and summaries.
        cluster: Task type -> tuple of `"host:port"` addresses (read-only).
        source: Where the cluster was found: `"tf_config"`, `"slurm"`,
            `"kubernetes"`, `"tpu"`, or `None` for a single process.
        local_index: This task's index among the tasks on its host (Slurm).
        local_tasks: How many tasks share its host (Slurm); a task sharing a
            node's GPUs with others gets its own share of them.
        num_ps: Number of parameter-server tasks.
        is_multi_worker: Whether more than one process trains.
        label: A short name for logs, e.g. `"worker 1"`, or `""` if single.
        tf_config: This task as a TF_CONFIG dict, or `None` if single.

    Examples:
        >>> import keras_distrib as kd
        >>> info = kd.cluster_info({"cluster": {"chief": ["h:1"], "worker": ["h:2"]},
        ...                         "task": {"type": "worker", "index": 0}})
        >>> (info.task_type, info.num_workers, info.is_chief, info.label)
        ('worker', 2, False, 'worker 0')
    """

    task_type: object = None
    task_index: int = 0
    num_workers: int = 1
    is_chief: bool = True
    cluster: types.MappingProxyType = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({})
    )
    source: object = None
    local_index: int = 0
    local_tasks: int = 1

    @property
    def tf_config(self):
        """This task as a TF_CONFIG dict (`{"cluster": ..., "task": ...}`), or None if single."""
        if self.task_type is None:
            return None
        return {
            "cluster": {k: list(v) for k, v in self.cluster.items()},
            "task": {"type": self.task_type, "index": self.task_index},
        }

    @property
    def num_ps(self):
        """Number of parameter-server tasks."""
        return len(self.cluster.get("ps", ()))

    @property
    def is_multi_worker(self):
        """Whether more than one process trains (`num_workers > 1`)."""
        return self.num_workers > 1

    @property
    def label(self):
        """A short name for logs, e.g. `"worker 1"`, or `""` if single."""
        if self.task_type is None:
            return ""
        return f"{self.task_type} {self.task_index}"


def _address_problems(task_type, addresses):
    problems = []
    if not isinstance(addresses, (list, tuple)) or not addresses:
        return [
            f"cluster[{task_type!r}] must be a non-empty list of 'host:port' "
            f"strings, got {addresses!r}"
        ]
    for i, address in enumerate(addresses):
        host, sep, port = str(address).rpartition(":")
        if not isinstance(address, str) or not sep or not host or not port.isdigit():
            problems.append(
                f"cluster[{task_type!r}][{i}]={address!r} is not 'host:port'"
            )
        elif not 1 <= int(port) <= 65535:
            problems.append(
                f"cluster[{task_type!r}][{i}]={address!r}: port {int(port)} is out of "
                "range (expected 1..65535)"
            )
        elif cluster_sources.host_problem(host, "") is not None:
            problems.append(cluster_sources.host_problem(host, f"cluster[{task_type!r}][{i}]"))
    return problems


def _duplicate_problems(cluster):
    """Every `host:port` that more than one task claims (each task needs its own)."""
    seen = {}
    for task_type, addresses in cluster.items():
        if isinstance(addresses, (list, tuple)):
            for i, address in enumerate(addresses):
                if isinstance(address, str):
                    seen.setdefault(address.strip().lower(), []).append(f"{task_type}[{i}]")
    return [
        f"{address!r} is given to {len(owners)} tasks ({', '.join(owners)}); every task "
        "needs its own host:port"
        for address, owners in seen.items() if len(owners) > 1
    ]


def parse_tf_config(tf_config):
    """Validates a TF_CONFIG value (str or dict) and returns a `ClusterInfo`.

    An empty value (`""`, `{}`) means a single process.

    Args:
        tf_config: The TF_CONFIG value: a JSON string or a dict.

    Returns:
        A `ClusterInfo` with `source="tf_config"` (`None` for a single process).

    Raises:
        ClusterConfigError: listing every problem, with the fix.
    """
    if isinstance(tf_config, str):
        try:
            config = json.loads(tf_config)
        except json.JSONDecodeError as error:
            raise ClusterConfigError(
                f"`TF_CONFIG` is not valid JSON ({error.msg} at character "
                f"{error.pos}): {tf_config[:200]!r}. Expected e.g. "
                '{"cluster": {"worker": ["localhost:12345", '
                '"localhost:23456"]}, "task": {"type": "worker", "index": 0}}.'
            ) from None
    else:
        config = tf_config
    if not isinstance(config, dict):
        raise ClusterConfigError(
            f"`TF_CONFIG` must be a JSON object, got {type(config).__name__}."
        )
    if not config:
        return ClusterInfo()

    problems = []
    unknown_keys = sorted(set(config) - {"cluster", "task", "environment", "rpc_layer"})
    if unknown_keys:
        problems.append(f"unknown top-level key(s) {unknown_keys}")
    cluster = config.get("cluster")
    task = config.get("task")
    if not isinstance(cluster, dict) or not cluster:
        problems.append(
            f"'cluster' must be a non-empty object of task lists, got {cluster!r}"
        )
        cluster = {}
    for task_type, addresses in cluster.items():
        if task_type not in TASK_TYPES:
            problems.append(
                f"unknown task type {task_type!r} in 'cluster' (expected "
                f"one of {list(TASK_TYPES)})"
            )
        problems.extend(_address_problems(task_type, addresses))
    problems.extend(_duplicate_problems(cluster))
    if len(cluster.get("chief", ())) > 1:
        problems.append(
            f"'cluster' names {len(cluster['chief'])} chiefs; at most one is allowed"
        )
    if cluster and not any(t in cluster for t in TRAINING_TASK_TYPES):
        problems.append("'cluster' names no 'chief' or 'worker' task")

    task_type, task_index = None, 0
    if not isinstance(task, dict):
        problems.append(
            f"'task' must be an object like {{'type': 'worker', 'index': 0}}, got {task!r}"
        )
    else:
        task_type = task.get("type")
        task_index = task.get("index", 0)
        if task_type not in TASK_TYPES:
            problems.append(
                f"task type {task_type!r} is unknown (expected one of {list(TASK_TYPES)})"
            )
        elif task_type != "evaluator" and task_type not in cluster:
            problems.append(f"task type {task_type!r} is not in 'cluster'")
        if not validation.is_whole(task_index, 0):
            problems.append(f"task index {task_index!r} is not a whole number >= 0")
        elif task_type in cluster and isinstance(cluster[task_type], (list, tuple)):
            if task_index >= len(cluster[task_type]):
                problems.append(
                    f"task index {task_index} is out of range: 'cluster' has "
                    f"{len(cluster[task_type])} {task_type!r} task(s), so the "
                    f"index must be 0..{len(cluster[task_type]) - 1}"
                )
    if problems:
        raise ClusterConfigError(
            "`TF_CONFIG` is invalid:\n  - "
            + "\n  - ".join(problems)
            + "\nFix TF_CONFIG (or let `keras-distrib launch` write it)."
        )

    num_workers = sum(len(cluster.get(t, ())) for t in TRAINING_TASK_TYPES)
    if "chief" in cluster:
        chief = task_type == "chief"
    else:
        chief = task_type == "worker" and task_index == 0
    return ClusterInfo(
        task_type=task_type,
        task_index=int(task_index),
        num_workers=max(num_workers, 1),
        is_chief=chief,
        cluster=types.MappingProxyType(
            {k: tuple(v) for k, v in cluster.items()}
        ),
        source="tf_config",
    )


def from_placement(placement):
    """The `ClusterInfo` of a `cluster_sources.Placement` (Slurm, Kubernetes, TPU).

    Raises:
        ClusterConfigError: `KD_PS` leaves no worker.
    """
    if placement.source == "tpu":
        # One client process drives every TPU host.
        hosts = {"worker": placement.addresses} if placement.addresses else {}
        return ClusterInfo(cluster=types.MappingProxyType(hosts), source="tpu")
    count = len(placement.addresses)
    if placement.ps and count < placement.ps + 2:
        raise ClusterConfigError(
            f"`KD_PS`={placement.ps} parameter servers leave no worker among the {count} "
            f"{placement.source} task(s): a parameter-server cluster needs a chief (rank 0), "
            f"the ps tasks and at least one worker, so at least {placement.ps + 2} tasks."
        )
    layout = cluster_sources.roles(count, placement.ps)
    cluster = {}
    for (task_type, _), address in zip(layout, placement.addresses):
        cluster.setdefault(task_type, []).append(address)
    task_type, task_index = layout[placement.rank]
    info = parse_tf_config({"cluster": cluster, "task": {"type": task_type, "index": task_index}})
    return dataclasses.replace(
        info, source=placement.source, local_index=placement.local_index,
        local_tasks=placement.local_tasks,
    )


_DETECTED = {}


def _from_environment():
    # Cached per environment: a Slurm node list costs a subprocess to expand.
    key = tuple(os.environ.get(name) for name in cluster_sources.ENVIRONMENT)
    if key not in _DETECTED:
        if os.environ.get("TF_CONFIG", "").strip():
            info = parse_tf_config(os.environ["TF_CONFIG"])
        else:
            placement = cluster_sources.detect()
            info = ClusterInfo() if placement is None else from_placement(placement)
        _DETECTED.clear()
        _DETECTED[key] = info
    return _DETECTED[key]


def cluster_info(tf_config=None):
    """This process's place in the cluster, as a frozen `ClusterInfo`.

    Reads the `TF_CONFIG` environment variable when it is set; otherwise the
    cluster manager's environment: a Slurm task started by `srun`, a pod of
    a Kubernetes Indexed Job or JobSet (with `KD_NUM_PODS` set), or a TPU
    pod's client (the variables kd reads are listed with the environment
    variables of the API reference).
    `source` says which; nothing found means a single process.

    Args:
        tf_config: A TF_CONFIG value (JSON string or dict) to parse instead
            of the environment.

    Returns:
        A `ClusterInfo`.

    Raises:
        ClusterConfigError: TF_CONFIG is malformed, or the cluster manager's
            variables are incomplete or disagree (every problem is listed,
            naming the variable).

    Examples:
        >>> import keras_distrib as kd
        >>> info = kd.cluster_info({"cluster": {"worker": ["h:1", "h:2"]},
        ...                         "task": {"type": "worker", "index": 1}})
        >>> (info.num_workers, info.is_chief, info.source)
        (2, False, 'tf_config')
    """
    if tf_config is None:
        return _from_environment()
    return parse_tf_config(tf_config)


def cluster_resolver(info=None):
    """A `tf.distribute` cluster resolver for `info` (this process's by default).

    None where TensorFlow's own TF_CONFIG resolver applies (TF_CONFIG, or a
    single process); for Slurm and Kubernetes a `SimpleClusterResolver` of
    the cluster `cluster_info()` found, so strategies and servers use the
    same addresses kd does.

    Args:
        info: A `ClusterInfo`; `cluster_info()` when `None`.
    """
    info = info or cluster_info()
    if info.source not in ("slurm", "kubernetes"):
        return None
    import tensorflow as tf

    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({k: list(v) for k, v in info.cluster.items()}),
        task_type=info.task_type, task_id=info.task_index, rpc_layer="grpc",
    )


def is_chief(tf_config=None):

    """Whether this process is the chief (the one whose files persist).

    The chief is the `chief` task, else worker 0, else the single process.

    Args:
        tf_config: A TF_CONFIG value (JSON string or dict) to read instead
            of the environment (as `cluster_info`).

    Examples:
        >>> import keras_distrib as kd
        >>> kd.is_chief({"cluster": {"worker": ["h:1", "h:2"]}, "task": {"type": "worker", "index": 0}})
        True
    """
    return cluster_info(tf_config).is_chief


def chief_verbose(verbose):
    """Keras `verbose` for this process: progress bars on the chief only.

    `"auto"` becomes 0 on non-chief workers (their bars would repeat the
    chief's); an explicit value is kept.

    Args:
        verbose: Keras's `verbose`: `"auto"`, 0, 1, 2 or a bool.

    Raises:
        ValueError: `verbose` is not "auto", 0, 1, 2 or a bool.
    """
    try:
        valid = verbose == "auto" or (not isinstance(verbose, str) and int(verbose) == verbose
                                      and int(verbose) in (0, 1, 2))
    except (TypeError, ValueError):
        valid = False
    if not valid:
        raise ValueError(f"`verbose`={verbose!r}: expected 'auto', 0, 1 or 2")
    if verbose == "auto" and not cluster_info().is_chief:
        return 0
    return verbose


@contextlib.contextmanager
def writer_directory(directory, info=None):
    """Yields the directory this process should write `directory`'s files to.

    The chief writes to `directory` itself. Every other worker still takes
    part in the save (collectives must not deadlock), but writes into a
    private temporary directory that is removed when the block exits.

    Args:
        directory: The real destination.
        info: A `ClusterInfo`; the current process's when `None`.
    """
    info = info or cluster_info()
    if info.is_chief:
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"`directory`={os.fspath(directory)!r} is a file; give a directory "
                             "(a new path is created)")
        os.makedirs(directory, exist_ok=True)
        yield directory
        return
    scratch = files.make_scratch(f"{info.task_type}{info.task_index}")
    try:
        yield scratch
    finally:
        files.remove_scratch(scratch)
