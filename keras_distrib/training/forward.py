"""The forward pass of a kd model on several replicas, as one device computes it.

What the model's layers do inside a replica's batch (`replica.ReplicaBatch`),
so that the replicas together compute what one device computes for the
global batch:

- an empty replica gets one padded row, dropped from the outputs
  (`pad_empty_batch`, `drop_padding`);
- a plain Keras sub-model or a layer where the rows of the batch may meet
  runs as `coupling` says (`sub_model_call`, `layer_call`);
- a layer's state updated in `call` adds the sum over replicas
  (`replica_state_updates`);
- a hand-written loop's forward pass opens its own batch
  (`opens_own_batch`, `loop_plan`, `check_loop_shape`).

BatchNormalization's global moments are `batch_norm`; random draws, `draws`.

`models.DistributedModelMixin` installs these on its layers; what kd
refuses to run is `refusals`.
"""

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
    "check_loop_shape",
    "drop_padding",
    "first_input",
    "layer_call",
    "layer_state",
    "loop_plan",
    "may_meet",
    "opens_own_batch",
    "pad_empty_batch",
    "record_loss",
    "replica_state_updates",
    "row_wise_call",
    "rows_meet_call",
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
        batch.forward.record_loss(loss)


def pad_empty_batch(x, batch):
    """`x` with one row of zeros in place of an empty batch (see StepPlan)."""
    if batch.rows.surely_has_rows:
        return x

    def pad(value):
        if not isinstance(value, tf.Tensor) or value.shape.rank in (None, 0):
            return value
        filler = lambda: tf.zeros(tf.concat([[1], tf.shape(value)[1:]], 0), value.dtype)
        padded = penalties.mark_rows(tf.cond(batch.rows.has_rows, lambda: value, filler))
        return coupling.mark_layout(padded, coupling.row_layout(value, batch), batch)

    return tree.map_structure(pad, x)


def drop_padding(outputs, batch, first=None, owner=None):
    """Outputs without the padded row (and its Keras mask, if any).

    Checks that each output holds the replica's rows (read from its graph):
    the padded row can be cut only from a tensor with one row per row of
    the batch. One that does not (a statistic of the batch, rows mixed by
    an op kd cannot read) is refused, naming it.
    """
    if batch.rows.surely_has_rows:
        return outputs

    def cut(value):
        if not isinstance(value, tf.Tensor) or value.shape.rank in (None, 0):
            return value
        if batch.step.rows_meet == "global":
            _check_rows(value, owner)
        mask = _keras_compat.get_keras_mask(value)
        # Keeps Keras's cross-entropy on the logits of a softmax/sigmoid
        # output (without, saturated probabilities are clipped: a model
        # whose outputs saturate trained far off one device).
        # (Its logits too are the model's rows: the cut's `cond` on the row
        # count would hide them from the walk.)
        result = _keras_compat.keep_keras_logits(
            value, lambda v: coupling.mark_layout(penalties.mark_rows(
                tf.cond(batch.rows.has_rows, lambda: v, lambda: v[:0])), layout, batch)
        )
        if mask is not None:
            # (The cut's `cond` on the row count hides the mask's rows from the walk.)
            cut_mask = tf.cond(batch.rows.has_rows, lambda: mask, lambda: mask[:0])
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
        if batch is None or batch.coupling.global_region or tf.executing_eagerly() \
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
                if batch.coupling.global_region:
                    # Computed from the global batch, the same on every replica: added once.
                    first = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0)
                    return keras_assign(variable.value + sign * value * tf.cast(first, value.dtype))
                if tf.get_static_value(value) is None:
                    if batch.plan.xla_forward and batch.forward.in_forward:
                        raise ValueError(
                            f"layer {layer.name!r} ({type(layer).__name__}) updates its variable "
                            f"{variable.path!r} with `{name}` in the forward pass, which kd sums "
                            "over the replicas with an all-reduce: `jit_compile=True` with several "
                            "CPU replicas (or workers) compiles only the forward pass with XLA, "
                            "because TensorFlow cannot synchronize replicas inside XLA here. Use "
                            "jit_compile=False (or GPUs, where XLA compiles the whole step)."
                        )
                    value = replica.replica_sum(value * tf.cast(batch.rows.has_rows, value.dtype))
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
