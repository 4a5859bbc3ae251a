"""The forward pass of a kd model on several replicas, as one device computes it.

What the model's layers do inside a replica's batch (`replica.ReplicaBatch`),
so that the replicas together compute what one device computes for the
global batch:

- an empty replica gets one padded row, dropped from the outputs
  (`pad_empty_batch`, `drop_padding`);
- random layers and `keras.random` draws shaped by the batch draw for the
  global batch, each replica keeping its rows (`global_batch_call`,
  `global_batch_draw`), and seed generators advance as one device's
  (`counted_draws`);
- a plain Keras sub-model or a layer where the rows of the batch may meet
  runs as `coupling` says (`sub_model_call`, `layer_call`);
- a layer's state updated in `call` adds the sum over replicas
  (`replica_state_updates`), and seed states are checkpointed with the
  model (`random_states`, `RandomStates`);
- a hand-written loop's forward pass opens its own batch
  (`opens_own_batch`, `loop_plan`, `check_loop_shape`).

BatchNormalization's global moments are `batch_norm`.

`models.DistributedModelMixin` installs these on its layers; what kd
refuses to run is `refusals`.
"""

import functools

import keras
import tensorflow as tf
from keras import tree

from keras_distrib import _keras_compat
from keras_distrib.training import coupling
from keras_distrib.training import penalties
from keras_distrib.training import replica
from keras_distrib.cluster import devices
from keras_distrib.cluster import strategies

__all__ = [
    "GLOBAL_BATCH_RANDOM_LAYERS",
    "KERAS_LAYER_LISTS",
    "ROWS_MEET_LAYERS",
    "ROW_WISE_LAYERS",
    "RandomStates",
    "check_loop_shape",
    "counted_draws",
    "drop_padding",
    "first_input",
    "global_batch_call",
    "global_batch_draw",
    "layer_call",
    "layer_state",
    "loop_plan",
    "may_meet",
    "opens_own_batch",
    "pad_empty_batch",
    "random_states",
    "record_loss",
    "replica_state_updates",
    "row_wise_call",
    "rows_meet_call",
    "state_keys",
    "sub_model_call",
]

