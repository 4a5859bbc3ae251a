"""What a tensor is to the replica's rows, read from the graph: one op table, one policy.

kd's one owner of the question "how does this value relate to the rows of
the replica's batch?". The answer (a kind) is one of:

- a term of the weights alone (weight regularizers, a constant): the same
  on every replica (`FIXED`); computed from the global batch kd gathered,
  also the same on every replica (`GLOBAL`);
- one entry per row, each row its own (`ROWS`);
- a sum over rows (`add_loss(c * tf.reduce_sum(x))`): the replicas' values
  add up to one device's (`ROW_SUM`);
- a mean over rows (Keras's activity regularizers divide by the batch
  size; `tf.reduce_mean` over the batch axis): the global value is
  sum_r n_r * value_r / N (`ROW_MEAN`);
- a share of a loss kd computed (`SHARE`);
- an `Unknown`: the rows meet (`Unknown.meets`: a variance of the batch, a
  product of two sums, `x @ y^T`), a per-replica random draw mixes them, or
  kd cannot read the op at all (`Unknown.unread`).

`kind_of` decides by walking back from a tensor to where its values come
from: variables and constants, the replica's batch (its rows: the first
axis), and the ops between them, each read by its entry in `OPS`, the op
table. An entry says how the op's output kind follows from its inputs'
kinds, and how its rows lie in the global batch (`layout_of_op`, which
`coupling.row_layout` reads): one list of ops for both questions. An op not
in the table, or given inputs its rule does not cover, is `Unknown`
(unread): never taken as rows. What kd then does is one policy
(`coupling.meets`, `coupling.inline`, `scaling.replica_share`): computed on
the global batch where kd can, else refused at the first trace
(`refusal`, naming the op and the fix).

kd's own layers mark what they compute (`mark_fixed`, `mark_rows`,
`mark_meets`): global BatchNormalization statistics are the same on every
replica, a random layer laid out over the global batch keeps the
replica's rows, a shuffle of the rows makes them meet.

The same walk finds where the rows of a batch meet (`Unknown.meets`):
a product of two row-aligned tensors across the batch (`x @ y^T`, an
einsum over two row indices), a statistic of the rows fed back into rows,
a maximum, sort or top-k across rows, rows picked by index, labels
numbered from the batch size (`arange(batch_size)`, `eye(batch_size)`),
cumulative sums over rows. Each is exact given the whole global batch,
which `keras_distrib.training.coupling` then gathers (`mark_gathered`:
the same on every replica, GLOBAL); everything computed from gathered
tensors alone is GLOBAL too. It also finds per-replica random draws inside
per-example losses (`row_mixing`): what a plain Keras model's Dropout
computes in a hand-written loop, which no gathering makes exact.
"""

import dataclasses
import weakref

import numpy as np
import tensorflow as tf

__all__ = [
    "FIXED",
    "GLOBAL",
    "NO_ROWS",
    "OPS",
    "ROWS",
    "ROW_BLOCKS",
    "ROW_MEAN",
    "ROW_SUM",
    "SHARE",
    "Term",
    "Unknown",
    "holds_no_rows",
    "kind_of",
    "kind_of_value",
    "layout_of_op",
    "loss_terms",
    "mark_fixed",
    "mark_gathered",
    "mark_kind",
    "mark_meets",
    "mark_offset",
    "mark_rows",
    "mark_share",
    "refusal",
    "row_mixing",
    "row_sources",
]

FIXED = "fixed"  # the same on every replica
ROWS = "rows"  # one entry per row of the replica's batch on the first axis
ROW_SUM = "row_sum"  # a linear function of sums over the rows
ROW_MEAN = "row_mean"  # a linear function of means over the rows
_SHAPE = "shape"  # the shape of a ROWS tensor (entry 0: the row count)
_COUNT = "count"  # the replica's row count
_DRAW = "draw"  # random numbers drawn per replica, one per row
_STATIC = "static"  # an integer constant cast to a number, maybe the static row count
_OPTIONAL = "optional"  # the replica's next batch as an Optional (get_next_as_optional)
_COLUMNS = "columns"  # rows transposed onto the second axis (`transpose(x)`, `x[None, :]`)
_OFFSET = "offset"  # where the replica's rows start in the global batch (`kd.losses.global_batch`)
# The rows regrouped along the first axis, each entry one row's: merged with
# the axes after them (`reshape(x, [-1, classes])` of a (rows, steps,
# classes) tensor), or batches concatenated along the rows (a GAN's
# generated and real images). Sums and means over its entries add up as
# over rows; what depends on its order is not read.
ROW_BLOCKS = "row blocks"
# A replica's share of a loss kd computed (its shares add up over replicas to
# the global loss): what it is made of is kd's arithmetic, not the walk's.
SHARE = "share"


@dataclasses.dataclass(frozen=True)
class _Index:
    """The replica's rows numbered from 0 (`range` over the row count), by the op that numbered them."""

    op: str


# Computed from the global batch (tensors kd gathered from every replica) and
# weights alone: the same on every replica; its gradient reaches each
# replica's own rows through the gather (see coupling.gather).
GLOBAL = "global"


@dataclasses.dataclass(frozen=True)
class Unknown:
    """A value kd cannot split over replicas; `mixing` says where rows were mixed, if so.

    `meets`: the rows of the batch meet at `op` in a way the whole global
    batch makes exact (`mixing` says how); False where they mix with
    something no gathering fixes (a per-replica random draw).
    """

    op: str
    mixing: str = ""
    meets: bool = False
    op_type: str = ""

    @property
    def unread(self):
        """Whether kd could not read the op at all (no rule for it, or for its inputs' kinds)."""
        return not self.mixing and not self.meets

    @property
    def on_global_batch(self):
        """Whether kd computes the value on the global batch: its rows meet there, or kd cannot read `op`.

        On the global batch every replica computes what one device computes,
        whatever the op does with the rows; a per-replica random draw
        (`mixing` without `meets`) is not fixed by it.
        """
        return self.meets or self.unread

    @property
    def why(self):
        """What happens at `op`, in words (for an error message)."""
        if self.mixing:
            return self.mixing
        what = f"`{self.op}` ({self.op_type})" if self.op_type else f"`{self.op}`"
        return (f"{what} is an op kd cannot read: it does not know whether its output keeps "
                "each row of the batch its own, so it cannot split it over replicas")


def refusal(kind, what, replicas):
    """kd's one refusal of a value it cannot split over `replicas` (`kind`: an `Unknown`), as text.

    Where kd can, it computes such a value on the global batch (a layer, a
    loss, `compute_loss`, what a custom step computes from the model's
    outputs: `coupling`); the refusal is for the rest, at the first trace.
    """
    return (
        f"kd cannot split {what} over the {replicas} replicas: {kind.why}. One device computes "
        "it from the whole batch; each replica would compute it from its own rows, so training "
        "would silently differ from one device. Gather the tensors it starts from with "
        "`kd.losses.global_batch(tensor)` (every replica's rows, the gradient flowing back to "
        "each) and compute it from those, compute it inside a kd model's layers or loss (kd "
        "then computes it on the global batch), or compile the model with "
        "`rows_meet=\"per_replica\"` to keep Keras's per-replica behaviour (not exact)."
    )


_MARKS = weakref.WeakKeyDictionary()  # graph -> {tensor name: kind}


