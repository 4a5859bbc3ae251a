"""BatchNormalization with the global batch's moments on several replicas.

Every BatchNormalization of a kd model on several replicas normalizes with
the mean and variance of the global batch, as one device does
(`global_moments`, in place of Keras's moments); a
model compiled with `batch_norm="per_replica"` keeps Keras's per-replica
statistics on its layers that are not synchronized
(`PER_REPLICA_BATCH_NORM`).
"""

import math
import weakref

import keras
import tensorflow as tf

from keras_distrib import _keras_compat
from keras_distrib.training import penalties
from keras_distrib.training import replica

__all__ = [
    "PER_REPLICA_BATCH_NORM",
    "global_batch_norm",
    "global_moments",
]

# BatchNormalization layers (not synchronized) of models compiled with
# batch_norm="per_replica": they keep Keras's per-replica statistics.
PER_REPLICA_BATCH_NORM = weakref.WeakSet()


def global_moments(layer, inputs, mask, keras_moments, axes):
    """Mean and variance of a BatchNormalization over every replica.

    Every BatchNormalization of a kd model on several replicas uses it
    (unless compiled with `batch_norm="per_replica"`, and then still the
    synchronized ones), so statistics are those of the global batch.
    `keras_moments` is the layer's own (Keras's) moments; `axes` the axes
    the layer reduces over (all but its channels).

    One all-reduce in the forward pass (and so one in the backward pass):
    each replica computes its own row count n_i, mean m_i and sum of
    squared deviations M2_i (two passes over its rows, as one device does),
    and the all-reduce gathers every replica's triple (each in its own slot
    of a zero-filled buffer). Every replica then merges them in the same
    order, Chan et al.'s parallel formula: N = sum n_i, mean = sum n_i m_i / N,
    M2 = sum M2_i + sum n_i (m_i - mean)^2, variance = M2 / N. No E[x^2] -
    E[x]^2 cancellation: float64 stays within 1e-12 of one device. The
    buffer holds R slots of 2C + 1 values (C channels), as PyTorch's
    SyncBatchNorm gathers; Keras's `synchronized=True` takes three
    all-reduces. A replica whose batch is empty (or padded, see StepPlan)
    contributes n_i = 0. Masked inputs follow Keras's masked formula (mean
    and variance over the weight sum plus epsilon).

    Without a mask (and with the channels known when traced), the backward
    pass is written out (`_unmasked_global_moments`): one device's gradient
    of a row x is g_mean / N + g_var * 2 (x - mean) / N, with g_mean and
    g_var the gradients of the global loss, the replicas' own summed in one
    all-reduce of 2C values. Differentiating through the merge instead
    would trace about three times the ops of Keras's per-replica
    statistics, which TensorFlow then optimizes at the first step.
    """
    context = tf.distribute.get_replica_context()
    batch = replica.current_batch()
    if replica.replicas_in_sync() == 1 or batch is None or batch.coupling.global_region:
        return keras_moments(inputs, mask)  # one replica, or the global batch already
    if layer in PER_REPLICA_BATCH_NORM and not layer.synchronized:
        # Per replica on request (batch_norm="per_replica"): not a place
        # where kd gathers the rows that meet (`coupling`), which would see
        # the replica's statistics fed back into its rows.
        mean, variance = keras_moments(inputs, mask)
        return penalties.mark_fixed(mean), penalties.mark_fixed(variance)
    if mask is None:
        moments = _unmasked_global_moments(context, batch, inputs, axes)
        if moments is not None:
            return moments
    dtype = inputs.dtype
    live = tf.cast(batch.rows.has_rows, dtype)
    if mask is None:
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), dtype)
        count = tf.reshape(count * live, [1])
    else:
        kept = tf.broadcast_to(tf.expand_dims(tf.cast(mask, tf.bool), -1), tf.shape(inputs))
        kept = tf.logical_and(kept, batch.rows.has_rows)
        count = tf.reshape(tf.reduce_sum(tf.cast(kept, dtype), axes), [-1])
        inputs = tf.where(kept, inputs, tf.zeros_like(inputs))
    channels = tf.shape(tf.reduce_sum(inputs, axes, keepdims=True))
    local_sum = tf.reduce_sum(inputs, axes, keepdims=True) * live
    local_mean = tf.math.divide_no_nan(local_sum, count if mask is None else tf.reshape(count, channels))
    squares = tf.math.squared_difference(inputs, tf.stop_gradient(local_mean))
    if mask is not None:
        squares = tf.where(kept, squares, tf.zeros_like(squares))
    local_m2 = tf.reduce_sum(squares, axes, keepdims=True) * live
    own = [count, tf.reshape(local_mean, [-1]), tf.reshape(local_m2, [-1])]
    brings_rows = not batch.rows.knows_global_rows  # N travels along, for the loss that follows
    if brings_rows:
        own.insert(0, tf.reshape(tf.cast(batch.rows.local_rows, dtype), [1]))
    own = tf.concat(own, 0)
    replicas = replica.replicas_in_sync()
    slots = tf.one_hot(context.replica_id_in_sync_group, replicas, dtype=dtype)
    local = batch.collectives.chain(slots[:, None] * own[None, :])
    gathered = context.all_reduce(tf.distribute.ReduceOp.SUM, local)
    batch.collectives.after_collective(gathered)
    if brings_rows:
        batch.rows.learn_global_rows(tf.reduce_sum(tf.stop_gradient(gathered[:, 0])))
        gathered = gathered[:, 1:]
    size = tf.size(local_mean)
    counts, means, m2s = tf.split(gathered, [tf.size(count), size, size], axis=1)
    total_count = tf.reduce_sum(counts, 0)
    total = tf.reduce_sum(counts * means, 0)
    mean = tf.math.divide_no_nan(total, total_count)
    spread = tf.reduce_sum(m2s, 0) + tf.reduce_sum(
        counts * tf.math.squared_difference(means, tf.stop_gradient(mean)), 0)
    if mask is None:
        variance = tf.math.divide_no_nan(spread, total_count)
    else:
        # Keras divides by the weight sum plus epsilon, and measures the
        # squares about that (slightly shrunk) mean.
        shrunk = total / (total_count + keras.backend.epsilon())
        spread += total_count * tf.math.squared_difference(mean, shrunk)
        mean = shrunk
        variance = spread / (total_count + keras.backend.epsilon())
    mean = tf.squeeze(tf.reshape(mean, channels), axes)
    variance = tf.squeeze(tf.reshape(variance, channels), axes)
    # The same on every replica: what reads the graph (kd.losses) may rely on it.
    return penalties.mark_fixed(mean), penalties.mark_fixed(variance)


