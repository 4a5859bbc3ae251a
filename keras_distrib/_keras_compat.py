"""Every place where keras_distrib depends on Keras internals, in one module.

Keras 3 divides each replica's loss by its own row count and by the replica
count, reduces step logs with a per-replica mean, and builds models from a
`strategy.reduce` of the first batch (which crashes under multi-worker).
We correct those at the narrowest point we can reach:

- `GlobalCompileLoss` replaces the model's `CompileLoss` and wraps each
  resolved loss so that it returns the replica's share of the exact global
  mean (`GlobalReductionLoss`), and its per-output trackers so they report
  the true global value (`GlobalShareMean`).
- `first_local_batch` replaces the symbolic-build reduction.
- Keras variables implement `assign_add(x)` as `assign(self + x)`. Under
  CentralStorageStrategy a metric variable is an `AggregatingVariable`
  that sums what every replica assigns, so each step stores
  R * old + sum(x) (plain Keras reports counts that double every step).
  Under ParameterServerStrategy, workers update the same variable on a
  parameter server concurrently; a read-modify-write loses increments
  (plain Keras: `optimizer.iterations` 29 instead of 32).
  `patch_aggregating_assign` routes both to the variable's own atomic
  `assign_add`/`assign_sub`.

These touch private Keras names, so they are checked against the versions we
test (`TESTED_KERAS`). `tests/test_keras_compat.py` fails loudly if a new
Keras changes the behaviour they rely on.
"""

import warnings

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import ps_values
from tensorflow.python.distribute import sharded_variable
from keras.src import backend as keras_backend
from keras.src import tree
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.tensorflow import core as keras_tf_core
from keras.src.losses import loss as keras_loss
from keras.src.trainers import compile_utils
from keras.src.utils import tracking

from keras_distrib import losses as kd_losses

TESTED_KERAS = ((3, 12), (3, 15))


def _version_tuple(version):
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


KERAS_VERSION = _version_tuple(keras.__version__)
if not TESTED_KERAS[0] <= KERAS_VERSION <= TESTED_KERAS[1]:
    warnings.warn(
        f"keras_distrib is tested with Keras {TESTED_KERAS[0]}..{TESTED_KERAS[1]}"
        f" and found Keras {keras.__version__}; run its test suite "
        "(tests/test_keras_compat.py) before trusting exactness.",
        stacklevel=2,
    )

_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


def num_replicas():
    return tf.distribute.get_strategy().num_replicas_in_sync


class GlobalReductionLoss(keras.losses.Loss):
    """Wraps a Keras loss so it returns this replica's share of the global loss.

    The per-element losses, masks and sample weights are combined exactly as
    `keras.losses.Loss.__call__` does on one device; only the denominator
    changes: it is all-reduced across replicas, so the shares add up to the
    one-device value.
    """

    def __init__(self, inner):
        super().__init__(
            name=inner.name, reduction=inner.reduction, dtype=inner.dtype
        )
        self.inner = inner

    def call(self, y_true, y_pred):
        return self.inner.call(y_true, y_pred)

    def __call__(self, y_true, y_pred, sample_weight=None):
        reduction = self.inner.reduction
        if reduction in (None, "none"):
            return self.inner(y_true, y_pred, sample_weight)
        dtype = self.inner.dtype
        in_mask = keras_backend.get_keras_mask(y_pred)
        with tf.name_scope(self.name):
            y_pred = tree.map_structure(lambda x: tf.cast(x, dtype), y_pred)
            y_true = tree.map_structure(lambda x: tf.cast(x, dtype), y_true)
            values = tf.convert_to_tensor(self.inner.call(y_true, y_pred), dtype)
            mask = _combine_masks(in_mask, keras_backend.get_keras_mask(values))
            weights = None
            if sample_weight is not None:
                weights = tf.cast(tf.convert_to_tensor(sample_weight), dtype)
            if mask is not None:
                float_mask = tf.cast(mask, dtype)
                if weights is None:
                    weights = float_mask
                else:
                    float_mask, weights = keras_loss.squeeze_or_expand_to_same_rank(
                        float_mask, weights
                    )
                    weights = weights * float_mask
            if weights is not None:
                values, weights = keras_loss.squeeze_or_expand_to_same_rank(
                    values, weights
                )
                values = values * weights
            numerator = tf.reduce_sum(values)
            if reduction == "sum":
                return numerator
            if reduction == "mean_with_sample_weight" and weights is not None:
                denominator = tf.reduce_sum(weights)
            elif reduction in _MEAN_REDUCTIONS and mask is not None:
                denominator = tf.reduce_sum(tf.cast(mask, dtype))
            else:
                denominator = tf.cast(tf.size(values), dtype)
            return kd_losses.global_share(numerator, denominator)


def _combine_masks(first, second):
    if first is not None and second is not None:
        return tf.logical_and(tf.cast(first, tf.bool), tf.cast(second, tf.bool))
    return first if first is not None else second


