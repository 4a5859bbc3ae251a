"""The global-batch scaling rule: every replica's loss is its share of the global mean.

kd's central idea, in one place. One device computes the mean loss over
the N rows of the global batch, L = (1/N) * sum_i l_i. Replica r holds n_r
of those rows (n_r may be 0 on an uneven last batch) and computes its
share S_r = (1/N) * sum over its rows of l_i, so that sum_r S_r = L and
the sum of the replicas' gradients is one device's gradient: the
all-reduce before the optimizer is a SUM (`gradients.all_reduce`).

Where each part lives:

- the share: `losses` (`GlobalReductionLoss`, `global_mean`, and Keras's
  loss objects in a kd step), with N from `replica.ReplicaBatch.global_rows`;
- the batch's counts: `replica.ReplicaBatch` (n_r, N, `fraction` = n_r / N);
- deferred scale, the decision (`defers_scaling`, here): N costs an
  all-reduce before the loss; where kd computes the whole loss and sums the
  gradients itself, each replica uses R * n_r in its place
  (`ReplicaBatch.defer`), and the gradient all-reduce carries n_r and
  corrects: multiplied by R * n_r (`to_own_scale`) and divided by the summed
  N (`divided`), the gradient is one device's, in one collective;
- a loss kd did not compute (plain ops on the replica's rows): taken as a
  mean over rows, each replica's gradient weighted by n_r / N before the sum
  (`row_weighted`); a sum over rows adds up as it is; a loss computed on the
  global batch adds 1/R of each replica's gradient.

`gradients.all_reduce` applies these around its one all-reduce.
"""

import keras
import tensorflow as tf

from keras_distrib import _keras_compat
from keras_distrib.training import coupling
from keras_distrib.training import forward
from keras_distrib.training import losses as kd_losses
from keras_distrib.training import penalties

__all__ = [
    "defers_scaling",
    "divided",
    "map_values",
    "per_dtype",
    "row_weighted",
    "to_own_scale",
]


def defers_scaling(model, *, training, kd_compute_loss):
    """Whether `model`'s step can scale its loss without the global row count first.

    Deferred scaling (`replica.ReplicaBatch.defer`) changes what the loss
    share is until the gradient all-reduce corrects it, so it is used only
    where kd computes the whole loss and reduces the gradients itself: kd's
    own `compute_loss`, losses that reduce to a scalar, a model whose
    optimizer has kd's gradient pipeline. A step that reads the share in
    any other way keeps the global count, read before the loss.

    Nor where a layer's backward pass crosses replicas (BatchNormalization
    with global statistics): a replica's gradient then holds parts of the
    other replicas' loss shares, which the correction by its own R * n_r
    would scale wrongly on uneven batches. N then travels in the layer's
    own all-reduce (`forward.global_moments`), at no extra collective.

    `kd_compute_loss`: kd's own `compute_loss` (the model's must be it, not
    an override).
    """
    if not forward.spreads_over_replicas():
        return False
    layers = _keras_compat.flatten_layers(model)
    if training and any(forward.global_batch_norm(layer) and layer.trainable for layer in layers):
        return False
    if coupling.meets_at_any(layers + _compiled_loss_objects(model)):
        return False  # computed on the global batch: shares are exact, a layer's gradient crosses replicas
    for name, own in (("compute_loss", kd_compute_loss),
                      ("_compute_loss", getattr(keras.Model, "_compute_loss"))):
        if getattr(getattr(model, name), "__func__", None) is not own:
            return False
    compiled = _keras_compat.compiled_loss(model)
    if compiled is not None:
        losses = _keras_compat.compiled_losses(compiled)
        if losses is None or not all(
            isinstance(loss, kd_losses.GlobalReductionLoss) and loss.reduction not in (None, "none")
            for loss in losses
        ):
            return False
    if not isinstance(_keras_compat.loss_tracker(model), (kd_losses.GlobalShareMean, type(None))):
        return False
    if training:
        return model.optimizer is not None and _keras_compat.has_gradient_pipeline(model.optimizer)
    return True


def _compiled_loss_objects(model):
    compiled = _keras_compat.compiled_loss(model)
    losses = _keras_compat.compiled_losses(compiled) if compiled is not None else None
    return [getattr(loss, "inner", loss) for loss in losses or ()]


def row_weighted(batch, gradients, kind=None):
    """Gradients of a loss kd did not compute, weighted by the replica's rows.

    No loss share was computed in this step (no `compute_loss`, Keras loss
    object, or `kd.losses` call): the loss came from plain ops on the
    replica's rows, and kd takes it as their mean (`keras.ops.mean` of
    per-row terms, as Keras's guides write a VAE's loss). One device's
    gradient of the global mean is sum_r (n_r / N) * gradient_r, exact for
    such a loss; a replica without rows adds nothing (its mean of no rows
    is NaN). A loss the graph shows to be a sum over rows (`kind`
    `penalties.ROW_SUM`, see `gradients.classify_gradient_target`: `tf.reduce_sum(...) / 16`)
    adds up over replicas as it is: its gradients are summed unweighted.
    A loss computed on the global batch kd gathered (`penalties.GLOBAL`)
    adds 1/R of each replica's gradient.
    """
    if kind == penalties.GLOBAL:
        # Computed on the global batch, the same on every replica: each
        # replica's gradient holds its own rows' part R times (coupling.gather)
        # and the rest once, so 1/R of each adds up to one device's.
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        return [map_values(g, lambda v: v / tf.cast(replicas, v.dtype)) for g in gradients]
    fractions = per_dtype(gradients, lambda dtype: tf.cast(batch.fraction, dtype)) \
        if kind != penalties.ROW_SUM else None

    def weighted(value):
        if fractions is not None:
            value = value * fractions[value.dtype]
        if batch.surely_has_rows:
            return value
        return tf.where(batch.has_rows, value, tf.zeros_like(value))

    return [map_values(g, weighted) for g in gradients]


def to_own_scale(batch, gradients):
    """Gradients of shares in deferred scale, multiplied by the replica's R * n_r.

    Summed over the replicas and divided by N (`divided`), they are the
    gradients of the shares in the global scale (see `replica.ReplicaBatch.defer`).
    """
    scales = per_dtype(gradients, batch.own_scale)
    return [map_values(g, lambda v: v * scales[v.dtype]) for g in gradients]


def divided(gradients, global_rows):
    """Sums of deferred-scale gradients divided by N: the one-device gradients."""
    counts = per_dtype(gradients, lambda dtype: tf.cast(global_rows, dtype))
    return [map_values(g, lambda v: tf.math.divide_no_nan(v, counts[v.dtype])) for g in gradients]


def per_dtype(gradients, function):
    """`{dtype: function(dtype)}` for the dtypes of `gradients`' values: one op each, not one per gradient."""
    dtypes = {(g.values if isinstance(g, tf.IndexedSlices) else g).dtype for g in gradients}
    return {dtype: function(dtype) for dtype in dtypes}


def map_values(gradient, function):
    """`function` applied to a gradient's values (a `tf.IndexedSlices` keeps its indices)."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(function(gradient.values), gradient.indices, gradient.dense_shape)
    return function(gradient)