def _mark(tensor, kind):
    if not isinstance(tensor, tf.Tensor) or tf.executing_eagerly() or not hasattr(tensor, "graph"):
        return tensor
    try:
        _MARKS.setdefault(tensor.graph, {})[tensor.name] = kind
    except (TypeError, AttributeError):
        pass
    return tensor


@tf.autograph.experimental.do_not_convert
def mark_fixed(tensor):
    """Marks `tensor` as `FIXED`: the same on every replica (e.g. global batch statistics)."""
    return _mark(tensor, FIXED)


@tf.autograph.experimental.do_not_convert
def mark_share(tensor):
    """Marks `tensor` as a loss share kd computed (see `SHARE`)."""
    return _mark(tensor, SHARE)


@tf.autograph.experimental.do_not_convert
def mark_offset(tensor):
    """Marks `tensor` as where the replica's rows start in the global batch."""
    return _mark(tensor, _OFFSET)


@tf.autograph.experimental.do_not_convert
def mark_gathered(tensor):
    """Marks `tensor` as holding the global batch, the same on every replica (GLOBAL)."""
    return _mark(tensor, GLOBAL)


@tf.autograph.experimental.do_not_convert
def mark_kind(tensor, kind):
    """Marks `tensor` with a kind read in another graph (a compiled function's, that returns it)."""
    return _mark(tensor, kind)


@tf.autograph.experimental.do_not_convert
def mark_meets(tensor, why):
    """Marks `tensor` as where the batch's rows meet (`why`: how), e.g. a permutation of the rows."""
    if isinstance(tensor, tf.Tensor) and hasattr(tensor, "op"):
        return _mark(tensor, Unknown(tensor.op.name, f"`{tensor.op.name}` {why}", meets=True))
    return tensor


@tf.autograph.experimental.do_not_convert
def mark_rows(tensor):
    """Marks `tensor` as holding the replica's rows, each its own (e.g. a laid-out random layer)."""
    return _mark(tensor, ROWS)


_IDENTITY = {"Identity", "Snapshot", "StopGradient", "PreventGradient", "EnsureShape",
             "CheckNumerics", "Cast", "DebugIdentityV3"}
_LINEAR_UNARY = _IDENTITY | {"Neg"}
_UNARY = _LINEAR_UNARY | {
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Ceil", "Cos", "Cosh", "Elu", "Erf",
    "Erfc", "Exp", "Expm1", "Floor", "IsFinite", "IsInf", "IsNan", "LeakyRelu", "Log", "Log1p",
    "LogicalNot", "Reciprocal", "Relu", "Relu6", "Rint", "Round", "Rsqrt", "Selu", "Sigmoid",
    "Sign", "Sin", "Sinh", "Softplus", "Softsign", "Sqrt", "Square", "Tan", "Tanh", "ZerosLike",
    "OnesLike", "Softmax", "LogSoftmax",
}
_BINARY = {"Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "MulNoNan", "Maximum",
           "Minimum", "Pow", "SquaredDifference", "BiasAdd", "Greater", "GreaterEqual", "Less",
           "LessEqual", "Equal", "NotEqual", "LogicalAnd", "LogicalOr", "FloorDiv", "FloorMod",
           "Xdivy", "Xlogy", "Atan2"}
_PER_ROW_IMAGE = {"Conv2D", "Conv3D", "DepthwiseConv2dNative", "MaxPool", "MaxPoolV2", "AvgPool",
                  "MaxPool3D", "AvgPool3D"}
_DATA = {"IteratorGetNext", "MultiDeviceIteratorGetNextFromShard", "OptionalGetValue",
         "IteratorGetNextSync"}
_STATELESS_RANDOM_PREFIX = "StatelessRandom"
_STATEFUL_READS = {"ReadVariableOp", "VarHandleOp", "ResourceGather"}


_FOLDED = {"Sub": np.subtract, "AddV2": np.add, "Add": np.add, "Mul": np.multiply}


def _const(tensor, depth=0):
    """`tensor`'s value if known when traced (TensorFlow's own folding, and small integer arithmetic)."""
    value = tf.get_static_value(tensor)
    if value is not None or depth > 4:
        return value
    op = tensor.op
    if op.type in _FOLDED:
        a, b = (_const(t, depth + 1) for t in op.inputs)
        return None if a is None or b is None else _FOLDED[op.type](a, b)
    if op.type == "Pack":
        parts = [_const(t, depth + 1) for t in op.inputs]
        return None if any(p is None for p in parts) else np.stack(parts, op.get_attr("axis"))
    if op.type == "ConcatV2":
        parts = [_const(t, depth + 1) for t in op.inputs]
        return None if any(p is None for p in parts) else np.concatenate(parts[:-1], int(parts[-1]))
    if op.type == "StridedSlice" and op.inputs[0].op.type == "Shape" and \
            op.get_attr("shrink_axis_mask") == 1 and not op.get_attr("ellipsis_mask"):
        # One known dimension of a partly known shape (`shape(x)[-1]`).
        dims = op.inputs[0].op.inputs[0].shape
        begin = _const(op.inputs[1], depth + 1)
        if dims.rank is None or begin is None or begin.size != 1:
            return None
        dim = dims[int(begin.reshape(-1)[0])]
        return None if dim is None else np.int32(dim)
    if op.type == "Slice" and op.inputs[0].op.type == "Shape":
        # The known dimensions of a partly known shape (the features, not the rows).
        dims = op.inputs[0].op.inputs[0].shape.as_list()
        begin, size = _const(op.inputs[1], depth + 1), _const(op.inputs[2], depth + 1)
        if begin is None or size is None or len(begin) != 1:
            return None
        start = int(begin[0])
        part = dims[start:] if int(size[0]) == -1 else dims[start:start + int(size[0])]
        return None if any(d is None for d in part) else np.array(part, np.int32)
    return None


def _rank(tensor):
    return tensor.shape.rank


def _axes(op, tensor, values):
    """The normalized constant axes of a reduction, or None."""
    axes = _const(values)
    rank = _rank(tensor)
    if axes is None or rank is None:
        return None
    axes = [int(a) for a in (axes.reshape(-1) if hasattr(axes, "reshape") else [axes])]
    return {a % rank if rank else 0 for a in axes} if axes else set(range(rank))


def _unknown_of(kinds):
    for kind in kinds:
        if isinstance(kind, Unknown) and kind.mixing:
            return kind
    for kind in kinds:
        if isinstance(kind, Unknown):
            return kind
    return None


def _mixing(op, why):
    return Unknown(op.name, f"`{op.name}` ({op.type}) {why}")


def _meeting(op, why):
    """The rows of the batch meet at `op`: exact given the whole global batch."""
    return Unknown(op.name, f"`{op.name}` ({op.type}) {why}", meets=True)


def _broadcasts_into_rows(rows, other):
    """Whether `other` (FIXED) combined with a ROWS tensor keeps its rows."""
    if _rank(rows) is None or _rank(other) is None:
        return False
    if _rank(other) < _rank(rows):
        return True
    return other.shape[0] == 1 if _rank(other) else True


