"""Sharded input pipelines in which every example is seen once per epoch.

`distribute_dataset` batches by the global batch and lets `tf.distribute`
split each global batch across workers and replicas. With DATA sharding the
global batch k holds exactly the rows k*B .. k*B+B-1, as on one device;
when the last batch is smaller than the number of replicas, some replicas
receive empty batches (kd models count them correctly) instead of examples
being dropped or a collective hanging. FILE sharding gives each worker whole
files, and falls back to DATA sharding (with a warning) when there are fewer
files than workers, so no example is lost or repeated either way.
"""

import glob as glob_lib
import os
import warnings

import numpy as np
import tensorflow as tf

from keras_distrib import _keras_compat
from keras_distrib.cluster import info as cluster
from keras_distrib.training import replica
from keras_distrib import validation

__all__ = [
    "describe_input",
    "distribute_dataset",
    "file_count",
    "replay_epochs",
    "replica_split",
    "shard_files",
]

_POLICIES = {
    "auto": tf.data.experimental.AutoShardPolicy.AUTO,
    "file": tf.data.experimental.AutoShardPolicy.FILE,
    "data": tf.data.experimental.AutoShardPolicy.DATA,
    "off": tf.data.experimental.AutoShardPolicy.OFF,
}


def _policy(shard_policy):
    if isinstance(shard_policy, tf.data.experimental.AutoShardPolicy):
        return shard_policy
    key = str(shard_policy).lower()
    if key not in _POLICIES:
        raise ValueError(
            f"`shard_policy`={shard_policy!r} is not a shard policy. Expected one "
            f"of {sorted(_POLICIES)} (or a tf.data.experimental.AutoShardPolicy)."
        )
    return _POLICIES[key]


def _strategy_or_current(strategy):
    if strategy is not None:
        return strategy
    if not tf.distribute.has_strategy() and cluster.cluster_info().num_workers > 1:
        raise ValueError(
            "`strategy` is None outside any strategy scope, in a multi-worker job: "
            "the data would not be sharded and every worker would read everything. "
            "Pass `strategy=`, or call this inside `with strategy.scope():`."
        )
    return tf.distribute.get_strategy()


def _as_dataset(data):
    if isinstance(data, tf.data.Dataset):
        return data
    if isinstance(data, (np.ndarray, dict, tuple, list)) or tf.is_tensor(data):
        structure = tuple(data) if isinstance(data, list) else data
        try:
            return tf.data.Dataset.from_tensor_slices(structure)
        except (ValueError, TypeError) as error:
            raise ValueError(
                f"`data` could not be sliced into examples ({error}). Pass arrays "
                "with the same first dimension, a dict or tuple of them, a "
                "tf.data.Dataset, or a dataset_fn(input_context)."
            ) from error
    raise TypeError(
        f"`data` is a {type(data).__name__}. Expected a tf.data.Dataset, NumPy "
        "arrays (or a dict/tuple of them), or a dataset_fn(input_context)."
    )


def _check_flags(*, strategy=None, drop_remainder=False, shuffle=False, seed=0):
    """Raises ValueError listing every bad flag of `distribute_dataset`."""
    problems = []
    if strategy is not None and not isinstance(strategy, tf.distribute.Strategy):
        problems.append(
            f"`strategy`={strategy!r}: expected a tf.distribute.Strategy (e.g. "
            "kd.make_strategy()), or None for the current one"
        )
    for name, value in (("drop_remainder", drop_remainder), ("shuffle", shuffle)):
        if not isinstance(value, (bool, np.bool_)):
            problems.append(f"`{name}`={value!r}: expected True or False")
    if not validation.is_whole(seed, 0):
        problems.append(f"`seed`={seed!r}: expected a whole number >= 0")
    if problems:
        raise ValueError("Invalid distribute_dataset arguments:\n  - " + "\n  - ".join(problems))


