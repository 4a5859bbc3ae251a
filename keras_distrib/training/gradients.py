"""kd's gradient pipeline: the all-reduce (one, or in buckets), then the optimizer as on one device.

On one device, Keras's optimizer sees the gradient of the batch loss and
runs: unscale (loss scaling) -> accumulate (`gradient_accumulation_steps`)
-> clip (`clipnorm`, `clipvalue`, `global_clipnorm`) -> weight decay and
update -> EMA and the step counter. Keras 3 under a `tf.distribute` strategy
runs the same steps on each replica's *partial* gradient and all-reduces only
at the update: clipping then sees a fraction of the gradient (weights end up
0.3-1.7 relative off after a few steps) and accumulation crashes with
several replicas.

kd's models give their optimizer a different first step: each replica's
gradient of its loss share is summed over all replicas at once (an
all-reduce, SUM: one, or one per bucket where communication is a real part
of the step, see `buckets`), so every replica holds the gradient one device
computes.
The optimizer's own pipeline then runs unchanged, in one-device order, on
that gradient, and its own all-reduce is skipped. A non-finite value on any
replica makes the summed gradient non-finite everywhere, so a
`LossScaleOptimizer` skips the step on every replica and worker together.
"""

import logging

import keras
import tensorflow as tf

from keras_distrib import _keras_compat
from keras_distrib.training import buckets
from keras_distrib.training import coupling
from keras_distrib.training import penalties
from keras_distrib.training import replica
from keras_distrib.training import scaling
from keras_distrib.training import logs as logs_lib
from keras_distrib.cluster import strategies

__all__ = [
    "SparseGradientInLoop",
    "all_reduce",
    "apply_reduced",
    "bucket_plan",
    "check_loop_target",
    "exact_optimizer",
    "install",
    "optimizers_of",
    "overrides_apply_gradients",
    "report_bucket_plan",
]

logger = logging.getLogger("keras_distrib")


class SparseGradientInLoop(Exception):
    """A sparse gradient met inside a compiled multi-step loop, where kd cannot gather it.

    TensorFlow fixes the shape of a collective at its first loop iteration,
    and gathering sparse (`tf.IndexedSlices`) gradients changes shape with
    the batch. With every replica in this process kd gathers them without a
    collective (see `gradients.all_reduce`); across worker processes, or in
    an XLA-compiled step, the step runs one step per compiled call instead.
    """


@tf.autograph.experimental.do_not_convert
def all_reduce(gradients, variables=None):
    """Sums per-replica gradients over every replica (one all-reduce).

    Sparse gradients (`tf.IndexedSlices`, from `Embedding`) are gathered,
    not summed densely: every replica's slices, in replica order, as one
    device holds them for the whole batch (Keras's optimizers treat repeated
    indices slice by slice: Adam squares each one). `None` entries stay
    `None`. Outside a replica context, or with one replica in sync, returns
    `gradients`.

    Inside a step looped in one compiled function (`steps_per_execution`,
    `steps_per_loop`), sparse gradients are concatenated on one device in
    cross-replica context instead of gathered by a collective, in replica
    order.

    In a kd model's own training step, whose loss shares are in deferred
    scale (each replica's R x n_r rows standing for the global N), the same
    all-reduce carries the row count and divides by it: one collective per
    step.

    Where the step's `bucket_plan` says so, the gradients are summed in
    buckets (`buckets.split`), last layers first, each its own collective
    started as soon as the backward pass has produced its gradients; the
    row count and the metric states ride in the first bucket. Each element
    is summed over the replicas as in one all-reduce.

    Args:
        gradients: A list of this replica's gradients (tensors,
            `tf.IndexedSlices` or `None`).
        variables: The variables they are the gradients of, in the same
            order (optional). A step whose batch records its global
            gradients (`ReducedState.recorded_gradients`, the first-step
            check) records them with their variables.

    Returns:
        The global gradients, in the same order.

    Raises:
        SparseGradientInLoop: a sparse gradient in a looped step across
            worker processes, or in an XLA-compiled step. TensorFlow fixes
            the shape of a collective at its first loop iteration, and a
            gather's shape changes with the batch; kd's step then runs one
            step per call instead.
    """
    summed = _summed(list(gradients))
    batch = replica.current_batch()
    if batch is not None and batch.reduced.recorded_gradients is not None and variables is not None:
        batch.reduced.recorded_gradients.append((list(variables), summed))
    return summed