def _binary(op, kinds):
    a, b = kinds[0], kinds[1]
    ta, tb = op.inputs[0], op.inputs[1]
    kind_set = {a, b}
    if kind_set == {FIXED}:
        return FIXED
    if _COLUMNS in kind_set:
        if kind_set <= {_COLUMNS, FIXED}:
            return _COLUMNS
        if ROWS in kind_set:
            return _meeting(op, "combines every row of the batch with every other row (e.g. "
                                "`labels[:, None] == labels[None, :]`)")
        return _unread(op)
    if kind_set <= {ROWS, FIXED, _DRAW}:
        if ROWS in kind_set and _DRAW in kind_set:
            return _mixing(op, "combines the rows with random numbers drawn for this replica's "
                               "rows only (e.g. a Dropout or GaussianNoise of a plain Keras model)")
        fixed_ok = all(_broadcasts_into_rows(op.outputs[0], t) for k, t in ((a, ta), (b, tb))
                       if k == FIXED)
        if not fixed_ok:
            return _unread(op)
        return _DRAW if _DRAW in kind_set else ROWS
    statistics = {ROW_SUM, ROW_MEAN}
    if kind_set & {ROWS, _DRAW} and kind_set & statistics:
        return _meeting(op, "combines the rows with a statistic of the batch's rows (e.g. "
                            "`x - mean(x, axis=0)`)")
    if op.type in ("Add", "AddV2", "Sub") and len(kind_set) == 1 and a in statistics:
        return a
    if op.type in ("Add", "AddV2", "Sub") and kind_set == {ROW_MEAN, FIXED}:
        # A mean plus a term of the weights: weighted by n_r / N, both add up.
        return ROW_MEAN
    if op.type in ("Mul", "MulNoNan") and FIXED in kind_set and kind_set & statistics:
        return (kind_set - {FIXED}).pop()
    if op.type in ("RealDiv", "Div", "DivNoNan") and b == FIXED and a in statistics:
        return a
    if op.type in ("RealDiv", "Div", "DivNoNan") and a == ROW_SUM and b == _COUNT:
        return ROW_MEAN
    if op.type in ("RealDiv", "Div", "DivNoNan") and a == ROW_SUM and b == _STATIC and \
            int(_const(op.inputs[1].op.inputs[0])) in _static_rows(op.graph):
        # Keras divides by `ops.cast(ops.shape(x)[0])`: with a static batch
        # shape, the row count is an integer constant of the graph.
        return ROW_MEAN
    if op.type in ("Add", "AddV2") and kind_set == {_OFFSET, FIXED} and \
            _rank(ta if a == FIXED else tb) == 1:
        # The offset plus `range` of a static row count: the global row numbers.
        return ROWS
    if _STATIC in kind_set:
        return _binary(op, [FIXED if k == _STATIC else k for k in kinds])
    if _COUNT in kind_set and kind_set <= {_COUNT, FIXED}:
        return _COUNT if op.type in ("Mul", "Maximum") else _unread(op)
    if kind_set & statistics and kind_set <= statistics | {FIXED}:
        return _meeting(op, "combines sums or means over the batch's rows into a value that "
                            "is neither one sum nor one mean over the rows")
    return _unread(op)


def _reduce(op, kinds):
    kind = kinds[0]
    if kind == FIXED:
        return FIXED if kinds[1] == FIXED else _unread(op)
    if kind in (ROW_SUM, ROW_MEAN):
        return kind if op.type in ("Sum", "Mean") and kinds[1] == FIXED else _unread(op)
    if kind not in (ROWS, _DRAW, ROW_BLOCKS):
        return _unread(op)
    axes = _axes(op, op.inputs[0], op.inputs[1])
    if axes is None:
        return _unread(op)
    if 0 not in axes:
        return kind
    if kind == _DRAW:
        return _unread(op)
    return {"Sum": ROW_SUM, "Mean": ROW_MEAN}.get(op.type) or _meeting(
        op, "reduces across the batch's rows")


def _keeps_rows(op):
    """Whether a shape op on a ROWS tensor keeps its first axis the rows."""
    source, result = op.inputs[0], op.outputs[0]
    if op.type == "Reshape":
        before, after = source.shape[1:], result.shape[1:]
        if before.is_fully_defined() and after.is_fully_defined():
            return before.num_elements() == after.num_elements()
        target = _const(op.inputs[1])  # e.g. [-1, features], computed in the graph
        return before.is_fully_defined() and target is not None and target.ndim == 1 and \
            len(target) >= 1 and int(target[0]) == -1 and all(int(d) >= 0 for d in target[1:]) and \
            int(np.prod(target[1:])) == before.num_elements()
    if op.type == "ExpandDims":
        axis = _const(op.inputs[1])
        return axis is not None and int(axis) % (_rank(result) or 1) != 0
    if op.type == "Squeeze":
        dims = list(op.get_attr("squeeze_dims"))
        rank = _rank(source)
        return bool(dims) and rank is not None and all(d % rank != 0 for d in dims)
    if op.type == "Transpose":
        perm = _const(op.inputs[1])
        return perm is not None and int(perm[0]) == 0
    if op.type in ("Pad", "PadV2", "MirrorPad"):
        paddings = _const(op.inputs[1])
        return paddings is not None and list(paddings[0]) == [0, 0]
    if op.type == "Tile":
        multiples = _const(op.inputs[1])
        return multiples is not None and int(multiples[0]) == 1
    if op.type == "StridedSlice":
        strides = _const(op.inputs[3])
        full = op.get_attr("begin_mask") & 1 and op.get_attr("end_mask") & 1
        return bool(full) and strides is not None and int(strides[0]) == 1 and \
            not op.get_attr("shrink_axis_mask") & 1 and not op.get_attr("new_axis_mask") & 1 and \
            not op.get_attr("ellipsis_mask")
    return False


def _makes_columns(op):
    """Whether a shape op puts a 2-D result's rows on its second axis."""
    result = op.outputs[0]
    if _rank(result) != 2:
        return False
    if op.type == "Transpose":
        perm = _const(op.inputs[1])
        return perm is not None and list(perm) == [1, 0]
    if op.type == "ExpandDims":
        axis = _const(op.inputs[1])
        return axis is not None and int(axis) % 2 == 0
    if op.type == "StridedSlice":
        strides = _const(op.inputs[3])
        return bool(op.get_attr("new_axis_mask") & 1) and strides is not None and \
            all(int(s) == 1 for s in strides) and not op.get_attr("shrink_axis_mask") and \
            not op.get_attr("ellipsis_mask") and \
            op.get_attr("begin_mask") | 1 == op.get_attr("end_mask") | 1 == (1 << len(strides)) - 1
    return False


_SHAPE_OPS = {"Reshape", "ExpandDims", "Squeeze", "Transpose", "Pad", "PadV2", "MirrorPad", "Tile",
              "StridedSlice"}


# ---------------------------------------------------------------------------
# The op table: for each op type kd reads, how its output's kind follows its
# inputs' kinds (`kind`), and how its output's rows lie in the global batch
# given its inputs' (`layout`, see `layout_of_op`). An op type not in the
# table is not read: its output is `Unknown` (see `Unknown.unread`), never
# taken as rows.


@dataclasses.dataclass(frozen=True)
class _Op:
    """One entry of the op table.

    `kind(op, index, kinds)`: the kind of `op.outputs[index]` given its
    inputs' kinds. `layout`: one of `_LAYOUTS` ("" where the layout of its
    rows cannot be read).
    """

    kind: object
    layout: str = ""


