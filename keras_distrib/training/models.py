"""`kd.Model`, `kd.Sequential` and `DistributedModelMixin`.

The steps below handle one replica's batch and nothing else; the distributed
wrapping (`strategy.run`, reductions, several steps per call) is
`keras_distrib.training.step`, and the epochs, callbacks and resume are
`keras_distrib.training.loop`, both shared with `kd.TrainLoop` and parameter-server
training.
"""

import contextlib
import functools
import inspect
import json
import math
import os
import warnings
import weakref

import h5py
import keras
import tensorflow as tf
from keras import tree

from keras_distrib import _keras_compat
from keras_distrib.training import coupling
from keras_distrib.training import front
from keras_distrib.training import gradients
from keras_distrib.training import losses as kd_losses
from keras_distrib.training import loop
from keras_distrib.training import penalties
from keras_distrib.training import replica
from keras_distrib.training import step as step_lib
from keras_distrib.cluster import devices
from keras_distrib.cluster import strategies
from keras_distrib import validation

__all__ = [
    "DistributedModelMixin",
    "FunctionalModel",
    "Model",
    "Sequential",
    "global_moments",
    "layer_state",
    "random_states",
    "unregistered_class_warning",
    "unsupported_settings",
]

BATCH_NORM_MODES = ("global", "per_replica")

# Keras's random layers whose output rows depend only on their own input row
# and the draws: run on the global batch, each replica keeps its rows.
_GLOBAL_BATCH_RANDOM_LAYERS = tuple(
    getattr(keras.layers, name) for name in dir(keras.layers)
    if name.startswith("Random") or name.endswith("Dropout") or name == "GaussianNoise"
    if isinstance(getattr(keras.layers, name), type)
)
# BatchNormalization layers (not synchronized) of models compiled with
# batch_norm="per_replica": they keep Keras's per-replica statistics.
_PER_REPLICA_BATCH_NORM = weakref.WeakSet()


def _record_loss(loss):
    batch = replica.current_batch()
    if batch is not None:
        batch.record_loss(loss)


def _static_rows(x):
    """Rows in a batch of arrays or eager tensors (its first input's), or None."""
    for value in tree.flatten(x):
        if value is None:
            continue
        if isinstance(value, tf.RaggedTensor):
            return int(value.nrows())
        shape = getattr(value, "shape", None)
        if shape is None or len(shape) == 0 or shape[0] is None:
            return None
        return int(shape[0])
    return None


def _file_stamp(path):
    try:
        status = os.stat(path)
    except (OSError, TypeError, ValueError):
        return None
    return status.st_mtime_ns, status.st_size, status.st_ino


def _record_registered_class(path, cls):
    """Names `cls` by its registered name in a legacy `.h5` file's model config."""
    name = keras.saving.get_registered_name(cls)
    if name == cls.__name__:  # not registered: Keras's bare name is all there is
        return
    with h5py.File(path, "r+") as file:
        config = file.attrs.get("model_config")
        if config is None:
            return
        if isinstance(config, bytes):
            config = config.decode("utf-8")
        config = json.loads(config)
        if config.get("class_name") != cls.__name__:
            return
        config["class_name"] = name
        file.attrs["model_config"] = json.dumps(config).encode("utf-8")


def _pad_empty_batch(x, batch):
    """`x` with one row of zeros in place of an empty batch (see StepPlan)."""
    if batch.surely_has_rows:
        return x

    def pad(value):
        if not isinstance(value, tf.Tensor) or value.shape.rank in (None, 0):
            return value
        filler = lambda: tf.zeros(tf.concat([[1], tf.shape(value)[1:]], 0), value.dtype)
        padded = penalties.mark_rows(tf.cond(batch.has_rows, lambda: value, filler))
        return coupling.mark_layout(padded, coupling.row_layout(value, batch), batch)

    return tree.map_structure(pad, x)


def _drop_padding(outputs, batch, first=None):
    """Outputs without the padded row (and its Keras mask, if any)."""
    if batch.surely_has_rows:
        return outputs

    def cut(value):
        if not isinstance(value, tf.Tensor) or value.shape.rank in (None, 0):
            return value
        mask = _keras_compat.get_keras_mask(value)
        # Keeps Keras's cross-entropy on the logits of a softmax/sigmoid
        # output (without, saturated probabilities are clipped: a model
        # whose outputs saturate trained far off one device).
        result = _keras_compat.keep_keras_logits(
            value, lambda v: tf.cond(batch.has_rows, lambda: v, lambda: v[:0])
        )
        if mask is not None:
            _keras_compat.set_keras_mask(
                result, tf.cond(batch.has_rows, lambda: mask, lambda: mask[:0])
            )
        # The model's rows, each its own, as its first input's (kd's models map rows to rows).
        return coupling.mark_layout(penalties.mark_rows(result), layout, batch)

    first = next((t for t in tree.flatten(first) if isinstance(t, tf.Tensor) and t.shape.rank), None)
    layout = coupling.row_layout(first, batch) if first is not None else None
    return tree.map_structure(cut, outputs)


def _spreads_over_replicas():
    context = tf.distribute.get_replica_context()
    return context is not None and context.num_replicas_in_sync > 1


def _global_rows_of(rows, of, batch):
    """Where a replica's `rows` of `of` lie in one device's tensor: (its rows, the indices of these).

    `of` (a tensor, or the count of its rows) has its rows laid out as kd
    reads them (`coupling.row_layout`: the batch's rows, several batches
    concatenated); else as k stacked blocks of the batch's rows
    (`_blocks_of`). A replica without rows of the step, fed one padded row,
    draws for it as asked (its outputs are dropped).
    """
    rows = tf.cast(rows, tf.int32)
    layout = coupling.row_layout(of, batch)
    if not layout:
        return _blocks_of(rows, batch)
    indices, total, expected = coupling.global_indices(layout, batch)
    padded = tf.logical_and(tf.equal(expected, 0), tf.equal(rows, 1))
    check = tf.debugging.Assert(
        tf.logical_or(padded, tf.equal(rows, expected)),
        [replica.DRAW_REFUSAL, "rows drawn:", rows, "rows kd laid out:", expected],
    )
    with tf.control_dependencies([check]):
        indices = tf.cond(padded, lambda: tf.range(rows), lambda: indices)
    return tf.where(padded, rows, total), indices


def _spread(value, indices, total):
    """`value`'s rows at `indices` of a zero tensor of `total` rows."""
    return tf.scatter_nd(indices[:, None], value, tf.concat([[total], tf.shape(value)[1:]], 0))


def _global_batch_call(layer, call):
    """`call` of a random layer, drawing for the global batch.

    Keras draws random numbers statelessly from the layer's seed state, the
    same on every replica; one device draws them for every row of the
    global batch. So each replica runs the layer on the global batch (its
    own rows in place, zeros elsewhere) and keeps its rows: the same draws
    one device makes for them, whatever the replica layout. Rows of several
    batches concatenated (`concat([unlabeled, labeled])`) lie where one
    device holds them (`coupling.row_layout`).
    """

    def laid_out(inputs, *args, **kwargs):
        batch = replica.current_batch()
        if batch is None or kwargs.get("training") in (None, False) or batch.global_region \
                or not _spreads_over_replicas():
            return call(inputs, *args, **kwargs)
        if not isinstance(inputs, tf.Tensor):
            raise ValueError(
                f"layer {layer.name!r} ({type(layer).__name__}) received "
                f"{type(inputs).__name__} inputs in a step on several replicas: kd lays out its "
                "random draws over the global batch only for a single tensor input. Pass a "
                "tensor, or apply the layer in the input pipeline instead."
            )
        total, indices = _global_rows_of(tf.shape(inputs)[0], inputs, batch)
        mask = kwargs.get("mask")
        if isinstance(mask, tf.Tensor) and mask.shape.rank:
            kwargs["mask"] = _spread(mask, indices, total)
        batch.laid_out += 1  # its draws are already the global batch's
        try:
            outputs = call(_spread(inputs, indices, total), *args, **kwargs)
        finally:
            batch.laid_out -= 1
        mine = tf.gather(outputs, indices)
        mine.set_shape(inputs.shape[:1].concatenate(outputs.shape[1:]))
        # Each row its own, as on one device, where the inputs' rows lie.
        return coupling.mark_layout(penalties.mark_rows(mine), coupling.row_layout(inputs, batch), batch)

    return laid_out


