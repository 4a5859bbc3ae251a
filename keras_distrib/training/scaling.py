"""The global-batch scaling rule: every replica's loss is its share of the global mean.

kd's central idea, and its arithmetic, in one place. One device computes
the mean loss over the N rows of the global batch, L = (1/N) * sum_i l_i.
Replica r holds n_r of those rows (n_r may be 0 on an uneven last batch)
and computes its share S_r = (1/N) * sum over its rows of l_i, so that
sum_r S_r = L and the sum of the replicas' gradients is one device's
gradient: the all-reduce before the optimizer is a SUM
(`gradients.all_reduce`).

Here, as functions of the replica's batch (`replica.ReplicaBatch`: n_r,
N, whether the step defers the scale):

- a replica's part of the global batch, `fraction` = n_r / N;
- deferred scale: N costs an all-reduce before the loss; where kd computes
  the whole loss and sums the gradients itself (the decision:
  `deferral.defers_scaling`), each replica uses R * n_r in its place
  (`own_scale`, `defer`, `in_step_scale`), and the gradient all-reduce
  carries n_r and corrects: multiplied by R * n_r (`to_own_scale`) and
  divided by the summed N (`divided`), the gradient is one device's, in
  one collective;
- a loss kd did not compute (plain ops on the replica's rows): taken as a
  mean over rows, each replica's gradient weighted by n_r / N before the sum
  (`row_weighted`); a sum over rows adds up as it is; a loss computed on the
  global batch adds 1/R of each replica's gradient.

The shares themselves are computed by `losses` (`GlobalReductionLoss`,
`global_mean`, and Keras's loss objects in a kd step) and by the model's
`add_loss` terms, with these functions; `gradients.all_reduce` applies the
corrections around its one all-reduce.
"""

import tensorflow as tf

from keras_distrib.training import penalties
from keras_distrib.training import replica

__all__ = [
    "defer",
    "divided",
    "fraction",
    "in_step_scale",
    "map_values",
    "own_scale",
    "per_dtype",
    "row_weighted",
    "to_own_scale",
]


def fraction(batch):
    """n_r / N: the replica's part of the global batch (0 if it has no rows).

    In deferred scale, n_r / (R * n_r): 1/R, 0 if empty (no N needed).
    """
    if batch.deferred:
        return tf.math.divide_no_nan(batch.local_rows, own_scale(batch, batch.local_rows.dtype))
    return tf.math.divide_no_nan(batch.local_rows, batch.global_rows)


def own_scale(batch, dtype):
    """R * n_r: the replica's stand-in for N in deferred scale, as `dtype`."""
    return tf.cast(batch.local_rows, dtype) * tf.cast(replica.replicas_in_sync(), dtype)


def defer(batch, share):
    """A loss share in deferred scale: `share` * N / (R * n_r).

    `share` sums over the replicas to the global loss; the result is what
    the replica's own scale (R * n_r standing for N) makes of it. The
    gradient all-reduce multiplies each gradient by R * n_r (`to_own_scale`)
    and divides the sum by N (`divided`), giving back the gradient of
    `share`. Needs N (an all-reduce when not yet known).
    """
    global_rows = tf.cast(batch.global_rows, share.dtype)
    return tf.math.divide_no_nan(share * global_rows, own_scale(batch, share.dtype))


def in_step_scale(batch, share):
    """`share` in the scale of `batch`'s step: deferred (`defer`) where the step defers, else as it is."""
    return defer(batch, share) if batch.deferred else share


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
        replicas = replica.replicas_in_sync()
        return [map_values(g, lambda v: v / tf.cast(replicas, v.dtype)) for g in gradients]
    fractions = per_dtype(gradients, lambda dtype: tf.cast(fraction(batch), dtype)) \
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
    gradients of the shares in the global scale (see `defer`).
    """
    scales = per_dtype(gradients, lambda dtype: own_scale(batch, dtype))
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
