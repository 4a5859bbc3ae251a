"""Handing a model on (keras_distrib/training/saving.py).

- A functional or Sequential kd model's `model.save` file, and
  `kd.save_for_keras`'s, load in plain Keras in a process where kd cannot
  be imported (kd is pip-installed here, so the process blocks the import),
  as Keras's own classes: the same weights, predictions and optimizer state
  as the kd model; `model.export` serves there too. A subclass of the
  user's own does not load there without its code, as in plain Keras (the
  contrast). Where kd is loaded, both `model.save` and `kd.load_model` give
  the kd model back.
- `kd.load_model` loads a plain Keras file as a kd model that trains on as
  plain Keras does on one device (optimizer state included); rebuilding a
  kd model around a loaded plain one loses the optimizer state (the
  contrast). kd's own compile settings survive the trip through Keras.
"""

import json
import os
import zipfile

import keras
import numpy as np
import pytest

import keras_distrib as kd
from keras_distrib.training import models as kd_models
from tests import _harness

TOLERANCE = 2e-5
ROWS, BATCH = 33, 8  # the last batch has 1 row


def _data():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(ROWS, 5)).astype("float32")
    return x, (x @ rng.normal(size=(5, 1))).astype("float32")


def _layers(inputs):
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    hidden = keras.layers.BatchNormalization()(hidden)
    return keras.layers.Dense(1)(hidden)


def _largest(a, b):
    return max(float(np.max(np.abs(u - v) / (1 + np.abs(u)))) for u, v in zip(a, b))


@pytest.fixture(scope="module")
def trained():
    """A kd model trained one epoch with Adam (moments, step count) and per-replica batch statistics."""
    keras.utils.set_random_seed(2)
    inputs = keras.Input((5,))
    model = kd.Model(inputs, _layers(inputs))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"],
                  batch_norm="per_replica", pss_evaluation_shards=3)
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model


@keras.saving.register_keras_serializable(package="test_saving")
class OwnModel(kd.Model):
    """A functional subclass of the user's own: its file needs this class, as in plain Keras."""


@pytest.mark.cluster
def test_a_saved_file_loads_where_kd_cannot_be_imported(trained, tmp_path):
    x, _ = _data()
    kd.save_for_keras(trained, tmp_path / "handed.keras")
    trained.save(tmp_path / "saved.keras")
    trained.export(str(tmp_path / "exported"), verbose=False)
    keras.utils.set_random_seed(5)
    sequential = kd.Sequential([keras.Input((5,)), keras.layers.Dense(3, activation="relu"),
                                keras.layers.Dense(1)])
    sequential.save(tmp_path / "sequential.keras")
    inputs = keras.Input((5,))
    OwnModel(inputs, keras.layers.Dense(1)(inputs)).save(tmp_path / "own_class.keras")
    arrays = {"x": x, "predictions": trained.predict(x, verbose=0),
              "sequential": sequential.predict(x, verbose=0),
              "weight_count": len(trained.weights), "optimizer_count": len(trained.optimizer.variables)}
    arrays.update({f"weight_{i}": w for i, w in enumerate(trained.get_weights())})
    arrays.update({f"optimizer_{i}": v.numpy() for i, v in enumerate(trained.optimizer.variables)})
    np.savez(tmp_path / "expected.npz", **arrays)
    code, output = _harness.run_script("without_kd.py", tmp_path, timeout=240, fresh=True)
    assert code == 0, output[-4000:]
    (result,) = _harness.results_of(output)
    assert result["blocked"] and result["kd_modules"] == [], result
    # model.save's file and save_for_keras's: Keras's class, kd's weights, optimizer, predictions.
    for name in ("saved", "handed"):
        loaded = result[name]
        assert loaded["class"] == "Functional" and loaded["compiled"], (name, result)
        assert loaded["iterations"] == int(trained.optimizer.iterations.numpy()) == 5, (name, result)
        assert loaded["optimizer_count"][0] == loaded["optimizer_count"][1], (name, result)
        for key in ("weights", "optimizer", "predictions"):
            assert loaded[key] is not None and loaded[key] <= TOLERANCE, (name, key, result)
    assert result["sequential"][0] == "Sequential" and result["sequential"][1] <= TOLERANCE, result
    assert result["served"] <= TOLERANCE, result
    # Contrast: a subclass of the user's own is not there without its code.
    assert "Could not locate class 'OwnModel'" in result["own_class"], result