def _summed(gradients):
    if replica.replicas_in_sync() == 1:
        return gradients
    context = tf.distribute.get_replica_context()
    present = [g for g in gradients if g is not None]
    if not present:
        return gradients
    batch = replica.current_batch()
    if batch is not None and batch.plan.looped and any(
        isinstance(g, tf.IndexedSlices) for g in present
    ):
        return _all_reduce_in_loop(context, batch, gradients)
    if batch is not None and batch.own_step.deferred:
        present = _all_reduce_deferred(context, batch, present)
    else:
        if batch is not None:
            kind, batch.reduced.gradient_kind = batch.reduced.gradient_kind, None
            if kind is None and batch.loss.shares:
                kind = replica.SHARE  # no target classified (gradients of a share kd computed)
            if kind != replica.SHARE:
                present = scaling.row_weighted_gradients(batch, present, kind)
        present, _ = _sum_in_buckets(context, batch, present)
    summed = iter(present)
    return [None if g is None else next(summed) for g in gradients]


def _all_reduce_deferred(context, batch, gradients):
    """All-reduces gradients of loss shares in deferred scale, with the row count.

    Each replica's gradient is of its share times N / (R * n_r) (see
    `scaling.defer`): multiplied by R * n_r, summed, and divided
    by N, which travels in the same all-reduce, it is the gradient one
    device computes. One collective: nothing in the step waited for N.
    """
    dtype = next((g.dtype for g in gradients if g.dtype.is_floating), tf.float32)
    scaled = scaling.to_own_scale(batch, gradients)
    summed, (global_rows,) = _sum_in_buckets(context, batch, scaled, [tf.cast(batch.rows.local_rows, dtype)])
    batch.rows.learn_global_rows(global_rows)
    return scaling.divided(summed, global_rows)


def bucket_plan(model, gradient_bytes, strategy=None):
    """The `buckets.BucketPlan` of `model`'s steps, for `gradient_bytes` of dense gradients.

    `model`'s `gradient_buckets` (a kd model's `compile` argument; `"auto"`
    for any other model, or none: a hand-written loop) under `strategy`'s
    workers (the current strategy by default).
    """
    setting = getattr(model, "gradient_buckets", buckets.AUTO) if model is not None else buckets.AUTO
    return buckets.choose(setting, gradient_bytes=gradient_bytes,
                          workers=strategies.traits(strategy).workers)


def report_bucket_plan(model):
    """Logs (INFO, logger `keras_distrib`) how `model`'s training steps all-reduce; returns the plan.

    Called once at the start of `fit`, with the bytes of the model's
    trainable weights (its gradients' size). Nothing is logged with one replica.
    """
    strategy = model.distribute_strategy
    if strategy.num_replicas_in_sync < 2:
        return None
    sizes = [_bytes(v) for v in model.trainable_variables]
    plan = bucket_plan(model, sum(sizes), strategy)
    logger.info(plan.describe(len(buckets.split(sizes, plan.bucket_bytes))))
    return plan


def _bytes(tensor):
    """Bytes of a dense tensor of known shape (0 for sparse gradients or unknown shapes)."""
    if isinstance(tensor, tf.IndexedSlices):
        return 0
    count = tensor.shape.num_elements()
    return 0 if count is None else count * tf.as_dtype(tensor.dtype).size