def _blocks_of(rows, batch):
    """Where a replica's `rows` lie in the global batch: k stacked blocks of its n_r rows.

    A draw shaped by the batch has k * n_r rows on a replica (k = 1 for
    `(batch_size, d)`; k = 2 for a GAN's labels, a `tf.concat` of two
    batches): one device draws k * N, block j holding rows j*N..(j+1)*N-1.
    Returns (k * N, the indices of this replica's rows in it). A leading
    dimension that is not a multiple of n_r fails the step, naming the fix.
    """
    local = tf.cast(batch.local_rows, tf.int32)
    rows = tf.cast(rows, tf.int32)
    blocks = tf.math.floordiv(rows, tf.maximum(local, 1))
    # A replica without rows draws what it is asked (a padded row, see
    # StepPlan.pad_empty, whose outputs are dropped).
    empty = tf.equal(local, 0)
    check = tf.debugging.Assert(
        tf.logical_or(empty, tf.equal(blocks * local, rows)),
        [replica.DRAW_REFUSAL, "rows drawn:", rows, "replica rows:", local],
    )
    with tf.control_dependencies([check]):
        total = tf.cast(batch.global_rows, tf.int32)
        offset = tf.cast(batch.offset, tf.int32)
        starts = tf.range(blocks) * total + offset
        mine = tf.reshape(starts[:, None] + tf.range(local)[None, :], [-1])
        indices = tf.cond(empty, lambda: tf.range(rows), lambda: mine)
    return tf.where(empty, rows, blocks * total), indices


def _lays_out_draws():
    batch = replica.current_batch()
    return batch is not None and not batch.laid_out and not batch.global_region \
        and _spreads_over_replicas()


def _batch_shaped(rows):
    """Whether a draw's leading dimension `rows` may follow the batch (unknown when traced)."""
    return rows is not None and tf.get_static_value(rows) is None


def _global_batch_draw(name, shaped, draw):
    """`keras.random.<name>`, drawing for the global batch in a kd step on several replicas.

    As for Keras's random layers (`_global_batch_call`): Keras draws
    statelessly from the generator's state, the same on every replica, so
    each replica draws what one device draws for the global batch and keeps
    its own rows. Draws whose leading dimension is known when traced (a
    `(latent_dim,)` vector) are not shaped by the batch and stay as they are.
    """

    first_name = "shape" if shaped else {"dropout": "inputs", "categorical": "logits"}[name]

    @functools.wraps(draw)
    def drawing(*args, **kwargs):
        if not _lays_out_draws():
            return draw(*args, **kwargs)
        if first_name in kwargs:
            first = kwargs.pop(first_name)
        else:
            first, args = args[0], args[1:]
        batch = replica.current_batch()
        if shaped:
            shape = tf.convert_to_tensor(first, tf.int32) if not isinstance(first, (list, tuple)) \
                else tf.stack([tf.cast(d, tf.int32) for d in first])
            if shape.shape.rank != 1 or shape.shape[0] in (None, 0) or not _batch_shaped(shape[0]):
                return draw(first, *args, **kwargs)
            leading = first[0] if isinstance(first, (list, tuple)) and tf.is_tensor(first[0]) else shape[0]
            total, indices = _global_rows_of(shape[0], leading, batch)
            drawn = draw(tf.concat([[total], shape[1:]], 0), *args, **kwargs)
            return penalties.mark_rows(tf.gather(drawn, indices))  # one device's draws for these rows
        inputs = tf.convert_to_tensor(first)
        noise_shape = kwargs.get("noise_shape", args[1] if name == "dropout" and len(args) > 1 else None)
        if noise_shape is not None and not isinstance(noise_shape, (list, tuple)):
            return draw(first, *args, **kwargs)
        if inputs.shape.rank in (None, 0) or (noise_shape is not None and noise_shape[0] is not None):
            return draw(first, *args, **kwargs)
        total, indices = _global_rows_of(tf.shape(inputs)[0], inputs, batch)
        spread = _spread(inputs, indices, total)
        mine = tf.gather(draw(spread, *args, **kwargs), indices)
        if name == "dropout":
            mine.set_shape(inputs.shape)
        return penalties.mark_rows(mine)

    return drawing



def _metric_in_scope(metric):
    """`metric`, made again in the current strategy's scope if it was made outside it.

    A metric object made before the scope holds plain variables: each
    replica updates the one copy, and its state cannot travel in the step's
    gradient all-reduce with the other metrics' (it cost a collective of its
    own per step). Its config makes the same metric, with per-replica states.
    """
    if not isinstance(metric, keras.metrics.Metric) or \
            tf.distribute.get_strategy().num_replicas_in_sync == 1 or \
            all(_keras_compat.sync_on_read_aggregation(v) is not None for v in metric.variables):
        return metric
    try:
        return type(metric).from_config(metric.get_config())
    except (TypeError, ValueError, NotImplementedError):
        return metric  # a metric of one's own that cannot be made again: as it is


def _sub_model_call(layer, call):
    """`call` of a plain Keras model inside a kd model's step (see `coupling.layer_call`)."""
    layer_call = coupling.layer_call(layer, call, pad=True)

    def called(inputs, *args, **kwargs):
        return coupling.anchor(layer_call(inputs, *args, **kwargs), layer)

    return called


def _layer_call(layer, call):
    return coupling.layer_call(layer, call, pad=False)


# Layers of these libraries compute each row from its own row (kd handles
# BatchNormalization and the random layers itself); kd reads the graph of
# the others' `call` (a layer of one's own, a Lambda, a functional model's
# own ops) at the first trace, for rows that meet.
_LIBRARIES = ("keras.", "keras_hub.", "keras_nlp.", "keras_cv.", "keras_distrib.", "tf_keras.")


def _may_meet(layer):
    """Whether the rows of a batch may meet in `layer`'s own computation."""
    if isinstance(layer, (keras.layers.BatchNormalization,) + _GLOBAL_BATCH_RANDOM_LAYERS):
        return False
    if isinstance(layer, keras.layers.Lambda):
        return True
    if isinstance(layer, _keras_compat.Functional) and _keras_compat.has_own_operations(layer):
        return True
    defined = next((cls for cls in type(layer).__mro__ if "call" in vars(cls)), type(layer))
    return not defined.__module__.startswith(_LIBRARIES)


def _recorded_result(metric, result):
    """`metric.result` that tells kd's step which logs are this metric's (see step.py)."""

    def recorded():
        value = result()
        batch = replica.current_batch()
        if batch is not None:
            if isinstance(value, dict):
                for key, leaf in value.items():
                    batch.metric_results[id(leaf)] = (leaf, key)
            else:
                batch.metric_results[id(value)] = (value, metric.name)
        return value

    return recorded


def _counted_draws(generator, keras_next):
    """`generator.next` that reads its state once per replica step.

    Keras's `next()` reads the state and writes it plus [0, 1]. Under
    CentralStorageStrategy the one stored state is written by the last
    replica only (see `_keras_compat.write_seed_state_from_last_replica`),
    so a second draw in the step would read, on the other replicas, a state
    their own first draw did not advance. Here each replica reads the state
    at its first draw and counts its draws: the i-th draw of the step gets
    the state plus [0, i], as on one device, on every replica.
    """

    def next_seed(ordered=True):
        batch = replica.current_batch()
        if batch is None or not ordered or not _spreads_over_replicas():
            return keras_next(ordered)
        start, count = batch.seed_draws.get(id(generator), (None, 0))
        if start is None:
            start = tf.convert_to_tensor(generator.state.value) * 1
        step = tf.constant([0, 1], start.dtype)
        generator.state.assign(start + step * (count + 1))
        batch.seed_draws[id(generator)] = (start, count + 1)
        return start + step * count

    return next_seed


def _random_layer_problem(layer):
    """Why kd cannot lay out `layer`'s random draws over the global batch, or None."""
    if isinstance(layer, _GLOBAL_BATCH_RANDOM_LAYERS) or not _keras_compat.owned_seed_generators(layer):
        return None
    rates = [getattr(layer, name, None) for name in ("dropout", "recurrent_dropout")]
    if not any(rates):
        # Its `keras.random` draws are laid out over the global batch
        # (`_global_batch_draw`); an RNN cell without dropout never draws.
        return None
    return (
        f"layer {layer.name!r} ({type(layer).__name__}) draws random numbers in a way kd "
        "cannot lay out over the global batch, so each replica's draws would differ from "
        "one device's. Use Keras's random layers (Dropout, GaussianNoise, GaussianDropout, "
        "SpatialDropout, Random* augmentation), which kd lays out exactly, set its dropout "
        "rates to 0, or train on one replica."
    )


