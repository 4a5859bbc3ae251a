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
import weakref

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import ps_values
from tensorflow.python.distribute import sharded_variable
from keras.src import backend as keras_backend
from keras.src import tree
from keras.src.backend.common import masking as keras_masking
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


# ---------------------------------------------------------------------------
# The optimizer's gradient pipeline (see keras_distrib/gradients.py).
#
# Keras's TF optimizer all-reduces inside `_backend_update_step`, after it
# has unscaled, accumulated and clipped each replica's partial gradient.
# kd all-reduces first (in `apply`), so these hooks make the optimizer skip
# its own reduction, and run the conditionals of `_backend_apply_gradients`
# (accumulation, EMA overwrite) in cross-replica context, where TensorFlow
# allows a `merge_call` inside a branch. Both are set on the optimizer
# instance only: other optimizers keep Keras's behaviour.

_PIPELINE_OPTIMIZERS = weakref.WeakSet()
_REPLICA_THREAD_STRATEGIES = (
    tf.distribute.MirroredStrategy,
    tf.distribute.MultiWorkerMirroredStrategy,
    tf.distribute.experimental.CentralStorageStrategy,
)


def base_optimizer(optimizer):
    """The optimizer that applies updates (a LossScaleOptimizer's inner one)."""
    return getattr(optimizer, "inner_optimizer", None) or optimizer


def has_gradient_pipeline(optimizer):
    return optimizer in _PIPELINE_OPTIMIZERS


def install_gradient_pipeline(optimizer, aggregate):
    """Makes `optimizer.apply` call `aggregate(grads)` before anything else.

    `aggregate` all-reduces the replicas' gradients; after it every replica
    holds the global gradient, and the optimizer's own reduction is skipped.
    """
    if optimizer in _PIPELINE_OPTIMIZERS:
        return
    outer_apply = optimizer.apply

    def apply(grads, trainable_variables=None):
        return outer_apply(aggregate(list(grads)), trainable_variables)

    object.__setattr__(optimizer, "apply", apply)
    base = base_optimizer(optimizer)
    object.__setattr__(base, "_all_reduce_sum_gradients", lambda grads_and_vars: list(grads_and_vars))
    backend_apply = base._backend_apply_gradients

    def backend_apply_gradients(grads, trainable_variables):
        if not _needs_cross_replica_conditionals(base):
            return backend_apply(grads, trainable_variables)
        context = tf.distribute.get_replica_context()
        context.merge_call(
            lambda distribution, grads: _apply_in_cross_replica(
                base, distribution, grads, trainable_variables
            ),
            args=(grads,),
        )

    object.__setattr__(base, "_backend_apply_gradients", backend_apply_gradients)
    _PIPELINE_OPTIMIZERS.add(optimizer)


def _needs_cross_replica_conditionals(optimizer):
    if tf.distribute.get_replica_context() is None or not tf.distribute.has_strategy():
        return False
    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        return False
    if not isinstance(tf.distribute.get_strategy(), _REPLICA_THREAD_STRATEGIES):
        return False
    return bool(optimizer.gradient_accumulation_steps) or bool(
        optimizer.use_ema and optimizer.ema_overwrite_frequency
    )


def _apply_in_cross_replica(optimizer, distribution, grads, variables):
    """Keras's `_backend_apply_gradients`, its `cond`s in cross-replica context.

    Every replica holds the same (all-reduced) gradient, so each branch runs
    the same replica function on every replica, as one device would run it.
    """

    def on_replicas(function):
        return lambda: distribution.extended.call_for_each_replica(function, args=(grads,))

    def update(step_grads):
        step_grads = optimizer._clip_gradients(step_grads)
        optimizer._apply_weight_decay(variables)
        optimizer._backend_update_step(step_grads, variables, optimizer.learning_rate)

    steps = optimizer.gradient_accumulation_steps
    if steps:
        accumulators = [
            optimizer._accumulated_gradients[optimizer._get_variable_index(v)] for v in variables
        ]

        def update_with_accumulated(step_grads):
            update([(g + a) / steps for g, a in zip(step_grads, accumulators)])
            optimizer._backend_reset_gradient_accumulators()

        def accumulate(step_grads):
            optimizer._backend_increment_gradient_accumulators(step_grads, accumulators)

        is_update_step = tf.equal((optimizer._iterations + 1) % steps, 0)
        tf.cond(is_update_step, on_replicas(update_with_accumulated), on_replicas(accumulate))
    else:
        on_replicas(update)()
    if optimizer.use_ema:
        trainable = optimizer._trainable_variables
        on_replicas(lambda _: optimizer._update_model_variables_moving_average(trainable))()
        if optimizer.ema_overwrite_frequency:
            overwrite = tf.equal((optimizer.iterations + 1) % optimizer.ema_overwrite_frequency, 0)
            tf.cond(
                overwrite,
                on_replicas(lambda _: optimizer._overwrite_model_variables_with_average_value(trainable)),
                lambda: None,
            )


# ---------------------------------------------------------------------------
# Per-replica forward-pass bookkeeping (see keras_distrib/models.py).

_LOSS_RECORDING_LAYERS = weakref.WeakSet()
_SYNC_BATCH_NORM_LAYERS = weakref.WeakSet()


def flatten_layers(model):
    """Every layer of `model`, nested ones included (the model first)."""
    return model._flatten_layers(include_self=True, recursive=True)


def record_add_loss(layer, record):
    """Makes `layer.add_loss(loss)` also call `record(loss)` (idempotent).

    Keras keeps add_loss terms on the layer object, shared by the replicas
    of a MirroredStrategy; the replicas trace in turns, switching at every
    collective, so a replica may read another's terms. `record` puts them
    in the calling replica's own (thread-local) batch instead.
    """
    if layer in _LOSS_RECORDING_LAYERS:
        return
    add_loss = layer.add_loss

    def recording_add_loss(loss):
        record(loss)
        return add_loss(loss)

    object.__setattr__(layer, "add_loss", recording_add_loss)
    _LOSS_RECORDING_LAYERS.add(layer)


def is_sync_batch_norm(layer):
    return isinstance(layer, keras.layers.BatchNormalization) and bool(
        getattr(layer, "synchronized", False)
    )


def replace_batch_norm_moments(layer, moments):
    """Makes a synchronized BatchNormalization use `moments(layer, x, mask, original)`.

    `original` is Keras's `_moments`; `layer_axes(layer)` gives the axes.
    """
    if layer in _SYNC_BATCH_NORM_LAYERS:
        return
    original = layer._moments
    object.__setattr__(
        layer, "_moments", lambda inputs, mask: moments(layer, inputs, mask, original)
    )
    _SYNC_BATCH_NORM_LAYERS.add(layer)


def batch_norm_axes(layer):
    """The axes a BatchNormalization layer reduces over (all but its channels)."""
    return list(layer._reduction_axes)


def get_keras_mask(tensor):
    return keras_masking.get_keras_mask(tensor)


def set_keras_mask(tensor, mask):
    keras_masking.set_keras_mask(tensor, mask)


def dataset_element_spec(epoch_iterator):
    """The element spec of a Keras TFEpochIterator's dataset, without iterating.

    Opening an iterator would consume (and for a reshuffling dataset,
    reorder) the user's data; building the model needs only shapes.
    """
    return epoch_iterator._distributed_dataset.element_spec