def _unmasked_global_moments(context, batch, inputs, axes):
    """`global_moments` of unmasked inputs, its gradient written out; None if shapes are unknown.

    The same forward pass (one all-reduce of every replica's count, mean
    and M2, merged by Chan et al.'s formula) with the shapes known when
    traced taken as numbers, under a `tf.custom_gradient` whose backward
    pass all-reduces the replicas' gradients of the mean and the variance
    (2C values, the one collective the backward pass made before) and
    applies one device's formula to the replica's rows. The token that
    chains the step's collectives (`replica.CollectiveOrder.chain`) and N,
    when it travels here, leave as outputs of the same function. Every op counts twice (traced, then
    optimized at the first step) and once more per layer and replica:
    what is known when traced is a number, not an op.
    """
    shape = inputs.shape
    if shape.rank is None or 0 not in axes:
        return None
    reduced = [shape[d] for d in axes if d != 0]
    channels = [shape[d] for d in range(shape.rank) if d not in axes]
    if any(d is None for d in reduced + channels):
        return None
    size = math.prod(channels)
    # Statistics broadcast over the rows as they are when the channels come last.
    last = axes == list(range(shape.rank - len(channels)))
    keep = [1 if d in axes else shape[d] for d in range(shape.rank)]
    spread_out = (lambda value: value) if last and len(channels) == 1 else (
        lambda value: tf.reshape(value, keep))
    dtype = inputs.dtype
    # A replica whose rows are known when traced needs no zeroing of a padded row.
    live = None if batch.rows.surely_has_rows else tf.cast(batch.rows.has_rows, dtype)
    live_times = (lambda value: value) if live is None else (lambda value: value * live)
    brings_rows = not batch.rows.knows_global_rows  # N travels along, for the loss that follows
    if shape[0] is not None and live is None:
        count = float(shape[0] * math.prod(reduced))
        heads = tf.constant(([float(batch.rows.static_rows)] if brings_rows else []) + [count], dtype)
    else:
        count = live_times(tf.cast(tf.shape(inputs)[0], dtype) * math.prod(reduced))
        heads = tf.stack(([tf.cast(batch.rows.local_rows, dtype)] if brings_rows else []) + [count])
    replicas = replica.replicas_in_sync()
    replica_id = tf.get_static_value(context.replica_id_in_sync_group)
    token = [batch.collectives.moments_token] if batch.collectives.moments_token is not None else []
    first = int(brings_rows)  # the row count's column, if it travels here

    @tf.custom_gradient
    def moments(x, *token):
        local_mean = tf.math.divide_no_nan(live_times(tf.reduce_sum(x, axes)), count)
        local_m2 = live_times(tf.reduce_sum(tf.math.squared_difference(x, spread_out(local_mean)), axes))
        own = tf.concat([heads, tf.reshape(local_mean, [-1]) if len(channels) > 1 else local_mean,
                         tf.reshape(local_m2, [-1]) if len(channels) > 1 else local_m2], 0)
        # This replica's slot of a zero-filled [replicas, values] buffer.
        if replica_id is not None:
            local = tf.pad(tf.expand_dims(own, 0), [[int(replica_id), replicas - 1 - int(replica_id)], [0, 0]])
        else:
            slot = tf.one_hot(context.replica_id_in_sync_group, replicas, dtype=dtype)
            local = tf.expand_dims(slot, 1) * own
        if token:
            local += tf.cast(token[0], dtype)
        gathered = _sum_without_gradient(context, local)
        *rows, counts, means, m2s = tf.split(gathered, [1] * first + [1, size, size], axis=1)
        total = tf.reduce_sum(counts)
        mean = tf.math.divide_no_nan(tf.reduce_sum(counts * means, 0), total)
        spread = tf.reduce_sum(m2s + counts * tf.math.squared_difference(means, mean), 0)
        variance = tf.math.divide_no_nan(spread, total)
        outputs = (mean, variance, tf.math.multiply_no_nan(total, tf.zeros((), dtype)))
        if rows:
            outputs += (tf.reduce_sum(rows[0]),)

        def gradient(d_mean, d_variance, *_):
            # One device's gradient of the rows from the global loss's
            # gradients of the statistics: every replica's, summed.
            d_mean = tf.zeros_like(mean) if d_mean is None else d_mean
            d_variance = tf.zeros_like(variance) if d_variance is None else d_variance
            summed = _sum_without_gradient(context, tf.concat([d_mean, 2 * d_variance], 0))
            of_mean, of_variance = tf.split(tf.math.divide_no_nan(summed, total), 2)
            d_x = spread_out(of_mean) + spread_out(of_variance) * (x - spread_out(mean))
            return (live_times(d_x),) + (None,) * len(token)

        return outputs, gradient

    mean, variance, batch.collectives.moments_token, *global_rows = moments(inputs, *token)
    if brings_rows:
        batch.rows.learn_global_rows(tf.stop_gradient(global_rows[0]))
    if len(channels) > 1:
        mean, variance = tf.reshape(mean, channels), tf.reshape(variance, channels)
    # The same on every replica: what reads the graph (kd.losses) may rely on it.
    return penalties.mark_fixed(mean), penalties.mark_fixed(variance)


def _sum_without_gradient(context, value):
    """The sum of a dense `value` over the replicas, with no gradient of its own.

    For the body and the backward pass of a `tf.custom_gradient`, whose
    gradient kd writes: `ReplicaContext.all_reduce` wraps its collective in a
    gradient function of its own (another `tf.custom_gradient`, traced per
    call and replica), which nothing would use here. The same collective,
    built where TensorFlow builds it (`merge_call`), without that wrapper
    and without packing one tensor (`_keras_compat.sum_in_merge`); under
    XLA, where TensorFlow does not merge, and on TPUs,
    `ReplicaContext.all_reduce` itself.
    """
    if _keras_compat.in_xla_context() or tf.executing_eagerly() or isinstance(
            context.strategy, tf.distribute.TPUStrategy):
        return context.all_reduce(tf.distribute.ReduceOp.SUM, value)
    return context.merge_call(_keras_compat.sum_in_merge, args=(value,))


def global_batch_norm(layer):
    """Whether `layer` is a BatchNormalization computing global statistics."""
    return isinstance(layer, keras.layers.BatchNormalization) and (
        _keras_compat.is_sync_batch_norm(layer) or layer not in PER_REPLICA_BATCH_NORM
    )