# How an op's rows lie, given its inputs' layouts (see `layout_of_op`):
_KEEPS = "keeps"  # each output row is an input row's: the inputs' one layout
_NO_ROWS = "no rows"  # weights, constants, row numbers: no rows of the batch
_CONCAT = "concat"  # along the rows: the inputs' layouts one after the other
_COUNTS = "counts"  # a shape: the layout of the tensor whose rows it counts
_PACK = "pack"  # a shape built from a row count
_REDUCES = "reduces"  # a reduction: the input's layout unless it reduces the rows
_SHAPES = "shapes"  # a shape op: the input's layout where it keeps the rows
_STRIDED = "strided"  # a slice: of a shape, or a shape op
_LAYOUTS = (_KEEPS, _NO_ROWS, _CONCAT, _COUNTS, _PACK, _REDUCES, _SHAPES, _STRIDED)


def _constant_op(op, index, kinds):
    return FIXED


def _placeholder(op, index, kinds):
    output = op.outputs[index]
    if output.dtype == tf.resource:
        return FIXED
    return ROWS if (_rank(output) or 0) >= 1 else _unread(op)


def _data(op, index, kinds):
    return ROWS if (_rank(op.outputs[index]) or 0) >= 1 else _unread(op)


def _optional(op, index, kinds):
    return _OPTIONAL


def _stateless_random(op, index, kinds):
    return _DRAW if kinds[0] == _SHAPE else _unread(op)


def _identity_n(op, index, kinds):
    return kinds[index]


def _unary(op, index, kinds):
    kind = kinds[0]
    if kind == _COLUMNS and op.type in ("Softmax", "LogSoftmax"):
        return _meeting(op, "normalizes across the batch's rows")
    if kind in (ROW_SUM, ROW_MEAN) and op.type not in _LINEAR_UNARY:
        return _meeting(op, "is a nonlinear function of a sum or mean over the batch's rows")
    if kind in (_COUNT, _SHAPE):
        return kind if op.type in _LINEAR_UNARY else _unread(op)
    return kind


def _add_n(op, index, kinds):
    kind_set = set(kinds)
    if len(kind_set) == 1 and kinds[0] in (FIXED, ROWS, ROW_SUM, ROW_MEAN):
        return kinds[0]
    return _statistics(kind_set) or _unread(op)


def _statistics(kind_set):
    """The kind of terms added up or stacked (`sum(self.losses)`, `ops.sum(self.losses)`), or None.

    Sums over rows add up as sums; means over rows and terms of the weights
    add up as a mean (each weighted by n_r / N, a weight term counts once);
    a sum beside a weight term has no kind (the term would count once per
    replica).
    """
    if kind_set == {ROW_SUM}:
        return ROW_SUM
    if ROW_MEAN in kind_set and kind_set <= {ROW_MEAN, FIXED}:
        return ROW_MEAN
    return None


def _arg_reduce(op, index, kinds):
    if kinds[0] == ROWS:
        axes = _axes(op, op.inputs[0], op.inputs[1])
        if axes is None:
            return _unread(op)
        return ROWS if 0 not in axes else _meeting(op, "picks one of the batch's rows")
    return _reduce(op, kinds)


def _l2_loss(op, index, kinds):
    return {ROWS: ROW_SUM}.get(kinds[0]) or _unread(op)


def _shape(op, index, kinds):
    return _SHAPE if kinds[0] in (ROWS, _DRAW) else _unread(op)


def _pack(op, index, kinds):
    if kinds and kinds[0] == _COUNT and all(k == FIXED for k in kinds[1:]):
        return _SHAPE if op.get_attr("axis") == 0 else _unread(op)
    if _COUNT in kinds and set(kinds) <= {_COUNT, FIXED} and op.get_attr("axis") == 0:
        return _meeting(op, "shapes a tensor by the batch size on an axis after the first (e.g. "
                            "`eye(batch_size)`)")
    # Loss terms stacked to be summed (`ops.sum(self.losses)`): each entry
    # keeps its kind, and the sums and means `_reduce` reads of them add up.
    return _statistics(set(kinds)) or _unread(op)


def _merges_rows(op):
    """Whether a reshape merges the rows with the axes after them, keeping the rest.

    (The replicas' blocks have one size: every replica's batch has the same
    axes after the rows.)
    """
    before, after = op.inputs[0].shape, op.outputs[0].shape
    if before.rank is None or after.rank is None or not 1 <= after.rank < before.rank:
        return False
    trailing = after[1:].as_list()
    if None in trailing:
        target = _const(op.inputs[1])
        if target is None or target.ndim != 1 or len(target) != after.rank:
            return False
        trailing = [int(d) for d in target[1:]]
    kept = before[before.rank - after.rank + 1:]
    return kept.is_fully_defined() and kept.as_list() == trailing


def _shape_op(op, index, kinds):
    """A shape op (`_SHAPE_OPS`) on rows: rows where it keeps them, columns where it turns them."""
    if op.type == "Reshape" and kinds[0] in (ROWS, ROW_BLOCKS) and kinds[1] == _SHAPE:
        return ROWS  # back to a shape read off the rows (a loss reshaped to its rows)
    if op.type == "Reshape" and kinds[0] == ROWS and kinds[1] == FIXED and _merges_rows(op):
        return ROW_BLOCKS  # (tf.nn's sparse cross-entropy of a sequence's logits)
    if kinds[0] in (ROWS, _DRAW):
        others_fixed = all(k == FIXED for k in kinds[1:])
        if others_fixed and kinds[0] == ROWS and _makes_columns(op):
            return _COLUMNS
        return kinds[0] if others_fixed and _keeps_rows(op) else _unread(op)
    if op.type == "Transpose" and kinds[0] == _COLUMNS and kinds[1] == FIXED:
        perm = _const(op.inputs[1])
        return ROWS if perm is not None and list(perm) == [1, 0] else _unread(op)
    return _unread(op)


def _slice(op, index, kinds):
    """A slice of a shape: the row count (from entry 0) or the features; else a shape op."""
    if kinds[0] == _SHAPE and all(k == FIXED for k in kinds[1:]):
        begin = _const(op.inputs[1])
        if begin is None:
            return _unread(op)
        if op.type == "StridedSlice":
            if not op.get_attr("shrink_axis_mask") & 1:
                return _unread(op)
            return _COUNT if int(begin.reshape(-1)[0]) == 0 else FIXED
        return _SHAPE if int(begin.reshape(-1)[0]) == 0 else FIXED
    if op.type == "StridedSlice":
        return _shape_op(op, index, kinds)
    return _unread(op)


def _broadcast_to(op, index, kinds):
    """`broadcast_to(x, shape)`: rows where the shape's first entry is the row count."""
    value, shape = kinds[0], kinds[1]
    if shape == _SHAPE and value in (FIXED, ROWS):
        # A constant repeated for each row (a position embedding), or rows
        # broadcast along their other axes.
        return ROWS if value == FIXED or (_rank(op.inputs[0]) or 0) == (_rank(op.outputs[0]) or -1) \
            else _unread(op)
    if shape == FIXED and value == ROWS and (_rank(op.inputs[0]) or 0) == (_rank(op.outputs[0]) or -1):
        return ROWS  # a static batch shape: each row broadcast along its other axes
    return _unread(op)