class GlobalShareMean(keras.metrics.Mean):
    """A loss tracker that sums replica shares into the true global mean.

    Keras updates a loss tracker with `unscale_loss_for_distribution(share)`
    (the share times R), weighted by the replica's rows: only right when
    every replica holds the same number of rows. Here the share is recovered
    and weighted so that summing the SyncOnRead variables over replicas
    gives what one device records:

    - `weighting="rows"` (the model's `loss`): sum_b(N_b * loss_b) / sum_b(N_b),
      each replica adding share * N_b and counting its own rows;
    - `weighting="steps"` (per-output `<name>_loss`, which Keras weights by the
      static batch size, unknown in a `fit` pipeline, so 1 per batch):
      sum_b(loss_b) / batches, each replica adding its share and 1/R.
    """

    def __init__(self, name="loss", dtype=None, weighting="rows"):
        # Same leading arguments as keras.metrics.Mean, which Keras may use
        # to re-create a metric from its class.
        super().__init__(name=name, dtype=dtype)
        if weighting not in ("rows", "steps"):
            raise ValueError(f"`weighting`={weighting!r}: expected 'rows' or 'steps'.")
        self.weighting = weighting

    def get_config(self):
        return {**super().get_config(), "weighting": self.weighting}

    def update_state(self, values, sample_weight=None):
        batch = kd_losses.current_batch()
        if batch is None:
            return super().update_state(values, sample_weight=sample_weight)
        replicas = num_replicas()
        share = tf.cast(values, self.dtype) / replicas
        if self.weighting == "rows":
            self.total.assign_add(share * tf.cast(batch.global_rows, self.dtype))
            self.count.assign_add(tf.cast(batch.local_rows, self.dtype))
        else:
            self.total.assign_add(share)
            self.count.assign_add(tf.constant(1.0 / replicas, self.dtype))


class GlobalCompileLoss(compile_utils.CompileLoss):
    """`CompileLoss` whose losses and trackers are exact across replicas."""

    def build(self, y_true, y_pred):
        super().build(y_true, y_pred)
        self._flat_losses = [
            entry._replace(loss=_wrap_loss(entry.loss)) for entry in self._flat_losses
        ]
        trackers = [GlobalShareMean(m.name, weighting="steps") for m in self._metrics]
        self._metrics.clear()
        self._metrics.extend(trackers)


def _wrap_loss(loss):
    if isinstance(loss, GlobalReductionLoss):
        return loss
    return GlobalReductionLoss(loss)


@tracking.no_automatic_dependency_tracking
def install_global_losses(model):
    """Swaps the model's compiled loss and loss tracker for exact ones."""
    compiled = getattr(model, "_compile_loss", None)
    if compiled is not None and not isinstance(compiled, GlobalCompileLoss):
        model._compile_loss = GlobalCompileLoss(
            compiled._user_loss,
            compiled._user_loss_weights,
            output_names=compiled.output_names,
        )
    if getattr(model, "_loss_tracker", None) is not None and not isinstance(
        model._loss_tracker, GlobalShareMean
    ):
        model._loss_tracker = GlobalShareMean("loss", weighting="rows")


def unscale_for_tracker(share):
    """The value Keras's trackers expect: the replica loss times R."""
    return keras_loss.unscale_loss_for_distribution(share)


def autoconvert_optionals(data):
    """Keras feeds `tf.experimental.Optional` for absent parts; map to None."""
    return tree.map_structure(
        lambda x: None if isinstance(x, tf.experimental.Optional) else x, data
    )


def first_local_batch(strategy, batch):
    """A batch usable for symbolic building, from a distributed batch.

    Keras reduces a `PerReplica` batch with `strategy.reduce("MEAN")`, which
    fails under multi-worker strategies; shapes are all the build needs, so
    the first local replica's part is enough.
    """
    flat = tree.flatten(batch)
    if flat and all(isinstance(x, tf.distribute.DistributedValues) for x in flat):
        return tree.map_structure(
            lambda x: strategy.experimental_local_results(x)[0], batch
        )
    return batch


_PS_VARIABLES = (ps_values.AggregatingVariable, ps_values.CachingVariable)


def _delegating(name):
    original = getattr(keras_tf_core.Variable, name)

    def method(self, value):
        inner = getattr(self, "_value", None)
        if isinstance(inner, _PS_VARIABLES) and not in_stateless_scope():
            return getattr(inner, name)(tf.cast(value, inner.dtype))
        return original(self, value)

    method.__name__ = name
    method.__wrapped__ = original
    return method


def _sharded_readable(name):
    original = getattr(keras_tf_core.Variable, name)

    def method(self, *args, **kwargs):
        inner = getattr(self, "_value", None)
        if isinstance(inner, sharded_variable.ShardedVariable):
            # A partitioned weight reads as the concatenation of its shards.
            value = tf.convert_to_tensor(inner).numpy()
            return np.asarray(value, *args) if name == "__array__" else value
        return original(self, *args, **kwargs)

    method.__name__ = name
    method.__wrapped__ = original
    return method


def patch_aggregating_assign():
    """Makes `assign_add`/`assign_sub` sum increments under central storage and
    parameter servers, and partitioned weights readable as NumPy (saving)."""
    for name, make in (("assign_add", _delegating), ("assign_sub", _delegating),
                       ("numpy", _sharded_readable), ("__array__", _sharded_readable)):
        current = getattr(keras_tf_core.Variable, name)
        if not hasattr(current, "__wrapped__"):
            setattr(keras_tf_core.Variable, name, make(name))


patch_aggregating_assign()


def optimizer_variables(model):
    """The variables the optimizer updates: shards for partitioned weights.

    Under ParameterServerStrategy with a `variable_partitioner`, a Keras
    weight wraps a `ShardedVariable` (its parts live on different parameter
    servers). Neither the tape nor the Keras optimizer can update it whole,
    so each shard gets its own Keras variable: gradients and optimizer slots
    are per shard, on the shard's parameter server. The model still reads
    the whole weight (the concatenation of the same shards).
    """
    wrappers = getattr(model, "_kd_shard_variables", None)
    if wrappers is None:
        wrappers = {}
        object.__setattr__(model, "_kd_shard_variables", wrappers)
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
