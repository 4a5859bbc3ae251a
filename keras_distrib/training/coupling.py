"""Where the rows of a batch meet: found when a step is first traced, computed on the global batch.

Most training code treats each row of a batch on its own: a row's loss
depends on its own inputs, and kd splits the global batch over replicas
exactly (`losses`, `gradients`). Contrastive and retrieval code does not:
in-batch negatives compare every row with every other (`x @ y^T`), labels
number the rows (`arange(batch_size)`), a mined triplet loss picks each
row's hardest partner in the batch, a layer normalizes over the batch's
rows. On a replica those see only the replica's rows: plain Keras silently
trains another model there.

kd finds these places from the graph (`penalties`: the op where rows meet,
named) at the first trace of a step, at four kinds of site:

- a layer's `call` (a layer of one's own, a functional model's own ops),
  whose outputs or `add_loss` terms mix its input rows: the layer runs on
  the global batch and each replica keeps its rows (`LAYER`: the gather's
  gradient is all-reduced back, as BatchNormalization's statistics are);
- a loss kd calls (compiled losses, Keras loss objects in a custom step)
  and a `compute_loss` of one's own: computed on the global batch, the same
  value on every replica, returned as each replica's share of it;
- what a custom `train_step` computes itself (a contrastive loss written
  inline, its metrics): kd finds the tensors it starts from (the outputs of
  the model and of its sub-models, the batch's data) and gathers those
  (`ANCHOR`); everything computed from them alone is GLOBAL;
- the public `global_batch` helper, for hand-written code.

Gathering: one all-reduce of every gathered tensor's row count (with the
batch's own, when not known yet) and one of the rows, each replica's at its
offset in global row order, zeros elsewhere (exact: adding zeros changes no
bit). Where every replica then computes the same value (`GLOBAL`), a
replica's gradient reaches only its own rows, R times (each replica's share
is 1/R of the value): no collective in the backward pass. A layer's own rows
kept from a global computation need the true gradient of the gather: an
all-reduce in the backward pass, chained with BatchNormalization's so every
replica creates them in one order.

When a step is traced by kd's `Step`, a site seen for the first time that
meets rows raises `RowsMeet` after recording what to gather, and the step is
traced again; in a loop of one's own (no kd step to trace again) the site
computes on the global batch at once. A model compiled with
`rows_meet="per_replica"` keeps each replica's rows (Keras's behaviour).
"""

import contextlib
import weakref

import tensorflow as tf
from keras import tree

from keras_distrib.training import penalties
from keras_distrib.training import replica

__all__ = [
    "GatherInLoop",
    "MODES",
    "ROWS_REFUSAL",
    "RowsMeet",
    "anchor",
    "call_on_global_batch",
    "gather",
    "global_batch",
    "global_indices",
    "inline",
    "layer_call",
    "mark_layout",
    "meets",
    "meets_at_any",
    "on_global_batch",
    "on_replica_rows_first",
    "planned_data",
    "request_anchors",
    "row_layout",
    "rows_meet_in",
]

MODES = ("global", "per_replica")

# Said (and raised as a ValueError by kd's step) when a layer computed on the
# global batch returns another number of rows than it was given.
ROWS_REFUSAL = (
    "kd: a layer whose rows meet returned a different number of rows than the global batch it "
    "was given, so kd cannot give each replica its own rows of it."
)

_CLEAN = "clean"
_GLOBAL = "global"


class GatherInLoop(Exception):
    """A gather inside a compiled loop of several steps: kd's step runs one step per call then.

    TensorFlow fixes the shape of a collective at its first loop iteration,
    and a gathered batch's rows change with the batch (an uneven last batch).
    """


class RowsMeet(Exception):
    """Raised while a step is traced: rows meet where kd had not looked; it traces the step again.

    Its message says where (for the error if tracing again does not help).
    """


# Decisions, per site object: {site: {key: (decision, graph it was made in)}}.
_DECISIONS = weakref.WeakKeyDictionary()
# Tensors to gather in a custom step, per model: {model: {(step kind, anchor key)}}.
_ANCHORS = weakref.WeakKeyDictionary()