def _check_batch(global_batch_size, replicas, drop_remainder):
    if global_batch_size is None:
        raise ValueError(
            "`global_batch_size` is required to batch `data`: the number of "
            f"examples per step over all {replicas} replicas."
        )
    if not validation.is_whole(global_batch_size, 1):
        raise ValueError(f"`global_batch_size`={global_batch_size!r} must be a whole number >= 1.")
    if global_batch_size % replicas:
        lower = global_batch_size - global_batch_size % replicas
        raise ValueError(
            f"`global_batch_size`={global_batch_size} is not divisible by the "
            f"{replicas} replicas in sync. Use a multiple of {replicas} (e.g. "
            f"{lower or replicas} or {lower + replicas}); the last, partial batch "
            f"is handled either way (drop_remainder={drop_remainder})."
        )


def shard_files(pattern_or_list, input_context=None):
    """The files this input pipeline reads: every file exactly once overall.

    Args:
        pattern_or_list: A glob pattern or a list of paths (sorted, so every
            worker sees the same order).
        input_context: A `tf.distribute.InputContext` (as given to a
            `dataset_fn`); all files when `None`.

    Returns:
        The list of this pipeline's files.

    Raises:
        ValueError: no file matches, or fewer files than input pipelines
            (use DATA sharding then: `kd.distribute_dataset(..., shard_policy="data")`).
    """
    if isinstance(pattern_or_list, (str, os.PathLike)):
        files = sorted(glob_lib.glob(os.fspath(pattern_or_list)))
    else:
        files = sorted(os.fspath(f) for f in pattern_or_list)
    if not files:
        raise ValueError(
            f"`pattern_or_list`={pattern_or_list!r} matches no file. Check the "
            "path (FILE sharding needs files to split among workers)."
        )
    if input_context is None:
        return files
    pipelines = input_context.num_input_pipelines
    if len(files) < pipelines:
        raise ValueError(
            f"{len(files)} file(s) for {pipelines} input pipelines: FILE sharding "
            "would leave some workers without data. Write at least one file per "
            "worker, or shard by DATA (shard_policy='data')."
        )
    return files[input_context.input_pipeline_id::pipelines]


def _checked_dataset_fn(dataset_fn, global_batch_size, drop_remainder):
    def fn(input_context):
        dataset = dataset_fn(input_context)
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(
                f"`dataset_fn` returned a {type(dataset).__name__}; it must return "
                "a tf.data.Dataset (this worker's shard, batched per replica, or "
                "unbatched when `global_batch_size` is given)."
            )
        if global_batch_size is not None:
            per_replica = input_context.get_per_replica_batch_size(global_batch_size)
            dataset = dataset.batch(per_replica, drop_remainder=drop_remainder)
        return dataset

    return fn