def _concat(op, index, kinds):
    if kinds and kinds[-1] == FIXED and set(kinds[:-1]) <= {_SHAPE, FIXED} and _SHAPE in kinds:
        parts = [k for k, t in zip(kinds[:-1], op.inputs[:-1])
                 if not (k == FIXED and t.shape.num_elements() == 0)]
        if parts[0] == _SHAPE and all(k == FIXED for k in parts[1:]):
            return _SHAPE
        return _meeting(op, "shapes a tensor by the batch size on an axis after the first (e.g. "
                            "`zeros((batch_size, batch_size))`)")
    axis = _const(op.inputs[-1])
    rank = _rank(op.outputs[0])
    if axis is not None and rank and int(axis) % rank != 0 and all(k == ROWS for k in kinds[:-1]):
        return ROWS
    if axis is not None and rank and int(axis) % rank == 0 and \
            all(k in (ROWS, ROW_BLOCKS) for k in kinds[:-1]):
        return ROW_BLOCKS  # batches stacked along the rows
    return _unread(op)


def _attr(op, *names):
    return any(op.get_attr(name) for name in names if name in op.node_def.attr)


def _matmul(op, index, kinds):
    a, b = kinds[0], kinds[1]
    transposed = _attr(op, "transpose_a", "adj_x")
    second = _attr(op, "transpose_b", "adj_y")
    if a == ROWS and b == FIXED and not transposed and (op.type == "MatMul" or
                                                      (_rank(op.inputs[1]) or 3) <= 2):
        return ROWS
    if op.type != "MatMul" and a == ROWS and b == ROWS and (_rank(op.inputs[0]) or 0) >= 3:
        return ROWS
    similarities = ("multiplies two row-aligned tensors across the batch, so each row meets "
                    "every other row (e.g. similarities `x @ transpose(y)`)")
    if a == ROWS and b == _COLUMNS and not transposed and not second:
        return _meeting(op, similarities)
    if a == _COLUMNS and b == ROWS and not transposed:
        return ROW_SUM  # transpose(x) @ y: a sum over the rows of their outer products
    if a == FIXED and b == _COLUMNS and not transposed:
        return _COLUMNS
    if a == ROWS and b == ROWS and (_rank(op.inputs[0]) or 0) == 2:
        if transposed and not second:
            return ROW_SUM  # x^T y: a sum over the rows of their outer products
        return _meeting(op, similarities)
    return _unread(op)


def _per_row_image(op, index, kinds):
    data_format = op.get_attr("data_format") if "data_format" in op.node_def.attr else b"N"
    if kinds[0] == ROWS and all(k == FIXED for k in kinds[1:]) and data_format.startswith(b"N"):
        return ROWS
    return _unread(op)


def _select(op, index, kinds):
    kind_set = set(kinds)
    if kind_set <= {ROWS, FIXED, _DRAW}:
        if ROWS in kind_set and _DRAW in kind_set:
            return _mixing(op, "selects between the rows with random numbers drawn for this "
                               "replica's rows only (e.g. a Dropout of a plain Keras model)")
        return ROWS if ROWS in kind_set else _DRAW
    return _unread(op)


def _gather(op, index, kinds):
    axis = _const(op.inputs[2])
    if kinds[0] == FIXED and kinds[1] == ROWS and axis is not None and int(axis) == 0 and \
            not op.get_attr("batch_dims"):
        return ROWS  # an embedding lookup: each row's own ids
    return _rows_or_meeting(op, index, kinds)


def _resource_gather(op, index, kinds):
    if kinds[0] == FIXED and kinds[1] == ROWS and not op.get_attr("batch_dims"):
        return ROWS
    return _unread(op)


def _one_hot(op, index, kinds):
    return ROWS if kinds[0] == ROWS and all(k == FIXED for k in kinds[1:]) else _unread(op)


def _constant_axes(op, position):
    axes = _const(op.inputs[position])
    rank = _rank(op.inputs[0])
    if axes is None or not rank:
        return None
    return {int(a) % rank for a in axes.reshape(-1)}


def _rows_or_meeting(op, index, kinds):
    """The ops that reorder, number, accumulate or pick rows, and a few per-row ops.

    Along any axis but the first they keep the rows; along the rows, each
    row's value depends on the others: the rows meet.
    """
    kind_type = op.type
    rows = kinds[0] == ROWS
    others_fixed = all(k == FIXED for k in kinds[1:])
    if kind_type == "Range" and _COUNT in kinds and set(kinds) <= {_COUNT, FIXED}:
        return _Index(op.name)
    if kind_type == "Fill" and kinds[0] == _SHAPE and kinds[1] == FIXED:
        return ROWS  # e.g. ones((batch_size, 1)): one constant row per row
    if kind_type in ("SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits",
                     "InTopKV2") and ROWS in kinds and set(kinds) <= {ROWS, FIXED}:
        return ROWS
    if kind_type in ("SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits") and \
            set(kinds) == {ROW_BLOCKS}:
        return ROW_BLOCKS
    if kind_type == "GatherV2" and rows and kinds[1] in (ROWS, FIXED) and kinds[2] == FIXED:
        axis = _const(op.inputs[2])
        if axis is not None and int(axis) % (_rank(op.inputs[0]) or 1) == 0:
            return _meeting(op, "picks rows of the batch by index")
    if not (rows and others_fixed):
        return _unread(op)
    if kind_type in ("MatrixDiag", "MatrixDiagV2", "MatrixDiagV3"):
        return _meeting(op, "builds a square of the batch's rows (e.g. `eye(batch_size)`)")
    if kind_type in ("Cumsum", "Cumprod", "CumulativeLogsumexp"):
        axes = _constant_axes(op, 1)
        if axes is None:
            return _unread(op)
        return _meeting(op, "accumulates along the batch's rows") if 0 in axes else ROWS
    if kind_type in ("ReverseV2", "Roll"):
        axes = _constant_axes(op, 1 if kind_type == "ReverseV2" else 2)
        if axes is None:
            return _unread(op)
        return _meeting(op, "reorders the batch's rows") if 0 in axes else ROWS
    if kind_type == "TopKV2":
        if _rank(op.inputs[0]) == 1:
            return _meeting(op, "sorts or picks the top of the batch's rows")
        return ROWS
    if kind_type == "GatherV2":
        axis = _const(op.inputs[2])
        if axis is None:
            return _unread(op)
        if int(axis) % (_rank(op.inputs[0]) or 1) == 0:
            return _meeting(op, "picks rows of the batch by index")
        return ROWS if not op.get_attr("batch_dims") else _unread(op)
    if kind_type == "ClipByValue":
        return ROWS
    return _unread(op)