def _sum_in_buckets(context, batch, gradients, extra=()):
    """Sums `gradients` (in the model's variable order) and `extra` over the replicas.

    In the buckets of the step's `bucket_plan` (one bucket unless it says
    otherwise), each one collective per dtype (`replica.sum_packed`); `extra`
    (the row count) and the metric states ride in the first bucket, whose
    gradients the backward pass produces first.

    Returns:
        `(summed gradients, summed extra)`, each a list in its input's order.
    """
    gradients, extra = list(gradients), list(extra)
    sizes = [_bytes(g) for g in gradients]
    plan = bucket_plan(batch.step.model if batch is not None else None, sum(sizes))
    groups = buckets.split(sizes, plan.bucket_bytes) or [[]]
    results = [None] * len(gradients)
    summed_extra = []
    for number, indices in enumerate(groups):
        riders = extra if number == 0 else []
        summed = _sum_with_metric_states(
            context, batch if number == 0 else None, [gradients[i] for i in indices] + riders)
        for index, value in zip(indices, summed):
            results[index] = value
        if number == 0:
            summed_extra = summed[len(indices):]
    return results, summed_extra


def _sum_with_metric_states(context, batch, tensors):
    """Sums `tensors` over the replicas, with the metric states kd's step packed in.

    kd's own `train_step` updates its metrics before the update and leaves
    their variables on the replica's batch (`OwnStep.metric_variables`):
    each replica's local state rides in the same all-reduce, and the global
    state (what a read in cross-replica context sums) is kept on the batch
    for the step's logs (`ReducedState.global_metric_states`). The logs then
    cost no collective of their own.
    """
    variables = batch.own_step.metric_variables if batch is not None else None
    # Updates waiting for N (a per-output loss tracker in deferred scale) add
    # to the states after this all-reduce: the logs are read after the step then.
    if not variables or batch.rows.waits_for_global_rows or not logs_lib.packs_metric_states(variables):
        return replica.sum_packed(context, tensors)
    summed, batch.reduced.global_metric_states = logs_lib.sum_with_metric_states(context, tensors, variables)
    return summed


def classify_gradient_target(target, sources=()):
    """Classifies how `tape.gradient`'s `target` adds up over replicas, in a kd step (or refuses it).

    Records the kind on the replica's batch (`ReducedState.gradient_kind`),
    which `all_reduce` reads. In a hand-written loop's replica (no kd step,
    a kd model's forward pass traced), a target whose gradient, summed over
    the replicas, is not one device's is refused instead
    (`check_loop_target`).

    A loss share kd computed is summed over replicas as it is. Any other
    target (plain ops on the replica's rows) is classified from its graph
    (`penalties.kind_of`): a sum over rows is summed over replicas as it is;
    a loss computed on the global batch kd gathered adds 1/R of each
    replica's gradient; where the rows of the batch meet in it (an in-batch
    contrastive loss written in the step), or it passes an op kd cannot
    read, kd gathers the tensors it starts from and traces the step again,
    or refuses it naming the op (`coupling.inline`); one that mixes the
    replica's rows with per-replica random draws has no exact split and is
    refused, naming the op. A mean over rows, or a term of the weights,
    is weighted by n_r / N (`scaling.row_weighted_gradients`).
    """
    batch = replica.current_batch()
    if batch is None and replica.in_hand_written_loop():
        check_loop_target(target, sources)
        return
    if batch is None or replica.replicas_in_sync() == 1 \
            or tf.executing_eagerly() or not isinstance(target, tf.Tensor):
        return
    if replica.is_share(target):
        batch.reduced.gradient_kind = replica.SHARE
        return
    kind = penalties.kind_of(target)
    if kind == penalties.SHARE:  # shares kd computed, scaled by constants or summed
        batch.reduced.gradient_kind = replica.SHARE
        return
    if isinstance(kind, penalties.Unknown):
        if batch.step.rows_meet != "global":
            # Compiled to keep Keras's per-replica rows: shares summed as
            # they are, anything else taken as a mean of the replica's rows.
            batch.reduced.gradient_kind = replica.SHARE if batch.loss.shares else None
            return
        if kind.mixing and not kind.meets:
            raise ValueError(
                f"The loss whose gradient the step takes is not one kd can split over "
                f"{replica.replicas_in_sync()} replicas: {kind.mixing}. One device computes it "
                "from the whole batch; each replica would compute it from its own rows. Compute "
                "the loss with self.compute_loss(...), a Keras loss object, "
                "kd.losses.global_mean(per_example_loss), or tf.reduce_mean / tf.reduce_sum of "
                "per-row terms."
            )
        # Rows meet, or an op kd cannot read: the tensors it starts from
        # are gathered at the next trace, or it is refused.
        coupling.inline(kind, batch, "the loss whose gradient the step takes", target.graph)
    if kind in (penalties.ROW_SUM, penalties.GLOBAL):
        batch.reduced.gradient_kind = kind
    elif batch.loss.shares:
        batch.reduced.gradient_kind = replica.SHARE
    else:
        batch.reduced.gradient_kind = None


