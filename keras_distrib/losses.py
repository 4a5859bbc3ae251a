"""Exact global-batch loss scaling: each replica's share of the global mean.

With R replicas, replica r holds n_r of the N = sum(n_r) rows of a global
batch. Gradients are summed across replicas, so each replica must return a
loss whose sum over replicas is the loss of the whole batch:

    share_r = sum(loss_i * w_i for i in replica r) / D,   D = sum_r d_r

where d_r is the replica's local denominator (its element count, or its
weight sum for `mean_with_sample_weight`) and D is all-reduced each step.
Then sum_r share_r = (global weighted sum) / D: exactly the one-device value,
for uneven batches and for replicas that receive zero rows.

In kd's own training and evaluation steps, D of an unmasked mean is N
times the elements per row, so no all-reduce is needed before the gradient:
shares are in deferred scale (R * n_r standing for N, see
`replica.ReplicaBatch.defer`), and the gradient all-reduce brings N along
to put the scale right.

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

import keras
import tensorflow as tf
from keras import tree

from keras_distrib import _keras_compat
from keras_distrib import validation
from keras_distrib.replica import current_batch
from keras_distrib.replica import replica_sum

__all__ = [
    "global_mean",
    "global_share",
    "scale_regularization",
]


def _numbers(name, value, function):
    """`value` as a tensor of numbers, or a ValueError naming `name` before any op runs."""
    if value is None:
        raise ValueError(f"`{name}`=None: `kd.losses.{function}` needs a tensor (or array) of "
                         "numbers")
    try:
        tensor = tf.convert_to_tensor(value)
    except (ValueError, TypeError) as error:
        raise ValueError(f"`{name}`={str(value)[:80]!r} cannot be a tensor ({error}); "
                         f"`kd.losses.{function}` needs a tensor (or array) of numbers") from None
    if not (tensor.dtype.is_floating or tensor.dtype.is_integer):
        raise ValueError(f"`{name}` holds {tensor.dtype.name} values; `kd.losses.{function}` "
                         "needs numbers (cast them first)")
    return tensor


def global_share(numerator, local_denominator):
    """numerator / (local_denominator summed over replicas), 0 if that is 0.

    Raises:
        ValueError: an argument is not numbers.
    """
    numerator = _numbers("numerator", numerator, "global_share")
    if not numerator.dtype.is_floating:
        numerator = tf.cast(numerator, tf.float32)
    local_denominator = _numbers("local_denominator", local_denominator, "global_share")
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

    Raises:
        ValueError: an argument is not numbers, or `sample_weight`'s shape
            cannot weigh the losses (checked on static shapes).

    Example:
        >>> import tensorflow as tf
        >>> import keras_distrib as kd
        >>> float(kd.losses.global_mean(tf.constant([1.0, 2.0, 6.0])))
        3.0
    """
    values = _numbers("per_example_loss", per_example_loss, "global_mean")
    if not values.dtype.is_floating:
        values = tf.cast(values, tf.float32)
    if sample_weight is not None:
        weights = tf.cast(_numbers("sample_weight", sample_weight, "global_mean"), values.dtype)
        if weights.shape.rank is not None and values.shape.rank is not None:
            while weights.shape.rank < values.shape.rank:
                weights = tf.expand_dims(weights, -1)
            try:
                tf.broadcast_static_shape(weights.shape, values.shape)
            except ValueError:
                raise ValueError(
                    f"`sample_weight` of shape {tuple(tf.convert_to_tensor(sample_weight).shape)} "
                    f"cannot weigh `per_example_loss` of shape {tuple(values.shape)}; expected "
                    "one weight per row (shape (rows,)) or the losses' shape"
                ) from None
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

    Raises:
        ValueError: `losses` is not numbers, or `local_rows` is not a whole
            number >= 0 (or an integer tensor).
    """
    if isinstance(losses, (list, tuple)):
        if not losses:
            return tf.constant(0.0)
        total = tf.add_n([
            tf.reduce_sum(tf.cast(_numbers(f"losses[{i}]", l, "scale_regularization"), tf.float32))
            for i, l in enumerate(losses)])
    else:
        total = tf.reduce_sum(tf.cast(_numbers("losses", losses, "scale_regularization"),
                                      tf.float32))
    if local_rows is not None and not tf.is_tensor(local_rows) and not validation.is_whole(
            local_rows, 0):
        raise ValueError(f"`local_rows`={local_rows!r}: expected this replica's row count, a "
                         "whole number >= 0 (or an integer tensor), or None")
    if local_rows is not None and tf.is_tensor(local_rows) and not local_rows.dtype.is_integer:
        raise ValueError(f"`local_rows` is a {local_rows.dtype.name} tensor; expected an integer "
                         "row count (e.g. tf.shape(x)[0])")
    if local_rows is None:
        context = tf.distribute.get_replica_context()
        replicas = context.num_replicas_in_sync if context else 1
        return total / replicas
    local_rows = tf.cast(local_rows, total.dtype)
    fraction = tf.math.divide_no_nan(local_rows, replica_sum(local_rows))
    return tf.where(local_rows > 0, total * fraction, tf.zeros_like(total))


# ---------------------------------------------------------------------------
# Compiled losses: what kd models put in place of Keras's at compile time.

_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


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
        in_mask = _keras_compat.get_keras_mask(y_pred)
        with tf.name_scope(self.name):
            y_pred = tree.map_structure(lambda x: tf.cast(x, dtype), y_pred)
            y_true = tree.map_structure(lambda x: tf.cast(x, dtype), y_true)
            values = tf.convert_to_tensor(self.inner.call(y_true, y_pred), dtype)
            mask = _combine_masks(in_mask, _keras_compat.get_keras_mask(values))
            weights = None
            if sample_weight is not None:
                weights = tf.cast(tf.convert_to_tensor(sample_weight), dtype)
            if mask is not None:
                float_mask = tf.cast(mask, dtype)
                if weights is None:
                    weights = float_mask
                else:
                    float_mask, weights = _keras_compat.squeeze_or_expand_to_same_rank(
                        float_mask, weights
                    )
                    weights = weights * float_mask
            if weights is not None:
                values, weights = _keras_compat.squeeze_or_expand_to_same_rank(
                    values, weights
                )
                values = values * weights
            numerator = tf.reduce_sum(values)
            batch = current_batch()
            if reduction == "sum":
                return numerator if batch is None or not batch.deferred else batch.defer(numerator)
            if reduction == "mean_with_sample_weight" and weights is not None:
                denominator = tf.reduce_sum(weights)
            elif reduction in _MEAN_REDUCTIONS and mask is not None:
                denominator = tf.reduce_sum(tf.cast(mask, dtype))
            else:
                denominator = tf.cast(tf.size(values), dtype)
                if batch is not None and batch.deferred and _counts_rows(values):
                    # The global element count is N times the elements per
                    # row: in deferred scale, R * n_r stands for N.
                    replicas = tf.distribute.get_replica_context().num_replicas_in_sync
                    return tf.math.divide_no_nan(numerator, denominator * replicas)
                if batch is not None and batch.knows_global_rows and _counts_rows(values):
                    # N already known (a global BatchNormalization's
                    # all-reduce brought it): N rows of equal size, no
                    # all-reduce of the element count.
                    per_row = values.shape[1:].num_elements()
                    return tf.math.divide_no_nan(numerator, tf.cast(batch.global_rows, dtype) * per_row)
            if batch is None:
                return global_share(numerator, denominator)
            share = tf.math.divide_no_nan(numerator, batch.global_sum(denominator))
            return batch.defer(share) if batch.deferred else share


def _counts_rows(values):
    """Whether `values` hold one entry per row, each of the same static size.

    Their element count is then proportional to the row count on every
    replica, which deferred scaling relies on.
    """
    return values.shape.rank is not None and values.shape.rank >= 1 and \
        values.shape[1:].is_fully_defined()


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

    A loss with `reduction="none"` gives per-example values instead of a
    share; they are tracked as Keras tracks them on one device (see
    `_update_per_example`).
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
        batch = current_batch()
        if batch is None:
            return super().update_state(values, sample_weight=sample_weight)
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        share = tf.cast(values, self.dtype) / replicas
        if share.shape.rank != 0:
            return self._update_per_example(share, batch)
        if self.weighting == "rows":
            # share * N; in deferred scale share * R * n_r (the same number).
            rows = batch.own_scale(self.dtype) if batch.deferred else batch.global_rows
            self.total.assign_add(share * tf.cast(rows, self.dtype))
            self.count.assign_add(tf.cast(batch.local_rows, self.dtype))
        else:
            self.count.assign_add(tf.constant(1.0 / replicas, self.dtype))
            if not batch.deferred:
                return self.total.assign_add(share)
            # The share itself is share' * R * n_r / N: added once N is known
            # (the gradient all-reduce brings it in a training step).
            scaled = share * batch.own_scale(self.dtype)
            batch.when_global_rows(lambda global_rows: self.total.assign_add(
                tf.math.divide_no_nan(scaled, tf.cast(global_rows, self.dtype))))


    def _update_per_example(self, values, batch):
        # A loss with reduction="none" returns this replica's per-example
        # values (unscaled, kd's loss wrapper leaves them as they are). On one
        # device Keras's tracker adds mean(values) * rows and counts the rows
        # (the model's loss), or adds sum(values) and counts the leading
        # dimension (a per-output loss); each replica adds its own part.
        if self.weighting == "rows":
            rows = tf.cast(batch.local_rows, self.dtype)
            mean = tf.math.divide_no_nan(tf.reduce_sum(values), tf.cast(tf.size(values), self.dtype))
            self.total.assign_add(mean * rows)
            self.count.assign_add(rows)
        else:
            self.total.assign_add(tf.reduce_sum(values))
            self.count.assign_add(tf.cast(tf.shape(values)[0], self.dtype))


class GlobalCompileLoss(_keras_compat.CompileLoss):
    """Keras's `CompileLoss` whose losses and trackers are exact across replicas."""

    def build(self, y_true, y_pred):
        super().build(y_true, y_pred)
        _keras_compat.replace_compile_losses(
            self, _wrap_loss, lambda name: GlobalShareMean(name, weighting="steps")
        )


def _wrap_loss(loss):
    if isinstance(loss, GlobalReductionLoss):
        return loss
    return GlobalReductionLoss(loss)


def install_global_losses(model):
    """Swaps the model's compiled loss and loss tracker for exact ones."""
    compiled = _keras_compat.compiled_loss(model)
    if compiled is not None and not isinstance(compiled, GlobalCompileLoss):
        loss, loss_weights, output_names = _keras_compat.compile_loss_arguments(compiled)
        _keras_compat.set_compiled_loss(
            model, GlobalCompileLoss(loss, loss_weights, output_names=output_names)
        )
    tracker = _keras_compat.loss_tracker(model)
    if tracker is not None and not isinstance(tracker, GlobalShareMean):
        _keras_compat.set_loss_tracker(model, GlobalShareMean("loss", weighting="rows"))


def track_loss(model, share):
    """Updates the model's loss tracker with a replica's loss share."""
    tracker = _keras_compat.loss_tracker(model)
    if tracker is not None:
        tracker.update_state(_keras_compat.unscale_for_tracker(share))