# Keras 3.15's layers by what their training call does with the rows of a
# batch (`tests/test_rows_meet.py` checks that every layer Keras exports is in
# one of these lists, or is kd's own concern: BatchNormalization, Lambda,
# InputLayer). A layer of another class, or another library, is not trusted
# by name: kd reads its graph (`may_meet`).
#
# Each output row from its own input row (and from weights, constants and
# the layer's state), given that the layers they wrap are the same.
_ROW_WISE = (
    "Activation", "ActivityRegularization", "AdaptiveAveragePooling1D", "AdaptiveAveragePooling2D",
    "AdaptiveAveragePooling3D", "AdaptiveMaxPooling1D", "AdaptiveMaxPooling2D",
    "AdaptiveMaxPooling3D", "Add", "AdditiveAttention", "Attention", "AutoContrast", "Average",
    "AveragePooling1D", "AveragePooling2D", "AveragePooling3D", "Bidirectional",
    "CategoryEncoding", "CenterCrop", "Concatenate", "Conv1D", "Conv1DTranspose", "Conv2D",
    "Conv2DTranspose", "Conv3D", "Conv3DTranspose", "ConvLSTM1D", "ConvLSTM2D", "ConvLSTM3D",
    "Cropping1D", "Cropping2D", "Cropping3D", "Dense", "DepthwiseConv1D", "DepthwiseConv2D",
    "Discretization", "Dot", "ELU", "EinsumDense", "Embedding", "Equalization", "Flatten",
    "GRU", "GRUCell", "GlobalAveragePooling1D", "GlobalAveragePooling2D",
    "GlobalAveragePooling3D", "GlobalMaxPool1D", "GlobalMaxPool2D", "GlobalMaxPool3D",
    "GroupNormalization", "GroupQueryAttention", "HashedCrossing", "Hashing", "Identity",
    "IntegerLookup", "LSTM", "LSTMCell", "LayerNormalization", "LeakyReLU", "Masking",
    "MaxNumBoundingBoxes", "MaxPool1D", "MaxPool2D", "MaxPool3D", "Maximum", "MelSpectrogram",
    "Minimum", "MultiHeadAttention", "Multiply", "Normalization", "PReLU", "Permute", "Pipeline",
    "RMSNormalization", "RNN", "ReLU", "RepeatVector", "Rescaling", "Reshape", "Resizing",
    "ReversibleEmbedding", "STFTSpectrogram", "SeparableConv1D", "SeparableConv2D", "SimpleRNN",
    "SimpleRNNCell", "Softmax", "SpectralNormalization", "StackedRNNCells", "StringLookup",
    "Subtract", "TextVectorization", "TimeDistributed", "UnitNormalization", "UpSampling1D",
    "UpSampling2D", "UpSampling3D", "Wrapper", "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D",
    "ContrastLimitedAdaptiveHistogramEqualization",
)
# Random layers that draw per row: each output row from its own input row
# and its draws (laid out over the global batch, `global_batch_call`).
_PER_ROW_RANDOM = (
    "AlphaDropout", "AugMix", "Dropout", "GaussianDropout", "GaussianNoise", "RandAugment",
    "RandomBrightness", "RandomColorDegeneration", "RandomColorJitter", "RandomContrast",
    "RandomCrop", "RandomElasticTransform", "RandomErasing", "RandomFlip", "RandomGaussianBlur",
    "RandomGrayscale", "RandomHue", "RandomInvert", "RandomPerspective", "RandomPosterization",
    "RandomRotation", "RandomSaturation", "RandomSharpness", "RandomShear", "RandomTranslation",
    "RandomZoom", "Solarization", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D",
)
# Layers whose training call mixes the rows of the batch (MixUp and CutMix
# blend each image with another row's, drawn by a permutation of the batch):
# computed on the global batch (`rows_meet_call`).
_ROWS_MEET = ("MixUp", "CutMix")
# What kd handles itself, or reads: not a row-wise verdict.
_OWN_CONCERN = ("BatchNormalization", "InputLayer", "Lambda", "Layer", "TFSMLayer", "JaxLayer",
                "FlaxLayer", "TorchModuleWrapper")
KERAS_LAYER_LISTS = {"row_wise": _ROW_WISE, "per_row_random": _PER_ROW_RANDOM,
                     "rows_meet": _ROWS_MEET, "own_concern": _OWN_CONCERN}


def _keras_classes(names):
    return tuple(getattr(keras.layers, name) for name in names if hasattr(keras.layers, name))


ROW_WISE_LAYERS = _keras_classes(_ROW_WISE)
GLOBAL_BATCH_RANDOM_LAYERS = _keras_classes(_PER_ROW_RANDOM)
ROWS_MEET_LAYERS = _keras_classes(_ROWS_MEET)


def record_loss(loss):
    """Records an `add_loss` term on the calling replica's batch (see `_keras_compat.record_add_loss`)."""
    batch = replica.current_batch()
    if batch is not None:
        batch.record_loss(loss)


def pad_empty_batch(x, batch):
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


