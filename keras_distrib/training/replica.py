"""What one replica knows about the batch it processes in a step.

kd's step opens a `ReplicaBatch` around every replica step (`replica_batch`).
It holds typed parts, each written by one module (see `ReplicaBatch`):
the replica's row count n_r and, when something needs it, the global count
N (`BatchRows`), the step's `StepPlan` and identity, the forward pass's
state, the step's draws, the gradient all-reduce's state. Losses, metric trackers,
regularization, the forward pass and synchronized batch normalization read
it instead of all-reducing again. It is thread-local: under
MirroredStrategy each replica traces on its own thread.

N costs an all-reduce, a barrier across every replica and worker, so it is
computed only when first read (`BatchRows.global_rows`). kd's own
training step does without it: with `deferred` scaling (see
`OwnStep.deferred` and `keras_distrib.training.scaling`) each replica scales its loss by what it knows
(R * n_r instead of N), and the gradient all-reduce carries n_r along to
correct the scale afterwards: one collective per step.
"""

import contextlib
import dataclasses
import threading
import weakref

import tensorflow as tf
from keras import tree

from keras_distrib.training import penalties

__all__ = [
    "BatchRows",
    "CollectiveOrder",
    "CouplingState",
    "DrawState",
    "ForwardState",
    "LossState",
    "MetricResults",
    "OwnStep",
    "ReducedState",
    "ReplicaBatch",
    "SHARE",
    "StepIdentity",
    "StepPlan",
    "batch_rows",
    "current_batch",
    "in_hand_written_loop",
    "is_share",
    "keep_losses",
    "kept_losses",
    "mark_share",
    "piece_order",
    "replica_batch",
    "replica_sum",
    "replicas_in_sync",
    "rows_and_offsets",
    "sum_packed",
]

_STATE = threading.local()

# `ReducedState.gradient_kind` of a target that is a loss share kd computed.
SHARE = "share"

