"""kd.callbacks: scratch space of non-chief workers, ModelCheckpoint's placeholders, TensorBoard's model graph."""

import contextlib
import json
import os
import re
import signal
import tempfile
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_distrib as kd
from keras_distrib.training import loop as kd_loop
from keras_distrib.training import step as kd_step
from tests import _harness


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
# A preemption in the middle (or at the last step) of an epoch.

_X = np.random.default_rng(3).normal(size=(32, 3)).astype("float32")
_Y = (_X @ np.array([[1.0], [-2.0], [0.5]], "float32") + 0.1).astype("float32")
_EPOCHS, _BATCH = 3, 4  # 8 batches per epoch


def _preempt_model(plain=False, steps_per_execution=1):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(1)(keras.layers.Dense(4, activation="tanh")(inputs))
    model = (keras.Model if plain else kd.Model)(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"],
                  steps_per_execution=steps_per_execution)
    return model


class _EpochRecorder(keras.callbacks.Callback):
    """Records every epoch end with its logs and the weights then; SIGTERM after batch `at`."""

    def __init__(self, at=None):
        super().__init__()
        self.at, self.ends, self.epoch = at, [], 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.at == (self.epoch, batch):
            # raise_signal: handled before it returns (os.kill may reach
            # another of the process's threads, and the handler run later).
            signal.raise_signal(signal.SIGTERM)  # handled by BackupAndRestore

    def on_epoch_end(self, epoch, logs=None):
        self.ends.append((epoch, dict(logs), [w.copy() for w in self.model.get_weights()]))