def drop_padding(outputs, batch, first=None, owner=None):
    """Outputs without the padded row (and its Keras mask, if any).

    Checks that each output holds the replica's rows (read from its graph):
    the padded row can be cut only from a tensor with one row per row of
    the batch. One that does not (a statistic of the batch, rows mixed by
    an op kd cannot read) is refused, naming it.
    """
    if batch.surely_has_rows:
        return outputs

    def cut(value):
        if not isinstance(value, tf.Tensor) or value.shape.rank in (None, 0):
            return value
        if batch.rows_meet == "global":
            _check_rows(value, owner)
        mask = _keras_compat.get_keras_mask(value)
        # Keeps Keras's cross-entropy on the logits of a softmax/sigmoid
        # output (without, saturated probabilities are clipped: a model
        # whose outputs saturate trained far off one device).
        # (Its logits too are the model's rows: the cut's `cond` on the row
        # count would hide them from the walk.)
        result = _keras_compat.keep_keras_logits(
            value, lambda v: coupling.mark_layout(penalties.mark_rows(
                tf.cond(batch.has_rows, lambda: v, lambda: v[:0])), layout, batch)
        )
        if mask is not None:
            # (The cut's `cond` on the row count hides the mask's rows from the walk.)
            cut_mask = tf.cond(batch.has_rows, lambda: mask, lambda: mask[:0])
            _keras_compat.set_keras_mask(
                result, coupling.mark_layout(penalties.mark_rows(cut_mask), layout, batch))
        # The model's rows, each its own, as its first input's (checked above).
        return coupling.mark_layout(penalties.mark_rows(result), layout, batch)

    first = next((t for t in tree.flatten(first) if isinstance(t, tf.Tensor) and t.shape.rank), None)
    layout = coupling.row_layout(first, batch) if first is not None else None
    return tree.map_structure(cut, outputs)


def _check_rows(value, owner):
    kind = penalties.kind_of_value(value)
    if kind in (penalties.ROWS, penalties.ROW_BLOCKS, penalties.GLOBAL) or \
            replica.replicas_in_sync() == 1:
        return  # (GLOBAL: kept whole from a computation on the global batch)
    name = f"{owner.name!r} ({type(owner).__name__})" if owner is not None else "the model"
    if isinstance(kind, penalties.Unknown):
        raise ValueError(penalties.refusal(kind, f"the output `{value.op.name}` of {name}",
                                           replica.replicas_in_sync()))
    raise ValueError(
        f"the output `{value.op.name}` of {name} is not one row per row of the batch (kd reads "
        f"it as {kind!r}), so kd cannot split it over the replicas' rows: a model's outputs must "
        "hold one row per input row. Return the statistic from a layer's `add_loss` or a metric "
        "instead, or compute it in the loss."
    )


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


def global_batch_call(layer, call):
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
                or replica.replicas_in_sync() == 1:
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
        return coupling.mark_layout(_as_rows_of(mine, inputs), coupling.row_layout(inputs, batch), batch)

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
        and replica.replicas_in_sync() > 1


def _batch_shaped(rows):
    """Whether a draw's leading dimension `rows` may follow the batch (unknown when traced)."""
    return rows is not None and tf.get_static_value(rows) is None


def global_batch_draw(name, shaped, draw):
    """`keras.random.<name>`, drawing for the global batch in a kd step on several replicas.

    As for Keras's random layers (`global_batch_call`): Keras draws
    statelessly from the generator's state, the same on every replica, so
    each replica draws what one device draws for the global batch and keeps
    its own rows. Draws whose leading dimension is known when traced (a
    `(latent_dim,)` vector) are not shaped by the batch and stay as they are.
    """

    first_name = "shape" if shaped else {"dropout": "inputs", "categorical": "logits",
                                          "shuffle": "x"}[name]

    @functools.wraps(draw)
    def drawing(*args, **kwargs):
        if not _lays_out_draws():
            return draw(*args, **kwargs)
        if name == "shuffle":
            return _shuffle(draw, *args, **kwargs)
        if first_name in kwargs:
            first = kwargs.pop(first_name)
        else:
            first, args = args[0], args[1:]
        batch = replica.current_batch()
        if shaped:
            _refuse_row_parameters(name, args, kwargs)
            shape = tf.convert_to_tensor(first, tf.int32) if not isinstance(first, (list, tuple)) \
                else tf.stack([tf.cast(d, tf.int32) for d in first])
            if shape.shape.rank != 1 or shape.shape[0] in (None, 0) or not _batch_shaped(shape[0]):
                return draw(first, *args, **kwargs)
            leading = first[0] if isinstance(first, (list, tuple)) and tf.is_tensor(first[0]) else shape[0]
            total, indices = _global_rows_of(shape[0], leading, batch)
            drawn = draw(tf.concat([[total], shape[1:]], 0), *args, **kwargs)
            # One device's draws for these rows (several batches' stacked, where
            # the shape is of tensors concatenated along the rows).
            layout = coupling.row_layout(leading, batch) if tf.is_tensor(leading) else None
            kind = penalties.ROW_BLOCKS if layout and len(layout) > 1 else penalties.ROWS
            return penalties.mark_kind(tf.gather(drawn, indices), kind)
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
        return _as_rows_of(mine, inputs)

    return drawing


