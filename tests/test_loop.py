"""kd.TrainLoop: the loop fit uses, with compiled steps for hand-written loops.

Its exactness against one device, on one or many processes, is in
tests/test_exactness.py (the `loop_*` paths).
"""

import csv
import gc

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_distrib as kd
from keras_distrib.training import loop as kd_loop
from tests import _harness

@pytest.mark.cluster
def test_tensorflow_tutorial_loop_gives_the_same_weights():
    code, output = _harness.run_script("tf_tutorial_loop.py")
    assert code == 0, output[-4000:]
    (result,) = _harness.results_of(output)
    assert result["step_vs_tutorial"] <= 1e-6, result
    assert result["epoch_vs_tutorial"] <= 1e-6, result
    assert result["logs"] == ["loss"]
    errors = result["errors"]
    assert "not a distributed iterator" in errors["not_distributed"]
    assert "loop.distribute(dataset)" in errors["not_distributed"]
    assert "Create and compile the model inside" in errors["model_outside"]
    assert "Create the optimizer inside" in errors["optimizer_outside"]


def _model(model_class=kd.Model):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    model = model_class(inputs, keras.layers.Dense(1)(keras.layers.Dense(6, activation="tanh")(inputs)))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    return model


def _data():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(50, 4)).astype("float32")
    return x, (x.sum(axis=1, keepdims=True) * 0.3).astype("float32")


def _rows(path):
    with open(path) as f:
        rows = list(csv.reader(f))
    return rows[0], np.array(rows[1:], dtype="float64")


def test_stock_callbacks_see_what_plain_keras_fit_shows(tmp_path):
    # The reference is plain Keras's own fit loop on one device; kd's loop
    # (fit, and TrainLoop with 3 steps per call) must drive Keras's stock
    # callbacks the same way: CSV rows, learning-rate schedule, early stop.
    x, y = _data()
    runs = {}
    for name in ("keras", "kd_fit", "kd_loop"):
        model = _model(keras.Model if name == "keras" else kd.Model)
        log = tmp_path / f"{name}.csv"
        callbacks = [
            keras.callbacks.CSVLogger(str(log)),
            keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5),
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0),
        ]
        kwargs = dict(batch_size=16, epochs=6, callbacks=callbacks, validation_data=(x, y),
                      shuffle=False, verbose=0)
        if name == "kd_loop":
            history = kd.TrainLoop(model, steps_per_loop=3).fit(x, y, **kwargs)
        else:
            history = model.fit(x, y, **kwargs)
        runs[name] = (_rows(log), history.history, model.get_weights())
    (header, values), history, weights = runs["keras"]
    assert len(values) == 2  # 2 epochs: EarlyStopping stopped the run
    for name in ("kd_fit", "kd_loop"):
        (kd_header, kd_values), kd_history, kd_weights = runs[name]
        assert kd_header == header
        np.testing.assert_allclose(kd_values, values, rtol=2e-5, atol=1e-6)
        assert sorted(kd_history) == sorted(history)
        for key in history:
            np.testing.assert_allclose(kd_history[key], history[key], rtol=2e-5, atol=1e-6)
        for a, b in zip(kd_weights, weights):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def test_loop_evaluate_and_predict_match_plain_keras():
    # Against plain Keras on one device with the same weights.
    x, y = _data()
    model = _model()
    loop = kd.TrainLoop(model)
    loop.fit(x, y, batch_size=16, epochs=2, verbose=0)
    reference = _model(keras.Model)
    reference.set_weights(model.get_weights())
    expected = reference.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    actual = loop.evaluate(x, y, batch_size=16, verbose=0)
    assert sorted(actual) == sorted(expected)
    for key in expected:
        assert actual[key] == pytest.approx(expected[key], rel=2e-6)
    np.testing.assert_allclose(
        loop.predict(x, batch_size=16, verbose=0), reference.predict(x, batch_size=16, verbose=0),
        rtol=1e-6,
    )


class _StopAtFirstBatch(keras.callbacks.Callback):
    """Stops fit, evaluate and predict after their first batch, mid-pass."""

    def on_train_batch_end(self, batch, logs=None):
        self.model.stop_training = True

    def on_test_batch_end(self, batch, logs=None):
        self.model.stop_evaluating = True

    def on_predict_batch_end(self, batch, logs=None):
        self.model.stop_predicting = True


def _iterators_kept(model):
    """tf.data iterators still alive, without a garbage collection, after passes stopped early."""
    x, y = _data()
    gc.collect()
    gc.disable()  # what reference counting frees, not what a collection would
    try:
        before = sum(isinstance(o, tf.data.Iterator) for o in gc.get_objects())
        stop = [_StopAtFirstBatch()]
        model.fit(x, y, batch_size=8, epochs=2, callbacks=stop, verbose=0)
        model.evaluate(x, y, batch_size=8, callbacks=stop, verbose=0)
        model.predict(x, batch_size=8, callbacks=stop, verbose=0)
        return sum(isinstance(o, tf.data.Iterator) for o in gc.get_objects()) - before
    finally:
        gc.enable()


def test_a_pass_stopped_early_frees_its_input_pipeline_at_once():
    # Keras's epoch iterator and the generator of its pass hold each other:
    # a pass left mid-epoch keeps its tf.data iterators (and their threads)
    # until a full collection, which then waited up to 40 s in one
    # iterator's destructor (tools/gc_pauses). kd ends the pass on leaving.
    assert _iterators_kept(_model()) == 0
    # Plain Keras keeps them (the contrast; if this fails, Keras no longer
    # leaves the cycle, and `_keras_compat.end_pass` may go).
    assert _iterators_kept(_model(keras.Model)) >= 3


def test_bad_arguments():
    model = _model()
    with pytest.raises(ValueError, match=r"`steps_per_loop`=0 must be a whole number >= 1"):
        kd.TrainLoop(model, steps_per_loop=0)
    inputs = keras.Input((2,))
    uncompiled = kd.Model(inputs, keras.layers.Dense(1)(inputs))
    with pytest.raises(ValueError, match="is not compiled"):
        kd.TrainLoop(uncompiled)
    with pytest.raises(ValueError, match="must be a keras.Model"):
        kd.TrainLoop("model")
    with pytest.raises(ValueError, match="not a kd model.*kd.DistributedModelMixin"):
        kd.TrainLoop(_model(keras.Model))


def test_resuming_a_reshuffling_dataset_under_steps_per_epoch_is_refused_by_name():
    # Which order such an epoch trains on depends on where the earlier epochs
    # stopped in the data, which no backup holds: refused, not run inexactly.
    inputs = keras.Input((1,))
    model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    rows = tf.data.Dataset.from_tensor_slices((np.ones((8, 1)), np.ones((8, 1))))
    shuffled = rows.shuffle(8, seed=1, reshuffle_each_iteration=True).batch(2).repeat()
    source = kd_loop.epoch_source(model, x=shuffled, steps=3)
    with pytest.raises(ValueError, match=r"reshuffles each iteration .* `steps_per_epoch` is set"):
        kd_loop._replay_orders(source, 1)
    # A dataset that keeps its order resumes as it is (nothing to replay).
    fixed = rows.shuffle(8, seed=1, reshuffle_each_iteration=False).batch(2).repeat()
    kd_loop._replay_orders(kd_loop.epoch_source(model, x=fixed, steps=3), 1)