def _table():
    entries = {}

    def add(types, kind, layout=""):
        for op_type in types:
            entries[op_type] = _Op(kind, layout)

    add(("Const",), _constant_op, _NO_ROWS)
    add(("Placeholder",), _placeholder)
    add(("ReadVariableOp", "VarHandleOp"), _constant_op, _NO_ROWS)
    add(_DATA, _data)
    add(("IteratorGetNextAsOptional",), _optional)
    add(("IdentityN",), _identity_n)
    add(_IDENTITY | _UNARY, _unary, _KEEPS)
    add(_BINARY, lambda op, index, kinds: _binary(op, kinds), _KEEPS)
    add(("AddN",), _add_n, _KEEPS)
    add(("Sum", "Mean", "Max", "Min", "Prod", "All", "Any"),
        lambda op, index, kinds: _reduce(op, kinds), _REDUCES)
    add(("ArgMax", "ArgMin"), _arg_reduce)
    add(("L2Loss",), _l2_loss)
    add(("Shape",), _shape, _COUNTS)
    add(("Pack",), _pack, _PACK)
    add(_SHAPE_OPS - {"StridedSlice"}, _shape_op, _SHAPES)
    add(("StridedSlice",), _slice, _STRIDED)
    add(("Slice",), _slice)
    add(("ConcatV2",), _concat, _CONCAT)
    add(("BroadcastTo",), _broadcast_to, _KEEPS)
    add(("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"), _matmul, _KEEPS)
    add(("Einsum",), lambda op, index, kinds: _einsum(op, kinds))
    add(_PER_ROW_IMAGE, _per_row_image, _KEEPS)
    add(("Select", "SelectV2"), _select, _KEEPS)
    add(("GatherV2",), _gather)
    add(("ResourceGather",), _resource_gather)
    add(("OneHot",), _one_hot)
    add(("Range",), _rows_or_meeting, _NO_ROWS)
    add(("Fill", "ClipByValue"), _rows_or_meeting, _KEEPS)
    add(("SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits", "InTopKV2",
         "MatrixDiag", "MatrixDiagV2", "MatrixDiagV3", "Cumsum", "Cumprod", "CumulativeLogsumexp",
         "ReverseV2", "Roll", "TopKV2"), _rows_or_meeting)
    return entries


# The one op table (read by `kind_of` and friends, and by `layout_of_op`).
OPS = _table()
_STATELESS_RANDOM = _Op(_stateless_random)


def _entry(op_type):
    """The table's entry for `op_type`, or None: an op kd does not read."""
    entry = OPS.get(op_type)
    if entry is None and op_type.startswith(_STATELESS_RANDOM_PREFIX):
        return _STATELESS_RANDOM
    return entry


def _unread(op):
    """An op whose output kd cannot read, given its inputs' kinds: never taken as rows."""
    return Unknown(op.name, op_type=op.type)


def _kind_of_op_output(op, index, kinds):
    """The kind of `op.outputs[index]`, given its inputs' kinds (see `OPS`)."""
    kind_type = op.type
    if _STATIC in kinds and kind_type not in _BINARY:
        kinds = [FIXED if k == _STATIC else k for k in kinds]
    entry = _entry(kind_type)
    if kind_type in _SOURCES:
        return entry.kind(op, index, kinds)
    if _OPTIONAL in kinds:
        # The batch taken out of its Optional (`fit`'s input: a cond on
        # `has_value()`), or the condition itself.
        if kind_type == "OptionalHasValue":
            return FIXED
        output = op.outputs[index]
        if kind_type in ("If", "StatelessIf") and (_rank(output) or 0) >= 1:
            return ROWS
        return _unread(op)
    unknown = _unknown_of(kinds)
    if unknown is not None:
        return unknown
    if SHARE in kinds:
        return _with_share(op, kinds)
    row_numbers = next((k for k in kinds if isinstance(k, _Index)), None)
    if row_numbers is not None:
        return _with_index(op, kinds, row_numbers)
    if GLOBAL in kinds:
        return _with_global(op, kinds)
    if kind_type == "Cast" and kinds[0] == FIXED and op.inputs[0].op.type == "Const" and \
            op.inputs[0].dtype.is_integer and op.outputs[0].dtype.is_floating and \
            op.inputs[0].shape.rank == 0:
        return _STATIC
    if all(k == FIXED for k in kinds) and not op.op_def.is_stateful:
        return FIXED  # a function of weights and constants alone: the same on every replica
    if entry is None:
        return _unread(op)
    if ROW_BLOCKS in kinds and set(kinds) <= {ROW_BLOCKS, FIXED} and kind_type != "ConcatV2":
        # Regrouped rows go through what each row goes through alone.
        kind = entry.kind(op, index, [ROWS if k == ROW_BLOCKS else k for k in kinds])
        return ROW_BLOCKS if kind == ROWS else kind
    return entry.kind(op, index, kinds)


# Ops whose output's kind does not depend on their inputs' (where the walk starts).
_SOURCES = frozenset({"Const", "Placeholder", "ReadVariableOp", "VarHandleOp",
                      "IteratorGetNextAsOptional"} | _DATA)


# What coupling reads of the table: where a tensor's rows lie in the global batch.
NO_ROWS = ()


def holds_no_rows(op_type):
    """Whether the table says `op_type`'s output holds no rows of the batch (weights, row numbers)."""
    entry = _entry(op_type)
    return entry is not None and entry.layout == _NO_ROWS


def layout_of_op(op, value, layouts):
    """The layout of `value` (an output of `op`) given its inputs' layouts, or None (see `OPS`).

    A layout names the data leaves a tensor's rows come from, block after
    block (`coupling.row_layout`); `NO_ROWS`: weights and constants.
    """
    entry = _entry(op.type)
    layout = entry.layout if entry is not None else ""
    if layout == _NO_ROWS:
        return NO_ROWS
    if layout == _CONCAT:
        axis = tf.get_static_value(op.inputs[-1])
        parts = layouts[:-1]
        if axis is not None and int(axis) % max(value.shape.rank or 1, 1) == 0 and \
                all(p is not None for p in parts):
            return tuple(block for part in parts for block in part)
        return _same(parts)
    if layout == _COUNTS:
        return layouts[0]  # a row count has the layout it counts
    if layout == _STRIDED and op.inputs[0].op.type == "Shape":
        begin = tf.get_static_value(op.inputs[1])
        return layouts[0] if begin is not None and int(begin.reshape(-1)[0]) == 0 else NO_ROWS
    if layout == _PACK:
        if op.get_attr("axis") == 0:
            return layouts[0] if all(p == NO_ROWS for p in layouts[1:]) else None
        return None
    if layout == _REDUCES:
        axes = tf.get_static_value(op.inputs[1])
        rank = op.inputs[0].shape.rank
        if axes is None or not rank:
            return None
        return layouts[0] if 0 not in {int(a) % rank for a in axes.reshape(-1)} else NO_ROWS
    if layout == _KEEPS or (layout in (_SHAPES, _STRIDED) and _keeps_rows(op)):
        return _same(layouts)
    return None


def _same(layouts):
    """The one layout of these inputs' rows (weights and constants aside), or None."""
    found = {p for p in layouts if p != NO_ROWS}
    if None in found or len(found) > 1:
        return None
    return found.pop() if found else NO_ROWS


def _with_share(op, kinds):
    """A loss share kd computed, scaled or summed with others: still a share; else unknown."""
    others = {k for k in kinds if k != SHARE}
    if op.type in _IDENTITY or (op.type in ("Add", "AddV2", "Sub", "AddN") and not others):
        return SHARE
    if op.type in ("Mul", "RealDiv", "Div", "DivNoNan", "MulNoNan", "Neg") and others <= {FIXED, _STATIC}:
        if op.type not in ("RealDiv", "Div", "DivNoNan") or kinds[0] == SHARE:
            return SHARE
    return _unread(op)