def _as_rows_of(value, inputs):
    """`value` marked as the replica's rows, or as its regrouped rows where `inputs` are those."""
    if penalties.kind_of_value(inputs) == penalties.ROW_BLOCKS:
        return penalties.mark_kind(value, penalties.ROW_BLOCKS)
    return penalties.mark_rows(value)


def _refuse_row_parameters(name, args, kwargs):
    """Refuses a draw whose parameters (alpha, counts, ...) hold the replica's rows.

    kd draws for the global batch's shape and keeps the replica's rows; a
    parameter of the replica's rows alone cannot shape that draw.
    """
    for value in tree.flatten((args, kwargs)):
        if tf.is_tensor(value) and value.shape.rank and \
                penalties.kind_of_value(value) not in (penalties.FIXED, penalties.GLOBAL):
            raise ValueError(
                f"`keras.random.{name}` is given a parameter of shape {tuple(value.shape)} that "
                "depends on the rows of the batch, in a step on "
                f"{replica.replicas_in_sync()} replicas: kd draws "
                "for the global batch, as one device does, only with parameters that are the "
                "same for every row. Draw with scalar parameters (and scale the draws by the "
                "rows' values), or draw in the input pipeline."
            )


def _shuffle(draw, x, axis=0, seed=None):
    """`keras.random.shuffle` in a kd step: a permutation of the rows is where they meet.

    Each replica would permute its own rows; one device permutes the global
    batch's. A shuffle along the rows of what holds or counts the replica's
    rows is marked as where the rows meet (`penalties.mark_meets`): a layer
    or a loss holding it runs on the global batch, where the draw is one
    device's, and elsewhere kd refuses it (`coupling.inline`).
    """
    shuffled = draw(x, axis=axis, seed=seed)
    x = tf.convert_to_tensor(x)
    rank = x.shape.rank
    along_rows = rank is None or rank == 0 or int(axis) % rank == 0
    if along_rows and penalties.kind_of_value(x) not in (penalties.FIXED, penalties.GLOBAL):
        return penalties.mark_meets(shuffled, "(keras.random.shuffle) permutes the rows of the "
                                              "batch: one device permutes the global batch's")
    return shuffled


def sub_model_call(layer, call):
    """`call` of a plain Keras model inside a kd model's step (see `coupling.layer_call`)."""
    layer_call = coupling.layer_call(layer, call, pad=True)

    def called(inputs, *args, **kwargs):
        return coupling.anchor(layer_call(inputs, *args, **kwargs), layer)

    return called


def layer_call(layer, call):
    """A layer's `call` that runs where the rows of the batch meet as `coupling.layer_call` says."""
    return coupling.layer_call(layer, call, pad=False)


def may_meet(layer):
    """Whether kd reads `layer`'s own computation for rows that meet (or ops it cannot read).

    Not for Keras's layers listed above by what they do with the rows
    (their class exactly: a subclass may change `call`); every other layer,
    of one's own or of another library, is read at the first trace
    (`coupling.layer_call`).
    """
    if isinstance(layer, keras.layers.BatchNormalization) or \
            type(layer) in GLOBAL_BATCH_RANDOM_LAYERS + ROWS_MEET_LAYERS:
        return False
    if isinstance(layer, keras.layers.Lambda):
        return True
    if isinstance(layer, _keras_compat.Functional):
        return _keras_compat.has_own_operations(layer)
    defined = next((cls for cls in type(layer).__mro__ if "call" in vars(cls)), type(layer))
    if defined is keras.Sequential:
        return False  # calls its layers in turn: they are read (or trusted) one by one
    return type(layer) not in ROW_WISE_LAYERS