def layer_state(model):
    """(layer, variable) for each non-trainable variable a layer may assign in `call`.

    BatchNormalization's moving statistics (kd makes them global) and the
    random layers' seed states (the same on every replica) are not
    included; each variable is named with the innermost layer holding it.
    """
    owners = {}
    skipped = set()
    for layer in _keras_compat.flatten_layers(model):
        skipped.update(id(g.state) for g in _keras_compat.owned_seed_generators(layer))
        for variable in layer.non_trainable_weights:
            if isinstance(layer, keras.layers.BatchNormalization):
                skipped.add(id(variable))
            owners[id(variable)] = (layer, variable)
    return [pair for key, pair in owners.items() if key not in skipped]


def random_states(model):
    """Every seed state of `model`'s random draws, by a name stable across processes.

    Keras's `SeedGenerator`s held by the model and its layers (Dropout and
    the other random layers, a generator a custom `train_step` draws from).
    A name is the holder's position among the model's layers and the
    attribute holding the generator, e.g. `"layer_3_seed_generator"`: the
    same model built again (another process, another replica layout) gives
    the same names, whatever names Keras's counters gave the variables.
    """
    states = {}
    for index, layer in enumerate(_keras_compat.flatten_layers(model)):
        for attribute, value in sorted(vars(layer).items()):
            if isinstance(value, keras.random.SeedGenerator):
                states[f"layer_{index}_{attribute}"] = value.state
    return states


class _RandomStates(tf.Module):
    """The seed states of a model's random draws, as checkpoint dependencies."""

    def __init__(self, states):
        super().__init__(name="kd_random_states")
        self.keys = _state_keys(states)
        for name, variable in states.items():
            setattr(self, name, variable)


def _state_keys(states):
    return tuple((name, id(variable)) for name, variable in states.items())


def _replica_state_updates(layer, variable):
    """Updates of a layer's variable that mean on many replicas what they mean on one.

    In a step on several replicas, `assign_add`/`assign_sub` of a value that
    depends on the data add the sum over replicas (counts and sums of rows:
    what one device adds for the global batch; an empty replica adds
    nothing), and of a constant add it once (a step counter). `assign` has
    no such meaning: each replica's value comes from its own rows; it is
    refused at the first step, naming the layer and the variable.
    """

    def make(current, keras_assign):
        def assign(value, *args, **kwargs):
            if _in_replica_step():
                replicas = tf.distribute.get_replica_context().num_replicas_in_sync
                raise ValueError(
                    f"layer {layer.name!r} ({type(layer).__name__}) assigns its variable "
                    f"{variable.path!r} with `assign` in a step on {replicas} replicas: each "
                    "replica computes the value from its own rows, and what one device computes "
                    "from the global batch cannot be rebuilt from them. kd sums `assign_add`/"
                    "`assign_sub` increments over the replicas (exact for counts and sums of "
                    "rows): update the variable that way, or outside the training step (e.g. in "
                    "a callback), or train on one replica."
                )
            return current["assign"](value, *args, **kwargs)

        def adding(name, sign):
            def update(value, *args, **kwargs):
                if not _in_replica_step():
                    return current[name](value, *args, **kwargs)
                value = tf.convert_to_tensor(value, variable.dtype)
                batch = replica.current_batch()
                if batch.global_region:
                    # Computed from the global batch, the same on every replica: added once.
                    first = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0)
                    return keras_assign(variable.value + sign * value * tf.cast(first, value.dtype))
                if tf.get_static_value(value) is None:
                    if batch.plan.xla_forward and batch.in_forward:
                        raise ValueError(
                            f"layer {layer.name!r} ({type(layer).__name__}) updates its variable "
                            f"{variable.path!r} with `{name}` in the forward pass, which kd sums "
                            "over the replicas with an all-reduce: `jit_compile=True` with several "
                            "CPU replicas (or workers) compiles only the forward pass with XLA, "
                            "because TensorFlow cannot synchronize replicas inside XLA here. Use "
                            "jit_compile=False (or GPUs, where XLA compiles the whole step)."
                        )
                    value = replica.replica_sum(value * tf.cast(batch.has_rows, value.dtype))
                return keras_assign(variable.value + sign * value)

            return update

        return {"assign": assign, "assign_add": adding("assign_add", 1),
                "assign_sub": adding("assign_sub", -1)}

    return make


def _defers_scaling(model, batch, *, training):
    """Whether `model`'s step can scale its loss without the global row count first.

    Deferred scaling (`replica.ReplicaBatch.defer`) changes what the loss
    share is until the gradient all-reduce corrects it, so it is used only
    where kd computes the whole loss and reduces the gradients itself: kd's
    own `compute_loss`, losses that reduce to a scalar, a model whose
    optimizer has kd's gradient pipeline. A step that reads the share in
    any other way keeps the global count, read before the loss.

    Nor where a layer's backward pass crosses replicas (BatchNormalization
    with global statistics): a replica's gradient then holds parts of the
    other replicas' loss shares, which the correction by its own R * n_r
    would scale wrongly on uneven batches. N then travels in the layer's
    own all-reduce (`global_moments`), at no extra collective.
    """
    if not _spreads_over_replicas():
        return False
    layers = _keras_compat.flatten_layers(model)
    if training and any(_global_batch_norm(layer) and layer.trainable for layer in layers):
        return False
    if coupling.meets_at_any(layers + _compiled_loss_objects(model)):
        return False  # computed on the global batch: shares are exact, a layer's gradient crosses replicas
    for name, own in (("compute_loss", DistributedModelMixin.compute_loss),
                      ("_compute_loss", getattr(keras.Model, "_compute_loss"))):
        if getattr(getattr(model, name), "__func__", None) is not own:
            return False
    compiled = _keras_compat.compiled_loss(model)
    if compiled is not None:
        losses = _keras_compat.compiled_losses(compiled)
        if losses is None or not all(
            isinstance(loss, kd_losses.GlobalReductionLoss) and loss.reduction not in (None, "none")
            for loss in losses
        ):
            return False
    if not isinstance(_keras_compat.loss_tracker(model), (kd_losses.GlobalShareMean, type(None))):
        return False
    if training:
        return model.optimizer is not None and _keras_compat.has_gradient_pipeline(model.optimizer)
    return True


def _compiled_loss_objects(model):
    compiled = _keras_compat.compiled_loss(model)
    losses = _keras_compat.compiled_losses(compiled) if compiled is not None else None
    return [getattr(loss, "inner", loss) for loss in losses or ()]


def _in_replica_step():
    return replica.current_batch() is not None and _spreads_over_replicas()


def global_moments(layer, inputs, mask, keras_moments):
    """Mean and variance of a BatchNormalization over every replica.

    Every BatchNormalization of a kd model on several replicas uses it
    (unless compiled with `batch_norm="per_replica"`, and then still the
    synchronized ones), so statistics are those of the global batch.

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
    traced about three times the ops of Keras's per-replica statistics,
    which TensorFlow then optimizes at the first step: kd's first step took
    1.9x Keras 3's CPU seconds on a ResNet.
    """
    context = tf.distribute.get_replica_context()
    batch = replica.current_batch()
    if context is None or context.num_replicas_in_sync == 1 or batch is None or batch.global_region:
        return keras_moments(inputs, mask)  # one replica, or the global batch already
    if layer in _PER_REPLICA_BATCH_NORM and not layer.synchronized:
        # Per replica on request (batch_norm="per_replica"): not a place
        # where kd gathers the rows that meet (`coupling`), which would see
        # the replica's statistics fed back into its rows.
        mean, variance = keras_moments(inputs, mask)
        return penalties.mark_global(mean), penalties.mark_global(variance)
    axes = _keras_compat.batch_norm_axes(layer)
    if mask is None:
        moments = _unmasked_global_moments(context, batch, inputs, axes)
        if moments is not None:
            return moments
    dtype = inputs.dtype
    live = tf.cast(batch.has_rows, dtype)
    if mask is None:
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), dtype)
        count = tf.reshape(count * live, [1])
    else:
        kept = tf.broadcast_to(tf.expand_dims(tf.cast(mask, tf.bool), -1), tf.shape(inputs))
        kept = tf.logical_and(kept, batch.has_rows)
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
    brings_rows = not batch.knows_global_rows  # N travels along, for the loss that follows
    if brings_rows:
        own.insert(0, tf.reshape(tf.cast(batch.local_rows, dtype), [1]))
    own = tf.concat(own, 0)
    replicas = context.num_replicas_in_sync
    slots = tf.one_hot(context.replica_id_in_sync_group, replicas, dtype=dtype)
    local = batch.chain(slots[:, None] * own[None, :])
    gathered = context.all_reduce(tf.distribute.ReduceOp.SUM, local)
    batch.after_collective(gathered)
    if brings_rows:
        batch.learn_global_rows(tf.reduce_sum(tf.stop_gradient(gathered[:, 0])))
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
    return penalties.mark_global(mean), penalties.mark_global(variance)