def file_count(dataset):
    """Number of files a dataset reads, or None when it reads no file list.

    Args:
        dataset: A `tf.data.Dataset` (e.g. a `TFRecordDataset` or
            `list_files` pipeline).

    Returns:
        The number of files, or `None`.

    Raises:
        ValueError: `dataset` is not a `tf.data.Dataset`.
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise ValueError(f"`dataset` is a {type(dataset).__name__}; expected a tf.data.Dataset "
                         "(e.g. tf.data.TFRecordDataset(files))")
    graph = _keras_compat.serialized_graph(dataset)
    graph_def = tf.compat.v1.GraphDef()
    graph_def.ParseFromString(graph.numpy())
    for node in graph_def.node:
        if node.op == "TensorSliceDataset":
            for inner in graph_def.node:
                if inner.name == node.input[0] and inner.op == "Const":
                    tensor = inner.attr["value"].tensor
                    if tensor.dtype == tf.string.as_datatype_enum:
                        return max(len(tensor.string_val), int(np.prod([d.size for d in tensor.tensor_shape.dim]) or 0))
    return None


def distribute_dataset(data, *, strategy=None, global_batch_size=None, shard_policy="auto",
                       drop_remainder=False, shuffle=False, seed=0):
    """Batches, shards and distributes `data` so each example is seen once per epoch.

    Args:
        data: A `tf.data.Dataset` of single examples, NumPy arrays (or a dict
            or tuple of them), or a `dataset_fn(input_context)` returning this
            worker's dataset (as `distribute_datasets_from_function`).
        strategy: The strategy; the current one when `None`.
        global_batch_size: Examples per step over all replicas. Required for
            datasets and arrays; for a `dataset_fn`, optional (then the
            function's dataset is batched per replica here).
        shard_policy: `"auto"`, `"file"`, `"data"` or `"off"` (as
            `tf.data.experimental.AutoShardPolicy`). `"off"` makes every
            worker read everything: then each example is seen once per worker.
        drop_remainder: Drop the last partial batch (static shapes, e.g. TPU).
        shuffle: Shuffle examples each epoch, with the same order on every
            worker (a fixed `seed`), so sharding stays exactly-once.
        seed: The shuffle seed.

    Returns:
        A `tf.distribute.DistributedDataset`.

    Raises:
        ValueError / TypeError: an empty dataset, a bad batch size (not
            divisible by the replicas), an unknown policy, a `dataset_fn` that
            returns something else than a dataset.
    """
    _check_flags(strategy=strategy, drop_remainder=drop_remainder, shuffle=shuffle, seed=seed)
    strategy = _strategy_or_current(strategy)
    policy = _policy(shard_policy)
    replicas = strategy.num_replicas_in_sync
    if callable(data) and not isinstance(data, tf.data.Dataset):
        if global_batch_size is not None:
            _check_batch(global_batch_size, replicas, drop_remainder)
        return strategy.distribute_datasets_from_function(
            _checked_dataset_fn(data, global_batch_size, drop_remainder)
        )
    dataset = _as_dataset(data)
    _check_batch(global_batch_size, replicas, drop_remainder)
    if dataset.cardinality() == 0:
        raise ValueError("`data` is empty: the dataset has no examples to train on.")
    if policy == tf.data.experimental.AutoShardPolicy.FILE:
        files = file_count(dataset)
        workers = cluster.cluster_info().num_workers
        if files is None:
            raise ValueError(
                "`shard_policy`='file' but `data` does not read a list of files. "
                "Build it from files (e.g. TFRecordDataset(kd.data.shard_files(...))) "
                "or use shard_policy='data'."
            )
        if files < workers:
            warnings.warn(
                f"{files} file(s) for {workers} workers: sharding by DATA instead of "
                "FILE so that every example is still read exactly once.",
                stacklevel=2,
            )
            policy = tf.data.experimental.AutoShardPolicy.DATA
    if shuffle:
        size = int(dataset.cardinality())
        buffer = size if size > 0 else 10_000
        dataset = dataset.shuffle(buffer, seed=seed, reshuffle_each_iteration=True)
    dataset = dataset.batch(global_batch_size, drop_remainder=drop_remainder)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    return strategy.experimental_distribute_dataset(dataset.with_options(options))


def replay_epochs(dataset, epochs):
    """Moves a dataset that reshuffles each epoch on to the order of epoch `epochs`.

    A dataset shuffled with `reshuffle_each_iteration=True` draws a new order
    each time an iterator over it is opened, from a seed state that lives in
    the process: a process resuming at epoch E would draw epoch 0's order
    for it. Opening (and dropping) E iterators first gives epoch E's order,
    as in the uninterrupted run. Opening an iterator reads no element, so it
    costs little; for a distributed dataset kd opens each worker's plain iterator.
    `fit`, `kd.TrainLoop` and parameter-server training do this when they
    resume from a backup; call it in a loop of your own that opens one
    iterator per epoch, before the first iterator of the resumed epoch.

    Args:
        dataset: A `tf.data.Dataset` or a distributed dataset (the one whose
            iterators the loop opens; in one process they share the seed
            state with the dataset they were made from).
        epochs: Iterators to open and drop (the epochs trained before).

    Returns:
        Whether any iterator was opened (False for `epochs`=0 or a dataset
        that does not reshuffle).

    Raises:
        ValueError: `epochs` is not a whole number >= 0, or `dataset` is not
            a dataset.

    Examples:
        >>> import tensorflow as tf, keras_distrib as kd
        >>> data = tf.data.Dataset.range(6).shuffle(6, seed=1, reshuffle_each_iteration=True)
        >>> orders = [list(data.as_numpy_iterator()) for _ in range(3)]
        >>> again = tf.data.Dataset.range(6).shuffle(6, seed=1, reshuffle_each_iteration=True)
        >>> kd.replay_epochs(again, 2)
        True
        >>> list(again.as_numpy_iterator()) == orders[2]
        True
    """
    problems = []
    if not validation.is_whole(epochs, 0):
        problems.append(f"`epochs`={epochs!r}: expected a whole number >= 0 (the epochs trained "
                        "before the resumed one)")
    iterable = isinstance(dataset, tf.data.Dataset) or hasattr(dataset, "element_spec")
    if not iterable or not hasattr(dataset, "__iter__"):
        problems.append(f"`dataset` is a {type(dataset).__name__}: expected a tf.data.Dataset or "
                        "a distributed dataset (strategy.experimental_distribute_dataset)")
    if problems:
        raise ValueError("Invalid replay_epochs arguments:\n  - " + "\n  - ".join(problems))
    if epochs == 0 or _keras_compat.reshuffles_each_iteration(dataset) is False:
        return False
    for _ in range(epochs):
        _keras_compat.draw_order(dataset)
    return True


def replica_split(rows, replicas):
    """How `tf.distribute` splits a batch of `rows` over `replicas` replicas.

    TensorFlow cuts the batch into pieces of ceil(rows / replicas) rows, in
    order: the last non-empty piece holds what is left, and the pieces after
    it are empty. A full global batch (a multiple of the replicas) splits
    evenly; a partial last batch does not. Measured against the per-replica
    batches of `experimental_distribute_dataset` (tests/scripts/data_errors.py).

    Args:
        rows: Rows in the global batch.
        replicas: Replicas in sync.

    Returns:
        The row count of each piece, in order. Piece m goes to worker
        m % W (of W workers), to its local replica m // W.

    Examples:
        >>> replica_split(26, 4), replica_split(2, 4), replica_split(32, 4)
        ([7, 7, 7, 5], [1, 1, 0, 0], [8, 8, 8, 8])

    Raises:
        ValueError: `rows` is not a whole number >= 0, or `replicas` >= 1.
    """
    problems = []
    if not validation.is_whole(rows, 0):
        problems.append(f"`rows`={rows!r}: expected a whole number >= 0")
    if not validation.is_whole(replicas, 1):
        problems.append(f"`replicas`={replicas!r}: expected a whole number >= 1")
    if problems:
        raise ValueError("; ".join(problems))
    size = -(-rows // replicas)
    counts = []
    for _ in range(replicas):
        take = min(size, rows)
        counts.append(take)
        rows -= take
    return counts


def _piece_of_replica(replica_id, workers, local):
    """Which piece of each global batch replica `replica_id` receives.

    With DATA sharding every worker sees the global batch cut into pieces,
    and takes every W-th piece: worker w's local replica r (global replica
    w * local + r) gets piece r * W + w.
    """
    return replica.piece_order(workers * local, workers)[replica_id]


def describe_input(data, *, strategy=None, global_batch_size=None, shard_policy="auto",
                   drop_remainder=False, steps_per_epoch=None, print_fn=print):
    """Explains how `data` will be split, and warns about what will go wrong.

    Prints, for this worker and each of its replicas, the shard policy in
    effect, the files or rows each reads, the steps per epoch and the size of
    the last batch. Warns about fewer files than workers, an unknown size
    with no `steps_per_epoch`, and a last batch smaller than the replica
    count (some replicas get empty batches; kd models handle that exactly,
    plain Keras does not).

    The split of the last batch is TensorFlow's (`replica_split`): 26 rows
    on 4 replicas are [7, 7, 7, 5], 2 rows are [1, 1, 0, 0].

    Args:
        data: What you would pass to `fit` or `distribute_dataset`: NumPy
            arrays (or a dict or tuple of them), a `tf.data.Dataset` or a
            `dataset_fn(input_context)`.
        strategy: The strategy; the current one when `None`.
        global_batch_size: Examples per step over all replicas.
        shard_policy: As `distribute_dataset`.
        drop_remainder: As `distribute_dataset`.
        steps_per_epoch: Steps per epoch, for data of unknown size.
        print_fn: Where the report's lines go (`print` by default).

    Returns:
        A dict with the same facts (`policy`, `examples`, `steps`,
        `last_batch`, `last_batch_per_replica` (rows of the last batch, by
        global replica id), `files`, `warnings`).

    Examples:
        >>> import numpy as np, keras_distrib as kd
        >>> report = kd.describe_input(np.arange(10), global_batch_size=4, print_fn=lambda line: None)
        >>> report["steps"], report["last_batch"]
        (3, 2)
    """
    strategy = _strategy_or_current(strategy)
    info = cluster.cluster_info()
    replicas = strategy.num_replicas_in_sync
    workers = max(info.num_workers, 1)
    local = replicas // workers
    label = f"[{info.label}] " if info.label else ""
    policy = _policy(shard_policy)
    report = {"warnings": [], "policy": policy.name, "files": None}
    if steps_per_epoch is not None and not validation.is_whole(steps_per_epoch, 1):
        raise ValueError(f"`steps_per_epoch`={steps_per_epoch!r}: expected a whole number >= 1, "
                         "or None")
    dataset = _as_dataset(data)
    _check_batch(global_batch_size, replicas, drop_remainder)
    files = file_count(dataset)
    report["files"] = files
    if policy in (tf.data.experimental.AutoShardPolicy.AUTO, tf.data.experimental.AutoShardPolicy.FILE):
        if files is not None and files >= workers:
            report["policy"] = "FILE"
        else:
            report["policy"] = "DATA"
            if files is not None and workers > 1:
                report["warnings"].append(
                    f"{files} file(s) for {workers} workers: FILE sharding is impossible, "
                    "DATA sharding is used (every worker reads every file)."
                )
    examples = int(dataset.cardinality())
    report["examples"] = examples if examples >= 0 else None
    if examples < 0:
        report["steps"] = steps_per_epoch
        if steps_per_epoch is None:
            report["warnings"].append(
                "The dataset's size is unknown and `steps_per_epoch` is not set: "
                "epochs end when the data runs out, and progress bars cannot show totals."
            )
        report["last_batch"] = None
    else:
        full, rest = divmod(examples, global_batch_size)
        steps = full if drop_remainder or not rest else full + 1
        report["steps"] = steps_per_epoch or steps
        report["last_batch"] = global_batch_size if (drop_remainder or not rest) else rest
        if drop_remainder and rest:
            report["warnings"].append(f"drop_remainder=True drops the last {rest} example(s) every epoch.")
        if report["last_batch"] < replicas:
            report["warnings"].append(
                f"The last batch has {report['last_batch']} row(s) for {replicas} replicas: "
                "some replicas get an empty batch (exact with kd models; plain Keras "
                "gives wrong gradients here)."
            )
    last = report["last_batch"] if report["last_batch"] is not None else global_batch_size
    pieces = replica_split(last, replicas)
    report["last_batch_per_replica"] = [
        pieces[_piece_of_replica(g, workers, local)] for g in range(replicas)
    ]
    first_replica = info.task_index * local if info.task_type in ("worker", "chief") else 0
    per_replica = global_batch_size // replicas
    print_fn(f"{label}shard policy {report['policy']}, {workers} worker(s) x {local} replica(s), "
             f"global batch {global_batch_size} = {per_replica} per replica")
    print_fn(f"{label}examples: {report['examples']}, steps per epoch: {report['steps']}, "
             f"last batch: {report['last_batch']} row(s), per replica {report['last_batch_per_replica']}")
    last_size = -(-last // replicas)
    for g in range(first_replica, first_replica + local):
        piece = _piece_of_replica(g, workers, local)
        if report["policy"] == "DATA":
            rows_text = f"rows [{piece * per_replica}, {(piece + 1) * per_replica}) of each global batch"
        else:
            rows_text = f"{per_replica} rows of each of this worker's batches"
        count = pieces[piece]
        last_text = (f"rows [{piece * last_size}, {piece * last_size + count})" if count
                     else "none (an empty batch)")
        print_fn(f"{label}  replica {g}: {rows_text}; of the last batch: {last_text}")
    if report["policy"] == "FILE":
        print_fn(f"{label}  this worker reads every {workers}th file of {files}, starting with file {info.task_index}")
    for message in report["warnings"]:
        print_fn(f"{label}WARNING: {message}")
    return report