def _with_index(op, kinds, index):
    """The replica's row numbers: the global batch's once its offset is added, else the rows meet."""
    if op.type in _IDENTITY and len(kinds) == 1:
        return index
    if op.type in ("Add", "AddV2") and set(kinds) == {index, _OFFSET}:
        return ROWS  # global row numbers, each row its own
    return _numbered(index)


def _numbered(index):
    return Unknown(index.op, f"`{index.op}` (Range) numbers the rows from the batch size (e.g. "
                             "`arange(batch_size)` labels): each replica numbers its own rows "
                             "from 0, one device the global batch's", meets=True)


def _with_global(op, kinds):
    """An op with a GLOBAL input: GLOBAL with weights and constants, else the global batch meets local rows."""
    if not any(k in (ROWS, _COLUMNS, _DRAW, _COUNT, _SHAPE, ROW_SUM, ROW_MEAN) for k in kinds):
        return GLOBAL
    return _meeting(op, "combines the global batch with this replica's own rows")


def _per_row_subscripts(subscripts, letter):
    return subscripts[:1] == letter and letter not in subscripts[1:]


def _einsum(op, kinds):
    """An einsum's kind from its equation: each ROWS operand's first subscript indexes rows."""
    equation = op.get_attr("equation").decode()
    if "->" not in equation or "." in equation:
        return _unread(op)
    inputs, output = equation.replace(" ", "").split("->")
    inputs = inputs.split(",")
    if len(inputs) != len(kinds) or not set(kinds) <= {ROWS, FIXED}:
        return _unread(op)
    letters = {subscripts[:1] for subscripts, kind in zip(inputs, kinds) if kind == ROWS}
    if not letters:
        return FIXED
    if len(letters) > 1:
        return _meeting(op, "multiplies row-aligned tensors across the batch, so each row meets "
                            "every other row (e.g. similarities `einsum('ie,je->ij', x, y)`)")
    (letter,) = letters
    if not all(_per_row_subscripts(s, letter) for s, k in zip(inputs, kinds) if k == ROWS) or \
            any(letter in s for s, k in zip(inputs, kinds) if k == FIXED):
        return _unread(op)
    if letter not in output:
        return ROW_SUM  # summed over the rows: a sum of per-row products
    return ROWS if _per_row_subscripts(output, letter) else _unread(op)


_ROW_SIZES = {}  # graph -> static row counts of the batch tensors seen in this evaluation


def _static_rows(graph):
    return _ROW_SIZES.get(id(graph), ())


def _note_rows(op, kinds):
    for output, kind in zip(op.outputs, kinds):
        if kind == ROWS and output.shape.rank and output.shape[0] is not None:
            _ROW_SIZES.setdefault(id(op.graph), set()).add(int(output.shape[0]))


def _evaluate(tensor):
    """The kind of a graph tensor (see the module docstring)."""
    try:
        return _walk(tensor)
    finally:
        _ROW_SIZES.clear()


def _walk(tensor, memo=None):
    memo = {} if memo is None else memo
    marks = {}
    stack = [(tensor.op, False)]
    while stack:
        op, ready = stack.pop()
        if op.name in memo:
            continue
        graph_marks = marks.get(op.graph)
        if graph_marks is None:
            graph_marks = marks[op.graph] = _MARKS.get(op.graph, {})
        marked = [graph_marks.get(out.name) for out in op.outputs]
        if all(m is not None for m in marked) and op.outputs:
            memo[op.name] = marked
            _note_rows(op, marked)  # a padded batch keeps its static row count
            continue
        if not ready:
            stack.append((op, True))
            stack.extend((t.op, False) for t in op.inputs if t.op.name not in memo)
            continue
        kinds = [memo[t.op.name][t.value_index] for t in op.inputs]
        memo[op.name] = [m if m is not None else _kind_of_op_output(op, i, kinds)
                         for i, m in enumerate(marked)]
        if op.type in ("Placeholder",) or op.type in _DATA:
            _note_rows(op, memo[op.name])
    return memo[tensor.op.name][tensor.value_index]


@tf.autograph.experimental.do_not_convert
def kind_of(term):
    """How `term` adds up over replicas: FIXED, ROW_SUM, ROW_MEAN, GLOBAL or an `Unknown`.

    A term that still has one entry per row (not reduced) counts as its sum
    over rows (`scale_regularization` sums each term). Needs a graph tensor
    (inside a `tf.function`, where `strategy.run` traces its replicas); an
    eager tensor is `Unknown`.
    """
    if not isinstance(term, tf.Tensor) or not hasattr(term, "op") or tf.executing_eagerly():
        try:
            term.op  # noqa: B018 - an eager tensor has no op
        except (AttributeError, ValueError):
            return Unknown("an eager tensor")
    try:
        kind = _evaluate(term)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        return Unknown(term.op.name)  # a graph shape the walk does not know: not split
    kind = _settled(kind)
    if kind in (ROWS, ROW_BLOCKS):
        return ROW_SUM
    if kind in (FIXED, ROW_SUM, ROW_MEAN, GLOBAL, SHARE):
        return kind
    if isinstance(kind, Unknown):
        return kind
    return Unknown(term.op.name)


@tf.autograph.experimental.do_not_convert
def kind_of_value(tensor):
    """What `tensor` holds: ROWS, GLOBAL, FIXED, ROW_SUM, ROW_MEAN, another kind or an `Unknown`.

    Unlike `kind_of`, a tensor with one entry per row stays ROWS. Needs a
    graph tensor; anything else is `Unknown`.
    """
    if not isinstance(tensor, tf.Tensor) or tf.executing_eagerly() or not hasattr(tensor, "op"):
        return Unknown("a value that is not a graph tensor")
    try:
        kind = _evaluate(tensor)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        return Unknown(tensor.op.name)
    return _settled(kind)


def _settled(kind):
    if kind == _STATIC:
        return FIXED
    if isinstance(kind, _Index):
        return _numbered(kind)
    return kind


_LOCAL = (ROWS, _COLUMNS, _COUNT, _SHAPE, ROW_SUM, ROW_MEAN)


@tf.autograph.experimental.do_not_convert
def row_sources(op_name, graph, anchor_of):
    """The anchors above the op `op_name` along the replica's own rows.

    Walks up from the op's inputs through tensors that hold (or count) the
    replica's rows, stopping at those `anchor_of(tensor)` names (a key).
    Returns `(keys, complete)`: the keys found, and whether every such path
    ended at one (False: a path reached the data or a value without one).
    """
    memo = {}
    try:
        op = graph.get_operation_by_name(op_name)
    except (KeyError, ValueError):
        return set(), False
    found, complete = set(), True
    stack, seen = list(op.inputs), set()
    while stack:
        tensor = stack.pop()
        if tensor.ref() in seen:
            continue
        seen.add(tensor.ref())
        key = anchor_of(tensor)
        if key is not None:
            found.add(key)
            continue
        try:
            kind = _walk(tensor, memo)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError):
            kind = Unknown(tensor.op.name)
        finally:
            _ROW_SIZES.clear()
        if kind in (FIXED, GLOBAL, _STATIC, _OFFSET) or tensor.dtype == tf.resource:
            continue
        if tensor.op.type == "Placeholder" or tensor.op.type in _DATA or not tensor.op.inputs:
            complete = False
            continue
        stack.extend(tensor.op.inputs)
    return found, complete