def _decision(site, key):
    """The decision for `site` if made while tracing another graph (a trace of this graph decides again)."""
    entry = _DECISIONS.get(site, {}).get(key)
    if entry is None:
        return None
    decision, graph = entry
    # Within one trace every replica runs the same trial (the same collectives).
    if graph is not None and graph() is tf.compat.v1.get_default_graph():
        return None
    return decision


def meets_at_any(sites):
    """Whether kd computes on the global batch at any of `sites` (layers, loss objects, models)."""
    return any(decision != _CLEAN for site in sites
               for decision, _ in _DECISIONS.get(site, {}).values())


def _decide(site, key, decision):
    graph = tf.compat.v1.get_default_graph()
    _DECISIONS.setdefault(site, {})[key] = (decision, weakref.ref(graph))


def _active(batch):
    """Whether rows may meet across replicas in `batch`'s step (and kd handles them)."""
    return batch is not None and not batch.coupling.global_region and replica.replicas_in_sync() > 1 \
        and batch.step.rows_meet == "global" and not tf.executing_eagerly()


def meets(values, statistics=False):
    """The first place in `values` (a structure of tensors) kd computes on the global batch, or None.

    Where the batch's rows meet (`penalties.Unknown.meets`), and where a
    value passes an op kd cannot read (`Unknown.unread`): on the global
    batch every replica computes what one device computes, whatever the op
    does with the rows. (A per-replica random draw of a plain Keras model,
    `Unknown.mixing` alone, is left to the sites that refuse it.)

    `statistics`: a statistic of the rows (a sum or mean over them) counts
    too, as it does where a layer returns one: the layer that consumes it
    combines it with rows.
    """
    for value in tree.flatten(values):
        if isinstance(value, tf.Tensor) and value.dtype != tf.resource:
            kind = penalties.kind_of_value(value)
            if isinstance(kind, penalties.Unknown) and kind.on_global_batch:
                return kind
            if statistics and kind in (penalties.ROW_SUM, penalties.ROW_MEAN):
                return penalties.Unknown(
                    value.op.name, f"`{value.op.name}` ({value.op.type}) is a statistic of the "
                    "batch's rows that the layer returns", meets=True)
    return None


def _row_aligned(values, what):
    """The positions in `values` (flat) of tensors holding the replica's rows.

    A tensor whose rows already meet, or that passed an op kd cannot read,
    cannot be gathered into the global batch's rows: refused, naming `what`
    takes it (the policy of `penalties.refusal`).
    """
    positions = []
    for index, value in enumerate(values):
        if isinstance(value, tf.Tensor) and value.shape.rank and value.dtype != tf.resource:
            kind = penalties.kind_of_value(value)
            if kind in (penalties.ROWS, penalties.ROW_BLOCKS):
                positions.append(index)
            elif isinstance(kind, penalties.Unknown) and kind.on_global_batch:
                raise ValueError(penalties.refusal(kind, what, replica.replicas_in_sync()))
    return positions


# ---------------------------------------------------------------------------
# Where a tensor's rows lie in the global batch.

# A layout: the data leaves a tensor's rows come from, block after block
# (`(0,)`: the batch's own rows; `(0, 2)`: leaf 0's rows, then leaf 2's, as
# `concat([x, z])` stacks them; `(0, 0)`: two blocks of the batch, a GAN's
# generated and real images). One device holds, for a layout, every
# replica's rows of each block in turn. `penalties.NO_ROWS`: weights and
# constants. `penalties.layout_of_op` reads an op's layout from its inputs'.


def mark_layout(tensor, layout, batch=None):
    """Records that `tensor`'s rows have `layout` (kd's own outputs: padded, laid out, drawn)."""
    batch = batch if batch is not None else replica.current_batch()
    if batch is not None and isinstance(tensor, tf.Tensor) and layout is not None:
        batch.coupling.layouts[tensor.ref()] = layout
    return tensor


