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

import contextlib
import threading

import tensorflow as tf
from keras.src import tree
from keras.src.backend.common.symbolic_scope import in_symbolic_scope

_STATE = threading.local()


class StepPlan:
    """How a replica runs its forward pass; decided once per compiled step.

    Attributes:
        pad_empty: Feed an empty replica batch to the model as one row of
            zeros and drop that row's outputs. TensorFlow's CPU (oneDNN)
            convolution and pooling kernels mishandle 0-row batches (wrong
            shapes, or a crash); the padded row contributes nothing.
        xla_forward: Compile the forward pass (and its gradient) with XLA on
            the replica's device, the all-reduces staying outside: what
            `jit_compile=True` means where XLA cannot compile a whole step
            that synchronizes replicas (several CPU replicas, multi-worker).
        looped: The step runs inside a loop compiled into one function
            (`steps_per_execution` > 1, `steps_per_loop` > 1, a whole epoch).
    """

    def __init__(self, *, pad_empty=False, xla_forward=False, looped=False):
        self.pad_empty = bool(pad_empty)
        self.xla_forward = bool(xla_forward)
        self.looped = bool(looped)

    def __repr__(self):
        return (f"StepPlan(pad_empty={self.pad_empty}, xla_forward={self.xla_forward}, "
                f"looped={self.looped})")


class ReplicaBatch:
    """What kd knows about the batch one replica processes in a step.

    Attributes:
        local_rows: Rows on this replica, n_r (a float32 scalar tensor).
        global_rows: Rows over all replicas, N = sum(n_r) (all-reduced).
        plan: The `StepPlan` of the step.
        losses: The `add_loss` terms of this replica's latest forward pass
            (recorded per replica; `None` before the first one).
        owner: The model whose forward pass recorded `losses`.
    """

    def __init__(self, local_rows, global_rows, plan=None):
        self.local_rows = local_rows
        self.global_rows = global_rows
        self.plan = plan or StepPlan()
        self.losses = None
        self.owner = None
        self.in_forward = False

    @property
    def fraction(self):
        """n_r / N: this replica's part of the global batch (0 if empty)."""
        return tf.math.divide_no_nan(self.local_rows, self.global_rows)

    @property
    def has_rows(self):
        """A boolean tensor: whether this replica holds any row."""
        return self.local_rows > 0

    def record_loss(self, loss):
        """Keeps an `add_loss` term of the current forward pass."""
        if self.in_forward and self.losses is not None:
            self.losses.extend(tf.nest.flatten(loss))


def batch_rows(x):
    """Rows in a replica's batch: the leading dimension of the first input."""
    for value in tree.flatten(x):
        if value is not None:
            return tf.shape(value)[0]
    raise ValueError(
        "The batch has no input tensor (`x` is empty or all None); "
        "kd models need at least one input to count rows."
    )


def replica_sum(value):
    """All-reduces `value` (SUM) across the replicas of the current strategy.

    Identity without a strategy. Must be called in a replica context (inside
    `strategy.run`, `train_step` or `test_step`).
    """
    context = tf.distribute.get_replica_context()
    if context is None:
        if in_symbolic_scope():
            return value  # Keras building shapes under strategy.scope().
        raise RuntimeError(
            "kd.losses needs a replica context: call it inside "
            "`strategy.run(...)` or a model's train_step/test_step, not "
            "directly under `strategy.scope()`."
        )
    if context.num_replicas_in_sync == 1:
        return value
    return context.all_reduce(tf.distribute.ReduceOp.SUM, value)


@contextlib.contextmanager
def replica_batch(local_rows, plan=None):
    """Records this replica's row count (and the all-reduced global count).

    kd's step opens this around every replica step, so that losses, metric
    trackers, regularization and the forward pass can use the global count
    without another all-reduce. Inside an open batch (e.g. a `train_step`
    override calling `self.replica_batch(x)`), the open batch is reused.
    """
    current = getattr(_STATE, "batch", None)
    if current is not None:
        yield current
        return
    local_rows = tf.cast(local_rows, tf.float32)
    batch = ReplicaBatch(local_rows, replica_sum(local_rows), plan)
    _STATE.batch = batch
    try:
        yield batch
    finally:
        _STATE.batch = None


def current_batch():
    """The `ReplicaBatch` of the step being traced on this thread, or None."""
    return getattr(_STATE, "batch", None)


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