def test_a_saved_file_names_keras_classes_and_loads_back_as_kd(trained, tmp_path):
    trained.save(tmp_path / "saved.keras")
    with zipfile.ZipFile(tmp_path / "saved.keras") as archive:
        config = json.loads(archive.read("config.json"))
    # Keras's module and class (what plain Keras falls back to), kd's registered name.
    inputs = keras.Input((5,))
    keras_functional = type(keras.Model(inputs, keras.layers.Dense(1)(inputs)))
    assert (config["module"], config["class_name"]) == (keras_functional.__module__, "Functional")
    assert config["registered_name"] == "keras_distrib>FunctionalModel"
    assert "batch_norm" not in config["compile_config"]  # plain Keras's compile refuses it
    plain_loaded = keras.saving.load_model(tmp_path / "saved.keras")
    assert type(plain_loaded) is kd_models.FunctionalModel and plain_loaded.compiled
    back = kd.load_model(tmp_path / "saved.keras")
    assert type(back) is kd_models.FunctionalModel
    assert (back.batch_norm, back.pss_evaluation_shards) == ("per_replica", 3)
    x, _ = _data()
    for loaded in (plain_loaded, back):
        for saved, restored in zip(trained.optimizer.variables, loaded.optimizer.variables):
            np.testing.assert_array_equal(saved.numpy(), restored.numpy())
        np.testing.assert_array_equal(trained.predict(x, verbose=0), loaded.predict(x, verbose=0))
    # A nested kd model is named as Keras's too.
    inner = kd.Sequential([keras.Input((5,)), keras.layers.Dense(3)], name="inner")
    inputs = keras.Input((5,))
    kd.Model(inputs, keras.layers.Dense(1)(inner(inputs))).save(tmp_path / "nested.keras")
    with zipfile.ZipFile(tmp_path / "nested.keras") as archive:
        nested = json.loads(archive.read("config.json"))
    (layer,) = [layer for layer in nested["config"]["layers"] if layer["config"]["name"] == "inner"]
    assert (layer["class_name"], layer["registered_name"]) == ("Sequential", "keras_distrib>Sequential")
    assert type(keras.saving.load_model(tmp_path / "nested.keras").get_layer("inner")) is kd.Sequential


def test_a_plain_keras_file_trains_on_in_kd_as_plain_keras_does(tmp_path):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    plain = keras.Model(inputs, _layers(inputs))
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    x, y = _data()
    plain.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    plain.save(tmp_path / "plain.keras")

    model = kd.load_model(tmp_path / "plain.keras")
    assert isinstance(model, kd.Model) and model.compiled
    assert int(model.optimizer.iterations.numpy()) == 5
    # The reference: plain Keras, one device, from the same file.
    reference = keras.saving.load_model(tmp_path / "plain.keras")
    assert type(reference).__name__ == "Functional"
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    difference = _largest(reference.get_weights(), model.get_weights())
    assert difference <= TOLERANCE, difference
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=TOLERANCE)

    # Contrast: a kd model rebuilt around the loaded layers starts a new optimizer.
    rebuilt_plain = keras.saving.load_model(tmp_path / "plain.keras")
    rebuilt = kd.Model(rebuilt_plain.inputs, rebuilt_plain.outputs)
    rebuilt.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    rebuilt.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert _largest(reference.get_weights(), rebuilt.get_weights()) > 100 * TOLERANCE