@tf.autograph.experimental.do_not_convert
def row_mixing(tensor):
    """Where `tensor` (per-example values) mixes the replica's rows, or "" if nowhere kd can see.

    Ops kd does not know are not judged (""): only row statistics and
    per-replica random draws that reach the values are named.
    """
    if not isinstance(tensor, tf.Tensor) or tf.executing_eagerly():
        return ""
    try:
        kind = _evaluate(tensor)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        return ""
    return kind.mixing if isinstance(kind, Unknown) else ""


@dataclasses.dataclass(frozen=True)
class Term:
    """One term of a loss that adds terms up (see `loss_terms`).

    `tensor`: the term; `kind`: what it is to the rows (as `kind_of` says);
    `replica_power`: how many times a constant equal to the replicas in
    sync multiplies it (-1: divided by R once, `x / R` or `x * (1 / R)`;
    a row count times R in a divisor counts too). Other constants (a
    regularizer's rate) do not count: the rule asks where R is, not what
    the term's scale is.
    """

    tensor: tf.Tensor
    kind: object
    replica_power: int


_ADDS = {"Add", "AddV2", "Sub", "AddN", "Neg"}
_SCALES = {"Mul", "MulNoNan"}
_DIVIDES = {"RealDiv", "Div", "DivNoNan"}


def _scalar_const(tensor, depth=0):
    """`tensor`'s value if it is a constant single number when traced, else None.

    Also an entry of a constant shape (`tf.shape(x)[0]` of a static shape
    is a constant vector sliced), cast or scaled by constants.
    """
    try:
        value = _const(tensor)
        op = tensor.op
        if value is None and depth < 4 and op.type in _IDENTITY:
            value = _scalar_const(op.inputs[0], depth + 1)
        elif value is None and depth < 4 and op.type in _FOLDED:
            a, b = (_scalar_const(t, depth + 1) for t in op.inputs)
            value = None if a is None or b is None else _FOLDED[op.type](a, b)
        elif value is None and op.type == "StridedSlice" and op.get_attr("shrink_axis_mask") == 1:
            whole, begin = _const(op.inputs[0]), _const(op.inputs[1])
            if whole is not None and begin is not None and np.ndim(whole) == 1 and np.size(begin) == 1:
                value = whole[int(np.reshape(begin, ()))]
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        return None
    if value is None or np.size(value) != 1:
        return None
    return float(np.reshape(value, ()))


def _power_of(value, replicas):
    """+1 if the constant `value` is R, -1 if it is 1/R, else 0."""
    if np.isclose(value, replicas, rtol=1e-6, atol=0):
        return 1
    if np.isclose(value * replicas, 1.0, rtol=1e-6, atol=0):
        return -1
    return 0


def _divisor_power(tensor, replicas):
    """The power of R in a divisor that is not constant (`cast(rows * R)`: 1)."""
    power = 0
    while True:
        op = tensor.op
        if op.type in _IDENTITY:
            tensor = op.inputs[0]
            continue
        if op.type in _SCALES:
            constants = [_scalar_const(t) for t in op.inputs]
            if constants[1] is not None:
                power, tensor = power + _power_of(constants[1], replicas), op.inputs[0]
                continue
            if constants[0] is not None:
                power, tensor = power + _power_of(constants[0], replicas), op.inputs[1]
                continue
        return power


@tf.autograph.experimental.do_not_convert
def loss_terms(target, replicas):
    """The terms a scalar loss adds up, each with its kind and its power of R (see `Term`).

    Walks down from `target` through what adds terms (`+`, `-`, `tf.add_n`,
    a `reduce_sum` of stacked terms), what leaves them as they are (casts,
    identities) and what scales them by a number the same on every replica
    (a constant, a variable: a loss scale); every other op ends a term,
    whose kind `kind_of` reads. Constants equal to R (`replicas`) or 1/R on
    the way are counted (`Term.replica_power`), as is R in a divisor that
    counts rows (`tf.nn.compute_average_loss` without `global_batch_size`
    divides by `rows * R`). A constant term (its gradient is 0) is left out.

    Args:
        target: A graph tensor (the loss whose gradient is taken).
        replicas: R, the replicas in sync.

    Returns:
        A list of `Term`s.
    """
    try:
        return _loss_terms(target, replicas)
    finally:
        _ROW_SIZES.clear()


def _loss_terms(target, replicas):
    # One walk for every term: the ops it read, and the static row counts it
    # noted (`_static_rows`), serve the next term's walk.
    memo = {}

    def kind(tensor):
        try:
            found = _walk(tensor, memo)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError):
            return Unknown(tensor.op.name)
        found = _settled(found)
        return ROW_SUM if found in (ROWS, ROW_BLOCKS) else found

    terms, stack = [], [(target, 0)]
    while stack:
        tensor, power = stack.pop()
        op = tensor.op
        if _scalar_const(tensor) is not None or op.type in ("Const", "StopGradient", "PreventGradient"):
            continue  # no gradient
        if _MARKS.get(tensor.graph, {}).get(tensor.name) is not None:
            terms.append(Term(tensor, kind(tensor), power))  # kd's own (a share): read as a whole
            continue
        if op.type in _IDENTITY or op.type in _ADDS:
            stack.extend((t, power) for t in op.inputs)
            continue
        if op.type == "Sum" and op.inputs[0].op.type == "Pack" and (_rank(op.inputs[0]) or 0) == 1 \
                and kind(op.inputs[1]) == FIXED:
            stack.extend((t, power) for t in op.inputs[0].op.inputs)  # sum of stacked terms
            continue
        if op.type == "Sum" and _rank(op.inputs[0]) == 0:
            stack.append((op.inputs[0], power))
            continue
        if op.type in _DIVIDES and kind(tensor) == ROW_MEAN and kind(op.inputs[0]) != ROW_MEAN:
            # A sum over rows divided by their count, known when traced
            # where the batch's shape is static: a mean, not a constant scale.
            terms.append(Term(tensor, ROW_MEAN, power - _divisor_power(op.inputs[1], replicas)))
            continue
        if op.type in _SCALES | _DIVIDES:
            a, b = op.inputs[0], op.inputs[1]
            constants = [_scalar_const(a), _scalar_const(b)]
            if constants[1] is not None and op.type in _DIVIDES and kind(a) == ROW_SUM and \
                    float(constants[1]).is_integer() and int(constants[1]) in _static_rows(op.graph):
                # A sum over rows divided by the replica's static row count
                # (`tf.shape(x)[0]` is a constant where the shape is static):
                # a mean. (Divided by R times it, every replica's rows counted:
                # exact, as every replica has those rows.)
                terms.append(Term(tensor, ROW_MEAN, power))
                continue
            if constants[1] is not None:
                sign = -1 if op.type in _DIVIDES else 1
                stack.append((a, power + sign * _power_of(constants[1], replicas)))
                continue
            if constants[0] is not None and op.type in _SCALES:
                stack.append((b, power + _power_of(constants[0], replicas)))
                continue
            kinds = [kind(a), kind(b)]
            if kinds[1] == FIXED and kinds[0] != FIXED and (_rank(b) or 0) == 0:
                stack.append((a, power))  # scaled by a number the same on every replica
                continue
            if op.type in _SCALES and kinds[0] == FIXED and kinds[1] != FIXED and (_rank(a) or 0) == 0:
                stack.append((b, power))
                continue
        terms.append(Term(tensor, kind(tensor), power))
    return terms