def check_loop_target(target, sources=()):
    """Refuses a hand-written loop's loss whose gradient, summed over the replicas, is not one device's.

    A hand-written loop's optimizer sums the replicas' gradients (Keras's
    own all-reduce, or kd's: `exact_optimizer`), so each term of the loss
    must add up over the replicas to one device's value of it. Read term
    by term (`penalties.loss_terms`):

    - a share kd computed (`kd.losses.global_mean`,
      `kd.losses.scale_regularization`), or a sum over the replica's rows
      times constants (`tf.reduce_sum(x) / GLOBAL_BATCH`,
      `tf.nn.compute_average_loss(x, global_batch_size=GLOBAL_BATCH)`):
      the replicas' values add up to the global batch's;
    - a term of the weights alone, or one computed on the global batch
      (the same on every replica), divided by R once
      (`tf.nn.scale_regularization_loss(...)`): its R copies add up to one;
    - refused: a mean over the replica's rows (`tf.reduce_mean`): R of them
      count R times, and divided by R (`tf.nn.compute_average_loss`
      without `global_batch_size`) they weigh a replica of 1 row as one
      of 16 on an uneven last batch; a term of the weights not divided by
      R once (`sum(model.losses)`); a term kd cannot split (rows meeting,
      an op it cannot read).

    Only a gradient with respect to variables (the loss's) is read, on
    several replicas, in a traced function.

    Raises:
        ValueError: naming every refused term, what is wrong and the fix.
    """
    replicas = replica.replicas_in_sync()
    if replicas == 1 or tf.executing_eagerly():
        return
    if not any(isinstance(s, (tf.Variable, keras.Variable)) for s in tf.nest.flatten(sources)):
        return  # a gradient with respect to inputs (a gradient penalty) is not summed
    named = {}  # what is wrong -> the terms it is wrong with
    for tensor in tf.nest.flatten(target):
        if not isinstance(tensor, tf.Tensor) or not hasattr(tensor, "op"):
            continue
        for term in penalties.loss_terms(tensor, replicas):
            problem = _loop_term_problem(term, replicas)
            if problem:
                named.setdefault(problem, []).append(f"`{term.tensor.op.name}`")
    problems = [f"{', '.join(names)} {'is' if len(names) == 1 else 'are each'} {problem}"
                for problem, names in named.items()]
    if problems:
        raise ValueError(
            f"The loss whose gradient a hand-written loop takes on {replicas} replicas does not "
            "add up to one device's loss: the optimizer sums the replicas' gradients, so each "
            "term must be this replica's share of the global batch's value. "
            + " ".join(problems) + " kd's recipe: `kd.losses.global_mean(per_example_loss) + "
            "kd.losses.scale_regularization(model.losses, local_rows=tf.shape(x)[0])` (exact "
            "on any split, an uneven last batch included); TensorFlow's: "
            "`tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH) + "
            "tf.nn.scale_regularization_loss(model.losses)`; or train with `kd.TrainLoop` (see "
            "the hand-written loops guide)."
        )


