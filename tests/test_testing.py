"""kd.testing: assert_parity catches broken models and passes good ones, as a user's pytest plugin.

The main test writes a user's test file (and a conftest.py loading the plugin)
into a temporary directory and runs pytest on it in a process of its own
(forked from the harness's warm interpreter: TensorFlow imported, its devices
not started, as when a fresh pytest has loaded the plugin): the plugin must
split the CPU before TensorFlow starts its devices, which this suite's own
process did long ago. The broken models are the ones users
write: a plain keras.Model subclass with gradient clipping, BatchNormalization
that is not synchronized, Dropout, a train_step that averages its loss over
the replica's rows, and a plain model on an uneven last batch.
"""

import os
import re

import numpy as np
import pytest
import tensorflow as tf

import keras_distrib as kd
from keras_distrib import report
from keras_distrib import testing
from tests import _harness


USER_TESTS = '''
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_distrib as kd

rng = np.random.default_rng(0)
X = rng.normal(size=(33, 5)).astype("float32")  # batches of 16: the last has 1 row
Y = (X @ rng.normal(size=(5, 1)) + 0.1 * rng.normal(size=(33, 1))).astype("float32")


def build(model_class, *, clipnorm=None, batch_norm=None, dropout=0.0, compile_options=None):
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    if batch_norm is not None:
        hidden = keras.layers.BatchNormalization(synchronized=batch_norm, name="norm")(hidden)
    if dropout:
        hidden = keras.layers.Dropout(dropout, name="drop")(hidden)
    model = model_class(inputs, keras.layers.Dense(1, name="out")(hidden))
    options = {"clipnorm": clipnorm} if clipnorm else {}
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9, **options), loss="mse",
                  metrics=["mae"], **(compile_options or {}))
    return model


class Counter(keras.layers.Layer):
    """Counts the rows it sees: state assigned in call."""

    def build(self, input_shape):
        self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False, name="seen")

    def call(self, x):
        self.seen.assign_add(tf.cast(tf.shape(x)[0], "float32"))
        return x


def counting(model_class):
    inputs = keras.Input((5,))
    model = model_class(inputs, keras.layers.Dense(1)(Counter(name="counter")(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    return model


def dataset_fn(input_context):
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)


def good_model():
    return build(kd.Model, clipnorm=0.5)


def plain_model():
    return build(keras.Model)


class ClippedKeras(keras.Model):
    """A plain keras.Model subclass: Keras 3 clips each replica's partial gradient."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh", name="hidden")
        self.out = keras.layers.Dense(1, name="out")

    def call(self, x):
        return self.out(self.hidden(x))


def clipped_keras():
    model = ClippedKeras()
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9, clipnorm=0.5), loss="mse")
    return model


class OwnLoss(kd.Model):
    """A train_step whose loss is plain ops on the replica's rows (`LOSS` picks which)."""

    LOSS = "mean"

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            errors = tf.square(self(x, training=True) - y)
            if self.LOSS == "mean":  # as Keras's guides write it: exact
                loss = tf.reduce_mean(errors)
            elif self.LOSS == "sum":  # a sum over a fixed batch size: exact
                loss = tf.reduce_sum(errors) / 16.0
            elif self.LOSS == "rmse":  # rows meet: kd computes it on the global batch
                loss = tf.sqrt(tf.reduce_mean(errors))
            elif self.LOSS == "cumsum":  # later rows weigh more: rows meet, the global batch
                loss = tf.reduce_mean(tf.math.cumsum(errors, axis=0)) / 8.0
            else:  # later rows weigh more, in a loop kd cannot read: the global batch
                loss = tf.foldl(lambda total, row: 0.9 * total + row,
                                tf.reduce_mean(errors, axis=1), initializer=tf.zeros((), errors.dtype))
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        return {}


class HandMadeLoss(OwnLoss):
    LOSS = "fold"


def hand_made_loss():
    return build(HandMadeLoss)


def own_loss(kind):
    return lambda: build(type(f"{kind.title()}Loss", (OwnLoss,), {"LOSS": kind}))


def test_good_model_matches_everywhere_in_process():
    result = kd.testing.assert_parity(good_model, (X, Y), batch_size=16,
                                      strategies=["one_device", "mirrored", "central_storage"])
    assert sorted(result) == ["central_storage (2 replicas, fit)", "mirrored (2 replicas, fit)",
                              "one_device (1 replica, fit)"]
    assert max(result.values()) <= 2e-5
    # Two epochs, through kd.TrainLoop, and synchronized BatchNormalization.
    kd.testing.assert_parity(lambda: build(kd.Model, clipnorm=0.5, batch_norm=True), (X, Y),
                             batch_size=16, steps=6, path="loop")


def test_plain_keras_subclass_with_clipping_is_caught():
    with pytest.raises(AssertionError) as caught:
        kd.testing.assert_parity(clipped_keras, (X, Y), batch_size=16)
    message = str(caught.value)
    assert "mirrored (2 replicas, fit) does not train like one device" in message
    assert "first mismatch: step 1 (epoch 1, batch 1 of 3)" in message
    assert "first variable: clipped_keras/hidden/kernel (5, 8)" in message
    assert re.search(r"max \\|a - b\\| / \\(1 \\+ \\|a\\|\\) = [0-9.e-]+ \\(tolerance 2e-05", message)
    assert "likely cause: per-replica gradient clipping: the optimizer (`clipnorm`=0.5)" in message


def test_unsynchronized_batch_norm_is_caught():
    for model_fn in (lambda: build(keras.Model, batch_norm=False),
                     lambda: build(kd.Model, batch_norm=False, compile_options={"batch_norm": "per_replica"})):
        with pytest.raises(AssertionError) as caught:
            kd.testing.assert_parity(model_fn, (X, Y), batch_size=16)
        message = str(caught.value)
        assert "first mismatch: step 1" in message
        assert "likely cause: unsynchronized BatchNormalization: 'norm' normalizes" in message
        assert "kd models compute global statistics" in message
        # Not round-off: float64 shows the same difference.
        assert re.search(r"float64 re-check: the same training in float64 still differs by [0-9.e-]+ "
                         r"\\(an exact model matches to about 1e-12\\): a real difference", message), message


def round_off_model():
    """A bias before synchronized BatchNormalization has a gradient of exactly zero;
    Adam turns its float32 round-off into steps of the learning rate's size."""
    inputs = keras.Input((4, 4, 3))
    hidden = keras.layers.Conv2D(4, 3, padding="same", name="conv")(inputs)
    hidden = keras.layers.BatchNormalization(synchronized=True, name="norm")(hidden)
    hidden = keras.layers.GlobalAveragePooling2D()(keras.layers.ReLU()(hidden))
    model = kd.Model(inputs, keras.layers.Dense(3, name="out")(hidden))
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_round_off_is_told_from_a_real_difference():
    images = rng.normal(size=(33, 4, 4, 3)).astype("float32")
    labels = rng.integers(0, 3, size=(33,))
    with pytest.warns(UserWarning, match=r"float32 differs from one device by [0-9.e-]+ \\(tolerance "
                      r"2e-05\\), and the same training in float64 matches to [0-9.e-]+: float32 round-off"):
        result = kd.testing.assert_parity(round_off_model, (images, labels), batch_size=16)
    assert max(result.values()) <= 1e-9, result  # the float64 difference
    assert keras.config.floatx() == "float32" and keras.config.dtype_policy().name == "float32"


class BatchOf16(keras.layers.Layer):
    """Assumes the global batch: fails on a replica's half of it."""

    def call(self, x):
        return x + tf.ones((16, 5))


def test_the_whole_error_when_a_strategy_fails():
    def model_fn():
        inputs = keras.Input((5,))
        model = kd.Model(inputs, keras.layers.Dense(1)(BatchOf16()(inputs)))
        model.compile(optimizer="sgd", loss="mse")
        return model

    with pytest.raises(AssertionError) as caught:
        kd.testing.assert_parity(model_fn, (X[:32], Y[:32]), batch_size=16)
    message = str(caught.value)
    assert "training under mirrored (2 replicas, fit) failed (on one device it runs): ValueError: " \
           "Dimensions must be equal, but are 8 and 16" in message, message
    assert "the whole error:" in message and "with input shapes: [8,5], [16,5]." in message, message


def test_dropout_is_caught():
    with pytest.raises(AssertionError, match="likely cause: dropout or other randomness: 'drop'"):
        kd.testing.assert_parity(lambda: build(keras.Model, dropout=0.3), (X, Y), batch_size=16)


def test_kd_model_with_dropout_and_batch_norm_matches_on_datasets():
    # kd draws dropout for the global batch and normalizes over it; the data
    # as a tf.data.Dataset and as a dataset_fn.
    model_fn = lambda: build(kd.Model, batch_norm=False, dropout=0.3)
    for data in (tf.data.Dataset.from_tensor_slices((X, Y)).batch(16), dataset_fn):
        result = kd.testing.assert_parity(model_fn, data, strategies=["mirrored"])
        assert max(result.values()) <= 2e-5


def test_layer_state_is_named():
    with pytest.raises(AssertionError) as caught:
        kd.testing.assert_parity(lambda: counting(keras.Model), (X, Y), batch_size=16)
    message = str(caught.value)
    assert "first variable: counter/seen ()" in message
    assert "likely cause: layer state: 'counter' (Counter) updates its non-trainable variable" in message
    kd.testing.assert_parity(lambda: counting(kd.Model), (X, Y), batch_size=16)


def test_custom_reduction_is_caught():
    # A loop over the rows kd cannot read: kd computes it on the global batch ...
    result = kd.testing.assert_parity(hand_made_loss, (X, Y), batch_size=16)
    assert max(result.values()) <= 2e-5, result
    # ... and where the model leaves each replica its own rows, the parity check catches it.
    with pytest.raises(AssertionError) as caught:
        kd.testing.assert_parity(lambda: build(HandMadeLoss, compile_options={"rows_meet": "per_replica"}),
                                 (X, Y), batch_size=16)
    assert 'likely cause: rows left to each replica: the model was compiled with rows_meet="per_replica"' \
        in str(caught.value), str(caught.value)
    # A mean or a sum over the replica's rows: kd reads which from the graph,
    # exact; where the rows meet (the root of a mean, a cumulative sum over
    # rows), kd computes the loss on the global batch.
    for kind in ("mean", "sum", "rmse", "cumsum"):
        result = kd.testing.assert_parity(own_loss(kind), (X, Y), batch_size=16)
        assert max(result.values()) <= 2e-5, kind
    # Told to leave each replica its own rows, the same model is caught.
    with pytest.raises(AssertionError) as caught:
        kd.testing.assert_parity(
            lambda: build(type("RmseLoss", (OwnLoss,), {"LOSS": "rmse"}),
                          compile_options={"rows_meet": "per_replica"}), (X, Y), batch_size=16)
    assert "likely cause: rows left to each replica: the model was compiled with " \
        'rows_meet="per_replica"' in str(caught.value)


def test_plain_model_is_caught_at_the_uneven_batch():
    with pytest.raises(AssertionError) as caught:
        kd.testing.assert_parity(plain_model, (X, Y), batch_size=16)
    message = str(caught.value)
    assert ("first mismatch: step 3 (epoch 1, batch 3 of 3; the uneven last batch: 1 row, "
            "split [1, 0] over the 2 replicas)") in message
    assert "steps before it: 1-2 match" in message
    assert "likely cause: a plain Keras model (Functional, not a kd model) on an uneven batch" in message


def test_fixtures(kd_strategy, kd_one_device, kd_mirrored, kd_central_storage,
                  kd_multi_worker, kd_parameter_server):
    assert kd_strategy.num_replicas_in_sync in (1, 2)
    assert [s.num_replicas_in_sync for s in (kd_one_device, kd_mirrored, kd_central_storage)] == [1, 2, 2]
    assert callable(kd_multi_worker) and callable(kd_parameter_server)


def test_other_processes():
    result = kd.testing.assert_parity(good_model, (X, Y), batch_size=16, steps=4,
                                      strategies=["multi_worker", "parameter_server"])
    assert max(result.values()) <= 2e-5, result
    with pytest.raises(AssertionError) as caught:
        kd.testing.assert_parity(plain_model, (X, Y), batch_size=16, strategies=["multi_worker"])
    assert ("training under multi_worker (2 worker processes, fit) failed (on one device it runs): "
            "worker ") in str(caught.value)
    assert "PerReplica" in str(caught.value)
'''