def row_layout(tensor, batch):
    """The layout of `tensor`'s rows (see `penalties.NO_ROWS`), or None where kd cannot tell.

    Read from the graph with the op table that also gives each tensor its
    kind (`penalties.OPS`, `penalties.layout_of_op`): the step's data
    leaves, concatenations along the rows, and the ops that keep each row
    its own (elementwise ops, matrix products with weights, convolutions,
    reshapes that keep the rows); an op the table does not read has no
    layout (kd then counts the rows instead, see `gather`); a
    tensor kd made (a padded batch, a random layer's output) has its layout
    recorded. A row count (`tf.shape(x)[0]`) has the layout of `x`.
    """
    memo = batch.coupling.layouts
    leaves = {leaf.ref(): (index,) for index, leaf in enumerate(batch.rows.leaves)}
    stack = [(tensor, False)]
    while stack:
        value, ready = stack.pop()
        key = value.ref()
        if key in memo:
            continue
        if key in leaves:
            memo[key] = leaves[key]
            continue
        op = value.op
        if penalties.holds_no_rows(op.type) or value.dtype == tf.resource or (
                op.type == "Placeholder" and key not in leaves) or not op.inputs:
            memo[key] = penalties.NO_ROWS if op.type != "Placeholder" or value.dtype == tf.resource else None
            continue
        pending = [t for t in op.inputs if t.ref() not in memo]
        if not ready and pending:
            stack.append((value, True))
            stack.extend((t, False) for t in pending)
            continue
        memo[key] = penalties.layout_of_op(op, value, [memo.get(t.ref()) for t in op.inputs])
    return memo[tensor.ref()]


def global_indices(layout, batch):
    """Where this replica's rows of a tensor with `layout` lie in one device's, and that tensor's rows.

    Returns `(indices, total, rows)`: int32 indices of this replica's rows in
    the global tensor, the global tensor's row count, and this replica's.
    """
    local, totals, offsets = batch.rows.leaf_rows()
    indices, base = [], tf.constant(0, tf.int32)
    for leaf in layout:
        indices.append(base + offsets[leaf] + tf.range(local[leaf]))
        base += totals[leaf]
    rows = tf.add_n([local[leaf] for leaf in layout])
    return tf.concat(indices, 0), base, rows


# ---------------------------------------------------------------------------
# The gather.


def _summable(value):
    """`value` as a dtype the all-reduce sums exactly, and the way back."""
    if value.dtype.is_floating:
        return value, lambda v: v
    dtype = value.dtype
    return tf.cast(value, tf.float64), lambda v: tf.cast(v, dtype)


def _counted_layouts(values, batch):
    """Global indices for values kd cannot lay out: one all-reduce of their own row counts.

    Their rows then come in replica order (each replica's block at its
    offset in global row order), exact for what does not depend on the
    order of rows (a contrastive loss over rows that are concatenated from
    several batches, say).
    """
    # Inside a forward pass on one padded row (a replica without rows), none are real.
    live = 1 - tf.cast(batch.forward.padded[-1], tf.int32) if batch.forward.padded else 1
    local = tf.cast(tf.stack([tf.shape(v)[0] * live for v in values]), tf.float32)
    totals, offsets = replica.rows_and_offsets(local)
    totals, offsets, local = (tf.cast(t, tf.int32) for t in (totals, offsets, local))
    return [(offsets[i] + tf.range(local[i]), totals[i], local[i]) for i in range(len(values))]


