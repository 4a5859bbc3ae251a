"""Variables under central storage and parameter servers, partitioned weights, seed state (kd models' only).

Part of `keras_distrib._keras_compat`: only these modules touch `keras.src`,
`tensorflow.python` or private attributes of Keras/TensorFlow objects.
"""

import weakref

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import ps_values
from tensorflow.python.distribute import sharded_variable
from keras.src.backend.common.stateless_scope import in_stateless_scope as _in_stateless_scope

from keras_distrib._keras_compat.losses import _replace_on_instance
from keras_distrib._keras_compat.optimizer import base_optimizer

__all__ = [
    "fix_variables",
    "model_variables",
    "optimizer_variables",
    "replace_seed_next",
    "variable_copies",
    "weight_partitions",
    "write_from_first_replica",
    "write_seed_state_from_last_replica",
]


_PS_VARIABLES = (ps_values.AggregatingVariable, ps_values.CachingVariable)


def _delegating(variable, inner, name):
    keras_method = getattr(type(variable), name).__get__(variable)

    def method(value):
        if _in_stateless_scope():
            return keras_method(value)
        return getattr(inner, name)(tf.cast(value, inner.dtype))

    method.__name__ = name
    return method


def _sharded_readable(inner, name):
    def method(*args, **kwargs):
        # A partitioned weight reads as the concatenation of its shards.
        value = tf.convert_to_tensor(inner).numpy()
        return np.asarray(value, *args[:1]) if name == "__array__" else value

    method.__name__ = name
    return method


def fix_variables(variables):
    """Atomic `assign_add`/`assign_sub` and NumPy reads for `variables`.

    Applied to a kd model's variables (weights, metrics, optimizer) only;
    see the module docstring. Idempotent.
    """
    for variable in variables:
        inner = getattr(variable, "_value", None)
        fixed = vars(variable)  # the instance's own overrides, if any
        if isinstance(inner, _PS_VARIABLES) and "assign_add" not in fixed:
            for name in ("assign_add", "assign_sub"):
                object.__setattr__(variable, name, _delegating(variable, inner, name))
        elif isinstance(inner, sharded_variable.ShardedVariable) and "numpy" not in fixed:
            for name in ("numpy", "__array__"):
                object.__setattr__(variable, name, _sharded_readable(inner, name))
            serialize, restore = _sharded_checkpointing(inner)
            object.__setattr__(variable, "_serialize_to_tensors", serialize)
            object.__setattr__(variable, "_restore_from_tensors", restore)


def _sharded_checkpointing(inner):
    """A partitioned Keras weight's checkpoint: one entry per shard.

    Keras's variable writes `{"VARIABLE_VALUE": value}`, which TensorFlow
    cannot save for a `ShardedVariable` (no device: the first backup of a
    parameter-server run with a `variable_partitioner` failed). Each shard
    is written under its own key, on its parameter server; a backup restores
    into the same partitioning only (`BackupAndRestore` records it and
    refuses another by name: the optimizer's state is per shard too).
    """
    keys = [f"VARIABLE_VALUE_part_{i}" for i in range(len(inner.variables))]

    def serialize():
        return {key: shard.read_value() for key, shard in zip(keys, inner.variables)}

    def restore(restored_tensors):
        return tf.group([shard.assign(restored_tensors[key])
                         for key, shard in zip(keys, inner.variables)])

    return serialize, restore


def weight_partitions(model):
    """`{weight index: rows of each part}` for the weights a `variable_partitioner` split.

    Keyed by the weight's index in `model.weights` (paths carry the model's
    own name, which another process may number otherwise).
    """
    parts = {}
    for index, weight in enumerate(model.weights):
        inner = getattr(weight, "_value", None)
        if isinstance(inner, sharded_variable.ShardedVariable):
            parts[str(index)] = [int(shard.shape[0]) for shard in inner.variables]
    return parts