# The user's file in four runs, which the suite's two pytest workers can run
# beside other tests: the two tests that re-run in float64, the rest of the
# plugin's process in two halves, and the one that starts worker clusters.
# Together they run the file's 14 tests. In one run (about 120 CPU seconds,
# mostly single-threaded tracing, which a loaded CPU stretches most) it reached
# its limit; the in-process run took 31 s alone and 365 s beside a CPU hog and
# a running suite, so it is halved (about 13 s of tests each).
_FLOAT64_RERUNS = "test_round_off_is_told_from_a_real_difference or test_layer_state_is_named"
_IN_PROCESS_FIRST = ("test_custom_reduction_is_caught or test_good_model_matches_everywhere_in_process"
                     " or test_plain_keras_subclass_with_clipping_is_caught"
                     " or test_the_whole_error_when_a_strategy_fails or test_fixtures")


@pytest.mark.cluster
@pytest.mark.parametrize("selection,count", [
    (_FLOAT64_RERUNS, 2),
    (_IN_PROCESS_FIRST, 7),
    (f"not ({_FLOAT64_RERUNS} or {_IN_PROCESS_FIRST} or test_other_processes)", 4),
    ("test_other_processes", 1),
], ids=["float64_reruns", "in_process_first", "in_process_rest", "other_processes"])
def test_plugin_in_a_user_test_file(tmp_path, selection, count):
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["keras_distrib.testing"]\n')
    (tmp_path / "test_user_model.py").write_text(USER_TESTS)
    # `python -m pytest ...`, forked from the warm interpreter (TensorFlow imported, not started).
    code, output = _harness.run_python(
        [os.path.join(os.path.dirname(pytest.__file__), "__main__.py"), "-q", "-p", "no:cacheprovider",
         "--kd-devices", "2", "-W", "ignore::UserWarning", "-k", selection, "test_user_model.py"],
        _harness._env(), str(tmp_path), timeout=540)
    assert code == 0, output[-6000:]
    assert re.search(rf"\b{count} passed\b", output), output[-3000:]