def gather(values, batch, *, own_gradient):
    """Every replica's rows of each of `values`, in global row order; and this replica's offsets.

    Args:
        values: Tensors whose first axis holds this replica's rows (a
            replica without rows of the step contributes none, whatever its
            tensors hold: kd feeds it one padded row).
        batch: The replica's `ReplicaBatch`.
        own_gradient: True where every replica then computes the same
            value from the gathered tensors: a replica's gradient reaches
            only its own rows, R times (each replica's share is 1/R of that
            value), and the backward pass needs no collective. False for the
            true gradient of the gather (an all-reduce of the gradient),
            where each replica keeps its own rows of what it computes.

    Returns:
        `(gathered, places)`: the gathered tensors (the same on every
        replica, marked GLOBAL) and, for each, `(indices, rows)`: where this
        replica's rows lie in it, and how many it has.

    A tensor whose rows kd can lay out (`row_layout`: the step's data and
    what is computed row by row from it) takes one device's order, from the
    step's row counts (one all-reduce per step, shared); others cost one
    all-reduce of their row counts and come in replica order.
    """
    context = tf.distribute.get_replica_context()
    replicas = replica.replicas_in_sync()
    if batch.plan.looped:
        raise GatherInLoop("the global batch cannot be gathered inside a compiled loop")
    values = [tf.convert_to_tensor(v) for v in values]
    layouts = [row_layout(v, batch) for v in values]
    places = [None] * len(values)
    counted = [i for i, layout in enumerate(layouts) if not layout]
    for index, place in zip(counted, _counted_layouts([values[i] for i in counted], batch)
                            if counted else ()):
        places[index] = place
    for index, layout in enumerate(layouts):
        if layout:
            places[index] = global_indices(layout, batch)
    placed, back = [], []
    for value, (indices, total, rows) in zip(values, places):
        summable, restore = _summable(value[:rows])  # a padded row of a replica without rows goes
        buffer = tf.scatter_nd(indices[:, None], summable,
                               tf.concat([[total], tf.shape(summable)[1:]], 0))
        placed.append(buffer)
        back.append(restore)
    if not own_gradient:
        placed = [batch.collectives.chain(p) for p in placed]
    summed = replica.sum_packed(context, placed)
    if not own_gradient:
        batch.collectives.after_collective(summed[0])
    gathered = []
    for index, (value, total) in enumerate(zip(placed, summed)):
        if own_gradient and values[index].dtype.is_floating:
            # The value of the sum; the gradient of this replica's own rows, R times.
            total = tf.stop_gradient(total) + (value - tf.stop_gradient(value)) * replicas
        result = back[index](total)
        result.set_shape(tf.TensorShape([None]).concatenate(values[index].shape[1:]))
        gathered.append(penalties.mark_gathered(result))
    return gathered, [(indices, rows) for indices, _, rows in places]


# ---------------------------------------------------------------------------
# Sites.


@contextlib.contextmanager
def _global_region(batch):
    batch.coupling.global_region += 1
    try:
        yield
    finally:
        batch.coupling.global_region -= 1


def _retrace_or_go_on(batch, site, key, where, decision=_GLOBAL):
    """Records that rows meet at `site`; raises RowsMeet where kd's step can trace again."""
    _decide(site, key, decision)
    if batch.step.retraceable:
        raise RowsMeet(where.why)


def call_on_global_batch(site, function, args, *, share_scalars=False):
    """`function(*args)`, on the global batch where the rows of its arguments meet in it.

    A loss of kd's or one's own (`compute_loss`, a Keras loss): the first
    time, it runs on the replica's rows and kd reads its result's graph; if
    rows meet, the row-aligned tensors among `args` are gathered and it runs
    again inside the global region, where kd's own sites leave the global
    batch alone. `site` keys the decision (the loss object, the model).
    The three steps, for a caller that writes them out:
    `on_replica_rows_first`, `rows_meet_in`, `on_global_batch`.

    Returns:
        `(result, on_global_batch)`. With `share_scalars`, a scalar result
        computed on the global batch comes back as this replica's share of
        it (1/R, recorded as a share); other results are GLOBAL.
    """
    if on_replica_rows_first(site):
        result = function(*args)
        if not rows_meet_in(site, result):
            return result, False
    with on_global_batch(site, args) as global_args:
        result = function(*global_args)
    if share_scalars:
        batch = replica.current_batch()
        result = tree.map_structure(lambda v: _as_share(v, batch), result)
    return result, True


def on_replica_rows_first(site):
    """Whether a call at `site` runs on the replica's rows first (then `rows_meet_in` reads it).

    False where kd already knows, in this trace, that the rows meet there:
    the call runs `on_global_batch` straight away.
    """
    return not _active(replica.current_batch()) or _decision(site, "call") in (None, _CLEAN)


