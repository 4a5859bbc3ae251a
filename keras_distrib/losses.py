"""Exact global-batch loss scaling: each replica's share of the global mean.

With R replicas, replica r holds n_r of the N = sum(n_r) rows of a global
batch. Gradients are summed across replicas, so each replica must return a
loss whose sum over replicas is the loss of the whole batch:

    share_r = sum(loss_i * w_i for i in replica r) / D,   D = sum_r d_r

where d_r is the replica's local denominator (its element count, or its
weight sum for `mean_with_sample_weight`) and D is all-reduced each step.
Then sum_r share_r = (global weighted sum) / D: exactly the one-device value,
for uneven batches and for replicas that receive zero rows.

The classic mistakes this prevents:
- `reduce_mean` per replica: divides by n_r, so a replica with 1 row of an
  uneven last batch weighs as much as one with 32.
- dividing by a fixed `global_batch_size`: wrong on the partial last batch.
- Keras loss objects are already divided by R (`scale_loss_for_distribution`):
  dividing again, or adding raw `model.losses`, over- or under-counts.
- averaging scaled losses with a `Mean` metric: with shares [2, 3] and
  [4, 5] on 2 replicas, the global mean is 3.5, but a Mean of per-replica
  shares gives (2+3)/4 averaged with (4+5)/4 = 1.75.
"""

import tensorflow as tf

from keras_distrib.replica import replica_sum

__all__ = [
    "global_mean",
    "global_share",
    "scale_regularization",
]


def global_share(numerator, local_denominator):
    """numerator / (local_denominator summed over replicas), 0 if that is 0."""
    denominator = replica_sum(tf.cast(local_denominator, numerator.dtype))
    return tf.math.divide_no_nan(numerator, denominator)


def global_mean(per_example_loss, sample_weight=None):
    """This replica's share of the exact global mean of `per_example_loss`.

    The sum of the shares over all replicas equals the mean over the whole
    global batch (the same value one device computes with
    `reduction="sum_over_batch_size"`): weighted values are summed and
    divided by the global element count, all-reduced each call.

    Args:
        per_example_loss: Losses of this replica's rows, shape `(n_r, ...)`.
            May be empty.
        sample_weight: Optional weights broadcastable to the losses.

    Returns:
        A scalar: this replica's share.

    Example:
        >>> import tensorflow as tf
        >>> import keras_distrib as kd
        >>> float(kd.losses.global_mean(tf.constant([1.0, 2.0, 6.0])))
        3.0
    """
    values = tf.convert_to_tensor(per_example_loss)
    if not values.dtype.is_floating:
        values = tf.cast(values, tf.float32)
    if sample_weight is not None:
        weights = tf.cast(sample_weight, values.dtype)
        if weights.shape.rank is not None and values.shape.rank is not None:
            while weights.shape.rank < values.shape.rank:
                weights = tf.expand_dims(weights, -1)
        values = values * weights
    count = tf.cast(tf.size(values), values.dtype)
    return global_share(tf.reduce_sum(values), count)


def scale_regularization(losses, *, local_rows=None):
    """This replica's share of the regularization total.

    Every replica computes the same weight penalties, so each must contribute
    a part that sums to the total once. Without `local_rows` each replica
    contributes 1/R. With `local_rows`, it contributes n_r / N, which also
    makes batch-mean `add_loss` terms (activity penalties) exact on uneven
    batches; replicas with no rows then contribute nothing.

    Args:
        losses: A list of scalar tensors (e.g. `model.losses`), or one tensor.
        local_rows: This replica's row count; see above.

    Returns:
        A scalar tensor (0.0 for an empty list).
    """
    if isinstance(losses, (list, tuple)):
        if not losses:
            return tf.constant(0.0)
        total = tf.add_n([tf.reduce_sum(tf.cast(l, tf.float32)) for l in losses])
    else:
        total = tf.reduce_sum(tf.cast(losses, tf.float32))
    if local_rows is None:
        context = tf.distribute.get_replica_context()
        replicas = context.num_replicas_in_sync if context else 1
        return total / replicas
    local_rows = tf.cast(local_rows, total.dtype)
    fraction = tf.math.divide_no_nan(local_rows, replica_sum(local_rows))
    return tf.where(local_rows > 0, total * fraction, tf.zeros_like(total))