def test_a_plain_sequential_file_becomes_a_kd_sequential(tmp_path):
    plain = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    plain.compile(optimizer="sgd", loss="mse", jit_compile=False, steps_per_execution=2)
    plain.save(tmp_path / "plain.keras")
    model = kd.load_model(tmp_path / "plain.keras")
    assert isinstance(model, kd.Sequential) and model.steps_per_execution == 2
    assert model.batch_norm == "global"  # kd's default: the file holds no setting of kd's
    uncompiled = kd.load_model(tmp_path / "plain.keras", compile=False)
    assert isinstance(uncompiled, kd.Sequential) and not uncompiled.compiled


def test_kd_settings_and_optimizer_state_survive_the_trip_through_keras(trained, tmp_path):
    path = kd.save_for_keras(trained, str(tmp_path / "handed.keras"))
    with zipfile.ZipFile(path) as archive:
        config = archive.read("config.json").decode()
    assert "keras_distrib" not in config and '"batch_norm":' not in config
    plain = keras.saving.load_model(path)  # here kd is installed: still Keras's class
    assert type(plain).__name__ == "Functional" and not isinstance(plain, kd.DistributedModelMixin)
    back = kd.load_model(path)
    assert isinstance(back, kd.Model)
    assert back.batch_norm == "per_replica" and back.pss_evaluation_shards == 3
    assert back.get_compile_config()["batch_norm"] == "per_replica"
    assert int(back.optimizer.iterations.numpy()) == int(trained.optimizer.iterations.numpy())
    for saved, loaded in zip(trained.optimizer.variables, back.optimizer.variables):
        np.testing.assert_array_equal(saved.numpy(), loaded.numpy())
    for saved, loaded in zip(trained.get_weights(), back.get_weights()):
        np.testing.assert_array_equal(saved, loaded)


def test_an_existing_file_is_kept_unless_overwrite(trained, tmp_path):
    (tmp_path / "m.keras").write_bytes(b"an earlier model")
    with pytest.raises(ValueError, match=r"`filepath`=.*m\.keras' exists and `overwrite`=False; nothing was written"):
        kd.save_for_keras(trained, tmp_path / "m.keras", overwrite=False)
    assert (tmp_path / "m.keras").read_bytes() == b"an earlier model"
    assert sorted(os.listdir(tmp_path)) == ["m.keras"]


def test_nested_kd_models_are_handed_on_as_keras_models(tmp_path):
    inner = kd.Sequential([keras.Input((5,)), keras.layers.Dense(3)], name="inner")
    inputs = keras.Input((5,))
    model = kd.Model(inputs, keras.layers.Dense(1)(inner(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    path = kd.save_for_keras(model, tmp_path / "nested.keras")
    with zipfile.ZipFile(path) as archive:
        assert "keras_distrib" not in archive.read("config.json").decode()
    plain = keras.saving.load_model(path)
    assert type(plain.get_layer("inner")) is keras.Sequential


class _Subclassed(kd.DistributedModelMixin, keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)


def test_what_plain_keras_cannot_rebuild_is_refused_before_writing(tmp_path):
    model = _Subclassed()
    model(np.zeros((1, 5), "float32"))
    with pytest.raises(ValueError, match=r"(?s)`model` cannot be handed on to plain Keras:\n  - the model is a "
                                         r"_Subclassed, a subclass plain Keras cannot rebuild.*model\.export"):
        kd.save_for_keras(model, tmp_path / "m.keras")
    assert os.listdir(tmp_path) == []


def test_a_subclassed_plain_keras_file_is_refused_naming_the_fix(tmp_path):
    @keras.saving.register_keras_serializable(package="test_saving")
    class Plain(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    model = Plain()
    model(np.zeros((1, 5), "float32"))
    model.save(tmp_path / "plain.keras")
    with pytest.raises(ValueError, match=r"holds a Plain model, neither functional nor Sequential.*"
                                         r"kd\.DistributedModelMixin"):
        kd.load_model(tmp_path / "plain.keras")