# Said (and raised as a ValueError by kd's step) when a random draw's leading
# dimension is not a multiple of the replica's rows (see draws._blocks_of).
DRAW_REFUSAL = (
    "kd: a random draw in a step on several replicas has a leading dimension that is not a "
    "multiple of the rows of the replica, so kd cannot lay it out over the global batch as one "
    "device draws it. Draw with a leading dimension of k * the batch size "
    "(keras.random.normal((tf.shape(x)[0], ...), seed=...)), or with a leading dimension "
    "known when traced (not shaped by the batch)."
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepPlan:
    """How a replica runs its step; decided once per compiled step function (frozen).

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

    pad_empty: bool = False
    xla_forward: bool = False
    looped: bool = False

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if not isinstance(getattr(self, field.name), bool):
                raise TypeError(f"`{field.name}`={getattr(self, field.name)!r}: expected True or False.")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class StepIdentity:
    """Whose step a batch belongs to. Frozen: set whole, once, by the batch's opener.

    Written by `step` (kd's `Step`: every field) or by `model_call` (a
    model called outside a step: `rows_meet` only); the default is a
    hand-written loop's. Read by `coupling`, `forward`, `gradients`,
    `losses`, `model_call` and `step`.

    Attributes:
        model: The kd model whose step this is (None in a hand-written loop).
        kind: `"train"`, `"test"` or `"predict"` (None in a hand-written loop).
        retraceable: Whether kd's `Step` traces this step and can trace it
            again (`coupling.RowsMeet`).
        rows_meet: `"global"` (kd gathers the global batch where rows meet)
            or `"per_replica"` (the model was compiled to leave them).
    """

    model: object = None
    kind: str = None
    retraceable: bool = False
    rows_meet: str = "global"


class BatchRows:
    """The batch's row counts: this replica's n_r, the global N and the offset.

    Written by `replica` (`replica_batch` opens it; N and the offsets are
    learnt through its methods, called by `batch_norm`, `gradients` and
    `losses`), except `leaves`, which the batch's opener (`step`,
    `model_call`) sets once. Read by `batch_norm`, `coupling`, `draws`,
    `forward`, `gradients`, `losses`, `model_call` and `scaling`.

    Attributes:
        local_rows: Rows on this replica, n_r (a float32 scalar tensor).
        static_rows: n_r as a number when the batch's shape says it when
            traced (every batch the traced function takes has that many
            rows), else None.
        global_rows: Rows over all replicas, N = sum(n_r); all-reduced when
            first read, unless the gradient all-reduce has brought it.
        offset: Where this replica's rows start in the global batch (a
            float32 scalar tensor): the rows of the replicas whose pieces
            come before its own in TensorFlow's split (see `piece_order`).
            All-reduced with `global_rows` when first read.
        leaves: The step's data leaves (leaf 0 holds the batch's rows); their
            global row counts and this replica's offsets are all-reduced
            together when first read (`leaf_rows`).
    """

    __slots__ = ("local_rows", "static_rows", "leaves", "_global_rows", "_offset", "_leaf_rows", "_pending")

    def __init__(self, *, local_rows, static_rows=None, global_rows=None, offset=None):
        self.local_rows = local_rows
        self.static_rows = static_rows
        self.leaves = []
        self._global_rows = global_rows
        self._offset = offset
        self._leaf_rows = None  # (local, totals, offsets) of the leaves, once all-reduced
        self._pending = []  # (function of N) run once N is known: see `when_global_rows`

    @property
    def global_rows(self):
        if self._global_rows is None:
            self._learn_leaf_rows()
        return self._global_rows

    @property
    def offset(self):
        if self._offset is None:
            self._learn_leaf_rows()
        return self._offset

    def leaf_rows(self):
        """`(local, totals, offsets)` of the step's data leaves (int32 vectors; see `leaves`).

        Each leaf's rows on this replica, over all replicas, and where this
        replica's start in the global batch of that leaf: one all-reduce of
        every leaf's count, which also gives N and the offset of leaf 0 (the
        batch's). Without leaves, leaf 0 is the batch's rows.
        """
        if self._leaf_rows is None:
            self._learn_leaf_rows()
        return self._leaf_rows

    def _learn_leaf_rows(self):
        local = [self.local_rows] + [tf.cast(tf.shape(leaf)[0], tf.float32) for leaf in self.leaves[1:]]
        local = tf.stack(local)
        totals, offsets = rows_and_offsets(local)
        self._global_rows, self._offset = totals[0], offsets[0]
        self._leaf_rows = tuple(tf.cast(v, tf.int32) for v in (local, totals, offsets))

    @property
    def knows_global_rows(self):
        """Whether N is known without another all-reduce."""
        return self._global_rows is not None

    def global_sum(self, value):
        """`value` summed over the replicas, in the all-reduce that also brings N if unknown."""
        if self._global_rows is not None or replicas_in_sync() == 1:
            return replica_sum(value)
        value = tf.convert_to_tensor(value)
        rows = tf.cast(self.local_rows, value.dtype)
        total, global_rows = replica_sum([value, rows])
        self._global_rows = tf.cast(global_rows, self.local_rows.dtype)
        return total

    def learn_global_rows(self, global_rows):
        """Keeps N, all-reduced along with something else (the gradients)."""
        self._global_rows = tf.cast(global_rows, self.local_rows.dtype)

    def when_global_rows(self, function):
        """Runs `function(N)` now if N is known, else after the gradient all-reduce brings it."""
        if self._global_rows is not None:
            function(self._global_rows)
        else:
            self._pending.append(function)

    @property
    def waits_for_global_rows(self):
        """Whether updates wait for N (they run when an all-reduce brings it)."""
        return bool(self._pending)

    def finish(self):
        """Runs what waited for N (reading it with an all-reduce if nothing brought it)."""
        pending, self._pending = self._pending, []
        for function in pending:
            function(self.global_rows)

    @property
    def has_rows(self):
        """A boolean tensor: whether this replica holds any row."""
        return self.local_rows > 0

    @property
    def surely_has_rows(self):
        """Whether the batch's shape, known when traced, has rows: nothing to pad or mask then.

        The traced function then holds no branch for an empty replica (it
        is traced again, with an unknown row count, for a batch of another
        size), and shapes stay as the data gives them.
        """
        return self.static_rows is not None and self.static_rows > 0


class ForwardState:
    """The state of the replica's forward passes in this step.

    Written by `model_call` (a kd model's forward pass), and by `coupling`
    when it runs a layer a second time on the global batch (it drops the
    first run's `losses` and pushes a `padded` row of its own). Read by
    `coupling`, `forward`, `losses` and `model_call`.

    Attributes:
        losses: The `add_loss` terms of this replica's latest forward pass
            (recorded per replica; `None` before the first one).
        owner: The model whose forward pass recorded `losses`.
        in_forward: Whether a kd model's forward pass is running.
        padded: Inside forward passes fed one padded row: whether that row is
            padding (innermost last; `model_call`).
    """

    __slots__ = ("losses", "owner", "in_forward", "padded")

    def __init__(self):
        self.losses = None
        self.owner = None
        self.in_forward = False
        self.padded = []

    def record_loss(self, loss):
        """Keeps an `add_loss` term of the current forward pass."""
        if self.in_forward and self.losses is not None:
            self.losses.extend(tree.flatten(loss))


class CollectiveOrder:
    """The order of the forward pass's collectives, the same on every replica.

    Written through `after_collective`, by `batch_norm` and `coupling`
    (each forward-pass all-reduce); read through `chain` by the same two.

    Attributes:
        moments_token: A zero that follows the forward pass's latest
            collective, added to the next (`chain`, `after_collective`); None
            before the first.
    """

    __slots__ = ("moments_token",)

    def __init__(self):
        self.moments_token = None

    def chain(self, value):
        """`value` plus a zero that follows the previous forward-pass collective (see `after_collective`)."""
        if self.moments_token is None:
            return value
        return value + tf.cast(self.moments_token, value.dtype)

    def after_collective(self, value):
        """Makes the next `chain`ed collective follow the one that gave `value`.

        A zero that carries a gradient path from `value`, added to the next
        all-reduced sum: it orders the backward pass. The tape processes
        independent branches (two BatchNormalizations on one input) in an
        order that can differ between replicas, and collectives pair up by
        the order in which each replica creates them. With every all-reduce
        of the forward pass chained, their gradients are created in one
        order on every replica.
        """
        dtype = value.dtype if value.dtype.is_floating else tf.float32
        self.moments_token = tf.math.multiply_no_nan(
            tf.cast(tf.reduce_sum(value), dtype), tf.zeros((), dtype))


class CouplingState:
    """Where rows meet in this step: written by `coupling` only.

    Read by `coupling`, and `global_region` also by `batch_norm`, `draws`,
    `forward`, `losses`, `model_call` and `replica` (`mark_share`).

    Attributes:
        global_region: > 0 while a computation runs on the global batch
            kd gathered (`coupling`): kd's own sites leave it alone there.
        occurrences: id of a call's owner -> its calls so far in this step
            (`coupling.anchor`).
        anchors: tensor ref -> anchor key (`coupling.anchor`).
        layouts: tensor ref -> the leaves its rows come from (`coupling.row_layout`).
    """

    __slots__ = ("global_region", "occurrences", "anchors", "layouts")

    def __init__(self):
        self.global_region = 0
        self.occurrences = {}
        self.anchors = {}
        self.layouts = {}


class DrawState:
    """The step's random draws: written by `draws`.

    `coupling` also restores `seed_draws` after a layer's first run whose
    draws are not the step's. Read by `draws` and `coupling`.

    Attributes:
        seed_draws: id of a SeedGenerator -> (its state read, draws so far)
            in this step (`draws.counted_draws`).
        laid_out: > 0 inside a call kd already runs on the global batch
            (`forward`: its layers leave their draws alone there).
    """

    __slots__ = ("seed_draws", "laid_out")

    def __init__(self):
        self.seed_draws = {}
        self.laid_out = 0


class OwnStep:
    """What kd's own `train_step` / `test_step` decided: written by `models`.

    Read by `gradients`, `losses` and `scaling`.

    Attributes:
        deferred: Whether loss shares are in deferred scale: each replica's
            share times N / (R * n_r), so that no replica needs N before
            its gradient (see `scaling.defer`). Off unless kd's own step turns it on.
        metric_variables: The metric variables whose states travel in the
            gradient all-reduce (kd's own `train_step` updates its metrics
            first and sets them; None otherwise).
    """

    __slots__ = ("deferred", "metric_variables")

    def __init__(self):
        self.deferred = False
        self.metric_variables = None


class LossState:
    """The loss shares kd computed in this step.

    `shares` is written by `replica` (`mark_share`), `tracking_loss` by
    `losses` (`track_loss`). Read by `gradients` and `losses`
    (`is_share`).

    Attributes:
        shares: id -> tensor: the loss shares kd computed in this step (`mark_share`).
        tracking_loss: Whether kd's own step is updating the model's loss
            tracker with its loss share (`losses.track_loss`), not a custom
            step feeding it a value.
    """

    __slots__ = ("shares", "tracking_loss")

    def __init__(self):
        self.shares = {}
        self.tracking_loss = False


class ReducedState:
    """The gradient all-reduce's state: written by `gradients`.

    `step` opens `recorded_gradients` (an empty list) when the first-step
    check asks for it. Read by `gradients`, `step` and `first_step`.

    Attributes:
        gradient_kind: How the next gradients' target adds up over replicas
            (`gradients.classify_gradient_target`): `SHARE`, `penalties.ROW_SUM`,
            `penalties.GLOBAL`, or None for a mean over rows.
        global_metric_states: The global values of `OwnStep.metric_variables`
            (summed over every replica, as a read in cross-replica context),
            once the gradient all-reduce has brought them; None otherwise.
        recorded_gradients: None, or a list the gradient all-reduce appends
            `(variables, global gradients)` to at each optimizer's update
            (the first-step check reads them: `keras_distrib.training.first_step`).
    """

    __slots__ = ("gradient_kind", "global_metric_states", "recorded_gradients")

    def __init__(self):
        self.gradient_kind = None
        self.global_metric_states = None
        self.recorded_gradients = None


class MetricResults:
    """The metric results read in this step: written by `hooks`, read by `logs`.

    Attributes:
        results: id -> (tensor, log key): the metric results read in this
            step (`hooks`' recorded `result`; the step's logs read them).
    """

    __slots__ = ("results",)

    def __init__(self):
        self.results = {}


class ReplicaBatch:
    """What kd knows about the batch one replica processes in a step, in typed parts.

    Each part is written by one module (see each part's docstring); the
    batch itself holds nothing else.

    Attributes:
        rows: `BatchRows`: n_r, N, the offset and the data's leaves (`replica`).
        plan: The `StepPlan` of the step (frozen; the step's opener).
        step: `StepIdentity`: the model, kind and rows-meet policy (frozen;
            the step's opener: `step` or `model_call`).
        forward: `ForwardState`: the forward passes' losses and padding (`model_call`).
        collectives: `CollectiveOrder`: the order of the forward pass's
            all-reduces (`batch_norm`, `coupling`, through its methods).
        coupling: `CouplingState`: where rows meet (`coupling`).
        draws: `DrawState`: the step's random draws (`draws`).
        own_step: `OwnStep`: kd's own `train_step`'s scaling and metrics (`models`).
        loss: `LossState`: the loss shares kd computed (`replica`, `losses`).
        reduced: `ReducedState`: the gradient all-reduce's state (`gradients`).
        metrics: `MetricResults`: the metric results read in the step (`hooks`).
    """

    __slots__ = ("rows", "plan", "step", "forward", "collectives", "coupling", "draws", "own_step",
                 "loss", "reduced", "metrics")

    def __init__(self, *, rows, plan=None):
        self.rows = rows
        self.plan = plan or StepPlan()
        self.step = StepIdentity()
        self.forward = ForwardState()
        self.collectives = CollectiveOrder()
        self.coupling = CouplingState()
        self.draws = DrawState()
        self.own_step = OwnStep()
        self.loss = LossState()
        self.reduced = ReducedState()
        self.metrics = MetricResults()


def mark_share(value):
    """Records `value` as a loss share kd computed (their sum over replicas is the global loss).

    Trackers, logs and the gradient all-reduce tell shares from values kd
    did not compute (see `is_share`). Returns `value`. On the global batch
    (`CouplingState.global_region`) a value is the whole batch's, not a share.
    """
    batch = current_batch()
    if batch is not None and tf.is_tensor(value) and not batch.coupling.global_region:
        batch.loss.shares[id(value)] = value
        penalties.mark_share(value)
    elif batch is None and tf.is_tensor(value) and in_hand_written_loop():
        penalties.mark_share(value)  # read by the check of the loop's gradient target
    return value


def is_share(value):
    """Whether `value` is a loss share recorded in the current step by `mark_share`."""
    batch = current_batch()
    return batch is not None and batch.loss.shares.get(id(value)) is value


def batch_rows(x):
    """Rows in a replica's batch: the leading dimension of the first input.

    A number when the input's shape gives it when traced, else a tensor.
    """
    for value in tree.flatten(x):
        if value is not None:
            if isinstance(value, tf.Tensor) and value.shape.rank and value.shape[0] is not None:
                return int(value.shape[0])
            return tf.shape(value)[0]
    raise ValueError(
        "The batch has no input tensor (`x` is empty or all None); "
        "kd models need at least one input to count rows."
    )


def replica_sum(value):
    """All-reduces `value` (SUM) across the replicas of the current strategy.

    Identity without a strategy, or with one replica. Needs a replica
    context (inside `strategy.run`, `train_step` or `test_step`), except
    while Keras builds shapes symbolically.
    """
    context = tf.distribute.get_replica_context()
    if context is None:
        if _in_symbolic_build():
            return value
        raise RuntimeError(
            "kd.losses needs a replica context: call it inside "
            "`strategy.run(...)` or a model's train_step/test_step, not "
            "directly under `strategy.scope()`."
        )
    if replicas_in_sync() == 1:
        return value
    if isinstance(value, (list, tuple)):
        return sum_packed(context, value)
    return context.all_reduce(tf.distribute.ReduceOp.SUM, value)


def sum_packed(context, tensors):
    """Sums tensors over the replicas: one all-reduce per dtype, of one flat buffer.

    TensorFlow packs a list itself only on some paths (it falls back to one
    collective per tensor, e.g. when destinations differ); a flat buffer is
    one collective whatever the path. `tf.IndexedSlices` are left to
    TensorFlow (gathered, not summed).
    """
    tensors = list(tensors)
    results = [None] * len(tensors)
    groups = {}
    for index, tensor in enumerate(tensors):
        if isinstance(tensor, tf.IndexedSlices):
            results[index] = context.all_reduce(tf.distribute.ReduceOp.SUM, tensor)
        else:
            tensors[index] = tf.convert_to_tensor(tensor)
            groups.setdefault(tensors[index].dtype, []).append(index)
    for indices in groups.values():
        parts = [tensors[i] for i in indices]
        sizes = [_size(t) for t in parts]
        # A vector of known length is its own flat piece: no reshape either way.
        flat = tf.concat([t if _is_flat(t) else tf.reshape(t, [-1]) for t in parts], axis=0)
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM, flat)
        for index, part, piece in zip(indices, parts, tf.split(summed, sizes)):
            if _is_flat(part):
                results[index] = piece
                continue
            shape = part.shape if part.shape.is_fully_defined() else tf.shape(part)
            results[index] = tf.reshape(piece, shape)
    return results


def _is_flat(tensor):
    return tensor.shape.rank == 1 and tensor.shape[0] is not None


def _size(tensor):
    static = tensor.shape.num_elements()
    return static if static is not None else tf.size(tensor)


def replicas_in_sync():
    """R: the replicas in sync of the current replica context (1 outside one).

    The one answer to "how many replicas" in the step machinery (a replica's
    step, its forward pass, losses, logs and gradients). Outside a replica
    context (cross-replica context, under `strategy.scope()`), 1: nothing
    there is one replica's share. What a strategy holds, asked before the
    step, is `strategy.num_replicas_in_sync`.
    """
    context = tf.distribute.get_replica_context()
    return context.num_replicas_in_sync if context is not None else 1


def _in_symbolic_build():
    from keras_distrib import _keras_compat

    return _keras_compat.in_symbolic_scope()


def piece_order(replicas, workers):
    """The piece of each global batch that each replica receives, by replica id.

    TensorFlow cuts a global batch into `replicas` pieces in order; worker w
    takes every W-th piece, so its local replica r (global replica id
    w * local + r) gets piece r * W + w (`kd.describe_input` prints it).
    """
    local = replicas // workers
    return [(g % local) * workers + g // local for g in range(replicas)]


def _order_before(context):
    """before[me][other] = 1.0 where replica `other`'s piece of a global batch comes before `me`'s."""
    replicas = replicas_in_sync()
    devices = getattr(tf.distribute.get_strategy().extended, "worker_devices", None) or ()
    workers = max(replicas // max(len(devices), 1), 1)
    if replicas % workers:
        workers = 1
    order = piece_order(replicas, workers)
    return tf.constant(
        [[1.0 if order[other] < order[mine] else 0.0 for other in range(replicas)]
         for mine in range(replicas)]
    )


def rows_and_offsets(local_counts):
    """Each count's global sum and this replica's offset: one all-reduce of every replica's counts.

    `local_counts`: float32 counts of rows on this replica (a vector). Each
    replica's counts go in its own slot of a zero buffer, so one all-reduce
    gives every replica's, hence both the global counts and where this
    replica's rows start in each global batch (the rows of the replicas
    whose pieces come before its own, see `piece_order`).

    Returns:
        `(totals, offsets)`, float32 vectors like `local_counts`.
    """
    context = tf.distribute.get_replica_context()
    replicas = replicas_in_sync()
    if replicas == 1:
        return replica_sum(local_counts), tf.zeros_like(local_counts)
    replica_id = context.replica_id_in_sync_group
    counts = context.all_reduce(
        tf.distribute.ReduceOp.SUM, tf.one_hot(replica_id, replicas)[:, None] * local_counts[None, :]
    )
    offsets = tf.linalg.matvec(counts, tf.gather(_order_before(context), replica_id), transpose_a=True)
    return tf.reduce_sum(counts, 0), offsets


@contextlib.contextmanager
def replica_batch(local_rows, plan=None):
    """Opens this replica's `ReplicaBatch`; N is all-reduced only if read.

    Inside an open batch (e.g. a `train_step` override calling
    `self.replica_batch(x)`), the open batch is reused.
    """
    current = getattr(_STATE, "batch", None)
    if current is not None:
        yield current
        return
    static_rows = local_rows if isinstance(local_rows, int) else None
    local_rows = tf.cast(local_rows, tf.float32)
    if replicas_in_sync() == 1:
        rows = BatchRows(local_rows=local_rows, static_rows=static_rows,
                         global_rows=local_rows, offset=tf.zeros_like(local_rows))
    else:
        rows = BatchRows(local_rows=local_rows, static_rows=static_rows)
    batch = ReplicaBatch(rows=rows, plan=plan)
    _STATE.batch = batch
    try:
        yield batch
        batch.rows.finish()
    finally:
        _STATE.batch = None


def keep_losses(owner, losses):
    """Keeps the `add_loss` terms of `owner`'s latest forward pass on this thread (a replica's).

    Called after a kd model's forward pass in a hand-written loop; it also
    records the graph that pass was traced in (`in_hand_written_loop`).
    """
    kept = getattr(_STATE, "losses", None)
    if kept is None:
        kept = _STATE.losses = {}
    kept[id(owner)] = (owner, list(losses or ()))
    _STATE.loop_graph = weakref.ref(tf.compat.v1.get_default_graph())


def in_hand_written_loop():
    """Whether this thread traces a replica of a hand-written loop: a kd model's forward pass
    opened its own batch in the current graph, and no kd step is open."""
    graph = getattr(_STATE, "loop_graph", None)
    return current_batch() is None and graph is not None and \
        graph() is tf.compat.v1.get_default_graph()


def kept_losses(owner):
    """The terms `keep_losses` kept for `owner` on this thread, if traced in the current graph."""
    owner_and_losses = getattr(_STATE, "losses", {}).get(id(owner))
    if owner_and_losses is None or owner_and_losses[0] is not owner:
        return None
    losses = owner_and_losses[1]
    graph = tf.compat.v1.get_default_graph()
    if any(getattr(loss, "graph", graph) is not graph for loss in losses):
        return None
    return losses


def current_batch():
    """The `ReplicaBatch` of the step being traced on this thread, or None."""
    return getattr(_STATE, "batch", None)
