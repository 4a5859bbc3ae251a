"""The global-batch scaling rule: every replica's loss is its share of the global mean.

kd's central idea, and its arithmetic, in one place. One device computes
the mean loss over the N rows of the global batch, L = (1/N) * sum_i l_i.
Replica r holds n_r of those rows (n_r may be 0 on an uneven last batch)
and computes its share S_r = (1/N) * sum over its rows of l_i, so that
sum_r S_r = L and the sum of the replicas' gradients is one device's
gradient: the all-reduce before the optimizer is a SUM
(`gradients.all_reduce`).

Here, as functions of the replica's batch (`replica.ReplicaBatch`: n_r and
N in its `rows`, whether the step defers the scale in its `own_step`):

- a replica's part of the global batch, `fraction` = n_r / N;
- deferred scale: N costs an all-reduce before the loss; where kd computes
  the whole loss and sums the gradients itself (the decision:
  `deferral.defers_scaling`), each replica uses R * n_r in its place
  (`own_scale`, `defer`, `in_step_scale`), and the gradient all-reduce
  carries n_r and corrects: multiplied by R * n_r (`to_own_scale`) and
  divided by the summed N (`divided`), the gradient is one device's, in
  one collective;
- a value's share by what it is (`replica_share`, the one place a kind
  becomes a share: `add_loss` terms, a custom step's scalars and loss,
  `kd.losses.scale_regularization`): a mean over rows, or a term of the
  weights alone, n_r / N of it; a sum over rows as it is; a value computed
  on the global batch 1/R of it; one kd cannot read is refused;
- a loss kd did not compute (plain ops on the replica's rows): its
  gradients weighted by `replica_share` of the loss's kind (`row_weighted_gradients`).

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
    "replica_share",
    "row_weighted_gradients",
    "to_own_scale",
]


def fraction(batch):
    """n_r / N: the replica's part of the global batch (0 if it has no rows).

    In deferred scale, n_r / (R * n_r): 1/R, 0 if empty (no N needed).
    """
    if batch.own_step.deferred:
        return tf.math.divide_no_nan(batch.rows.local_rows, own_scale(batch, batch.rows.local_rows.dtype))
    return tf.math.divide_no_nan(batch.rows.local_rows, batch.rows.global_rows)


def own_scale(batch, dtype):
    """R * n_r: the replica's stand-in for N in deferred scale, as `dtype`."""
    return tf.cast(batch.rows.local_rows, dtype) * tf.cast(replica.replicas_in_sync(), dtype)


def defer(batch, share):
    """A loss share in deferred scale: `share` * N / (R * n_r).

    `share` sums over the replicas to the global loss; the result is what
    the replica's own scale (R * n_r standing for N) makes of it. The
    gradient all-reduce multiplies each gradient by R * n_r (`to_own_scale`)
    and divides the sum by N (`divided`), giving back the gradient of
    `share`. Needs N (an all-reduce when not yet known).
    """
    global_rows = tf.cast(batch.rows.global_rows, share.dtype)
    return tf.math.divide_no_nan(share * global_rows, own_scale(batch, share.dtype))


def in_step_scale(batch, share):
    """`share` in the scale of `batch`'s step: deferred (`defer`) where the step defers, else as it is."""
    return defer(batch, share) if batch.own_step.deferred else share


def replica_share(kind, value, *, fraction, has_rows, replicas, what, row_sum=None):
    """This replica's share of `value`, by how it adds up over replicas (`kind`, see `penalties`).

    The shares add up over the replicas to one device's value:

    - `SHARE` (a share kd computed): as it is;
    - `GLOBAL` (computed on the global batch, the same on every replica):
      1/R of it, rows or none;
    - `ROW_SUM`: its own (`row_sum(value)`, the step's scale, where given);
    - `ROW_MEAN`, and `FIXED` (a term of the weights alone, the same on
      every replica): n_r / N of it (`fraction`), since sum_r n_r / N = 1;
      1/R of a `FIXED` value where no fraction is known;
    - an `penalties.Unknown`: no split is known; refused (ValueError naming
      `what` and the op, see `penalties.refusal`).

    A replica without rows adds 0 (where `has_rows` is a tensor) except to
    a value the same on every replica.

    Args:
        kind: What `value` is.
        value: A tensor (a scalar, or a gradient's values).
        fraction: n_r / N in `value`'s dtype, or None where not known.
        has_rows: A boolean tensor, or None where the replica surely has rows.
        replicas: R.
        what: The value, in words, for the refusal.
        row_sum: The step's scale for a sum over rows (`in_step_scale`).
    """
    if kind == penalties.SHARE:
        return value
    if isinstance(kind, penalties.Unknown):
        raise ValueError(penalties.refusal(kind, what, replicas))
    if kind == penalties.GLOBAL or (kind == penalties.FIXED and fraction is None):
        return value / tf.cast(replicas, value.dtype)
    if kind == penalties.ROW_SUM:
        share = row_sum(value) if row_sum is not None else value
    elif kind in (penalties.ROW_MEAN, penalties.FIXED):
        share = value * fraction
    else:
        raise ValueError(penalties.refusal(penalties.Unknown(str(kind)), what, replicas))
    return share if has_rows is None else tf.where(has_rows, share, tf.zeros_like(share))


def row_weighted_gradients(batch, gradients, kind=None):
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
    kind = penalties.ROW_MEAN if kind is None else kind
    # Computed on the global batch (GLOBAL), each replica's gradient holds its
    # own rows' part R times (coupling.gather) and the rest once: 1/R of each
    # adds up to one device's.
    replicas = replica.replicas_in_sync()
    # (n_r / N only where it weighs: N may cost an all-reduce.)
    fractions = per_dtype(gradients, lambda dtype: tf.cast(fraction(batch), dtype)) \
        if kind in (penalties.ROW_MEAN, penalties.FIXED) else {}
    has_rows = None if batch.rows.surely_has_rows else batch.rows.has_rows
    return [map_values(g, lambda v: replica_share(
        kind, v, fraction=fractions.get(v.dtype), has_rows=has_rows, replicas=replicas,
        what="the loss whose gradient the step takes")) for g in gradients]


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