def write_from_first_replica(variables):
    """Central storage: replica 0's `assign` to `variables` updates the one copy.

    Under CentralStorageStrategy a variable created without an aggregation
    (Keras's default; BatchNormalization's moving statistics) is an
    `AggregatingVariable` that TensorFlow refuses to update in a replica
    ("You must specify an aggregation method"). Its moving statistics are
    the same on every replica when kd computes the moments over the global
    batch (synchronized BatchNormalization), so replica 0 writes them and the
    others skip the write: what MirroredStrategy's saved (first) copy holds.
    No `merge_call`, so it also runs inside kd's compiled multi-step loops.
    Other variables and strategies are left alone. Idempotent.
    """
    _write_from_one_replica(variables, last=False)


def replace_seed_next(generator, make_next):
    """Makes `generator.next` call `make_next(generator, keras_next)` (idempotent)."""
    _replace_on_instance(generator, "next", make_next)


def write_seed_state_from_last_replica(generator, before_write=None):
    """Central storage: a `SeedGenerator`'s state is written by the last replica.

    Every replica draws from the same state (kd lays the draws out over the
    global batch) and computes the same next state; the one copy must keep
    the state every replica read until all have read it. Replicas are traced
    in order and TensorFlow runs the updates of a resource in the order they
    were created, so the last replica's write comes after every replica's
    read (kd's steps read a state once per step and count their draws, see
    `replace_seed_next`). `before_write(variable)`, if given, runs (at
    trace time) before each replica's write. Idempotent.
    """
    _write_from_one_replica([generator.state], last=True, before_write=before_write)


def _write_from_one_replica(variables, *, last, before_write=None):
    for variable in variables:
        inner = getattr(variable, "_value", None)
        if not isinstance(inner, ps_values.AggregatingVariable) or "assign" in vars(variable):
            continue
        if inner.aggregation != tf.VariableAggregation.NONE:
            continue
        object.__setattr__(variable, "assign", _one_replica_assign(variable, inner, last, before_write))


def _one_replica_assign(variable, inner, last, before_write):
    keras_assign = type(variable).assign.__get__(variable)

    def assign(value):
        context = tf.distribute.get_replica_context()
        if _in_stateless_scope() or context is None or context.num_replicas_in_sync == 1:
            return keras_assign(value)
        if before_write is not None:
            before_write(variable)
        stored = inner.get()
        value = tf.cast(value, stored.dtype)
        writer = context.num_replicas_in_sync - 1 if last else 0
        writes = tf.equal(context.replica_id_in_sync_group, writer)
        tf.cond(writes, lambda: stored.assign(value).op, tf.no_op)
        return value

    assign.__name__ = "assign"
    return assign


def model_variables(model):
    """Every variable of a kd model: weights, metrics, optimizer (and shards)."""
    found = list(model.variables) + list(model.metrics_variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        found += list(optimizer.variables)
        base = base_optimizer(optimizer)
        if base is not optimizer:
            found += list(base.variables)
    return found


_SHARD_VARIABLES = weakref.WeakKeyDictionary()


def optimizer_variables(model):
    """The variables the optimizer updates: shards for partitioned weights.

    Under ParameterServerStrategy with a `variable_partitioner`, a Keras
    weight wraps a `ShardedVariable` (its parts live on different parameter
    servers). Neither the tape nor the Keras optimizer can update it whole,
    so each shard gets its own Keras variable: gradients and optimizer slots
    are per shard, on the shard's parameter server. The model still reads
    the whole weight (the concatenation of the same shards).
    """
    wrappers = _SHARD_VARIABLES.setdefault(model, {})
    result = []
    for variable in model.trainable_weights:
        inner = getattr(variable, "_value", None)
        if not isinstance(inner, sharded_variable.ShardedVariable):
            result.append(variable)
            continue
        if id(variable) not in wrappers:
            wrappers[id(variable)] = [
                keras.Variable(shard, trainable=True, name=f"{variable.name}_shard_{i}")
                for i, shard in enumerate(inner.variables)
            ]
        result.extend(wrappers[id(variable)])
    return result


def variable_copies(variable):
    """The `tf.Variable`s that hold a Keras variable's state in this process.

    One per local replica for a mirrored or sync-on-read variable (each
    replica's copy, which a cross-replica `assign` would not set one by
    one), the variable itself otherwise.
    """
    inner = getattr(variable, "_value", variable)
    copies = getattr(inner, "values", None)
    if isinstance(copies, (tuple, list)) and copies and all(isinstance(c, tf.Variable) for c in copies):
        return list(copies)
    return [inner]