def _preempted_then_resumed(tmp_path, at, data=lambda: {"x": _X, "y": _Y, "batch_size": _BATCH},
                            scope=contextlib.nullcontext, steps_per_execution=1):
    """Runs kd fit preempted after batch `at` = (epoch, batch), then the restart."""
    backup, saved = str(tmp_path / "backup"), str(tmp_path / "m-{epoch}.weights.h5")
    runs = []
    for attempt in range(2):
        recorder = _EpochRecorder(at if attempt == 0 else None)
        callbacks = [kd.callbacks.BackupAndRestore(backup),
                     kd.callbacks.ModelCheckpoint(saved, save_weights_only=True), recorder]
        with scope():
            model = _preempt_model(steps_per_execution=steps_per_execution)
        if attempt == 0:
            with pytest.raises(SystemExit) as stop:
                model.fit(**data(), epochs=_EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
            assert stop.value.code == 42
            runs.append((recorder, sorted(os.listdir(tmp_path))))
        else:
            history = model.fit(**data(), epochs=_EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
            runs.append((recorder, history))
    return runs


@pytest.fixture(scope="module")
def plain_keras_epochs():
    """Plain Keras on one device, uninterrupted: each epoch's weights and logs."""
    model = _preempt_model(plain=True)
    recorder = _EpochRecorder()
    model.fit(_X, _Y, batch_size=_BATCH, epochs=_EPOCHS, shuffle=False, verbose=0, callbacks=[recorder])
    return recorder.ends


def _assert_weights(got, want):
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)


def test_an_interrupted_epoch_is_not_ended_and_counts_once_on_resume(tmp_path, plain_keras_epochs):
    # SIGTERM after batch 7 of 8 of the third epoch: the backup holds 7
    # batches, but the epoch did not end: no model-3 file, no epoch end.
    (first, files_then), (second, history) = _preempted_then_resumed(tmp_path, at=(2, 6))
    assert [epoch for epoch, _, _ in first.ends] == [0, 1]
    assert "m-3.weights.h5" not in files_then and {"m-1.weights.h5", "m-2.weights.h5"} <= set(files_then)
    # The restart finishes epoch 3 and ends it once, as one uninterrupted run does.
    assert [epoch for epoch, _, _ in second.ends] == [2]
    assert history.epoch == [2]
    epoch, logs, weights = second.ends[0]
    _assert_weights(weights, plain_keras_epochs[2][2])
    for key in ("loss", "mae"):
        np.testing.assert_allclose(logs[key], plain_keras_epochs[2][1][key], rtol=2e-5)
    model = _preempt_model()
    model.load_weights(str(tmp_path / "m-3.weights.h5"))
    _assert_weights(model.get_weights(), plain_keras_epochs[2][2])


def test_resuming_from_a_backup_at_an_epochs_last_step_ends_it_with_its_logs(tmp_path, plain_keras_epochs):
    # SIGTERM after the last batch of the second epoch: the backup is taken
    # at its last step, before the epoch ended. The restart runs no step of
    # it, and ends it with its real logs (restored metrics), not {}.
    (first, files_then), (second, _) = _preempted_then_resumed(tmp_path, at=(1, 7))
    assert [epoch for epoch, _, _ in first.ends] == [0]
    assert "m-2.weights.h5" not in files_then
    assert [epoch for epoch, _, _ in second.ends] == [1, 2]
    for (epoch, logs, weights), (_, want_logs, want_weights) in zip(second.ends, plain_keras_epochs[1:]):
        assert set(logs) == {"loss", "mae"}, logs
        for key in ("loss", "mae"):
            np.testing.assert_allclose(logs[key], want_logs[key], rtol=2e-5)
        _assert_weights(weights, want_weights)


@pytest.mark.parametrize("data,scope,steps_per_execution", [
    ("arrays", "default", 1),
    ("dataset", "default", 3),
    ("arrays", "mirrored", 1),
    ("distributed", "mirrored", 3),
])
def test_resume_skips_the_held_batches_before_distribution(tmp_path, plain_keras_epochs, monkeypatch,
                                                           data, scope, steps_per_execution):
    # The restart wraps the batched dataset in `skip` instead of pulling the
    # held batches through the distributed iterator; it trains the batches
    # an uninterrupted plain Keras run trains (one device, same batches).
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"]) if scope == "mirrored" else None
    rows = tf.data.Dataset.from_tensor_slices((_X, _Y))
    inputs = {
        "arrays": lambda: {"x": _X, "y": _Y, "batch_size": _BATCH},
        "dataset": lambda: {"x": rows.batch(_BATCH)},
        "distributed": lambda: {"x": kd.distribute_dataset(rows, strategy=strategy,
                                                            global_batch_size=_BATCH)},
    }[data]
    moved, pulled = [], []
    before = kd_loop.skip_before_distribution
    monkeypatch.setattr(kd_loop, "skip_before_distribution",
                        lambda *args: moved.append(before(*args)) or moved[-1])
    pulled_skip = kd_step.Step.skip
    monkeypatch.setattr(kd_step.Step, "skip",
                        lambda self, *args: pulled.append(args[1]) or pulled_skip(self, *args))
    _, (second, history) = _preempted_then_resumed(
        tmp_path, at=(2, 5), data=inputs, scope=strategy.scope if strategy else contextlib.nullcontext,
        steps_per_execution=steps_per_execution)
    assert moved[-1] is True and not [n for n in pulled if n], (moved, pulled)
    assert history.epoch == [2]
    epoch, logs, weights = second.ends[0]
    _assert_weights(weights, plain_keras_epochs[2][2])
    for key in ("loss", "mae"):
        np.testing.assert_allclose(logs[key], plain_keras_epochs[2][1][key], rtol=2e-5)


# Exact resume with every random state (tests/scripts/resume_random.py: float64,
# random flips, BatchNormalization, Dropout, GaussianNoise, `keras.random` in
# train_step; a crash after global step 11, the backup holding step 10).


@pytest.fixture(scope="module")
def random_references(tmp_path_factory):
    """Plain Keras on one device, uninterrupted, per (mode, data): the reference."""
    folder = tmp_path_factory.mktemp("random-references")

    def reference(mode, data):
        out = folder / f"{mode}-{data}.npz"
        if not out.exists():
            code, output = _harness.run_script("resume_random.py", 1, mode, data, folder / "unused",
                                               out, -1, "plain")
            assert code == 0 and "DONE 24" in output, output[-3000:]
        return str(out)

    return reference


@pytest.mark.cluster
@pytest.mark.parametrize("mode,data,first,second,stop", [
    ("fit", "dataset", 2, 4, 11),   # mid-epoch, onto more replicas
    ("fit", "arrays", 4, 2, 9),     # the first epoch's last step, onto fewer
    ("loop", "dataset", 2, 1, 11),  # kd.TrainLoop, onto one device
    ("manual", "dataset", 1, 2, 11),  # a kd.CheckpointManager loop
])
def test_a_resume_restores_every_random_state_on_any_replica_layout(
        random_references, tmp_path, mode, data, first, second, stop):
    backup, out = tmp_path / "backup", tmp_path / "out.npz"
    code, output = _harness.run_script("resume_random.py", first, mode, data, backup, out, stop)
    assert code == 3 and not out.exists(), output[-3000:]  # crashed after the backup
    code, output = _harness.run_script("resume_random.py", second, mode, data, backup, out, -1)
    assert code == 0 and "DONE 24" in output, output[-3000:]
    reference = random_references("manual" if mode == "manual" else "fit", data)
    assert _harness.saved_weights_diff(reference, str(out)) <= 1e-9
