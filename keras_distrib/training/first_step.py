"""The first-step check: the distributed step against one device, on the model's own first batch.

kd makes a step exact by reading what the model computes: where the rows of
the batch meet, how each term adds up over replicas. A model that does
something kd reads wrongly would otherwise train off one device's result
without a word. So at the first training step of every step function kd
traces (a `Step` made, or traced again where rows met), on several replicas,
kd checks the step itself: its loss, its logs and its global gradient
against what one device computes on the same global batch, from the same
weights and random state.

How, without tracing the step twice:

1. Before the step, `Snapshot` copies every variable it may write (weights,
   BatchNormalization statistics, seed states, metrics, optimizer state),
   each replica's copy.
2. The real first step runs. Its compiled function also returns the batch
   each replica took and the global gradients its all-reduce produced
   (`ReducedState.recorded_gradients`), tensors the step holds anyway.
3. The step's result is copied too, and the copies from before the step are
   written back. One device's step then runs eagerly on that global batch
   (the replicas' rows in the order of TensorFlow's split,
   `replica.piece_order`) in a thread of its own, outside the strategy,
   inside a `keras.StatelessScope`: it reads the variables as they were
   before the step and writes none of them (BatchNormalization statistics,
   metrics, seed states stay in the scope). It stops at the optimizer: the
   gradients are recorded and not applied, and what the step reads after
   its update are the weights the distributed step wrote.
4. Every log and every gradient is compared, relative to the largest
   magnitude of its value (`difference`), against round-off of its dtype
   (`TOLERANCE`). Within it, the step's result is written back and training
   goes on. Beyond it, every variable stays as it was before the step and a
   ValueError names the first log or gradient that differs, by how much,
   and the likely cause: the first layer whose outputs on each replica's
   rows apart differ from its outputs on the whole batch
   (`first_layer_apart`, on the batch every worker gathered), where there
   is one, or the layers it could not run apart (called only in a custom
   `train_step`).

Where the global batch's data exceeds `WHOLE_BATCH_BYTES`, steps 3 and 4
compare a sub-batch instead (`sub_batch`): each worker cuts the first
`SUB_BATCH_ROWS` rows of each of its replicas' batches, the distributed
step runs again on them from the variables before the step, only that
sub-batch is gathered for one device's step, and the real step's result is
written back when the two agree.

Random layers draw the same numbers in both: kd lays the replicas' draws out
over the global batch from the seed state one device starts from.

The check's eager work (the copies, one device's step, the comparison) runs
each op as its kernel (`_keras_compat.eager_ops_as_kernels`, entered by
`step.Step`): TensorFlow would otherwise make a function of each new eager
op first, which cost more than the step's own arithmetic on small models.

`model.compile(first_step_check=False)` turns it off.
"""

import threading

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from keras_distrib import _keras_compat
from keras_distrib.training import gradients as gradients_lib
from keras_distrib.training import logs as logs_lib
from keras_distrib.training import replica
from keras_distrib.cluster import strategies

__all__ = [
    "FirstStepMismatch",
    "GRADIENT_TOLERANCE",
    "SUB_BATCH_ROWS",
    "Snapshot",
    "TOLERANCE",
    "WHOLE_BATCH_BYTES",
    "applies",
    "check",
    "difference",
    "first_layer_apart",
    "global_batch",
    "replica_batches",
    "sub_batch",
]

# Round-off one device and several replicas may differ by, relative to a
# value's largest magnitude, by the dtype it is computed in: for the logs,
# the bounds of docs/concepts/exactness.md. A gradient is the derivative of
# the whole network, and its round-off grows with depth: one device's step
# computed eagerly and the replicas' compiled step (TensorFlow's fused
# kernels) give gradients apart by up to a few thousandths of the largest
# in float32 on a ResNet with 39 BatchNormalization layers, by a tenth in
# float16, where float64 agrees to 1e-15 (the measured margins:
# docs/benchmarks/2026-11-29-first-step-margins.md). Below float64 the
# gradients are held to a bound above what such round-off reaches on those
# models, which still catches a gradient of the wrong scale or a term
# missing or doubled; the loss and metrics to the dtype's round-off.
TOLERANCE = {"float64": 1e-9, "float32": 2e-5, "float16": 5e-3, "bfloat16": 2e-2}
GRADIENT_TOLERANCE = {"float64": 1e-9, "float32": 2e-2, "float16": 0.25, "bfloat16": 0.5}


