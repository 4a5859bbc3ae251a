"""kd.callbacks: scratch space of non-chief workers, ModelCheckpoint's placeholders, TensorBoard's model graph."""

import json
import os
import re
import tempfile
import warnings

import keras
import numpy as np
import pytest

import keras_distrib as kd


def _model(metrics=("mae",)):
    inputs = keras.Input((2,))
    model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse", metrics=list(metrics))
    return model


_DATA = (np.ones((4, 2), "float32"), np.ones((4, 1), "float32"))


def test_tensorboard_on_a_worker_makes_scratch_only_when_used_and_removes_it(tmp_path, monkeypatch):
    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch_root))
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": {"worker": ["localhost:1", "localhost:2"]}, "task": {"type": "worker", "index": 1}}))
    callback = kd.callbacks.TensorBoard(str(tmp_path / "logs"))
    assert os.listdir(scratch_root) == []  # nothing made at construction
    callback.set_model(_model())
    callback.on_train_begin()
    (scratch,) = os.listdir(scratch_root)
    assert scratch.startswith("kd-scratch-") and "tbworker1" in scratch
    callback.on_train_end()
    assert os.listdir(scratch_root) == []
    assert not (tmp_path / "logs").exists()  # the chief's directory: untouched by a worker


def test_model_checkpoint_catches_a_mistyped_log_key_before_training(tmp_path):
    model = _model(metrics=("accuracy",))
    callback = kd.callbacks.ModelCheckpoint(str(tmp_path / "m-{epoch}-{val_acuracy:.2f}.keras"))
    with pytest.raises(ValueError, match=r"\{val_acuracy\} \(did you mean \{val_accuracy\}\?\)"):
        model.fit(*_DATA, verbose=0, callbacks=[callback])
    assert int(model.optimizer.iterations.numpy()) == 0 and not os.listdir(tmp_path)


def test_model_checkpoint_warns_about_an_unknown_key_and_names_it_at_the_save(tmp_path):
    model = _model()
    callback = kd.callbacks.ModelCheckpoint(str(tmp_path / "m-{epoch}-{lr:.3f}.keras"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=r"`filepath`=.* names \{lr\}, which is not in the logs at "
                                             r"this save \(keys: \['batch', 'epoch', 'loss', 'mae'\]\)"):
            model.fit(*_DATA, verbose=0, callbacks=[callback])
    assert any("which the compiled model does not log" in str(w.message) for w in caught)
    assert not os.listdir(tmp_path)  # no file, no staging left


def test_model_checkpoint_fills_batch_and_log_keys(tmp_path):
    model = _model()
    callback = kd.callbacks.ModelCheckpoint(
        str(tmp_path / "m-{epoch:02d}-{batch}-{loss:.1f}.weights.h5"), save_weights_only=True,
        save_freq=2)
    model.fit(*_DATA, batch_size=1, verbose=0, callbacks=[callback])
    names = sorted(os.listdir(tmp_path))
    # As Keras: the batch number counts from 1 (saves after batches 2 and 4).
    assert len(names) == 2 and all(re.fullmatch(rf"m-01-{b}-\d+\.\d\.weights\.h5", n)
                                   for b, n in zip((2, 4), names)), names


def _graph_nodes(log_dir):
    """Node names of the conceptual graph (the `keras` tag) TensorBoard's Graphs tab shows."""
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.plugins.graph import keras_util

    events = event_accumulator.EventAccumulator(os.path.join(log_dir, "train"),
                                                size_guidance={"tensors": 0})
    events.Reload()
    if "keras" not in events.Tags()["tensors"]:
        return None
    (event,) = events.Tensors("keras")
    config = json.loads(event.tensor_proto.string_val[0])
    return sorted(node.name for node in keras_util.keras_model_to_graph_def(config).node)


class _FunctionalSubclass(kd.DistributedModelMixin, keras.Model):
    pass


@pytest.mark.parametrize("build", ["kd.Model", "kd.Sequential", "subclass"])
def test_tensorboard_writes_the_model_graph_keras_writes_for_its_own_models(tmp_path, build):
    x = np.random.default_rng(0).normal(size=(6, 3)).astype("float32")

    def layers():
        return [keras.layers.Dense(4, name="hidden"), keras.layers.Dense(1, name="out")]

    def functional(model_class):
        inputs = keras.Input((3,), name="x")
        hidden, out = layers()
        return model_class(inputs, out(hidden(inputs)), name="net")

    if build == "kd.Sequential":
        keras_model = keras.Sequential([keras.Input((3,), name="x"), *layers()], name="net")
        kd_model = kd.Sequential([keras.Input((3,), name="x"), *layers()], name="net")
    else:
        keras_model = functional(keras.Model)
        kd_model = functional(kd.Model if build == "kd.Model" else _FunctionalSubclass)
    graphs = {}
    for name, model, callback in [("keras", keras_model, keras.callbacks.TensorBoard),
                                  ("kd", kd_model, kd.callbacks.TensorBoard),
                                  ("contrast", kd_model, keras.callbacks.TensorBoard)]:
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, x[:, :1], batch_size=3, verbose=0,
                  callbacks=[callback(str(tmp_path / name), write_graph=True)])
        graphs[name] = _graph_nodes(str(tmp_path / name))
    assert graphs["keras"] and graphs["kd"] == graphs["keras"], graphs
    if build != "kd.Sequential":  # Keras's callback skips classes not named Functional
        assert graphs["contrast"] is None, graphs