def rows_meet_in(site, result):
    """Whether the rows of the batch meet in `result`, what a call at `site` returned on the replica's rows.

    Decided once per trace from `result`'s graph (`meets`). Where they meet,
    kd's step traces again where it can (`RowsMeet`); otherwise the call
    runs again `on_global_batch`.
    """
    batch = replica.current_batch()
    if not _active(batch) or _decision(site, "call") == _CLEAN:
        return False
    where = meets(result)
    if where is None:
        _decide(site, "call", _CLEAN)
        return False
    _retrace_or_go_on(batch, site, "call", where)
    return True


@contextlib.contextmanager
def on_global_batch(site, args):
    """Yields `args` with their row-aligned tensors gathered from every replica, in the global region.

    A call at `site` made inside runs on the global batch, where kd's own
    sites leave the global batch alone.
    """
    batch = replica.current_batch()
    flat = tree.flatten(args)
    positions = _row_aligned(flat, f"what {_site_name(site)} is given")
    # A softmax or sigmoid output's logits, from which Keras's losses compute
    # the cross-entropy, are gathered with it (its probabilities saturate).
    logits = [(i, flat[i]._keras_logits) for i in positions
              if getattr(flat[i], "_keras_logits", None) is not None]
    gathered, _ = gather([flat[i] for i in positions] + [l for _, l in logits], batch,
                         own_gradient=True)
    for position, value in zip(positions, gathered):
        flat[position] = value
    for (position, _), value in zip(logits, gathered[len(positions):]):
        flat[position]._keras_logits = value
    with _global_region(batch):
        yield tree.pack_sequence_as(args, flat)


def _site_name(site):
    name = getattr(site, "name", None)
    return f"{name!r} ({type(site).__name__})" if name else type(site).__name__


def _as_share(value, batch):
    if isinstance(value, tf.Tensor) and value.shape.rank == 0 and value.dtype.is_floating:
        return replica.mark_share(value / tf.cast(replica.replicas_in_sync(), value.dtype))
    return value


def layer_call(layer, call, *, pad, meets=False):
    """A layer's `call` that runs on the global batch where its rows meet.

    The first time, the layer runs on the replica's rows and kd reads the
    graph of its outputs and of the `add_loss` terms it added. If rows meet,
    the layer's row-aligned inputs are gathered (their gradient all-reduced
    back), it runs on the global batch, and each replica keeps its own rows
    of the outputs. `pad`: feed a replica without rows one row of zeros and
    drop it from the outputs (TensorFlow's CPU kernels fail on 0 rows; a
    plain Keras model inside a kd model's step). `meets`: the layer's
    training call is known to mix rows (MixUp): on the global batch at once,
    without reading its graph.
    """

    def called(*args, **kwargs):
        if args:
            return on_inputs(call, *args, **kwargs)
        # Called with keywords only (an attention layer's `query=`, `value=`):
        # the first tensor among them stands for the inputs.
        name = next((k for k, v in kwargs.items() if isinstance(v, tf.Tensor)), None)
        if name is None:
            return call(**kwargs)
        inputs = kwargs.pop(name)
        return on_inputs(lambda x, *a, **k: call(*a, **{name: x}, **k), inputs, **kwargs)

    def on_inputs(call, inputs, *args, **kwargs):
        batch = replica.current_batch()
        key = kwargs.get("training")
        key = bool(key) if isinstance(key, bool) else None
        if not _active(batch):
            return _padded(call, inputs, args, kwargs, batch, pad)
        if meets and kwargs.get("training", True):
            _decide(layer, key, (_GLOBAL, ()))
            return _layer_on_global_batch(layer, call, inputs, args, kwargs, batch, ())
        decision = _decision(layer, key)
        if decision == _CLEAN:
            return _padded(call, inputs, args, kwargs, batch, pad)
        if decision is not None:
            return _layer_on_global_batch(layer, call, inputs, args, kwargs, batch, decision[1])
        if _first_unread((inputs, args, kwargs)) is not None:
            # Its inputs already passed an op kd cannot read (or meet): not
            # this layer's doing. The layer or loss that reads those inputs'
            # ops decides (or kd refuses there, see `_row_aligned`).
            return _padded(call, inputs, args, kwargs, batch, pad)
        losses = len(batch.forward.losses) if batch.forward.losses is not None else None
        draws = dict(batch.draws.seed_draws)
        outputs = _padded(call, inputs, args, kwargs, batch, pad, inspect=True)
        added = batch.forward.losses[losses:] if losses is not None else []
        where = outputs.where or _added_meet(added)
        if where is None:
            _decide(layer, key, _CLEAN)
            return outputs.value
        decision = (_GLOBAL, outputs.statistics)
        _retrace_or_go_on(batch, layer, key, where, decision)
        if losses is not None:  # the first run's terms and draws are not the step's
            del batch.forward.losses[losses:]
        batch.draws.seed_draws = draws
        return _layer_on_global_batch(layer, call, inputs, args, kwargs, batch, outputs.statistics)

    return called