# One device's step on the whole global batch needs memory for the whole
# batch's activations, the replicas' together. Where the global batch's data
# (inputs, targets, weights) exceeds this many bytes, the check runs the
# distributed step once more, and one device's, on a sub-batch of
# `SUB_BATCH_ROWS` rows of each replica's (on every worker, its own replicas').
WHOLE_BATCH_BYTES = 64 * 2**20
SUB_BATCH_ROWS = 4


class FirstStepMismatch(ValueError):
    """The first distributed step differs from one device's beyond round-off (nothing was trained)."""


def applies(model, strategy):
    """Whether `model`'s training steps under `strategy` are checked at their first step.

    On several replicas in sync, unless compiled with
    `first_step_check=False`. Not under a parameter server (each worker's
    step is one replica's, scheduled remotely), nor for a model compiled to
    compute on each replica's rows (`batch_norm="per_replica"`,
    `rows_meet="per_replica"`: not one device's step, by request).
    """
    traits = strategies.traits(strategy)
    if traits.replicas <= 1 or traits.is_parameter_server:
        return False
    if "per_replica" in (getattr(model, "batch_norm", "global"), getattr(model, "rows_meet", "global")):
        return False
    return getattr(model, "first_step_check", True) is not False


def _state_variables(model):
    """Every Keras variable a training step may write, each once."""
    found = {}
    for variable in _keras_compat.model_variables(model):
        found.setdefault(id(variable), variable)
    for optimizer in gradients_lib.optimizers_of(model):
        for variable in optimizer.variables:
            found.setdefault(id(variable), variable)
    return list(found.values())


class Snapshot:
    """Variables a step may write, copied; `restore` writes the copies back.

    Made in cross-replica context (the strategy's scope, outside a step).

    Args:
        model: The model whose variables are copied: every variable a step
            may write (`trainable_only=False`), or its trainable weights.

    Attributes:
        variables: The Keras variables copied.
        copies: For each, the values of its `tf.Variable`s in this process
            (each replica's copy of a distributed variable).
    """

    def __init__(self, model, *, trainable_only=False):
        self.variables = (list(model.trainable_variables) if trainable_only
                          else _state_variables(model))
        # (A read is the value at that moment: a later write does not change it.)
        self.copies = [[c.read_value() for c in _keras_compat.variable_copies(v)]
                       for v in self.variables]
        # A metric state, read in cross-replica context: summed (or averaged)
        # over every replica of every worker, as one device holds it.
        self._aggregated = {
            i: tf.convert_to_tensor(v.value) for i, v in enumerate(self.variables)
            if _keras_compat.sync_on_read_aggregation(v) is not None
        }

    def one_device_value(self, index):
        """What one device reads of variable `index` (taken in cross-replica context)."""
        if index in self._aggregated:
            return self._aggregated[index]
        return self.copies[index][0]

    def restore(self):
        """Writes every copy back into its variable."""
        _write(self.variables, self.copies)


def _write(variables, copies):
    for variable, values in zip(variables, copies):
        for holder, value in zip(_keras_compat.variable_copies(variable), values):
            holder.assign(value)