def _loop_term_problem(term, replicas):
    """What is wrong with one term of a hand-written loop's loss, in words ("" where nothing is)."""
    kind, power = term.kind, term.replica_power
    if kind in (penalties.SHARE, penalties.ROW_SUM):
        return ""
    if kind in (penalties.FIXED, penalties.GLOBAL):
        if power == -1:
            return ""
        what = "a term of the weights alone (e.g. `sum(model.losses)`'s weight regularization)" \
            if kind == penalties.FIXED else "a term computed on the global batch"
        scale = "not divided by the replicas" if power == 0 else \
            f"scaled by the replicas to the power {power}, not -1"
        return (f"{what}, the same on every replica, {scale}: its gradient counts "
                f"{replicas ** (power + 1):g} times. Divide it by the {replicas} replicas once "
                "(`tf.nn.scale_regularization_loss(term)`), or take "
                "`kd.losses.scale_regularization([term], local_rows=tf.shape(x)[0])`.")
    if kind == penalties.ROW_MEAN:
        if power == -1:
            return (f"a mean over this replica's rows divided by the {replicas} "
                    "replicas (what `tf.nn.compute_average_loss(per_example_loss)` gives without "
                    "`global_batch_size=`, or `tf.nn.scale_regularization_loss` of an activity "
                    "regularizer's mean): exact only when every replica has as many rows; on an "
                    "uneven batch (the last one) a replica of few rows weighs as one of many. Pass "
                    "`global_batch_size=` (the global batch's row count) to "
                    "`tf.nn.compute_average_loss`, or take `kd.losses.global_mean(per_example_loss)` "
                    "(and `kd.losses.scale_regularization` for `add_loss` terms).")
        scale = f"about {replicas} times" if power == 0 else \
            f"scaled by the replicas to the power {power + 1}, about {replicas ** (power + 1):g} times"
        return ("a mean over this replica's rows (e.g. "
                "`tf.reduce_mean(per_example_loss)`): each replica's mean weighs as the whole "
                f"batch's, so the summed gradient is {scale} one device's. Take "
                "`kd.losses.global_mean(per_example_loss)` (or `tf.nn.compute_average_loss("
                "per_example_loss, global_batch_size=GLOBAL_BATCH)`).")
    if isinstance(kind, penalties.Unknown):
        return (f"a term kd cannot split over the replicas: {kind.why}. Compute the loss from "
                "per-row terms (gathering with `kd.losses.global_batch(tensor)` where the rows "
                "meet).")
    return f"a value kd cannot split over the replicas ({kind})."


def _all_reduce_in_loop(context, batch, gradients):
    """`all_reduce` for a step inside a compiled loop, with sparse gradients.

    A collective keeps the shape of its first loop iteration, and a gather's
    shape changes with the batch (an uneven last batch, an empty replica),
    so the sparse gradients are not gathered by a collective: the dense ones
    are summed as always (with the row count, in deferred scale), and the
    sparse ones concatenated in cross-replica context on one device
    (`tf.distribute.ReductionToOneDevice`: every replica's slices, in
    replica order, as a collective gather gives them), which any shape can
    take. That needs every replica in this process; across worker
    processes, or inside an XLA cluster, the step runs one step per call
    instead.
    """
    strategy = tf.distribute.get_strategy()
    if strategies.traits(strategy).is_multi_worker or _keras_compat.in_xla_context():
        raise SparseGradientInLoop("sparse gradients cannot be gathered inside a compiled loop")
    sparse = [g for g in gradients if isinstance(g, tf.IndexedSlices)]
    dense = [g for g in gradients if g is not None and not isinstance(g, tf.IndexedSlices)]
    if batch.own_step.deferred:
        sparse = [scaling.map_values(g, lambda v: v * scaling.own_scale(batch, v.dtype)) for g in sparse]
        dense = _all_reduce_deferred(context, batch, dense)
    elif dense:
        dense, _ = _sum_in_buckets(context, batch, dense)
    gathered = context.merge_call(_concat_slices, args=tuple(sparse))
    if batch.own_step.deferred:
        gathered = scaling.divided(gathered, batch.rows.global_rows)  # N learnt in the dense all-reduce
    summed, gathered = iter(dense), iter(gathered)
    return [
        None if g is None else next(gathered) if isinstance(g, tf.IndexedSlices) else next(summed)
        for g in gradients
    ]


def _concat_slices(strategy, *per_replica):
    # Cross-replica context: each argument holds every replica's slices.
    concat = tf.distribute.ReductionToOneDevice()
    return concat.batch_reduce(tf.distribute.ReduceOp.SUM, [(v, v) for v in per_replica])