def rows_meet_call(layer, call):
    """`call` of a Keras layer whose training call mixes rows (`ROWS_MEET_LAYERS`), on the global batch.

    Its rows' inputs are gathered from every replica, it runs on them as on
    one device (its permutation and weights drawn for the global batch,
    from the seed state every replica shares), and each replica keeps its
    own rows (`coupling.layer_call`). In inference it is Keras's own.
    """
    return coupling.layer_call(layer, call, pad=False, meets=True)


def row_wise_call(layer, call):
    """`call` of a Keras layer that maps rows to rows (`ROW_WISE_LAYERS`): its outputs read as rows.

    kd trusts the layer's class, not the ops in its graph (an LSTM's loop,
    which the op table does not read): where its row-aligned inputs hold
    the replica's rows (or weights), its row-aligned outputs are marked as
    the replica's rows. Where an input already mixes rows, nothing is
    marked: what the graph says stands.
    """

    def called(*args, **kwargs):
        outputs = call(*args, **kwargs)
        batch = replica.current_batch()
        if batch is None or batch.global_region or tf.executing_eagerly() \
                or replica.replicas_in_sync() == 1:
            return outputs
        inputs = {penalties.kind_of_value(v) for v in tree.flatten((args, kwargs)) if _row_aligned(v)}
        if not inputs or not inputs <= {penalties.ROWS, penalties.ROW_BLOCKS, penalties.FIXED}:
            return outputs
        rows = penalties.ROW_BLOCKS if penalties.ROW_BLOCKS in inputs else penalties.ROWS
        for value in tree.flatten(outputs):
            if _row_aligned(value):
                kind = penalties.kind_of_value(value)
                if kind == rows or (isinstance(kind, penalties.Unknown) and kind.unread):
                    penalties.mark_kind(value, rows)
        return outputs

    return called


def _row_aligned(value):
    return isinstance(value, tf.Tensor) and bool(value.shape.rank) and value.dtype != tf.resource


def counted_draws(generator, keras_next):
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
        if batch is None or not ordered or replica.replicas_in_sync() == 1:
            return keras_next(ordered)
        start, count = batch.seed_draws.get(id(generator), (None, 0))
        if start is None:
            start = tf.convert_to_tensor(generator.state.value) * 1
        step = tf.constant([0, 1], start.dtype)
        generator.state.assign(start + step * (count + 1))
        batch.seed_draws[id(generator)] = (start, count + 1)
        return start + step * count

    return next_seed


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


class RandomStates(tf.Module):
    """The seed states of a model's random draws, as checkpoint dependencies."""

    def __init__(self, states):
        super().__init__(name="kd_random_states")
        self.keys = state_keys(states)
        for name, variable in states.items():
            setattr(self, name, variable)


def state_keys(states):
    """The identity of a model's seed states, to tell whether they changed."""
    return tuple((name, id(variable)) for name, variable in states.items())


def replica_state_updates(layer, variable):
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
                replicas = replica.replicas_in_sync()
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


def _in_replica_step():
    return replica.current_batch() is not None and replica.replicas_in_sync() > 1


def first_input(args, kwargs):
    """The first input a model was called with (`inputs`, positional or by name)."""
    return args[0] if args else kwargs.get("inputs")


def check_loop_shape():
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


def opens_own_batch(model, args, kwargs):
    """Whether `model` is called in a replica of several, with no kd step around it."""
    if first_input(args, kwargs) is None or replica.replicas_in_sync() == 1:
        return False
    if _keras_compat.in_symbolic_scope() or tf.executing_eagerly():
        return False
    return not strategies.traits(model.distribute_strategy).is_parameter_server


def loop_plan(model):
    """The `StepPlan` of a forward pass in a hand-written loop (no XLA, one step)."""
    return replica.StepPlan(pad_empty=not strategies.traits(model.distribute_strategy).is_tpu)