def _piece_order(strategy):
    replicas = strategy.num_replicas_in_sync
    local = len(tuple(getattr(strategy.extended, "worker_devices", ()))) or replicas
    workers = max(replicas // local, 1)
    return replica.piece_order(replicas, workers if replicas % workers == 0 else 1)


def _has_rows(value):
    return isinstance(value, (tf.Tensor, tf.RaggedTensor, tf.SparseTensor)) \
        and value.shape.rank != 0


def _row_count(value):
    if isinstance(value, tf.RaggedTensor):
        return value.nrows(out_type=tf.int64)
    if isinstance(value, tf.SparseTensor):
        return value.dense_shape[0]
    return tf.shape(value, out_type=tf.int64)[0]


def _counts(strategy, data):
    """Each replica's data bytes and rows of each leaf (-1: a leaf without rows), by replica id.

    A `[replicas, 1 + leaves]` array, the same on every worker: across
    workers one gather brings every replica's. Bytes count dense tensors.
    """
    flat = tree.flatten(data)

    def count(*values):
        size = sum((tf.size(v, out_type=tf.int64) * v.dtype.size for v in values
                    if isinstance(v, tf.Tensor)), tf.constant(0, tf.int64))
        rows = [_row_count(v) if _has_rows(v) else tf.constant(-1, tf.int64) for v in values]
        return tf.stack([size, *rows])[None]

    if strategies.traits(strategy).is_multi_worker:
        return np.asarray(strategy.gather(strategy.run(count, args=tuple(flat)), axis=0))
    local = [strategy.experimental_local_results(v) for v in flat]
    return np.concatenate([np.asarray(count(*values)) for values in zip(*local)], axis=0)


def replica_batches(strategy, data, counts=None):
    """Each replica's batch, in the order one device takes them (TensorFlow's split).

    `data`: the per-replica values a step function returned (this process's
    replicas). Returns one structure like `data` per replica, ordered by
    `replica.piece_order`: across workers, each leaf with rows is gathered
    from every worker (one gather), so every worker holds every replica's
    rows. A leaf without rows is replica 0's in each. `counts`: `_counts`
    of `data`, where already known.
    """
    flat = tree.flatten(data)
    local = [strategy.experimental_local_results(v) for v in flat]
    replicas = strategy.num_replicas_in_sync
    if strategies.traits(strategy).is_multi_worker:
        counts = _counts(strategy, data) if counts is None else counts
        leaves = []
        for index, (value, parts) in enumerate(zip(flat, local)):
            if not _has_rows(parts[0]):
                leaves.append([parts[0]] * replicas)
                continue
            gathered = strategy.gather(value, axis=0)
            leaves.append(tf.split(gathered, [int(r) for r in counts[:, 1 + index]], axis=0))
    else:
        leaves = [list(parts) if _has_rows(parts[0]) else [parts[0]] * len(parts) for parts in local]
    order = _piece_order(strategy)
    return [tree.pack_sequence_as(data, [leaf[r] for leaf in leaves])
            for r in sorted(range(len(order)), key=order.__getitem__)]


def _joined(pieces):
    """The pieces' rows in one batch; a leaf without rows is the first piece's."""
    def whole(*parts):
        return tf.concat(parts, axis=0) if _has_rows(parts[0]) else parts[0]

    return tree.map_structure(whole, *pieces)


def global_batch(strategy, data):
    """The global batch the replicas of one step took, as one device takes it.

    `data`: the per-replica values a step function returned (this process's
    replicas). Each leaf with rows is put together from every replica's
    rows, gathered from the other workers where there are several, in the
    order of TensorFlow's split (`replica.piece_order`); a leaf without rows
    is replica 0's.
    """
    return _joined(replica_batches(strategy, data))


def _dense(value):
    return np.asarray(tf.convert_to_tensor(value), dtype=np.float64)


def difference(value, reference, scale=0.0):
    """How far `value` is from `reference`, relative to the larger of their largest magnitudes.

    Relative to `scale` where that is larger: a gradient one device computes
    as zero up to round-off (a bias before BatchNormalization) is compared
    with the largest gradient of its step. Sparse gradients
    (`tf.IndexedSlices`) are compared dense. A value finite in one and not
    in the other counts as infinitely far; non-finite in both, as equal.
    """
    a, b = _dense(value), _dense(reference)
    if a.shape != b.shape:
        return np.inf
    if a.size == 0:
        return 0.0
    # Non-finite in both agrees (a sum over replicas may make NaN of one
    # device's inf; a LossScaleOptimizer skips either step alike).
    nonfinite = ~np.isfinite(a)
    if np.any(nonfinite != ~np.isfinite(b)):
        return np.inf
    a, b = np.where(nonfinite, 0.0, a), np.where(nonfinite, 0.0, b)
    scale = max(np.max(np.abs(a)), np.max(np.abs(b)), scale)
    if scale == 0:
        return 0.0
    return float(np.max(np.abs(a - b)) / scale)


def _tolerance(model, *dtypes, table=TOLERANCE):
    """Round-off of the least precise of the model's compute dtype and `dtypes`, from `table`."""
    names = [tf.as_dtype(d).name for d in dtypes if d is not None]
    names.append(tf.as_dtype(keras.backend.standardize_dtype(model.dtype_policy.compute_dtype)).name)
    return max(table.get(name, table["float32"]) for name in names)


class _RecordedUpdates:
    """Each optimizer's update records its gradients and writes nothing (one device's reference).

    The gradients go through kd's `all_reduce` (on one device: as they are),
    which records them on the step's batch, as in the distributed step: kd's
    own step calls it, and the optimizer's `apply` does in a step of one's
    own. What the step reads after the update are the weights the
    distributed step wrote (`after`).
    """

    def __init__(self, model, scope, after):
        self._optimizers = gradients_lib.optimizers_of(model)
        self._scope = scope
        self._after = after

    def __enter__(self):
        # kd's pipeline is the optimizer's own `apply` attribute (a step of
        # one's own), and Keras's apply after kd's all-reduce that of
        # `gradients.apply_reduced` (kd's own step): both kept, and put back.
        self._kept = []
        for optimizer in self._optimizers:
            gradients_lib.exact_optimizer(optimizer)
            self._kept.append((vars(optimizer).get("apply"),
                               _keras_compat.replace_reduced_apply(optimizer, self._write_after)))
            object.__setattr__(optimizer, "apply", self._apply_of(optimizer))
        return self

    def _apply_of(self, optimizer):
        def apply(grads, trainable_variables=None):
            variables = _keras_compat.updated_variables(optimizer, trainable_variables)
            gradients_lib.all_reduce(list(grads), variables)
            self._write_after(optimizer, grads, variables)

        return apply

    def _write_after(self, optimizer, grads, trainable_variables):
        for variable in _keras_compat.updated_variables(optimizer, trainable_variables):
            if id(variable) in self._after:
                self._scope.add_update((variable, self._after[id(variable)]))

    def __exit__(self, *exc):
        for optimizer, (apply, reduced_apply) in zip(self._optimizers, self._kept):
            if apply is None:
                object.__delattr__(optimizer, "apply")
            else:
                object.__setattr__(optimizer, "apply", apply)
            _keras_compat.replace_reduced_apply(optimizer, reduced_apply)


def _in_own_thread(function):
    """`function()`, run in a thread of its own: outside the strategy (one device's replica
    context), where a `keras.StatelessScope` is its own (Keras keeps it per thread)."""
    result = {}

    def run():
        try:
            result["value"] = function()
        except Exception as error:  # handed to the caller's thread
            result["error"] = error

    thread = threading.Thread(target=run, name="kd-first-step-check")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _one_device(model, step, data, before, after):
    """One device's step on `data` from the variables as they were before the step, writing none.

    Returns `(outputs, metric states, recorded gradients)`. `before`: the
    `Snapshot` of every variable before the step; the trainable weights
    hold these values again (the tape watches them), every other variable
    is read from it. `after`: the `Snapshot` of the distributed step's
    trainable weights, which the step reads after its update.
    """
    trainable = {id(v) for v in model.trainable_variables}
    # Every variable but the weights is read from the copies: nothing to write back.
    mapping = [(v, before.one_device_value(i)) for i, v in enumerate(before.variables)
               if id(v) not in trainable]
    # A weight's copies are alike on every replica: the first is its value.
    updated = {id(v): copies[0] for v, copies in zip(after.variables, after.copies)}

    def run():
        # Reads see the weights (the tape watches them); every write stays in the scope.
        with keras.StatelessScope(state_mapping=mapping) as scope, \
                _RecordedUpdates(model, scope, updated):
            return step(data)

    return _in_own_thread(run)


def _layer_of(variable, model):
    path = str(getattr(variable, "path", variable.name))
    return path.rsplit("/", 1)[0] if "/" in path else path


def _differences(model, logs, reference_logs, gradients, reference_gradients):
    """`[(what, difference, tolerance, variable or None)]` beyond tolerance.

    The logs first, then the gradients, by layer in model order.
    """
    found = []
    flat_logs = dict(tree.flatten_with_path(logs)) if logs else {}
    # The losses first: what the step optimizes, where a difference starts.
    ordered = sorted(tree.flatten_with_path(reference_logs),
                     key=lambda item: "loss" not in logs_lib.path_key(item[0]))
    for path, value in ordered:
        if path not in flat_logs or not tf.is_tensor(value) or not value.dtype.is_floating:
            continue
        distance = difference(flat_logs[path], value)
        tolerance = _tolerance(model, value.dtype)
        if not distance <= tolerance:
            found.append((f"the logged {logs_lib.path_key(path)!r}", distance, tolerance, None))
    order = {id(v): i for i, v in enumerate(model.trainable_variables)}
    pairs = []
    for (variables, values), (_, references) in zip(gradients, reference_gradients):
        largest = max([float(np.max(np.abs(_dense(r)), initial=0.0)) for r in references
                       if r is not None] + [0.0])
        for variable, value, reference in zip(variables, values, references):
            if value is None or reference is None:
                if (value is None) != (reference is None):
                    pairs.append((variable, np.inf, 0.0))
                continue
            distance = difference(value, reference, largest)
            tolerance = _tolerance(model, reference.dtype, variable.dtype, table=GRADIENT_TOLERANCE)
            if not distance <= tolerance:
                pairs.append((variable, distance, tolerance))
    pairs.sort(key=lambda item: order.get(id(item[0]), len(order)))
    found += [(f"the gradient of {v.path!r} (layer {_layer_of(v, model)!r})", d, t, v)
              for v, d, t in pairs]
    return found


def first_layer_apart(model, pieces, tolerance):
    """The first layer whose outputs on the global batch differ from its outputs on each replica's rows.

    Returns `(layer name, layer class, difference)`, or None: no layer
    differs, or the replicas' rows took other calls of the layers than the
    whole batch's. `pieces`: each replica's batch, in the order one device
    takes them (`replica_batches`: on every worker, every worker's
    replicas). One device runs the model in inference mode (no random
    draw, BatchNormalization's moving statistics) on the global batch,
    then on each replica's rows apart: a functional model through a model
    of the outputs of its own graph's calls (`graph_calls`: a layer shared
    with another model counts only here), any other model (a subclassed
    one) through its own `call` on the batch's inputs, each layer's outputs
    recorded as its calls return (`_RecordedCalls`; inner layers first). A layer computed
    only in a custom `train_step`, outside the model's `call`, is not seen
    (`_layers_apart` says which layers were). A layer whose outputs differ
    reads other rows of the batch than its own (its rows meet), so a
    replica computing it alone computes something else. Run only when the
    check refuses a step: it costs one forward pass per replica.
    """
    return _layers_apart(model, pieces, tolerance)[0]


def _layers_apart(model, pieces, tolerance):
    """`(first_layer_apart's answer, the layers the forward ran, nested ones included)`."""
    inputs = [keras.utils.unpack_x_y_sample_weight(piece)[0] for piece in pieces]
    graph, probe = _keras_compat.graph_calls(model), None
    if graph is not None:
        graph_inputs, calls = graph
        try:
            probe = keras.Model(graph_inputs, [t for _, outputs in calls for t in outputs])
        except (AttributeError, ValueError, TypeError):  # a graph the probe cannot cut
            probe = None
    if probe is not None:
        def outputs_of(x):
            flat, grouped = list(tree.flatten(probe(x, training=False))), []
            for _, outputs in calls:
                grouped.append(flat[:len(outputs)])
                flat = flat[len(outputs):]
            return [layer for layer, _ in calls], grouped
    else:
        # A subclassed model (or a graph the probe cannot cut): every layer's
        # outputs as its calls return, inner layers before the ones holding them.
        def outputs_of(x):
            with _RecordedCalls(model) as recorded:
                model(x, training=False)
            return [layer for layer, _ in recorded.calls], [o for _, o in recorded.calls]

    def forward():
        with keras.StatelessScope():  # inference writes nothing; nothing is kept if it did
            whole = outputs_of(tree.map_structure(lambda *p: tf.concat(p, axis=0), *inputs))
            apart = [outputs_of(x) for x in inputs if int(tf.shape(tree.flatten(x)[0])[0]) > 0]
            return whole, apart

    (layers, whole), apart = _in_own_thread(forward)
    seen = {id(inner): inner for layer in layers if isinstance(layer, keras.layers.Layer)
            for inner in _keras_compat.flatten_layers(layer)}
    # Calls matched in order: where the replicas' rows took other calls, nothing is named.
    if any(len(called) != len(layers) or any(a is not b for a, b in zip(called, layers))
           for called, _ in apart):
        return None, seen
    apart = [outputs for _, outputs in apart]
    for layer, outputs, *per_piece in zip(layers, whole, *apart):
        for index, value in enumerate(outputs):
            pieces_of = [flat[index] for flat in per_piece]
            if not tf.is_tensor(value) or value.shape.rank == 0 \
                    or any(not tf.is_tensor(p) or p.shape.rank == 0 for p in pieces_of):
                continue
            joined = tf.concat(pieces_of, axis=0)
            distance = difference(joined, value)
            if not distance <= tolerance:
                return (layer.name, type(layer).__name__, distance), seen
    return None, seen


def _step_layer_apart(model, step, data, pieces, before, after, seen, tolerance):
    """A layer the step calls outside the model's `call` whose rows meet, or the ones not compared.

    Returns `(first_layer_apart's answer or None, names of the layers not
    compared)`. One device's step runs again on the global batch `data`
    (from the variables `before`, writing none), recording each call of a
    layer `seen` does not hold (called only in a custom `train_step`) with
    its input. A layer whose input has the global batch's rows is run in
    inference mode on that input and on each replica's rows of it apart
    (`pieces`' row counts), compared as `first_layer_apart` does. One whose
    input has other rows (two views stacked, say) cannot be split by
    replica: it is returned as not compared.
    """
    if all(id(layer) in seen for layer in _keras_compat.flatten_layers(model) if layer is not model):
        return None, []  # every layer ran in the model's call: none is left to look at
    with _RecordedCalls(model) as recorded:
        _one_device(model, step, data, before, after)
    counts = [int(tf.shape(tree.flatten(keras.utils.unpack_x_y_sample_weight(p)[0])[0])[0])
              for p in pieces]
    outside = [(layer, x) for (layer, _), x in zip(recorded.calls, recorded.inputs)
               if id(layer) not in seen]
    not_compared = []

    def compare():
        with keras.StatelessScope():
            for layer, x in outside:
                if not (isinstance(x, tf.Tensor) and x.shape.rank and x.shape[0] == sum(counts)):
                    not_compared.append(layer.name)
                    continue
                whole = tree.flatten(layer(x, training=False))
                parts = [tree.flatten(layer(part, training=False))
                         for part in tf.split(x, counts, axis=0) if int(part.shape[0]) > 0]
                for index, value in enumerate(whole):
                    if not tf.is_tensor(value) or value.shape.rank == 0:
                        continue
                    distance = difference(tf.concat([p[index] for p in parts], axis=0), value)
                    if not distance <= tolerance:
                        return layer.name, type(layer).__name__, distance
        return None

    found = _in_own_thread(compare)
    return found, list(dict.fromkeys(not_compared))


class _RecordedCalls:
    """Within it, each call of a layer of `model` (the model itself aside) records its outputs.

    `calls`: `[(layer, flat outputs)]`, in the order the calls return;
    `inputs`: each call's first positional argument (None without one).
    The layers' own `call` attribute (kd's hooks where installed) is kept
    and put back.
    """

    def __init__(self, model):
        self._layers = [layer for layer in _keras_compat.flatten_layers(model) if layer is not model]
        self.calls = []
        self.inputs = []

    def __enter__(self):
        self._kept = [vars(layer).get("call") for layer in self._layers]
        for layer in self._layers:
            object.__setattr__(layer, "call", self._recording(layer, layer.call))
        return self

    def _recording(self, layer, call):
        def recorded(*args, **kwargs):
            outputs = call(*args, **kwargs)
            self.calls.append((layer, tree.flatten(outputs)))
            self.inputs.append(args[0] if args else None)
            return outputs

        return recorded

    def __exit__(self, *exc):
        for layer, kept in zip(self._layers, self._kept):
            if kept is None:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", kept)


def _data_bytes(strategy, data):
    return sum(int(np.prod(t.shape.as_list() or [1])) * t.dtype.size
               for value in tree.flatten(data) for t in strategy.experimental_local_results(value)
               if isinstance(t, tf.Tensor) and t.shape.is_fully_defined())


def sub_batch(strategy, data, rows=None, counts=None):
    """A distributed dataset of one global batch: `rows` (`SUB_BATCH_ROWS`) rows of each replica's `data`.

    `data`: the per-replica values a step function returned. Each worker's
    dataset holds its own replicas' first rows, one element per local
    replica in their order (`strategy.distribute_datasets_from_function`),
    so each replica takes its own rows again, where TensorFlow's split put
    its piece (`replica.piece_order`): no rows cross workers. None where a
    leaf holds no rows to cut, or the replicas would not all be cut to the
    same number of rows (an empty replica stays empty only where every
    replica is), the same answer on every worker. `counts`: `_counts` of
    `data`, where already known.
    """
    rows = SUB_BATCH_ROWS if rows is None else rows
    local = [strategy.experimental_local_results(v) for v in tree.flatten(data)]
    if not all(isinstance(parts[0], tf.Tensor) and parts[0].shape.rank for parts in local):
        return None
    counts = _counts(strategy, data) if counts is None else counts
    cut = np.minimum(counts[:, 1:], rows)
    if np.any(cut != cut[:1]):
        return None
    element = tree.pack_sequence_as(data, [tf.stack([part[:rows] for part in parts]) for parts in local])
    return strategy.distribute_datasets_from_function(
        lambda context: tf.data.Dataset.from_tensor_slices(element))


def check(model, strategy, step, logs, captured, snapshot, rerun=None):
    """Compares the first distributed step with one device's; refuses it beyond round-off.

    Args:
        model: The model whose step ran.
        strategy: Its strategy.
        step: One device's replica step, called eagerly on a global batch:
            returns `(outputs, metric states, recorded gradients)`.
        logs: The distributed step's global logs.
        captured: What its compiled function returned besides them:
            `{"data": per-replica batch, "gradients": per-replica global
            gradients, "variables": their variables}`.
        snapshot: The `Snapshot` taken before the step.
        rerun: Where the global batch's data exceeds `WHOLE_BATCH_BYTES`:
            a function that runs the distributed step once on the first
            batch of a distributed iterator it is given and returns
            `(logs, captured)` as above. The check then compares the two
            on a sub-batch (`sub_batch`) and leaves every variable as the
            real step left it.

    Raises:
        FirstStepMismatch: a log or gradient differs beyond round-off; every
            variable is back as it was before the step.
    """
    where, result = "global batch", None
    multi_worker = strategies.traits(strategy).is_multi_worker
    # Across workers every replica's counts, one gather: the same decisions on every worker.
    counts = _counts(strategy, captured["data"]) if multi_worker else None
    dataset = None
    if rerun is not None:
        size = int(np.sum(counts[:, 0])) if multi_worker else _data_bytes(strategy, captured["data"])
        if size > WHOLE_BATCH_BYTES:
            dataset = sub_batch(strategy, captured["data"], counts=counts)
    if dataset is not None:
        # The real step's result is kept; the step runs again, from the
        # variables before it, on a few rows of each replica's.
        result = Snapshot(model)
        snapshot.restore()
        try:
            logs, captured = rerun(iter(dataset))
        except Exception:
            snapshot.restore()
            raise
        where, counts = f"sub-batch ({SUB_BATCH_ROWS} rows of each replica's)", None
    pieces = replica_batches(strategy, captured["data"], counts)
    data = _joined(pieces)
    distributed = [
        (variables, [None if g is None else strategy.experimental_local_results(g)[0] for g in values])
        for variables, values in zip(captured["variables"], captured["gradients"])
    ]
    # One device starts from the weights as they were before the step.
    after = Snapshot(model, trainable_only=True)
    position = {id(v): i for i, v in enumerate(snapshot.variables)}
    _write(after.variables, [snapshot.copies[position[id(v)]] for v in after.variables])
    try:
        outputs, _, recorded = _one_device(model, step, data, snapshot, after)
    except Exception as error:
        snapshot.restore()
        raise FirstStepMismatch(
            f"kd's first-step check could not run one device's step of {type(model).__name__} "
            f"to compare the first distributed step with ({type(error).__name__}: {error}). "
            "Nothing was trained. Compile with first_step_check=False to train without the check."
        ) from error
    found = _differences(model, logs, outputs, distributed, recorded)
    if len(recorded) != len(distributed):
        found.append(("the number of optimizer updates", np.inf, 0.0, None))
    if not found:
        (after if result is None else result).restore()
        return
    snapshot.restore()
    what, distance, tolerance, _ = found[0]
    differing = [variable for *_, variable in found if variable is not None]
    layers = list(dict.fromkeys(_layer_of(v, model) for v in differing))
    more = ""
    if layers:
        more = f"; the gradients of {len(layers)} layers differ too, from the first: {_listed(layers)}"
    apart, step_only, not_compared = None, False, []
    try:
        apart, seen = _layers_apart(model, pieces, _tolerance(model))
        if apart is None:
            apart, not_compared = _step_layer_apart(model, step, data, pieces, snapshot, after,
                                                    seen, _tolerance(model))
            step_only = apart is not None
    except Exception:  # a diagnosis only: the refusal stands without it
        pass
    finally:
        snapshot.restore()
    overriding = [type(o).__name__ for o in gradients_lib.optimizers_of(model)
                  if gradients_lib.overrides_apply_gradients(o)]
    if apart is None and overriding:
        # Keras's step (and kd's) calls an `apply_gradients` override with
        # each replica's gradients; kd's all-reduce comes after it, in `apply`.
        advice = (f"the optimizer's own apply_gradients ({_listed(overriding)}) gets each "
                  "replica's gradients, as Keras's step gives it under a strategy, and changes "
                  "them in a way that does not add up over the replicas (a norm, say), so the sum "
                  "of the replicas' changed gradients is not one device's. Override `apply` "
                  "instead: kd hands it the gradients summed over every replica")
    else:
        advice = (f"{_cause(apart, step_only, not_compared)}. Gather the rows yourself with "
                  "kd.losses.global_batch(tensor), or compile with rows_meet=\"per_replica\" and "
                  "first_step_check=False to keep Keras's per-replica behaviour knowingly")
    raise FirstStepMismatch(
        f"The first training step of {type(model).__name__} on {strategy.num_replicas_in_sync} "
        f"replicas differs from one device's on the same {where}: {what} is off by "
        f"{distance:.3g} relative to its largest value (round-off allows {tolerance:.0e}){more}. "
        f"Nothing was trained: every variable is as it was before the step. Likely cause: "
        f"{advice}."
    )


def _cause(apart, step_only, not_compared):
    """The refusal's likely cause: the layer named (`step_only`: called only in a custom
    `train_step`), or what the diagnosis could not compare."""
    if apart is not None:
        name, kind, gap = apart
        where = " (called in the model's own train_step, outside its call)" if step_only else ""
        return (f"the first layer whose outputs differ is {name!r} ({kind}){where}: on each "
                f"replica's rows apart its outputs are off by {gap:.3g} from the whole batch's, so "
                "its rows meet (each row's output reads the batch's other rows) in an op kd could "
                "not read, and each replica computed it from its own rows")
    cause = ("the rows of the batch meet in an op kd could not read (a loss or layer reading "
             "the whole batch through an op kd does not know, e.g. a tf.while_loop over "
             "rows), so each replica computed it from its own rows")
    if not not_compared:
        return cause
    return (f"{cause}. No layer kd could run on each replica's rows apart reads other rows; the "
            f"model's own train_step also calls {_listed(not_compared)} on tensors whose rows are "
            "not the batch's (views stacked, say), which kd cannot split by replica to compare: "
            "the rows may meet there, or in the loss")


def _listed(names, shown=4):
    """The first `shown` names quoted, then "..." where there are more."""
    return ", ".join(repr(name) for name in names[:shown]) + (", ..." if len(names) > shown else "")
