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
`scaling.defer`), and the gradient all-reduce brings N along
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

import inspect

import keras
import tensorflow as tf
from keras import tree

from keras_distrib import _keras_compat
from keras_distrib.training import coupling
from keras_distrib.training import penalties
from keras_distrib.training import scaling
from keras_distrib.training.coupling import global_batch  # kd.losses.global_batch
from keras_distrib import validation
from keras_distrib.training.replica import current_batch
from keras_distrib.training.replica import in_hand_written_loop
from keras_distrib.training.replica import is_share
from keras_distrib.training.replica import mark_share
from keras_distrib.training.replica import replica_sum
from keras_distrib.training.replica import replicas_in_sync

__all__ = [
    "add_loss_share",
    "global_batch",
    "global_mean",
    "global_share",
    "replica_part",
    "row_weighted",
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


def _floating(tensor):
    """`tensor` cast to `keras.config.floatx()` unless it holds floating-point numbers already."""
    return tensor if tensor.dtype.is_floating else tf.cast(tensor, keras.config.floatx())


# The functions a user's loop calls inside its `tf.function` run as written,
# as Keras's own do: AutoGraph would otherwise rewrite them, and all they
# call, at every new trace (about a third of tracing the recipe's step).
@tf.autograph.experimental.do_not_convert
def global_share(numerator, local_denominator):
    """numerator / (local_denominator summed over replicas), 0 if that is 0.

    In the numerator's dtype (`keras.config.floatx()` for integers).

    Args:
        numerator: This replica's part of the numerator (a scalar tensor).
        local_denominator: This replica's part of the denominator (e.g. its
            row count); all-reduced over the replicas.

    Returns:
        A scalar: this replica's share; the shares add up to the global ratio.

    Raises:
        ValueError: an argument is not numbers.
    """
    numerator = _floating(_numbers("numerator", numerator, "global_share"))
    local_denominator = _numbers("local_denominator", local_denominator, "global_share")
    denominator = replica_sum(tf.cast(local_denominator, numerator.dtype))
    return mark_share(tf.math.divide_no_nan(numerator, denominator))


@tf.autograph.experimental.do_not_convert
def global_mean(per_example_loss, sample_weight=None):
    """This replica's share of the exact global mean of `per_example_loss`.

    The sum of the shares over all replicas equals the mean over the whole
    global batch (the same value one device computes with
    `reduction="sum_over_batch_size"`): weighted values are summed and
    divided by the global element count, all-reduced each call. The share
    has the losses' dtype (`keras.config.floatx()` for integers).

    On several replicas, losses that mix the replica's rows in a way one
    device does not (per-replica BatchNormalization statistics or random
    draws of a plain Keras model, which kd sees in the graph) are refused:
    a kd model lays those out over the global batch.

    Args:
        per_example_loss: Losses of this replica's rows, shape `(n_r, ...)`.
            May be empty.
        sample_weight: Optional weights broadcastable to the losses.

    Returns:
        A scalar: this replica's share.

    Raises:
        ValueError: an argument is not numbers, `sample_weight`'s shape
            cannot weigh the losses (checked on static shapes), or the
            losses mix the replica's rows (see above).

    Examples:
        >>> import tensorflow as tf
        >>> import keras_distrib as kd
        >>> float(kd.losses.global_mean(tf.constant([1.0, 2.0, 6.0])))
        3.0
    """
    values = _floating(_numbers("per_example_loss", per_example_loss, "global_mean"))
    _refuse_row_mixing(values)
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


_LAYOUT_FIX = (
    "kd lays BatchNormalization statistics and random layers (Dropout, GaussianNoise, ...) out "
    "over the global batch, as one device computes them, in the forward pass of a kd model: "
    "build the model as `kd.Model(inputs, outputs)` / `kd.Sequential(...)` (or put "
    "`kd.DistributedModelMixin` first in your model's bases), or train it with "
    "`kd.TrainLoop(model).train_step(iterator)`"
)


def _refuse_row_mixing(values):
    if replicas_in_sync() == 1 or current_batch() is not None:
        return
    kind = penalties.kind_of_value(values)
    if isinstance(kind, penalties.Unknown) and kind.meets:
        raise ValueError(
            f"`per_example_loss` depends on the rows of the batch together: {kind.mixing}. On "
            f"{replicas_in_sync()} replicas each computes that from its own rows, not from the "
            f"global batch one device sees. {_LAYOUT_FIX}; kd's models compute any layer whose "
            "rows meet on the global batch. For a loss of your own, gather the tensors the rows "
            "meet in with `kd.losses.global_batch(tensor)` (every replica's rows, the gradient "
            "flowing back to each; it also returns this replica's offset, for labels such as "
            "`offset + tf.range(rows)`)."
        )
    mixing = penalties.row_mixing(values)
    if mixing:
        raise ValueError(
            f"`per_example_loss` depends on this replica's rows together: {mixing}. On "
            f"{replicas_in_sync()} replicas each computes that from its own rows, not from the "
            f"global batch one device sees. {_LAYOUT_FIX}."
        )
    if isinstance(kind, penalties.Unknown) and kind.unread:
        raise ValueError(penalties.refusal(kind, "`per_example_loss`", replicas_in_sync()))


@tf.autograph.experimental.do_not_convert
def scale_regularization(losses, *, local_rows=None):
    """This replica's share of the `add_loss` and regularization terms.

    Each term adds up over replicas according to what it is, which kd reads
    from the graph that computes it (`keras_distrib.training.penalties`):

    - a term of the weights alone (weight regularizers, a constant) is the
      same on every replica: each contributes 1/R of it;
    - a sum over the batch's rows (`add_loss(c * tf.reduce_sum(x))`): each
      replica contributes its own sum (the sums add up to one device's);
    - a mean over rows (Keras's activity regularizers, which divide by the
      batch size; `tf.reduce_mean` over the rows): each contributes n_r / N
      of its own (needs `local_rows`); an empty replica contributes 0.

    The shares then add up to one device's value on any split of the global
    batch, an empty replica included. A term that is none of these (e.g. a
    variance of the batch) cannot be split exactly and is refused, as is a
    term kd cannot read (an eager tensor on several replicas). On one
    replica the result is the sum of the terms.

    Args:
        losses: A list of scalar tensors (e.g. `model.losses`), or one tensor.
        local_rows: This replica's row count (e.g. `tf.shape(x)[0]`); needed
            for means over rows on several replicas.

    Returns:
        A scalar tensor in the terms' dtype (`keras.config.floatx()` for an
        empty list or integer terms).

    Raises:
        ValueError: `losses` is not numbers, `local_rows` is not a whole
            number >= 0 (or an integer tensor), or a term cannot be split
            over replicas exactly (see above; the message names the term).

    Examples:
        >>> import tensorflow as tf
        >>> import keras_distrib as kd
        >>> float(kd.losses.scale_regularization([tf.constant(1.5), tf.constant(0.5)]))
        2.0
    """
    if local_rows is not None and not tf.is_tensor(local_rows) and not validation.is_whole(
            local_rows, 0):
        raise ValueError(f"`local_rows`={local_rows!r}: expected this replica's row count, a "
                         "whole number >= 0 (or an integer tensor), or None")
    if local_rows is not None and tf.is_tensor(local_rows) and not local_rows.dtype.is_integer:
        raise ValueError(f"`local_rows` is a {local_rows.dtype.name} tensor; expected an integer "
                         "row count (e.g. tf.shape(x)[0])")
    single = not isinstance(losses, (list, tuple))
    named = [("losses", losses)] if single else [(f"losses[{i}]", l) for i, l in enumerate(losses)]
    terms = [(name, _floating(_numbers(name, term, "scale_regularization"))) for name, term in named]
    if not terms:
        return mark_share(tf.constant(0.0, keras.config.floatx()))
    dtype = terms[0][1].dtype
    terms = [(name, tf.cast(term, dtype)) for name, term in terms]
    total = tf.add_n([tf.reduce_sum(term) for _, term in terms])
    replicas = replicas_in_sync()
    if replicas == 1:
        return mark_share(total)
    _refuse_other_replicas_terms(terms)
    kinds = [(name, term, penalties.kind_of(term)) for name, term in terms]
    refused = [(name, kind) for name, _, kind in kinds if isinstance(kind, penalties.Unknown)]
    if refused:
        raise ValueError(_unsplittable(refused, replicas))
    by_kind = {}
    for _, term, kind in kinds:
        by_kind.setdefault(kind, []).append(tf.reduce_sum(term))
    rows = None if local_rows is None else tf.cast(local_rows, dtype)
    if penalties.ROW_MEAN in by_kind and local_rows is None:
        raise ValueError(
            f"`local_rows`=None, but {len(by_kind[penalties.ROW_MEAN])} of the terms are "
            "means over the batch's rows (e.g. an activity regularizer), whose share on "
            f"{replicas} replicas is n_r / N of the replica's value: pass "
            "`local_rows=tf.shape(x)[0]` (this replica's row count)"
        )
    # A sum over no rows is 0 (a kd model feeds an empty replica one padded
    # row; its terms must not count).
    has_rows = None if rows is None else rows > 0
    # (n_r / N only where a mean weighs: it costs an all-reduce of the rows.)
    fraction = tf.math.divide_no_nan(rows, replica_sum(rows)) \
        if penalties.ROW_MEAN in by_kind else None
    share = tf.zeros((), dtype)
    for kind, values in by_kind.items():
        share += scaling.replica_share(
            kind, tf.add_n(values), fraction=None if kind == penalties.FIXED else fraction,
            has_rows=None if kind in (penalties.FIXED, penalties.GLOBAL, penalties.SHARE) else has_rows,
            replicas=replicas, what="the `add_loss`/regularization terms")
    return mark_share(share)


def _same_device(first, second):
    """Whether two device strings name the same device (fields one leaves out match anything)."""
    a, b = tf.DeviceSpec.from_string(first), tf.DeviceSpec.from_string(second)
    return all(x is None or y is None or x == y for x, y in (
        (a.job, b.job), (a.task, b.task), (a.device_type, b.device_type),
        (a.device_index, b.device_index)))


def _refuse_other_replicas_terms(terms):
    """Refuses terms another replica traced (read from a model's shared `losses` too late)."""
    context = tf.distribute.get_replica_context()
    try:
        devices = tf.nest.flatten(context.devices or [])
    except (AttributeError, IndexError, RuntimeError):
        return  # TensorFlow's multi-worker replica context does not say (IndexError)
    if not devices:
        return
    foreign = [name for name, term in terms
               if getattr(term, "op", None) is not None and term.op.device
               and not any(_same_device(term.op.device, d) for d in devices)]
    if foreign:
        raise ValueError(
            f"{', '.join(f'`{name}`' for name in foreign)} of `losses` were traced by another "
            "replica: Keras keeps a model's `add_loss` terms on its layers, shared by the "
            "replicas, and the replicas trace in turns, switching at every collective (such as "
            "`kd.losses.global_mean`'s). Read `model.losses` right after the forward pass, "
            "before any `kd.losses` call: `penalty = kd.losses.scale_regularization("
            "model.losses, local_rows=rows)` first, then `kd.losses.global_mean(...)`; or build "
            "the model as a kd model (`kd.Model`/`kd.Sequential`), whose `losses` are each "
            "replica's own."
        )


def _unsplittable(refused, replicas):
    lines = []
    for name, kind in refused:
        why = kind.mixing or (
            "is not a term of the weights alone, a sum or a mean over the batch's rows"
            if kind.op != "an eager tensor" else
            "is an eager tensor, whose graph kd cannot read: run the step in a `tf.function`")
        where = "" if kind.op == "an eager tensor" else f" (at `{kind.op}`)"
        lines.append(f"`{name}`{where} {why}")
    return (
        f"kd cannot split these `add_loss`/regularization terms over {replicas} replicas "
        "exactly:\n  - " + "\n  - ".join(lines) + "\nEach replica computes a term from its own "
        "rows; kd adds up terms of the weights alone, sums over rows (`tf.reduce_sum`) and means "
        "over rows (`tf.reduce_mean`, activity regularizers), built from ops whose effect on the "
        "rows it knows. Write the term as one of those, or add its exact share to the loss "
        "yourself (e.g. `kd.losses.global_mean(per_row_values)` for a mean over rows) and leave "
        "it out of the list."
    )


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
        dtype = self.inner.dtype
        in_mask = _keras_compat.get_keras_mask(y_pred)
        batch = current_batch()
        with tf.name_scope(self.name):
            # Where the rows of the batch meet in the loss (in-batch negatives, a
            # mined triplet), it is computed on the global batch (`coupling`).
            args = (y_true, y_pred, sample_weight, in_mask)
            global_batch = not coupling.on_replica_rows_first(self.inner)
            if not global_batch:
                terms = self._terms(*args)
                global_batch = coupling.rows_meet_in(self.inner, terms)
            if global_batch:
                with coupling.on_global_batch(self.inner, args) as global_args:
                    terms = self._terms(*global_args)
            numerator, denominator, values = terms
            if reduction in (None, "none"):
                return values
            whole = batch is not None and batch.coupling.global_region
            if global_batch or whole:
                if denominator is None:
                    denominator = tf.cast(tf.size(values), dtype)
                value = numerator if reduction == "sum" else tf.math.divide_no_nan(numerator, denominator)
                if whole:
                    return value  # inside a computation on the global batch: its value
                # The same on every replica: each replica's share is 1/R of it.
                replicas = replicas_in_sync()
                return mark_share(value / tf.cast(replicas, value.dtype))
            if reduction == "sum":
                return numerator if batch is None else scaling.in_step_scale(batch, numerator)
            if denominator is None:  # an element count: one entry per row
                denominator = tf.cast(tf.size(values), dtype)
                if batch is not None and batch.own_step.deferred and _counts_rows(values):
                    # The global element count is N times the elements per
                    # row: in deferred scale, R * n_r stands for N.
                    replicas = replicas_in_sync()
                    return tf.math.divide_no_nan(numerator, denominator * replicas)
                if batch is not None and batch.rows.knows_global_rows and _counts_rows(values) \
                        and getattr(self, "rows_are_the_batch", True):
                    # N already known (a global BatchNormalization's
                    # all-reduce brought it): N rows of equal size, no
                    # all-reduce of the element count.
                    per_row = values.shape[1:].num_elements()
                    return tf.math.divide_no_nan(numerator, tf.cast(batch.rows.global_rows, dtype) * per_row)
            if batch is None:
                return global_share(numerator, denominator)
            share = tf.math.divide_no_nan(numerator, batch.rows.global_sum(denominator))
            return scaling.in_step_scale(batch, share)

    def _terms(self, y_true, y_pred, sample_weight, in_mask):
        """(numerator, denominator or None for the element count, per-element losses) of a batch.

        The per-element losses, masks and sample weights combine exactly as
        `keras.losses.Loss.__call__` does on one device; the denominator is
        the batch's own (its weight or mask sum), None for its element count.
        """
        reduction = self.inner.reduction
        dtype = self.inner.dtype
        if reduction in (None, "none"):
            if in_mask is not None:
                _keras_compat.set_keras_mask(y_pred, in_mask)
            return None, None, self.inner(y_true, y_pred, sample_weight)
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
            values, weights = _keras_compat.squeeze_or_expand_to_same_rank(values, weights)
            values = values * weights
        numerator = tf.reduce_sum(values)
        if reduction == "mean_with_sample_weight" and weights is not None:
            denominator = tf.reduce_sum(weights)
        elif reduction in _MEAN_REDUCTIONS and mask is not None:
            denominator = tf.reduce_sum(tf.cast(mask, dtype))
        else:
            denominator = None
        return numerator, denominator, values


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
        if self.weighting == "rows" and not batch.loss.tracking_loss:
            # A custom step feeding the model's tracker (`metric.update_state(loss)`
            # for the metric named "loss"): one device's Mean adds the value once.
            return _tracker_update(self, super().update_state)(values, sample_weight)
        replicas = replicas_in_sync()
        share = tf.cast(values, self.dtype) / replicas
        if share.shape.rank != 0:
            return self._update_per_example(share, batch)
        if self.weighting == "rows":
            # share * N; in deferred scale share * R * n_r (the same number).
            rows = scaling.own_scale(batch, self.dtype) if batch.own_step.deferred else batch.rows.global_rows
            self.total.assign_add(share * tf.cast(rows, self.dtype))
            self.count.assign_add(tf.cast(batch.rows.local_rows, self.dtype))
        else:
            self.count.assign_add(tf.constant(1.0 / replicas, self.dtype))
            if not batch.own_step.deferred:
                return self.total.assign_add(share)
            # The share itself is share' * R * n_r / N: added once N is known
            # (the gradient all-reduce brings it in a training step).
            scaled = share * scaling.own_scale(batch, self.dtype)
            batch.rows.when_global_rows(lambda global_rows: self.total.assign_add(
                tf.math.divide_no_nan(scaled, tf.cast(global_rows, self.dtype))))


    def _update_per_example(self, values, batch):
        # A loss with reduction="none" returns this replica's per-example
        # values (unscaled, kd's loss wrapper leaves them as they are). On one
        # device Keras's tracker adds mean(values) * rows and counts the rows
        # (the model's loss), or adds sum(values) and counts the leading
        # dimension (a per-output loss); each replica adds its own part.
        if self.weighting == "rows":
            rows = tf.cast(batch.rows.local_rows, self.dtype)
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
        losses = [loss if isinstance(loss, GlobalReductionLoss) else GlobalReductionLoss(loss)
                  for loss in _keras_compat.compiled_losses(self)]
        trackers = [GlobalShareMean(name, weighting="steps")
                    for name in _keras_compat.compiled_loss_tracker_names(self)]
        _keras_compat.replace_compile_losses(self, losses, trackers)


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
    if tracker is None:
        return
    batch = current_batch()
    if batch is not None:
        batch.loss.tracking_loss = True
    try:
        tracker.update_state(_keras_compat.unscale_for_tracker(share))
    finally:
        if batch is not None:
            batch.loss.tracking_loss = False


# ---------------------------------------------------------------------------
# A custom step's own losses and trackers.


def loss_object_call(keras_call):
    """`keras.losses.Loss.__call__` that returns a share of the global loss in a kd step.

    Installed for the whole process at a kd model's first step
    (`_keras_compat.install_for_process`); outside a kd replica step it
    returns Keras's own result.

    Keras's loss objects reduce over the replica's own rows and divide by R:
    each replica's mean weighs the same, whatever its rows. Called in a kd
    replica step (a custom `train_step`'s `self.loss_fn(y, y_pred)`), the
    object computes what kd's compiled losses compute: this replica's share
    of the global-batch value, recorded as a share (`replica.mark_share`).
    Inside a kd model's forward pass (a layer's `add_loss` of a loss object)
    it stays Keras's: kd weighs `add_loss` terms by the replica's rows.
    """

    def call(loss, y_true, y_pred, sample_weight=None):
        batch = current_batch()
        if loss.reduction not in (None, "none") and replicas_in_sync() > 1 and in_hand_written_loop():
            raise ValueError(_reduced_in_loop(loss))
        if batch is None or batch.forward.in_forward or loss.reduction in (None, "none"):
            return keras_call(loss, y_true, y_pred, sample_weight)
        # A loss object of the user's may see other rows than the batch's (a
        # GAN's concatenated real and generated images): its element count is
        # all-reduced, never taken from the batch's N.
        wrapped = GlobalReductionLoss(loss)
        wrapped.rows_are_the_batch = False
        return mark_share(wrapped(y_true, y_pred, sample_weight=sample_weight))

    return call


def _reduced_in_loop(loss):
    return (
        f"The loss object {type(loss).__name__}(reduction={loss.reduction!r}) is called in a "
        f"hand-written loop's replica step on {replicas_in_sync()} replicas: Keras divides each "
        "replica's mean by the replicas, so replicas with different row counts (the last batch) "
        "weigh the same, and the summed gradient is not one device's. kd computes a loss object "
        "exactly in `fit` and `kd.TrainLoop`; in your own loop, make it with `reduction=None` and "
        "take `kd.losses.global_mean(loss_fn(y, y_pred))`, adding "
        "`kd.losses.scale_regularization(model.losses, local_rows=tf.shape(x)[0])` for the "
        "model's `add_loss` terms (see the hand-written loops guide)."
    )


@tf.autograph.experimental.do_not_convert
def row_weighted(value):
    """This replica's part of a per-replica scalar that kd did not compute.

    A scalar computed from the replica's own rows with plain ops (a
    `keras.ops.mean` over them) is taken as a mean over those rows: the
    global-batch value is sum_r (n_r / N) * value_r, exact for any mean of
    per-row terms, and for a value every replica shares (a learning rate).
    A value its graph shows to be a sum over rows adds up as it is. A
    replica without rows adds 0 (its mean of no rows is NaN). A recorded
    loss share is returned as it is (its sum is already the global value).

    A value computed on the global batch kd gathered (GLOBAL, the same on
    every replica) adds 1/R of itself.

    Outside a step on several replicas, returns `value`.

    Args:
        value: A scalar tensor (or number) computed from this replica's rows.

    Returns:
        This replica's part of the global value.

    Examples:
        >>> import keras_distrib as kd
        >>> kd.losses.row_weighted(2.5)  # outside a step: as it is
        2.5
    """
    return replica_part(value)


def add_loss_share(loss):
    """This replica's share of an `add_loss` or regularization term (`Model.additional_loss_share`).

    What the term is to the rows is read from its graph
    (`penalties.kind_of`), and `scaling.replica_share` gives the share:
    a sum over rows whole, a mean over rows or a term of the weights by
    n_r / N, a term computed on the global batch 1/R of it; a term kd
    cannot split is refused, naming the op.
    """
    if not loss.dtype.is_floating:
        loss = tf.cast(loss, keras.backend.floatx())
    batch = current_batch()
    if batch is None:
        # Keras's own rule outside kd's step: 1/R of the term, R the strategy's.
        return tf.reduce_sum(loss) / tf.distribute.get_strategy().num_replicas_in_sync
    total = tf.reduce_sum(loss)
    kind = penalties.kind_of(loss) if replicas_in_sync() > 1 else penalties.ROW_MEAN
    if isinstance(kind, penalties.Unknown) and batch.step.rows_meet != "global":
        kind = penalties.ROW_MEAN  # compiled to keep Keras's per-replica rows
    weighs = kind in (penalties.ROW_MEAN, penalties.FIXED)  # (n_r / N may cost an all-reduce)
    return scaling.replica_share(
        kind, total, fraction=tf.cast(scaling.fraction(batch), total.dtype) if weighs else None,
        has_rows=batch.rows.has_rows, replicas=replicas_in_sync(),
        what=f"the `add_loss` term `{loss.name if hasattr(loss, 'op') else loss}`",
        row_sum=lambda value: scaling.in_step_scale(batch, value))


def replica_part(value, what=None):
    """`row_weighted(value)`; `what` names the value where kd cannot split it.

    Where the rows of the batch meet in it, or it passes an op kd cannot
    read, kd gathers what it starts from at the next trace, or refuses
    (`coupling.inline`). The share is `scaling.replica_share`'s.
    """
    batch = current_batch()
    if batch is None or replicas_in_sync() == 1 or is_share(value):
        return value
    value = tf.convert_to_tensor(value)
    kind = penalties.kind_of(value)
    what = what or "the value given to `kd.losses.row_weighted`"
    if isinstance(kind, penalties.Unknown):
        if batch.step.rows_meet != "global":
            kind = penalties.ROW_MEAN  # compiled to keep Keras's per-replica rows
        else:
            coupling.inline(kind, batch, what, value.graph)  # gathered at the next trace, or refused
    weighs = kind in (penalties.ROW_MEAN, penalties.FIXED)  # (n_r / N may cost an all-reduce)
    return scaling.replica_share(
        kind, value, fraction=tf.cast(scaling.fraction(batch), value.dtype) if weighs else None,
        has_rows=batch.rows.has_rows, replicas=replicas_in_sync(), what=what)


def _tracker_update(metric, keras_update):
    """A `keras.metrics.Mean` tracker's `update_state` that one device's value reaches.

    On one device, `tracker.update_state(v)` adds v to the total and 1 to
    the count. In a kd step on several replicas a scalar v adds its
    replica's part of the global value (a loss share as it is, any other
    scalar weighted by the replica's rows, see `row_weighted`), and replica
    0 counts the step once: summed over replicas, the same total and count.
    Tensors of values (and weighted updates) are Keras's own: summing their
    per-replica totals and counts is already exact.
    """
    total, count = _keras_compat.mean_variables(metric)
    other_values = _metric_update(metric, keras_update)

    def update_state(values, sample_weight=None):
        batch = current_batch()
        if batch is None or replicas_in_sync() == 1 \
                or sample_weight is not None or getattr(values, "shape", None) is None \
                or values.shape.rank != 0:
            return other_values(values, sample_weight=sample_weight)
        part = replica_part(values, what=f"the value the tracker {metric.name!r} is updated with")
        total.assign_add(tf.cast(part, total.dtype))
        replica_id = tf.distribute.get_replica_context().replica_id_in_sync_group
        count.assign_add(tf.cast(tf.equal(replica_id, 0), count.dtype))

    return update_state


def exact_trackers(metrics):
    """Gives each `keras.metrics.Mean` tracker in `metrics` one device's update (idempotent)."""
    for metric in metrics:
        if not isinstance(metric, GlobalShareMean):
            _keras_compat.replace_mean_update(metric, _tracker_update)


def _metric_update(metric, keras_update):
    """A metric's `update_state` that counts what is computed on the global batch once.

    In a kd step on several replicas, values computed from the global batch
    kd gathered (GLOBAL: the same on every replica, e.g. a contrastive
    accuracy over in-batch similarities) update the metric on the first
    replica only (sample weights of 0 elsewhere), as one device updates it
    once; values where the rows of
    the batch meet in code kd did not call are gathered (or refused, see
    `coupling.inline`). Other values are Keras's own update.
    """

    def update_state(*args, **kwargs):
        batch = current_batch()
        if batch is None or replicas_in_sync() == 1 or batch.coupling.global_region:
            return keras_update(*args, **kwargs)
        tensors = [v for v in tree.flatten((args, kwargs)) if isinstance(v, tf.Tensor)]
        kinds = [penalties.kind_of_value(v) for v in tensors]
        for tensor, kind in zip(tensors, kinds):
            if isinstance(kind, penalties.Unknown) and kind.on_global_batch:
                coupling.inline(kind, batch, f"what the metric {metric.name!r} is updated with",
                                tensor.graph)
        if penalties.GLOBAL not in kinds or not _takes_sample_weight(keras_update):
            # (A metric without sample weights updates on every replica: each
            # adds the same, R times, and a ratio of its states stays one device's.)
            return keras_update(*args, **kwargs)
        rows = next(v for v, k in zip(tensors, kinds) if k == penalties.GLOBAL and v.shape.rank)
        first = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0)
        only_first = tf.fill(tf.shape(rows)[:1], tf.cast(first, keras.config.floatx()))
        weight = kwargs.pop("sample_weight", args[2] if len(args) > 2 else None)
        args = args[:2]
        if weight is not None:
            weight = tf.cast(weight, only_first.dtype)
            only_first = weight * tf.reshape(only_first, [-1] + [1] * (weight.shape.rank - 1)) \
                if weight.shape.rank else weight * only_first
        return keras_update(*args, sample_weight=only_first, **kwargs)

    return update_state


def _takes_sample_weight(update):
    try:
        return "sample_weight" in inspect.signature(update).parameters
    except (TypeError, ValueError):
        return False


def exact_metric_updates(metrics):
    """Gives every metric in `metrics` but the Mean trackers kd's global-batch update (idempotent)."""
    for metric in metrics:
        if not isinstance(metric, GlobalShareMean):
            _keras_compat.replace_metric_update(metric, _metric_update)