# In this process: the parts that need no second device.


def test_invalid_arguments_are_all_listed():
    with pytest.raises(ValueError) as caught:
        testing.assert_parity(42, [np.zeros((4, 2))], strategies=["mirorred"], steps=0, path="custom",
                              batch_size=0)
    message = str(caught.value)
    for text in ("`model_fn`=42 is not callable", "`path`='custom'", "`strategies` item 'mirorred'",
                 "`steps`=0", "`batch_size`=0", "`data` is a list"):
        assert text in message, (text, message)


def test_local_strategy_refuses_cluster_kinds():
    with pytest.raises(ValueError, match="`kind`='multi_worker' does not run in this process"):
        testing.local_strategy("multi_worker")


def test_one_device_parity_in_this_process():
    import keras

    def model_fn():
        inputs = keras.Input((3,))
        model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.1, clipnorm=0.1), loss="mse")
        return model

    x = np.random.default_rng(1).normal(size=(9, 3)).astype("float32")
    result = testing.assert_parity(model_fn, (x, x[:, :1]), strategies=["one_device"], batch_size=4)
    assert list(result) == ["one_device (1 replica, fit)"] and result["one_device (1 replica, fit)"] <= 2e-5


def test_error_line_and_error_text_find_the_message():
    nested = ValueError("Attempt to convert a value (PerReplica:{\n  0: <tf.Tensor ...>\n}) with an "
                        "unsupported type (<class 'tensorflow.python.distribute.values.PerReplica'>) "
                        "to a Tensor.")
    assert report.error_line(nested) == ("ValueError: Attempt to convert a value (PerReplica:{…}) with an "
                                         "unsupported type (PerReplica) to a Tensor.")
    @tf.function(input_signature=[tf.TensorSpec((None, 4))] * 2)
    def add(a, b):
        return a + b

    graph_error = None
    try:
        add(tf.ones((8, 4)), tf.ones((16, 4)))  # TensorFlow's "Graph execution error:"
    except tf.errors.InvalidArgumentError as error:
        graph_error = error
    assert str(graph_error).startswith("Graph execution error:")
    assert report.error_line(graph_error).startswith("InvalidArgumentError: Incompatible shapes: [8,4] vs. [16,4]")
    whole = report.error_text(graph_error)
    assert whole.startswith("InvalidArgumentError: Incompatible shapes: [8,4] vs. [16,4]")
    assert "File " not in whole and "Detected at node" not in whole
    wrapped = ValueError("in user code:\n\n    File \"x.py\", line 3, in f  *\n        y()\n\n"
                         "    ValueError: destinations can not be empty\n")
    assert report.error_line(wrapped) == "ValueError: destinations can not be empty"