def _first_unread(values):
    """The first tensor kind in `values` whose rows meet or kd cannot read, or None."""
    for value in tree.flatten(values):
        if isinstance(value, tf.Tensor) and value.shape.rank and value.dtype != tf.resource:
            kind = penalties.kind_of_value(value)
            if isinstance(kind, penalties.Unknown) and kind.on_global_batch:
                return kind
    return None


def _added_meet(terms):
    for term in terms:
        kind = penalties.kind_of(term) if isinstance(term, tf.Tensor) else None
        if isinstance(kind, penalties.Unknown) and kind.on_global_batch:
            return kind
    return None


class _Inspected:
    """A call's outputs, where rows meet in them, and which of them are statistics of the rows."""

    def __init__(self, value, where, inner):
        self.value, self.where = value, where
        self.statistics = tuple(
            isinstance(v, tf.Tensor) and penalties.kind_of_value(v) in (
                penalties.ROW_SUM, penalties.ROW_MEAN, penalties.FIXED)
            for v in tree.flatten(inner))


def _padded(call, inputs, args, kwargs, batch, pad, inspect=False):
    """`call`, an empty replica batch fed as one row of zeros when `pad` (see `layer_call`)."""
    # A batch whose rows are known when traced (and not 0) is never empty: no padding.
    if not (pad and batch is not None and not batch.forward.in_forward and batch.plan.pad_empty
            and not batch.coupling.global_region and isinstance(inputs, tf.Tensor)
            and inputs.shape.rank not in (None, 0) and not (inputs.shape[0] or 0) > 0):
        outputs = call(inputs, *args, **kwargs)
        return _Inspected(outputs, meets(outputs, statistics=True), outputs) if inspect else outputs
    from keras_distrib import _keras_compat

    has_rows = tf.shape(inputs)[0] > 0
    filler = lambda: tf.zeros(tf.concat([[1], tf.shape(inputs)[1:]], 0), inputs.dtype)
    layout = row_layout(inputs, batch)
    padded = mark_layout(penalties.mark_rows(tf.cond(has_rows, lambda: inputs, filler)), layout, batch)
    batch.forward.padded.append(tf.logical_not(has_rows))
    try:
        outputs = call(padded, *args, **kwargs)
    finally:
        batch.forward.padded.pop()
    where = meets(outputs, statistics=True) if inspect else None

    def cut_rows(value):
        # Rows that do not meet (or meet and are computed on the global
        # batch): each its own, which the cut's `cond` would hide from the
        # walk (a softmax output's logits as well).
        kept = tf.cond(has_rows, lambda: value, lambda: value[:0])
        return kept if where is not None else penalties.mark_rows(kept)

    def cut(value):
        if not isinstance(value, tf.Tensor) or value.shape.rank in (None, 0):
            return value
        kept = _keras_compat.keep_keras_logits(value, cut_rows)
        return kept if where is not None else mark_layout(penalties.mark_rows(kept), layout, batch)

    inner = outputs
    outputs = tree.map_structure(cut, outputs)
    return _Inspected(outputs, where, inner) if inspect else outputs