def _unmasked_global_moments(context, batch, inputs, axes):
    """`global_moments` of unmasked inputs, its gradient written out; None if shapes are unknown.

    The same forward pass (one all-reduce of every replica's count, mean
    and M2, merged by Chan et al.'s formula) with the shapes known when
    traced taken as numbers, under a `tf.custom_gradient` whose backward
    pass all-reduces the replicas' gradients of the mean and the variance
    (2C values, the one collective the backward pass made before) and
    applies one device's formula to the replica's rows. The token that
    chains the step's collectives (`replica.ReplicaBatch.chain`) and N,
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
    live = None if batch.surely_has_rows else tf.cast(batch.has_rows, dtype)
    live_times = (lambda value: value) if live is None else (lambda value: value * live)
    brings_rows = not batch.knows_global_rows  # N travels along, for the loss that follows
    if shape[0] is not None and live is None:
        count = float(shape[0] * math.prod(reduced))
        heads = tf.constant(([float(batch.static_rows)] if brings_rows else []) + [count], dtype)
    else:
        count = live_times(tf.cast(tf.shape(inputs)[0], dtype) * math.prod(reduced))
        heads = tf.stack(([tf.cast(batch.local_rows, dtype)] if brings_rows else []) + [count])
    replicas = context.num_replicas_in_sync
    replica_id = tf.get_static_value(context.replica_id_in_sync_group)
    token = [batch.moments_token] if batch.moments_token is not None else []
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
        gathered = context.all_reduce(tf.distribute.ReduceOp.SUM, local)
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
            summed = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.concat([d_mean, 2 * d_variance], 0))
            of_mean, of_variance = tf.split(tf.math.divide_no_nan(summed, total), 2)
            d_x = spread_out(of_mean) + spread_out(of_variance) * (x - spread_out(mean))
            return (live_times(d_x),) + (None,) * len(token)

        return outputs, gradient

    mean, variance, batch.moments_token, *global_rows = moments(inputs, *token)
    if brings_rows:
        batch.learn_global_rows(tf.stop_gradient(global_rows[0]))
    if len(channels) > 1:
        mean, variance = tf.reshape(mean, channels), tf.reshape(variance, channels)
    # The same on every replica: what reads the graph (kd.losses) may rely on it.
    return penalties.mark_global(mean), penalties.mark_global(variance)


def _spreads_strategy(strategy):
    traits = strategies.traits(strategy)
    return traits.replicas > 1 and not traits.is_parameter_server


def _global_batch_norm(layer):
    """Whether `layer` is a BatchNormalization computing global statistics."""
    return isinstance(layer, keras.layers.BatchNormalization) and (
        _keras_compat.is_sync_batch_norm(layer) or layer not in _PER_REPLICA_BATCH_NORM
    )


def unregistered_class_warning(model):
    """Warns when `keras.saving.load_model` will not find `model`'s class.

    A `.keras` file names the model's class; a subclass such as
    `class MyTask(kd.DistributedModelMixin, keras_hub.models.BertTextClassifier)`
    reloads only if Keras can look its name up: registered with
    `@keras.saving.register_keras_serializable()`, or passed to
    `load_model(..., custom_objects={"MyTask": MyTask})`. Said when saving,
    while the class is at hand, rather than when loading fails.

    Returns:
        True if it warned.
    """
    cls = type(model)
    if keras.saving.get_registered_object(keras.saving.get_registered_name(cls)) is cls:
        return False
    warnings.warn(
        f"{cls.__name__} is not registered with Keras, so keras.saving.load_model will not "
        f"find it in this file (\"Could not locate class '{cls.__name__}'\"). Decorate the class "
        "with @keras.saving.register_keras_serializable(), or load with "
        f"keras.saving.load_model(path, custom_objects={{'{cls.__name__}': {cls.__name__}}}).",
        stacklevel=3,
    )
    return True


def _strategy_name(strategy):
    if strategy is None or strategy is _keras_compat.default_strategy():
        return "no strategy"
    return type(strategy).__name__


def unsupported_settings(model, *, training):
    """What in `model`'s setup kd cannot make exact under its strategy.

    Returns a list of messages, each naming the setting and the way out.
    """
    strategy = model.distribute_strategy
    problems = []
    layers = _keras_compat.flatten_layers(model)
    optimizer = getattr(model, "optimizer", None)  # None: never compiled
    base = _keras_compat.base_optimizer(optimizer) if optimizer is not None else None
    if training and strategies.traits(strategy).is_central_storage:
        fix = "Use kd.make_strategy('mirrored') on the same devices, which is exact with it."
        why = ("CentralStorageStrategy keeps one copy of each variable, and Keras updates "
               "this variable on every replica, which TensorFlow refuses to aggregate")
        if base is not None and base.gradient_accumulation_steps:
            problems.append(f"`gradient_accumulation_steps`={base.gradient_accumulation_steps}: {why}. {fix}")
        if base is not None and base.use_ema:
            problems.append(f"`use_ema`=True: {why}. {fix}")
        if optimizer is not base:
            problems.append(f"LossScaleOptimizer (mixed precision): {why}. {fix}")
    if training and _spreads_strategy(strategy):
        # The model's own generators are drawn in its train_step, once per
        # replica from the one state: the same draws on every replica, which
        # is one device's for a draw that does not depend on the rows (a
        # loss weight, weight noise). Its layers' are refused unless kd lays
        # them out over the global batch.
        problems.extend(filter(None, map(_random_layer_problem, layers[1:])))
    plan = step_lib.plan_for(model)
    if training and plan.xla_forward:
        why = ("`jit_compile=True` with several CPU replicas (or workers) compiles only the "
               "forward pass with XLA, because TensorFlow cannot synchronize replicas inside XLA here")
        fix = "Use jit_compile=False (or GPUs, where XLA compiles the whole step)."
        for layer in layers:
            if _global_batch_norm(layer):
                problems.append(f"layer {layer.name!r} (BatchNormalization) all-reduces its global "
                                f"statistics inside the forward pass: {why}. {fix} Or compile with "
                                "batch_norm=\"per_replica\" (per-replica statistics, not exact).")
            elif isinstance(layer, keras.layers.RNN):
                problems.append(f"layer {layer.name!r} ({type(layer).__name__}) keeps TensorLists that "
                                f"cannot leave an XLA forward pass: {why}. {fix}")
    if training and strategies.traits(strategy).is_parameter_server:
        if base is not None and base.gradient_accumulation_steps:
            problems.append(
                f"`gradient_accumulation_steps`={base.gradient_accumulation_steps}: parameter-server "
                "workers update the variables asynchronously, so no worker's micro-steps form one "
                "update. Use a larger batch per step, or a synchronous strategy (multi_worker)."
            )
    return problems


def _first_input(args, kwargs):
    return args[0] if args else kwargs.get("inputs")


def _check_loop_shape():
    """Refuses, at its first trace, a hand-written loop shape that would never return.

    `next()` on `iter(distributed_dataset)` inside a `tf.function` (unrolled
    or in a `tf.range` loop) prefetches to each local replica's device from
    ops that each block a thread of TensorFlow's inter-op pool; with fewer
    threads than `devices.inter_op_threads_needed` the step's own ops wait
    for a thread forever (measured: 2 replicas on 2 threads hang on the
    first or second call). `kd.virtual_devices` grows the pool before
    TensorFlow starts, so this only refuses a pool fixed smaller.
    AutoGraph's `for batch in distributed_dataset:` returned on 2 threads.
    """
    strategy = tf.distribute.get_strategy()
    # Central storage's iterator returns (README, "Hand-written loops: the loop shape").
    mirrored = (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy)
    replicas = len(strategy.extended.worker_devices)
    if (not isinstance(strategy, mirrored) or replicas < 2
            or not _keras_compat.pulls_from_in_graph_iterator()):
        return
    threads, needed = devices.inter_op_threads(), devices.inter_op_threads_needed(replicas)
    if threads >= needed:
        return
    raise RuntimeError(
        f"This `tf.function` opens a distributed iterator (`iter(distributed_dataset)` inside "
        f"it) under {type(strategy).__name__} on {replicas} local replicas, with TensorFlow's "
        f"inter-op pool at {threads} threads: its prefetches to each replica's device block "
        f"those threads and the step would never return (a deadlock). Any one of these fixes it: "
        f"open the iterator in Python and pass it in (`iterator = iter(distributed_dataset)` "
        f"outside, `next(iterator)` inside); iterate the whole dataset inside (`for batch in "
        f"distributed_dataset:`); use kd's loop (`kd.TrainLoop(...).train_epoch(dataset)`); or "
        f"give TensorFlow {needed} inter-op threads first thing in the process "
        f"(`tf.config.threading.set_inter_op_parallelism_threads({needed})`, which "
        f"`kd.virtual_devices` does when it sets up replicas).")


def _opens_own_batch(model, args, kwargs):
    """Whether `model` is called in a replica of several, with no kd step around it."""
    if _first_input(args, kwargs) is None or not _spreads_over_replicas():
        return False
    if _keras_compat.in_symbolic_scope() or tf.executing_eagerly():
        return False
    return not strategies.traits(model.distribute_strategy).is_parameter_server


def _loop_plan(model):
    """The `StepPlan` of a forward pass in a hand-written loop (no XLA, one step)."""
    return replica.StepPlan(pad_empty=not strategies.traits(model.distribute_strategy).is_tpu)


class DistributedModelMixin(_keras_compat.ModelHooks):
    """Exact global-batch training for any `keras.Model` subclass.

    Put it first in the bases: `class MyModel(kd.DistributedModelMixin,
    keras.Model)`, or with a library's model class:
    `class MyTask(kd.DistributedModelMixin, keras_hub.models.BertTextClassifier)`
    keeps the task's constructor, compile defaults and `generate`. The model
    then behaves as `kd.Model` does (see there): each step scales the loss by
    the exact global example count, counts regularization and `add_loss`
    once across replicas, and reports global loss and metrics; the optimizer
    all-reduces gradients before it unscales, accumulates and clips them, as
    one device would.

    A `train_step` you write as Keras's guide "Customizing what happens in
    fit()" writes it (`self(x, training=True)`, `self.compute_loss(...)`,
    `self.optimizer.apply_gradients(...)`) stays exact: kd opens each
    replica's batch around it, and the rest is one device's too:

    - `compute_loss` returns this replica's share of the global loss; a Keras
      loss object called in the step (`self.loss_fn(y, y_pred)`) returns a
      share as well.
    - A loss of plain ops with no share computed in the step (no
      `compute_loss`, loss object or `kd.losses` call) is read from its graph
      at `tape.gradient`: a sum over rows is summed over replicas as it is;
      one in which the rows of the batch meet (a maximum over rows, the root
      of a mean, in-batch negatives, `arange(batch_size)` labels) is computed
      on the global batch (kd gathers the tensors it starts from and traces
      the step again); anything else is taken as a mean over the replica's
      rows (each replica's gradient weighted by n_r / N before the
      all-reduce: exact for a mean of per-row terms plus terms of the
      weights). A share mixed with a plain mean in one loss, or ops the walk
      does not follow (a `tf.while_loop` over rows), are not detected: use
      `compute_loss` or `kd.losses.global_mean` there.
    - What the step returns: a metric's `result()` (recognised by identity,
      nested `compile_metrics` included) is the metric's global value; a
      loss share is summed over replicas; another scalar is weighted by
      n_r / N (`kd.losses.row_weighted`); the rest is averaged over
      replicas. A `keras.metrics.Mean` tracker fed a scalar adds one
      device's value once per step.
    - `keras.random` draws shaped by the batch are drawn for the global
      batch and each replica keeps its rows; a draw whose leading dimension
      is not a multiple of the replica's rows, and TensorFlow's stateful
      random ops (`tf.random.normal`, `tf.random.Generator`), are refused at
      the first step on several replicas, naming the op.
    - Every Keras optimizer held as an attribute (a GAN's two) gets kd's
      gradient pipeline at the first step; plain `keras.Sequential` and
      `keras.Model` sub-models get a padded row on an empty replica; a model
      without `call` (a GAN) is built lazily.

    To reload a saved subclass, register it
    (`@keras.saving.register_keras_serializable()`) or pass
    `custom_objects={"MyTask": MyTask}` to `keras.saving.load_model`; `save`
    warns when neither would find it.

    Example:
        >>> import keras, tensorflow as tf, keras_distrib as kd
        >>> class Regressor(kd.DistributedModelMixin, keras.Model):
        ...     def train_step(self, data):
        ...         x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        ...         with tf.GradientTape() as tape:
        ...             loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        ...         grads = tape.gradient(loss, self.trainable_variables)
        ...         self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        ...         return self.compute_metrics(x, y, self(x), sample_weight=None)
        >>> inputs = keras.Input((3,))
        >>> model = Regressor(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
    """

    def compile(self, *args, pss_evaluation_shards=0, batch_norm="global", rows_meet="global",
                **kwargs):
        """`keras.Model.compile`, then kd's exact losses, trackers and gradient pipeline.

        Called outside any strategy scope, it runs in the scope of the
        strategy the model was created in, so the loss and metric trackers
        are that strategy's variables (as in tf-keras).

        `pss_evaluation_shards` (parameter-server training only): split
        evaluation over the workers in that many shards ("auto": 4 per
        worker), instead of evaluating on the coordinator; both are exact.

        `batch_norm`: `"global"` (default): every BatchNormalization
        normalizes over the global batch on several replicas, as one device
        does; `"per_replica"`: layers without `synchronized=True` normalize
        each replica's rows separately (Keras's behaviour: no all-reduce in
        the forward pass, but not what one device computes).

        `rows_meet`: `"global"` (default): where the rows of a batch meet
        (in-batch negatives, labels from the batch size, a layer reading
        statistics of the batch, a loss mining the batch), kd computes on the
        global batch gathered from every replica, as one device does
        (`keras_distrib.training.coupling`); `"per_replica"`: each replica
        sees only its own rows (Keras's behaviour).
        """
        if rows_meet not in coupling.MODES:
            raise ValueError(
                f"`rows_meet`={rows_meet!r}: expected one of {list(coupling.MODES)}. \"global\" "
                "computes where the rows of a batch meet on the global batch (exact); "
                "\"per_replica\" on each replica's rows."
            )
        if batch_norm not in BATCH_NORM_MODES:
            raise ValueError(
                f"`batch_norm`={batch_norm!r}: expected one of {list(BATCH_NORM_MODES)}. "
                "\"global\" computes BatchNormalization statistics over the global batch "
                "(exact); \"per_replica\" over each replica's rows."
            )
        self.pss_evaluation_shards = pss_evaluation_shards
        self.batch_norm = batch_norm
        self.rows_meet = rows_meet
        # Called outside any scope, compile runs in the model's strategy (as
        # tf-keras does): Keras creates the loss tracker here, and a tracker
        # made outside the scope is a plain variable on one device.
        scope = contextlib.nullcontext() if tf.distribute.has_strategy() else self.distribute_strategy.scope()
        with scope:
            for name in ("metrics", "weighted_metrics"):
                if kwargs.get(name) is not None:
                    kwargs[name] = tree.map_structure(_metric_in_scope, kwargs[name])
            super().compile(*args, **kwargs)
            kd_losses.install_global_losses(self)
            gradients.install(self.optimizer)
            # Not the metrics yet: a subclass's compile may create them after this returns.
            self._prepare_layers(variables=False)

    def get_compile_config(self):
        """The arguments `compile` was called with, serialized (saved in `.keras` files).

        kd's own arguments are kept when not their defaults, so a reloaded
        model compiles as the saved one was (e.g. `batch_norm="per_replica"`).
        """
        config = super().get_compile_config()
        if config is None:
            return config
        own = {"batch_norm": (getattr(self, "batch_norm", "global"), "global"),
               "rows_meet": (getattr(self, "rows_meet", "global"), "global"),
               "pss_evaluation_shards": (getattr(self, "pss_evaluation_shards", 0), 0)}
        return {**config, **{name: value for name, (value, default) in own.items() if value != default}}

    def compile_from_config(self, config):
        """Compiles from `get_compile_config()`'s output, as `keras.saving.load_model` does.

        Keras skips this for models that override `compile` (kd does), so a
        `.keras` file would reload uncompiled, without its optimizer state.
        Here it compiles through kd's `compile` and builds the optimizer on
        the variables it updates, so the saved optimizer variables load into
        it. A subclass with a `compile` of its own loads uncompiled, with
        Keras's warning, as with Keras.
        """
        if not config:
            return
        if type(self).compile is not DistributedModelMixin.compile:
            # The subclass's own compile (e.g. a GAN's compile(d_optimizer,
            # g_optimizer, loss_fn)) cannot take these arguments: Keras warns
            # and loads the model uncompiled; so does this.
            return super().compile_from_config(config)
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built and self.optimizer is not None:
            with self.distribute_strategy.scope():
                self.optimizer.build(_keras_compat.optimizer_variables(self))

    def _prepare_layers(self, variables=True):
        """Per-replica bookkeeping on every layer and variable (idempotent).

        `variables`: also the model's, metrics' and optimizer's variables;
        not in `compile`, where a subclass's own `compile` creates metrics
        after calling `super().compile()` (SimCLR's order).
        """
        per_replica = getattr(self, "batch_norm", "global") == "per_replica"
        for layer in _keras_compat.flatten_layers(self):
            _keras_compat.record_add_loss(layer, _record_loss)
            if isinstance(layer, keras.layers.BatchNormalization):
                _keras_compat.replace_batch_norm_moments(layer, global_moments)
                if per_replica:
                    _PER_REPLICA_BATCH_NORM.add(layer)
                else:
                    _PER_REPLICA_BATCH_NORM.discard(layer)
            if isinstance(layer, _GLOBAL_BATCH_RANDOM_LAYERS):
                _keras_compat.replace_call(layer, _global_batch_call)
            elif isinstance(layer, keras.Model) and layer is not self \
                    and not isinstance(layer, DistributedModelMixin):
                # A plain Keras model inside: padded for an empty replica, a
                # place where rows may meet, and its outputs where a custom
                # step's own computations start (coupling.anchor).
                _keras_compat.replace_call(layer, _sub_model_call)
            elif layer is not self and _may_meet(layer):
                _keras_compat.replace_call(layer, _layer_call)
        for layer, variable in layer_state(self):
            _keras_compat.replace_variable_updates(variable, _replica_state_updates(layer, variable))
        self._prepare_replica_writes()
        self._track_random_states()
        if variables:
            _keras_compat.fix_variables(_keras_compat.model_variables(self))

    def _track_random_states(self):
        # Keras's seed generators (random layers, a `SeedGenerator` of the
        # model's own) are not checkpoint dependencies of the model: a
        # restored model would draw other masks than the run it continues.
        # A child holding their states puts them in every checkpoint of the
        # model (kd's backups and the user's tf.train.Checkpoint alike).
        states = random_states(self)
        current = getattr(self, "_kd_random_states", None)
        if current is not None and current.keys == _state_keys(states):
            return
        self._kd_random_states = _RandomStates(states)

    def _prepare_replica_writes(self):
        # Under central storage, BatchNormalization's moving statistics are
        # written by replica 0 (see _keras_compat.write_from_first_replica).
        # Random layers' seed states are written by the last replica, after
        # every replica has read them.
        for layer in _keras_compat.flatten_layers(self):
            if isinstance(layer, keras.layers.BatchNormalization):
                _keras_compat.write_from_first_replica(layer.non_trainable_variables)
            for generator in _keras_compat.owned_seed_generators(layer):
                _keras_compat.write_seed_state_from_last_replica(generator)
                _keras_compat.replace_seed_next(generator, _counted_draws)
        object.__setattr__(self, "_kd_replica_writes", self.built)

    _kd_replica_writes = False

    def replica_batch(self, x):
        """Context for one replica's batch (row counts for loss scaling).

        kd's step already opens it around `train_step`/`test_step`; inside,
        this returns the open batch.
        """
        return replica.replica_batch(replica.batch_rows(x))

    def additional_loss_share(self, loss):
        """This replica's share of an `add_loss` or regularization term.

        Keras divides these terms by R. kd weighs a sum over the batch's rows
        (`add_loss(c * tf.reduce_sum(x))`, read from the term's graph) whole,
        since the replicas' sums add up to
        one device's, and every other term by n_r / N, which keeps means over
        rows (activity regularizers) exact on uneven batches and counts a
        term of the weights alone once. Replicas without rows contribute
        nothing.
        """
        if not loss.dtype.is_floating:
            loss = tf.cast(loss, keras.backend.floatx())
        batch = replica.current_batch()
        if batch is None:
            return tf.reduce_sum(loss) / tf.distribute.get_strategy().num_replicas_in_sync
        total = tf.reduce_sum(loss)
        kind = penalties.kind_of(loss) if _spreads_over_replicas() else None
        if kind == penalties.GLOBAL:
            # Computed on the global batch (a layer whose rows meet): the same
            # on every replica, each adds 1/R of it, rows or none.
            return total / tf.cast(tf.distribute.get_replica_context().num_replicas_in_sync, total.dtype)
        if kind == penalties.ROW_SUM:
            share = batch.defer(total) if batch.deferred else total
        else:
            share = total * tf.cast(batch.fraction, total.dtype)
        return tf.where(batch.has_rows, share, tf.zeros_like(total))

    @property
    def losses(self):
        # Within a step, the add_loss terms this replica's forward pass
        # recorded, and the weight penalties (the same on every replica).
        # After a forward pass that opened its own batch (a hand-written
        # loop), the terms that pass recorded on this replica's thread:
        # Keras's own list is shared by the replicas' threads.
        batch = replica.current_batch()
        if batch is not None and batch.owner is self and batch.losses is not None:
            recorded = batch.losses
        else:
            recorded = replica.kept_losses(self)
            if recorded is None:
                return super().losses
        weight_penalties = [
            v.regularizer(v) for v in self.trainable_weights
            if getattr(v, "regularizer", None) is not None
        ]
        return list(recorded) + weight_penalties

    # Called in users' `tf.function`s: it runs as written, as Keras's own call
    # does (see `kd.losses`), not rewritten by AutoGraph at every trace.
    @tf.autograph.experimental.do_not_convert
    def __call__(self, *args, **kwargs):
        if not self._kd_replica_writes and tf.distribute.has_strategy() \
                and not tf.distribute.in_cross_replica_context():
            # A hand-written loop may call the model in a replica without
            # compiling it: its BatchNormalization updates need kd's
            # central-storage writes all the same.
            self._prepare_replica_writes()
        batch = replica.current_batch()
        if batch is None and _opens_own_batch(self, args, kwargs):
            # A hand-written loop calls the model in `strategy.run` without
            # kd's step: the forward pass opens the replica's batch itself,
            # so BatchNormalization statistics and random layers are laid
            # out over the global batch as in `fit`.
            self._prepare_layers()
            _check_loop_shape()
            with replica.replica_batch(replica.batch_rows(_first_input(args, kwargs)),
                                       _loop_plan(self)) as batch:
                batch.rows_meet = getattr(self, "rows_meet", "global")
                batch.leaves = [t for t in tree.flatten(_first_input(args, kwargs))
                                if isinstance(t, tf.Tensor) and t.shape.rank][:1]
                outputs = self.__call__(*args, **kwargs)
                replica.keep_losses(self, batch.losses)
            return outputs
        if batch is None or batch.in_forward:
            return super().__call__(*args, **kwargs)
        plan = batch.plan
        padding = bool(args) and plan.pad_empty and not batch.global_region
        if padding:
            args = (_pad_empty_batch(args[0], batch),) + args[1:]
            batch.padded.append(tf.logical_not(batch.has_rows))
        batch.losses, batch.owner, batch.in_forward = [], self, True
        try:
            if plan.xla_forward:
                if any(_keras_compat.owned_seed_generators(layer)
                       for layer in _keras_compat.flatten_layers(self)):
                    batch.offset  # all-reduced here: XLA's forward pass cannot synchronize
                outputs, batch.losses = self._xla_forward(*args, **kwargs)
            elif _may_meet(self):
                # The model's own `call` (a subclass's, a functional model's
                # own ops) may make rows meet: see coupling.layer_call.
                own_call = coupling.layer_call(self, super().__call__, pad=False)
                outputs = own_call(*args, **kwargs)
            else:
                outputs = super().__call__(*args, **kwargs)
        finally:
            batch.in_forward = False
            if padding:
                batch.padded.pop()
        if plan.pad_empty and not batch.global_region:
            outputs = _drop_padding(outputs, batch, _first_input(args, kwargs))
        return coupling.anchor(outputs, self, batch)

    def _xla_forward(self, *args, **kwargs):
        # The forward pass (and its gradient) compiled on the replica's
        # device; the all-reduces stay outside (see StepPlan.xla_forward).
        forward = self._kd_xla_function
        if forward is None:
            def forward_pass(*args, **kwargs):
                batch = replica.current_batch()
                batch.losses = []
                outputs = self(*args, **kwargs)  # in_forward: Keras's own call
                return outputs, list(batch.losses)

            forward = step_lib.on_replica_device(
                tf.function(forward_pass, jit_compile=True, reduce_retracing=True)
            )
            object.__setattr__(self, "_kd_xla_function", forward)
        return forward(*args, **kwargs)

    _kd_xla_function = None

    def _call_model(self, x, training):
        if _keras_compat.call_has_training_arg(self):
            return self(x, training=training)
        return self(x)

    @step_lib.metrics_only
    @tf.autograph.experimental.do_not_convert
    def train_step(self, data):
        """One replica's training step: forward, loss share, gradients, update, metrics."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with self.replica_batch(x) as batch:
            batch.deferred = _defers_scaling(self, batch, training=True)
            with tf.GradientTape() as tape:
                y_pred = self._call_model(x, training=True)
                loss = _keras_compat.compute_loss(
                    self, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
                )
                kd_losses.track_loss(self, loss)
                if self.optimizer is not None:
                    loss = self.optimizer.scale_loss(loss)
            # The metrics update before the weights (they read y_pred only), so
            # their states travel in the gradient all-reduce: the step's logs
            # cost no collective of their own (gradients.all_reduce). Not for
            # an override that may update metrics after this returns.
            logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            if step_lib.reports_only_metrics(self, "train"):
                batch.metric_variables = list(self.metrics_variables)
            if self.trainable_weights:
                variables = _keras_compat.optimizer_variables(self)
                gradients = tape.gradient(loss, variables)
                self.optimizer.apply_gradients(zip(gradients, variables))
            else:
                warnings.warn("The model does not have any trainable weights.")
            batch.metric_variables = None
            return logs

    @step_lib.metrics_only
    @tf.autograph.experimental.do_not_convert
    def test_step(self, data):
        """One replica's evaluation step: forward, loss share, metrics."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with self.replica_batch(x) as batch:
            batch.deferred = _defers_scaling(self, batch, training=False)
            y_pred = self._call_model(x, training=False)
            loss = _keras_compat.compute_loss(
                self, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
            )
            kd_losses.track_loss(self, loss)
            return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    @tf.autograph.experimental.do_not_convert
    def predict_step(self, data):
        """One replica's prediction step: the forward pass."""
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        return self._call_model(x, training=False)

    def _check_strategy(self, training=False):
        """Refuses to run under a strategy the model (or its parts) was not created in."""
        if not tf.distribute.has_strategy():
            return
        active = tf.distribute.get_strategy()
        scope = f"`{type(active).__name__}.scope()`"
        created = _keras_compat.created_strategy(self)
        if created is not active:
            built_in = type(created).__name__ if created is not None else "no strategy"
            raise ValueError(
                f"This model was created under {built_in}, but is used inside "
                f"{scope}. Its variables are not "
                "distributed, so training would silently ignore the strategy. "
                "Create (and compile) the model inside `with strategy.scope():`."
            )
        if isinstance(active, (tf.distribute.MirroredStrategy,
                               tf.distribute.MultiWorkerMirroredStrategy)):
            stray = [v.path for v in self.weights
                     if not active.extended.variable_created_in_scope(v.value)]
            if stray:
                shown = ", ".join(f"`{p}`" for p in stray[:4]) + (" ..." if len(stray) > 4 else "")
                raise ValueError(
                    f"The model was created inside {scope}, but {len(stray)} of its "
                    f"variables were not ({shown}): a layer was built before the scope was "
                    "entered, so its weights are not mirrored and each replica would train "
                    "its own copy. Create the layers (and the model) inside "
                    "`with strategy.scope():`."
                )
        optimizer = getattr(self, "optimizer", None)
        if training and optimizer is not None:
            optimizer_strategy = _keras_compat.optimizer_strategy(optimizer, active)
            if optimizer_strategy is not active:
                raise ValueError(
                    f"The optimizer `{optimizer.name}` ({type(optimizer).__name__}) was created "
                    f"under {_strategy_name(optimizer_strategy)}, but the model trains inside "
                    f"{scope}: its step count and slots would not be distributed. Create the "
                    "optimizer inside `with strategy.scope():` (e.g. "
                    "`model.compile(optimizer=keras.optimizers.Adam(...))` there)."
                )

    def _check_exactness(self, training):
        """Refuses settings kd cannot make exact here, naming each one."""
        problems = unsupported_settings(self, training=training)
        if problems:
            strategy = type(self.distribute_strategy).__name__
            raise ValueError(
                f"kd cannot make this model exact under {strategy}:\n  - "
                + "\n  - ".join(problems)
            )

    # The compiled steps (Keras's names; each is a `keras_distrib.training.step.Step`).

    @tf.autograph.experimental.do_not_convert
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        """`keras.Model.compute_loss`: in a kd step, this replica's share of the global loss.

        The shares of all replicas sum to the loss one device computes for
        the global batch; kd records the value as a share, so a tracker fed
        it (`tracker.update_state(loss)`) and a step returning it log one
        device's value.
        """
        return replica.mark_share(super().compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training))

    def _optimizers(self):
        """Every Keras optimizer the model holds as an attribute (a GAN's two, say)."""
        found = []
        for value in vars(self).values():
            values = value if isinstance(value, (list, tuple)) else [value]
            found.extend(v for v in values if isinstance(v, keras.optimizers.Optimizer)
                         and all(v is not f for f in found))
        return found

    def _prepare_custom_step(self):
        """kd's gradient pipeline for every optimizer; one device's logs from every metric."""
        # Keras's loss objects and random draws change only inside kd's
        # replica steps; installed here, at the first step, not on import.
        kd_losses.exact_loss_objects()
        _keras_compat.replace_random_draws(_global_batch_draw)
        _keras_compat.replace_tape_gradient(gradients.judge_target)
        for optimizer in self._optimizers():
            gradients.install(optimizer)
        self._own_compute_loss_on_global_batch()
        metrics = list(self.metrics)
        kd_losses.exact_trackers(metrics)
        kd_losses.exact_metric_updates(metrics)
        for metric in metrics:
            _keras_compat.replace_metric_result(metric, _recorded_result)

    def _own_compute_loss_on_global_batch(self):
        """A `compute_loss` of the subclass's own runs on the global batch where its rows meet.

        (An in-batch contrastive loss: `coupling.call_on_global_batch`.) Its
        scalar result is then this replica's share, as kd's own `compute_loss`
        returns; a per-row result is the global batch's (GLOBAL).
        """
        if type(self).compute_loss is DistributedModelMixin.compute_loss or "compute_loss" in vars(self):
            return
        own = type(self).compute_loss.__get__(self)

        def compute_loss(*args, **kwargs):
            result, _ = coupling.call_on_global_batch(
                self, lambda a, k: own(*a, **k), (args, kwargs), share_scalars=True)
            return result

        compute_loss.__signature__ = inspect.signature(own)  # Keras reads its arguments
        compute_loss.__doc__ = own.__doc__
        object.__setattr__(self, "compute_loss", compute_loss)

    def _make_step(self, kind):
        self._check_strategy(training=kind == "train")
        self._check_exactness(training=kind == "train")
        self._prepare_layers()
        self._prepare_custom_step()
        return step_lib.Step(self, kind, steps=int(self.steps_per_execution or 1))

    def make_train_function(self, force=False):
        """The compiled training `Step` (`steps_per_execution` steps per call)."""
        if self.train_function is None or force:
            self.train_function = self._make_step("train")
        return self.train_function

    def make_test_function(self, force=False):
        """The compiled evaluation `Step`."""
        if self.test_function is None or force:
            self.test_function = self._make_step("test")
        return self.test_function

    def make_predict_function(self, force=False):
        """The compiled prediction `Step`."""
        if self.predict_function is None or force:
            self.predict_function = self._make_step("predict")
        return self.predict_function

    # fit, evaluate and predict run kd's loop (keras_distrib.training.loop).

    def _step_of(self, kind):
        return {"train": self.make_train_function, "test": self.make_test_function,
                "predict": self.make_predict_function}[kind]()

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
            sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
            validation_batch_size=None, validation_freq=1):
        """`keras.Model.fit`, exact under any strategy (kd's loop, shared with `kd.TrainLoop`)."""
        _keras_compat.assert_compiled(self, "fit")
        self._check_strategy(training=True)
        return front.fit(
            self, self._step_of, x, y, batch_size=batch_size, epochs=epochs, verbose=verbose,
            callbacks=callbacks, validation_split=validation_split,
            validation_data=validation_data, shuffle=shuffle, class_weight=class_weight,
            sample_weight=sample_weight, initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
            validation_batch_size=validation_batch_size, validation_freq=validation_freq,
        )

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
                 steps=None, callbacks=None, return_dict=False, **kwargs):
        """`keras.Model.evaluate`, exact under any strategy."""
        _keras_compat.assert_compiled(self, "evaluate")
        self._check_strategy()
        kwargs.pop("_use_cached_eval_dataset", None)
        shards = kwargs.pop("shards", None)
        if kwargs:
            raise validation.InputError(
                "Invalid `evaluate` arguments:\n  - "
                + ", ".join(f"`{name}`" for name in sorted(kwargs))
                + " not recognized; `evaluate` takes x, y, batch_size, verbose, sample_weight, "
                "steps, callbacks, return_dict (and shards under a ParameterServerStrategy)"
            )
        return front.evaluate(
            self, self._step_of, x, y, batch_size=batch_size, verbose=verbose,
            sample_weight=sample_weight, steps=steps, callbacks=callbacks,
            return_dict=return_dict, shards=shards,
        )

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """`keras.Model.predict`: every row once, in input order, under any strategy.

        Works on a model that was never compiled (inference), as Keras's.
        """
        self._check_strategy()
        return front.predict(self, self._step_of, x, batch_size=batch_size, verbose=verbose,
                             steps=steps, callbacks=callbacks)

    def predict_on_batch(self, x):
        """`keras.Model.predict_on_batch`: `x` as one batch, every row once, in order.

        Under a strategy the batch is split over the replicas as `predict`
        splits a batch (plain Keras gives every replica the whole batch and
        returns each row once per replica).
        """
        rows = _static_rows(x)
        if rows is None:
            raise ValueError(
                f"`x` ({type(x).__name__}) has no leading batch dimension to predict on; "
                "pass an array, a tensor, or a list/dict of them."
            )
        return self.predict(x, batch_size=max(rows, 1), verbose=0)

    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        """`keras.Model.save`; a legacy `.h5` file reloads as this model's class.

        Keras's legacy HDF5 format records the class by its bare Python name
        (`Sequential`, `FunctionalModel`), which `load_model` resolves to
        Keras's own class (a kd model would silently lose its exact steps) or
        not at all. Here the file names the class by its registered name
        (`keras_distrib>Sequential`), which `load_model` resolves to kd's.

        A subclass of your own (or of a KerasHub task) reloads only if
        registered (`@keras.saving.register_keras_serializable()`) or passed
        as `custom_objects`; saving one that is neither warns
        (`unregistered_class_warning`).
        """
        unregistered_class_warning(self)
        before = _file_stamp(filepath)
        result = super().save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)
        if str(filepath).endswith((".h5", ".hdf5")) and _file_stamp(filepath) != before:
            _record_registered_class(filepath, type(self))
        return result

    def build_from_data(self, iterator=None, data_batch=None):
        """Builds every variable from an epoch iterator's spec, or a batch.

        Never reads a batch from `iterator`: that would consume the user's
        data (or reorder a reshuffling dataset).
        """
        if iterator is not None and data_batch is None:
            loop.build(self, iterator)
        else:
            loop.build_model(self, data_batch)


