"""keras_distrib.training.penalties: what a term is, read from the graph that computes it.

In-process: the graph is the same on one device; the 2-replica arithmetic
is checked against one device in tests/test_losses.py (loop_layout.py).
"""

import keras
import pytest
import tensorflow as tf

from keras_distrib.training import penalties


def _kinds(layers, *, static_rows=None):
    """The kind of each of `model.losses` after a traced forward pass."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,))] + layers)
    found = []

    def forward(x):
        model(x, training=True)
        found.extend(penalties.kind_of(term) for term in model.losses)
        return tf.constant(0.0)

    spec = tf.TensorSpec((static_rows, 3), tf.float32)
    tf.function(forward, input_signature=[spec])(tf.zeros((static_rows or 5, 3)))
    return found


class _Adds(keras.layers.Layer):
    def __init__(self, penalty, **kwargs):
        super().__init__(**kwargs)
        self.penalty = penalty

    def call(self, inputs):
        self.add_loss(self.penalty(inputs))
        return inputs


def _activity_penalty(rows):
    layer = keras.layers.Dense(2, kernel_initializer="ones", activity_regularizer=keras.regularizers.L1(0.1))
    layer(tf.ones((rows, 3)))
    (term,) = layer.losses
    return float(term)


def _activity_penalty_is_a_mean():
    """Whether this Keras divides an activity penalty by the batch size (3.14 on) or sums it (3.13).

    Measured: two equal rows give one row's penalty if it is a mean, twice
    that if it is a sum.
    """
    one, two = _activity_penalty(1), _activity_penalty(2)
    assert abs(two - one) < 1e-6 * one or abs(two - 2 * one) < 1e-6 * one, (one, two)
    return abs(two - one) < 1e-6 * one


@pytest.mark.parametrize("static_rows", [None, 4])
def test_keras_regularizers(static_rows):
    dense = keras.layers.Dense(2, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.1),
                               activity_regularizer=keras.regularizers.L1(0.1))
    # Keras 3.14 on divides an activity penalty by the batch size: a mean over
    # rows, also where the graph holds that size as a constant; 3.13 sums it.
    activity = penalties.ROW_MEAN if _activity_penalty_is_a_mean() else penalties.ROW_SUM
    assert _kinds([dense], static_rows=static_rows) == [activity, penalties.FIXED]


@pytest.mark.parametrize("penalty, expected", [
    (lambda x: 1e-2 * tf.reduce_sum(x), penalties.ROW_SUM),
    (lambda x: tf.reduce_sum(tf.square(x), axis=1), penalties.ROW_SUM),  # per row: summed
    (lambda x: tf.reduce_mean(tf.reduce_sum(tf.abs(x), axis=1)), penalties.ROW_MEAN),
    (lambda x: tf.reduce_sum(tf.reduce_mean(x, axis=0)) * 0.5, penalties.ROW_MEAN),
    (lambda x: tf.constant(0.25), penalties.FIXED),
    # Terms stacked or added up (`ops.sum(self.losses)` in Keras's compute_loss docstring).
    (lambda x: keras.ops.sum([tf.reduce_mean(x), tf.constant(0.25)]), penalties.ROW_MEAN),
    (lambda x: tf.add_n([tf.reduce_mean(x), tf.constant(0.25)]), penalties.ROW_MEAN),
    (lambda x: keras.ops.sum([tf.reduce_sum(x), 2.0 * tf.reduce_sum(x)]), penalties.ROW_SUM),
])
def test_sums_means_and_constants(penalty, expected):
    assert _kinds([keras.layers.Dense(4), _Adds(penalty)]) == [expected]


def test_what_has_no_split_is_unknown():
    variance, squared_sum, mixed, product, mean_plus = _kinds([
        keras.layers.Dense(4),
        _Adds(lambda x: tf.reduce_mean(tf.square(x - tf.reduce_mean(x, axis=0)))),
        _Adds(lambda x: tf.square(tf.reduce_sum(x))),
        _Adds(lambda x: tf.reduce_sum(x) + 1.0),  # a sum plus a constant: no one weight
        _Adds(lambda x: tf.reduce_mean(x) * tf.reduce_mean(tf.abs(x))),
        _Adds(lambda x: tf.reduce_mean(x) + 1.0),  # a mean plus a constant: n_r / N splits both
    ])
    assert isinstance(variance, penalties.Unknown) and "statistic" in variance.mixing
    assert isinstance(squared_sum, penalties.Unknown)
    assert "(Square) is a nonlinear function of a sum or mean" in squared_sum.mixing
    assert isinstance(mixed, penalties.Unknown) and "neither one sum nor one mean" in mixed.mixing
    assert isinstance(product, penalties.Unknown) and "(Mul) combines sums or means" in product.mixing
    assert mean_plus == penalties.ROW_MEAN
    # Stacked: a sum beside a weight term, and a maximum of the stacked terms, stay unread.
    stacked_sum, stacked_max = _kinds([
        keras.layers.Dense(4),
        _Adds(lambda x: keras.ops.sum([tf.reduce_sum(x), tf.constant(0.25)])),
        _Adds(lambda x: tf.reduce_max(tf.stack([tf.reduce_mean(x), tf.reduce_mean(x * x)]))),
    ])
    assert isinstance(stacked_sum, penalties.Unknown) and stacked_sum.unread, stacked_sum
    assert isinstance(stacked_max, penalties.Unknown) and stacked_max.unread, stacked_max


def test_eager_tensors_are_unknown():
    assert isinstance(penalties.kind_of(tf.constant(1.0)), penalties.Unknown)


def test_row_mixing_names_per_replica_statistics_and_draws():
    keras.utils.set_random_seed(0)
    batch_norm = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization()])
    dropout = keras.Sequential([keras.Input((3,)), keras.layers.Dropout(0.5)])
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    found = {}

    @tf.function(input_signature=[tf.TensorSpec((None, 3), tf.float32)])
    def forward(x):
        for name, model in (("batch_norm", batch_norm), ("dropout", dropout), ("plain", plain)):
            found[name] = penalties.row_mixing(tf.reduce_sum(model(x, training=True), axis=1))
        # Statistics that are the same on every replica (kd's global moments) mix nothing.
        mean = penalties.mark_fixed(tf.reduce_mean(x, axis=0))
        found["global"] = penalties.row_mixing(x - mean)
        return tf.constant(0.0)

    forward(tf.zeros((2, 3)))
    assert "batch_normalization" in found["batch_norm"] and "statistic" in found["batch_norm"]
    assert "random numbers" in found["dropout"]
    assert found["plain"] == "" and found["global"] == ""


def test_an_op_the_table_does_not_read_is_unknown_never_rows():
    # `Lgamma` keeps each row its own, but kd's table has no rule for it:
    # closed by default, it is Unknown (named, with its type), and has no
    # row layout either (one table answers both questions).
    found = {}

    @tf.function(input_signature=[tf.TensorSpec((None, 3), tf.float32)])
    def forward(x):
        value = tf.math.lgamma(2.0 + x)
        found["kind"] = penalties.kind_of_value(value)
        found["term"] = penalties.kind_of(tf.reduce_mean(value))
        found["layout"] = penalties.layout_of_op(value.op, value, [(0,)])
        found["read"] = penalties.kind_of_value(tf.exp(x))
        return tf.constant(0.0)

    forward(tf.zeros((2, 3)))
    assert isinstance(found["kind"], penalties.Unknown) and found["kind"].unread
    assert "`Lgamma` (Lgamma) is an op kd cannot read" in found["kind"].why
    assert isinstance(found["term"], penalties.Unknown) and found["term"].unread
    assert found["layout"] is None
    assert found["read"] == penalties.ROWS
    assert "Lgamma" not in penalties.OPS and "Exp" in penalties.OPS


def test_a_sequence_loss_and_a_broadcast_embedding_keep_the_rows():
    # TensorFlow's sparse cross-entropy of a sequence merges the rows with
    # the steps and reshapes back; a position embedding is broadcast to each
    # row: both row by row, so kd computes them on the replica's rows.
    found = {}

    @tf.function(input_signature=[tf.TensorSpec((None, 8, 5)), tf.TensorSpec((None, 8), tf.int32)])
    def forward(logits, labels):
        found["loss"] = penalties.kind_of_value(
            keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
        found["mean"] = penalties.kind_of(tf.reduce_mean(tf.reshape(logits, [-1, 5])))
        position = tf.broadcast_to(tf.ones((8, 5)), tf.shape(logits))
        found["position"] = penalties.kind_of_value(position)
        return tf.constant(0.0)

    forward(tf.zeros((2, 8, 5)), tf.zeros((2, 8), tf.int32))
    assert found == {"loss": penalties.ROWS, "mean": penalties.ROW_MEAN,
                     "position": penalties.ROWS}


def test_loss_terms_split_a_loss_and_count_the_replicas_in_its_constants():
    """`loss_terms` (a hand-written loop's loss, read term by term with its power of R=2).

    TensorFlow's `compute_average_loss` without `global_batch_size` divides by
    rows * R: a mean divided by R. A rate that happens to be 1/R counts as a
    division by R; a variable scale (a loss scale), a stopped gradient and a
    constant change nothing. A static batch shape folds `tf.shape(x)[0]` into
    a constant: a sum divided by it is still a mean.
    """
    weight = tf.Variable([[0.5], [-1.0], [2.0]])
    scale = tf.Variable(4.0)
    found = {}

    def loss(x):
        per_example = tf.reduce_sum(tf.square(x @ weight), axis=1)
        penalty = 0.1 * tf.reduce_sum(tf.square(weight))  # a regularizer's own rate: not R
        terms = {
            "compute_average_loss": tf.nn.compute_average_loss(per_example, global_batch_size=16),
            "no_global_batch_size": tf.math.divide_no_nan(
                tf.reduce_sum(per_example), tf.cast(tf.shape(per_example)[0] * 2, tf.float32)),
            "scaled": scale * (tf.reduce_mean(per_example) + tf.add_n([penalty, penalty]) / 2.0),
            "half": 0.5 * penalty + tf.stop_gradient(tf.reduce_mean(per_example)) + 3.0,
            "counted": tf.reduce_sum(per_example) / tf.cast(tf.shape(per_example)[0], tf.float32),
        }
        for name, value in terms.items():
            found[name] = sorted((t.kind, t.replica_power) for t in penalties.loss_terms(value, 2))
        return tf.constant(0.0)

    tf.function(loss, input_signature=[tf.TensorSpec((None, 3), tf.float32)])(tf.ones((4, 3)))
    unknown_rows = dict(found)
    # A static batch shape: the row count is known when traced, still a
    # count; divided by rows * R it counts the global batch's rows (every
    # replica has as many).
    tf.function(loss, input_signature=[tf.TensorSpec((4, 3), tf.float32)])(tf.ones((4, 3)))
    assert found == dict(unknown_rows, no_global_batch_size=[(penalties.ROW_SUM, 0)]), found
    assert unknown_rows == {
        "compute_average_loss": [(penalties.ROW_SUM, 0)],
        "no_global_batch_size": [(penalties.ROW_MEAN, -1)],
        "scaled": [(penalties.FIXED, -1), (penalties.FIXED, -1), (penalties.ROW_MEAN, 0)],
        "half": [(penalties.FIXED, -1)],
        "counted": [(penalties.ROW_MEAN, 0)],
    }, unknown_rows