def _build_outside_replicas(optimizer, variables):
    """Builds an unbuilt `optimizer` on `variables` once, for every replica.

    Keras builds an optimizer at its first `apply`. In a hand-written loop
    that is inside `strategy.run`, on a replica's thread while a function is
    traced: the slot variables (Adagrad's accumulators, Adam's moments) then
    take their initial values from that replica's graph, and the first step
    fails with "You must feed a value for placeholder tensor". kd builds the
    optimizer in cross-replica context instead (one `merge_call`), lifted out
    of the function under the strategy's scope, as `optimizer.build` in the
    scope before the loop would. Nothing happens when the optimizer is built,
    outside a replica context, or without a strategy.
    """
    if optimizer.built or variables is None or not tf.distribute.has_strategy():
        return
    if tf.distribute.in_cross_replica_context():
        return
    variables = list(variables)

    @tf.autograph.experimental.do_not_convert  # merge_call would convert it in a user's loop
    def build(strategy):
        if optimizer.built:
            return
        with tf.init_scope(), strategy.scope():
            optimizer.build(variables)
            optimizer.built = True

    tf.distribute.get_replica_context().merge_call(build)


def exact_optimizer(optimizer):
    """Gives a Keras optimizer kd's gradient pipeline; returns the optimizer.

    kd models do this when they compile. Call it yourself for the optimizer
    of a hand-written loop: its `apply_gradients` then sums the replicas'
    gradients first and clips, accumulates and unscales the global gradient,
    as one device does. It needs no `optimizer.build` first: an unbuilt
    optimizer builds its slots once, for every replica, at the first step.
    Idempotent; other optimizers are not affected.

    Args:
        optimizer: A `keras.optimizers.Optimizer` (a `LossScaleOptimizer`
            included), created in the strategy's scope.

    Returns:
        `optimizer` itself.

    Raises:
        TypeError: `optimizer` is not a Keras optimizer.

    Examples:
        >>> import keras, keras_distrib as kd
        >>> optimizer = kd.exact_optimizer(keras.optimizers.SGD(0.1, global_clipnorm=1.0))
        >>> optimizer is kd.exact_optimizer(optimizer)
        True
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"`optimizer` must be a keras.optimizers.Optimizer, got {type(optimizer).__name__}. "
            "Create it with keras.optimizers (e.g. keras.optimizers.Adam(1e-3))."
        )
    _keras_compat.install_gradient_pipeline(optimizer, all_reduce, _build_outside_replicas)
    return optimizer


def apply_reduced(optimizer, grads, variables):
    """Updates `variables` through `optimizer` with gradients `all_reduce` summed.

    kd's own `train_step` all-reduces at its own call and applies here:
    Keras's `apply` (unscale, accumulate, clip, update, in one-device order)
    with the optimizer's own reduction skipped, as kd's pipeline does after
    its all-reduce in a user's `optimizer.apply_gradients(...)`.

    Args:
        optimizer: A Keras optimizer (given kd's pipeline here if it has
            not got it).
        grads: The global gradients, from `all_reduce`.
        variables: The variables they are the gradients of.
    """
    exact_optimizer(optimizer)
    variables = list(variables)
    _build_outside_replicas(optimizer, variables)
    _keras_compat.apply_reduced(optimizer, list(grads), variables)


def overrides_apply_gradients(optimizer):
    """Whether `optimizer`'s class overrides Keras's `apply_gradients` (its own step then calls it)."""
    return type(optimizer).apply_gradients is not keras.optimizers.Optimizer.apply_gradients


def install(optimizer):
    """`exact_optimizer` for a model's optimizer, which may be None.

    Args:
        optimizer: A Keras optimizer, or `None` (a model not compiled with one).

    Returns:
        `optimizer` itself.
    """
    if optimizer is not None:
        exact_optimizer(optimizer)
    return optimizer


def optimizers_of(model):
    """Every Keras optimizer `model` holds as an attribute (a GAN's two, say), each once."""
    found = []
    for value in vars(model).values():
        values = value if isinstance(value, (list, tuple)) else [value]
        found.extend(v for v in values if isinstance(v, keras.optimizers.Optimizer)
                     and all(v is not f for f in found))
    return found