@keras.saving.register_keras_serializable(package="keras_distrib")
class Model(DistributedModelMixin, keras.Model):
    """A `keras.Model` (functional or subclassed) with exact distributed steps.

    Its `train_step`, `test_step` and `predict_step` scale the loss by the
    exact global example count, scale regularization once across replicas
    and report the true global loss and metrics. `fit`, `evaluate` and
    `predict` take Keras's arguments and work under every strategy
    (`kd.make_strategy`), multi-worker and parameter server included, with
    `steps_per_execution=k` and `jit_compile=True` on several replicas;
    `predict` and `predict_on_batch` return every row once, in input order.
    `fit` on no data raises `kd.EmptyDataError` (a `ValueError`, naming `x`);
    NaN or inf in the data gives a `kd.NonFiniteDataWarning` (Keras trains on
    it, and so does kd). Python-fed batches (`PyDataset`, generators,
    `from_generator`) are copied before TensorFlow sees them, so they train
    exactly and your arrays are never written.

    `compile` takes Keras's arguments and two of kd's:
    `batch_norm="per_replica"` (layers without `synchronized=True` normalize
    each replica's rows: no all-reduce in the forward pass, not exact) and,
    under parameter-server training, `pss_evaluation_shards=k` (evaluate on
    the workers in `k` shards; `"auto"`: 4 per worker). Called outside any
    strategy scope, `compile` runs in the scope of the strategy the model was
    created in.

    On several replicas the model is the model of one device:

    - every `BatchNormalization` normalizes over the global batch (one
      all-reduce per layer in the forward pass and one in the backward pass,
      gathering each replica's count, mean and squared deviations, merged
      exactly);
    - random layers (Dropout, GaussianNoise, GaussianDropout, SpatialDropout,
      `Random*` augmentation), and `keras.random` draws shaped by the batch
      in a layer of your own, draw for the global batch and keep each
      replica's rows; an RNN layer with dropout is refused at the first step,
      naming it;
    - a layer's non-trainable variable updated in `call` with
      `assign_add`/`assign_sub` of data adds the sum over replicas (a
      constant is added once); `assign` is refused at the first step,
      naming the layer and the variable.

    Everything else is Keras's own code, called as Keras calls it (saving
    formats, argument checks, ragged outputs, inference on a model never
    compiled): see the guide "A drop-in keras.Model". A `.keras` file of a kd
    model reloads compiled, with its optimizer's state, where kd's classes
    are registered: they register themselves when kd's model classes load
    (any use of `kd.Model`, `kd.Sequential` or `kd.DistributedModelMixin`;
    `import keras_distrib` alone loads no TensorFlow and registers nothing).
    `kd.Model(inputs, outputs)` returns kd's functional class, a subclass of
    `kd.Model` and of Keras's `Functional`.

    Args:
        *args: As `keras.Model`: `inputs` and `outputs` for a functional
            model, nothing (or your own arguments) for a subclass.
        **kwargs: As `keras.Model` (`name`, `trainable`, ...).

    Example:
        >>> import keras, keras_distrib as kd
        >>> inputs = keras.Input((3,))
        >>> model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
    """

    def __new__(cls, *args, **kwargs):
        # keras.Model turns itself into a Functional by rewriting the class
        # bases; we hand out a fixed functional subclass instead, so kd.Model
        # stays usable for subclassing after a functional model was built.
        if cls is Model and _keras_compat.functional_init_arguments(args, kwargs):
            return keras.Model.__new__(FunctionalModel)
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, *args, **kwargs):
        # A subclass calling `super().__init__(inputs=..., outputs=...)`
        # becomes functional as with Keras, but through FunctionalModel:
        # kd.Model's own bases never change.
        if not _keras_compat.functional_init_arguments(args, kwargs):
            super().__init__(*args, **kwargs)
            return
        if not isinstance(self, _keras_compat.Functional):
            _keras_compat.make_functional(type(self), Model, FunctionalModel)
        _keras_compat.functional_init(self, args, kwargs)


@keras.saving.register_keras_serializable(package="keras_distrib")
class FunctionalModel(Model, _keras_compat.Functional):
    """What `kd.Model(inputs, outputs)` returns: a functional `kd.Model`."""


@keras.saving.register_keras_serializable(package="keras_distrib")
class Sequential(DistributedModelMixin, keras.Sequential):
    """A `keras.Sequential` with exact distributed steps (as `kd.Model`).

    Its arguments are `keras.Sequential`'s: `layers` (in order), `trainable`,
    `name`.

    Example:
        >>> import keras, keras_distrib as kd
        >>> model = kd.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse")
    """


# Keras's legacy `.h5` format names a model's class by its bare Python name;
# kd's functional class has a name of its own, so a saved file resolves to it.
keras.saving.get_custom_objects().setdefault("FunctionalModel", FunctionalModel)
