"""Random draws on several replicas, as one device draws them for the global batch.

A random layer (Dropout, GaussianNoise, the `Random*` augmentations) and a
`keras.random` draw shaped by the batch draw for the global batch, and each
replica keeps its own rows (`global_batch_call`, `global_batch_draw`);
`shuffle` along the rows is where rows meet. Seed generators advance once
per draw as one device's, on every replica (`counted_draws`), and their
states are checkpointed with the model (`random_states`, `RandomStates`).
"""

import functools

import keras
import tensorflow as tf
from keras import tree

from keras_distrib import _keras_compat
from keras_distrib.training import coupling
from keras_distrib.training import penalties
from keras_distrib.training import replica

__all__ = [
    "RandomStates",
    "counted_draws",
    "global_batch_call",
    "global_batch_draw",
    "random_states",
    "state_keys",
]


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
        if batch is None or kwargs.get("training") in (None, False) or batch.coupling.global_region \
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
        batch.draws.laid_out += 1  # its draws are already the global batch's
        try:
            outputs = call(_spread(inputs, indices, total), *args, **kwargs)
        finally:
            batch.draws.laid_out -= 1
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
    local = tf.cast(batch.rows.local_rows, tf.int32)
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
        total = tf.cast(batch.rows.global_rows, tf.int32)
        offset = tf.cast(batch.rows.offset, tf.int32)
        starts = tf.range(blocks) * total + offset
        mine = tf.reshape(starts[:, None] + tf.range(local)[None, :], [-1])
        indices = tf.cond(empty, lambda: tf.range(rows), lambda: mine)
    return tf.where(empty, rows, blocks * total), indices


def _lays_out_draws():
    batch = replica.current_batch()
    return batch is not None and not batch.draws.laid_out and not batch.coupling.global_region \
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
        start, count = batch.draws.seed_draws.get(id(generator), (None, 0))
        if start is None:
            start = tf.convert_to_tensor(generator.state.value) * 1
        step = tf.constant([0, 1], start.dtype)
        generator.state.assign(start + step * (count + 1))
        batch.draws.seed_draws[id(generator)] = (start, count + 1)
        return start + step * count

    return next_seed


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