def _layer_on_global_batch(layer, call, inputs, args, kwargs, batch, statistics):
    """`call` on the global batch; each row-aligned output keeps this replica's rows.

    `statistics`: for each output (flat), whether it is a statistic of the
    rows (kept whole: the global batch's, the same on every replica).
    """
    if batch.plan.xla_forward and batch.forward.in_forward:
        raise ValueError(
            f"layer {layer.name!r} ({type(layer).__name__}) makes the rows of the batch meet, "
            "which kd computes on the global batch gathered from every replica: "
            "`jit_compile=True` with several CPU replicas (or workers) compiles only the forward "
            "pass with XLA, because TensorFlow cannot synchronize replicas inside XLA here. Use "
            "jit_compile=False (or GPUs, where XLA compiles the whole step)."
        )
    flat = tree.flatten(inputs)
    what = f"the inputs of layer {layer.name!r} ({type(layer).__name__})"
    positions = _row_aligned(flat, what)
    if not positions:
        return call(inputs, *args, **kwargs)
    # The rows of its other tensor arguments (a mask, an attention layer's
    # `value=`) are gathered with them.
    names = list(kwargs)
    keyed = [names[i] for i in _row_aligned([kwargs[n] for n in names], what)]
    values = [flat[i] for i in positions] + [kwargs[n] for n in keyed]
    gathered, places = gather(values, batch, own_gradient=False)
    kwargs = {**kwargs, **dict(zip(keyed, gathered[len(positions):]))}
    for position, value in zip(positions, gathered):
        flat[position] = value
    with _global_region(batch):
        outputs = call(tree.pack_sequence_as(inputs, flat), *args, **kwargs)
    first = flat[positions[0]]
    indices, rows = places[0]
    # A replica without rows of the step runs its forward pass on one padded
    # row (TensorFlow's CPU kernels fail on none): it keeps that many, zeros.
    fake = tf.shape(values[0])[0] - rows
    layout = row_layout(values[0], batch)

    def own_rows(value, statistic):
        if not isinstance(value, tf.Tensor) or value.shape.rank in (None, 0) or statistic:
            # A statistic of the global batch (or a scalar): the same on every
            # replica, its gradient all-reduced back through the gather.
            return penalties.mark_fixed(value) if isinstance(value, tf.Tensor) else value
        check = tf.debugging.assert_equal(tf.shape(value)[0], tf.shape(first)[0],
                                          message=ROWS_REFUSAL + f" Layer: {layer.name!r}.")
        with tf.control_dependencies([check]):
            kept = tf.gather(value, indices)
        kept = tf.concat([kept, tf.zeros(tf.concat([[fake], tf.shape(kept)[1:]], 0), kept.dtype)], 0)
        kept.set_shape(values[0].shape[:1].concatenate(value.shape[1:]))
        return mark_layout(penalties.mark_rows(kept), layout, batch)

    flat = tree.flatten(outputs)
    statistics = statistics if len(statistics) == len(flat) else (False,) * len(flat)
    return tree.pack_sequence_as(outputs, [own_rows(v, s) for v, s in zip(flat, statistics)])


# ---------------------------------------------------------------------------
# Custom steps: the tensors kd gathers for code it does not call itself.


def anchor(values, owner, batch=None):
    """Records `values` (a call's outputs, the step's data) as where a custom step's tensors start.

    Returns `values`, gathered (GLOBAL) where a previous trace found that
    the step makes their rows meet (`request_anchors`).
    """
    batch = batch if batch is not None else replica.current_batch()
    if not _active(batch) or batch.step.model is None:
        return values
    count = batch.coupling.occurrences.get(id(owner), 0)
    batch.coupling.occurrences[id(owner)] = count + 1
    key = (batch.step.kind, _owner_key(owner, batch), count)
    flat = tree.flatten(values)
    if key in _ANCHORS.get(batch.step.model, ()):
        positions = [i for i, v in enumerate(flat) if isinstance(v, tf.Tensor) and v.shape.rank]
        gathered, _ = gather([flat[i] for i in positions], batch, own_gradient=True)
        for position, value in zip(positions, gathered):
            flat[position] = value
        return tree.pack_sequence_as(values, flat)
    for value in flat:
        if isinstance(value, tf.Tensor):
            batch.coupling.anchors[value.ref()] = key
    return values


def _owner_key(owner, batch):
    if isinstance(owner, str):
        return owner
    return id(owner)


def planned_data(data, batch):
    """The step's data, its leaves gathered where a previous trace asked (see `anchor`)."""
    if not _active(batch) or batch.step.model is None:
        return data
    flat = tree.flatten(data)
    for index, value in enumerate(flat):
        if isinstance(value, tf.Tensor) and value.shape.rank:
            flat[index] = anchor(value, f"data{index}", batch)
    return tree.pack_sequence_as(data, flat)


def request_anchors(kind, graph, batch):
    """Asks the next trace to gather the tensors that rows meeting (`kind`) start from.

    Walks up from the op where rows meet to the nearest recorded anchors
    (the model's outputs, its sub-models', the step's data) along the
    replica's own rows. Returns False if a path reaches none (kd did not
    see where that tensor came from).
    """
    if batch.step.model is None:
        return False
    found, complete = penalties.row_sources(kind.op, graph, lambda t: batch.coupling.anchors.get(t.ref()))
    if not found or not complete:
        return False
    _ANCHORS.setdefault(batch.step.model, set()).update(found)
    return True


def inline(kind, batch, what, graph):
    """Rows meet (`kind`) in code kd did not call, or pass an op it cannot read: gather, or refuse.

    In kd's step, kd asks the next trace to gather the tensors the code
    starts from (`request_anchors`) and raises `RowsMeet`: computed from the
    global batch, the value is what one device computes. Where it cannot (a
    hand-written loop, a tensor kd did not see made), it refuses, naming the
    op and the fix (`penalties.refusal`). Nothing happens in a model
    compiled with `rows_meet="per_replica"`.
    """
    if batch is not None and batch.step.rows_meet != "global":
        return  # compiled to leave each replica its own rows
    if batch is not None and batch.step.retraceable and request_anchors(kind, graph, batch):
        raise RowsMeet(kind.why)
    raise ValueError(penalties.refusal(kind, what, replica.replicas_in_sync()))


# ---------------------------------------------------------------------------
# The public helper.


@tf.autograph.experimental.do_not_convert
def global_batch(tensor):
    """Every replica's rows of `tensor`, in global row order, and where this replica's start.

    Inside a step on several replicas (a kd model's `train_step`, a
    hand-written loop's `strategy.run`), returns the global batch of a
    row-aligned tensor: what one device holds for the whole batch, the same
    on every replica, and the offset of this replica's rows in it. The
    gradient flows back to the replica that owns each row (the gradient of
    the gather: the sum of every replica's gradient for those rows), so a
    loss over `global_batch(x)` trains as one device does. A replica
    without rows of the step contributes none. Outside a step on several
    replicas, returns `(tensor, 0)`.

    Use it to write in-batch negatives by hand, as SimCLR's and CLIP's code
    does: each replica's queries against every replica's keys.

    Args:
        tensor: This replica's rows (first axis), any dtype.

    Returns:
        `(global_tensor, offset)`: a tensor with the rows of every replica,
        and this replica's first row in it (an int32 scalar).

    Raises:
        ValueError: `tensor` has no rows axis (a scalar).

    Examples:
        >>> import tensorflow as tf, keras_distrib as kd
        >>> everything, offset = kd.losses.global_batch(tf.constant([[1.0], [2.0]]))
        >>> everything.numpy().tolist(), int(offset)
        ([[1.0], [2.0]], 0)
    """
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        raise ValueError(f"`tensor` is a scalar ({tensor.dtype.name}); `global_batch` gathers "
                         "rows: pass a tensor whose first axis holds this replica's rows")
    if replica.replicas_in_sync() == 1 or tf.distribute.get_replica_context() is None:
        return tensor, tf.constant(0, tf.int32)
    batch = replica.current_batch()
    with (contextlib.nullcontext(batch) if batch is not None else
          replica.replica_batch(tf.shape(tensor)[0])) as open_batch:
        (gathered,), ((indices, _),) = gather([tensor], open_batch, own_gradient=False)
        offset = tf.reduce_min(tf.concat([indices, [tf.shape(gathered)[0]]], 0))
    # Your own code then combines the global batch with this replica's rows
    # (its queries against every key): to kd's loss arithmetic, the gathered
    # rows are the same on every replica, as weights are, and its gradient
    # comes back through the gather.
    return penalties.mark_fixed(gathered), penalties.mark_offset(offset)
