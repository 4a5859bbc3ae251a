"""kd.Model, kd.Sequential and DistributedModelMixin: construction and refusals.

Exactness under every strategy is tested by tests/test_exactness.py.
"""

import contextlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_distrib as kd
from keras_distrib.training import draws as draws_lib
from tests import _harness


def test_functional_and_subclassed_models_both_work():
    inputs = keras.Input((3,))
    functional = kd.Model(inputs, keras.layers.Dense(2)(inputs))
    assert isinstance(functional, kd.Model)

    class Net(kd.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    net = Net()
    net.compile(optimizer="sgd", loss="mse")
    x = np.ones((4, 3), "float32")
    net.fit(x, np.zeros((4, 2), "float32"), verbose=0)
    assert net(x).shape == (4, 2)
    sequential = kd.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    sequential.compile(optimizer="sgd", loss="mse")
    sequential.fit(x, np.zeros((4, 1), "float32"), verbose=0)


def test_mixin_on_user_subclass():
    class Custom(kd.DistributedModelMixin, keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    model = Custom()
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(np.ones((8, 2), "float32"), np.ones((8, 1), "float32"), verbose=0, epochs=2)
    assert len(history.history["loss"]) == 2


def test_compile_outside_the_scope_makes_trackers_in_the_models_strategy():
    # tf-keras's distribute_strategy_test: a model created in the scope and
    # compiled outside it has every variable, trackers included, in the scope.
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    x = np.linspace(-1, 1, 24, dtype="float32").reshape(8, 3)
    y = x.sum(axis=1, keepdims=True) * 0.5

    def build(model_class, scope):
        with scope:
            inputs = keras.Input((3,))
            model = model_class(inputs, keras.layers.Dense(1, kernel_initializer="ones")(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
        history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
        tracked = [v for metric in model.metrics for v in metric.variables]
        in_scope = [strategy.extended.variable_created_in_scope(v.value) for v in tracked]
        return history, model.get_weights(), in_scope

    history, weights, in_scope = build(kd.Model, strategy.scope())
    assert in_scope and all(in_scope), in_scope
    reference, reference_weights, _ = build(keras.Model, contextlib.nullcontext())
    for key in ("loss", "mae"):
        np.testing.assert_allclose(history[key], reference[key], rtol=2e-5)
    for got, want in zip(weights, reference_weights):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    # Contrast: plain Keras makes its loss tracker outside the strategy there.
    _, _, plain_in_scope = build(keras.Model, strategy.scope())
    assert not all(plain_in_scope), plain_in_scope


@pytest.mark.cluster
def test_model_created_outside_scope_is_refused():
    """A model, a layer or an optimizer made outside the scope: a clear error before any step."""
    code, output = _harness.run_script("outside_scope.py")
    assert code == 0, output[-4000:]
    errors = {r["case"]: r["error"] for r in _harness.results_of(output)}
    assert errors["model_outside"].startswith("ValueError: This model was created under no "
                                              "strategy"), errors
    assert "Create (and compile) the model inside" in errors["model_outside"]
    assert errors["layer_outside"].startswith(
        "ValueError: The model was created inside `MirroredStrategy.scope()`, but 2 of its "
        "variables were not (`built_outside/kernel`, `built_outside/bias`)"), errors
    assert "Create the layers (and the model) inside" in errors["layer_outside"]
    assert errors["optimizer_outside"].startswith(
        "ValueError: The optimizer `adam` (Adam) was created under no strategy"), errors
    assert "Create the optimizer inside `with strategy.scope():`" in errors["optimizer_outside"]
    assert errors["everything_inside"] == "", errors


@pytest.mark.cluster
def test_batch_norm_and_nadam_in_a_hand_written_central_storage_loop():
    code, output = _harness.run_script("hand_written_loops.py", "central_storage")
    assert code == 0, output[-4000:]
    results = {r["case"]: r for r in _harness.results_of(output)}
    # A kd model with BatchNormalization(synchronized=True) and an unbuilt Adam,
    # never compiled: weights and moving statistics match one device.
    assert "error" not in results["kd_batch_norm_adam"], results["kd_batch_norm_adam"]
    assert results["kd_batch_norm_adam"]["diff"] <= 2e-5
    # Contrast: a plain Keras model cannot update its moving statistics there.
    assert "You must specify an aggregation method" in results["keras_batch_norm_adam"]["error"]
    # Nadam's state assigned in the replicas (a variable without aggregation).
    assert "error" not in results["kd_nadam"], results["kd_nadam"]
    assert results["kd_nadam"]["diff"] <= 2e-5
    assert "You must specify an aggregation method" in results["keras_nadam"]["error"]


@pytest.mark.cluster
def test_next_on_a_distributed_iterator_opened_in_a_tf_function_trains_exactly_or_is_refused():
    """tf-keras's hand-written-loop shape that hung on mirrored (a deadlock), under a watchdog.

    `iter()` inside a `tf.function`, `next()` for a fixed number of steps, a
    BatchNormalization model, the last global batch partial. With the
    inter-op pool kd.virtual_devices sizes it trains as one device does; with
    the pool fixed at 2 threads (too few for 2 replicas) it is refused at its
    first trace, naming the fixes, and the fix it names (`for batch in
    dataset:` inside) trains. On 4c0b8d4 the first run never returns.
    """
    code, output = _harness.run_script("loop_shape.py", timeout=150)
    assert code == 0, output[-4000:]
    results = {r["steps"]: r for r in _harness.results_of(output)}
    assert sorted(results, key=str) == [2, 3, "for-in", "tf.range"], output[-4000:]
    for case in results.values():
        assert "error" not in case and case["diff"] <= 2e-5, case
    code, output = _harness.run_script("loop_shape.py", "2", timeout=150)
    assert code == 0, output[-4000:]
    results = {r["steps"]: r for r in _harness.results_of(output)}
    for steps in (3, 2, "tf.range"):
        assert re.search(r"RuntimeError: This `tf.function` opens a distributed iterator .* on 2 "
                         r"local replicas, with TensorFlow's inter-op pool at 2 threads: .*never "
                         r"return .*`for batch in distributed_dataset:`.*"
                         r"set_inter_op_parallelism_threads\(4\)", results[steps]["error"]), results[steps]
    assert "error" not in results["for-in"] and results["for-in"]["diff"] <= 2e-5, results["for-in"]


def test_batch_norm_option_is_checked():
    inputs = keras.Input((3,))
    model = kd.Model(inputs, keras.layers.BatchNormalization()(inputs))
    with pytest.raises(ValueError, match=r"`batch_norm`='sync': expected one of \['global', 'per_replica'\]"):
        model.compile(optimizer="sgd", loss="mse", batch_norm="sync")
    model.compile(optimizer="sgd", loss="mse", batch_norm="per_replica")
    assert model.batch_norm == "per_replica"


def test_kd_compile_arguments_survive_a_reload(tmp_path):
    inputs = keras.Input((3,))
    model = kd.Model(inputs, keras.layers.BatchNormalization()(inputs))
    model.compile(optimizer="sgd", loss="mse", batch_norm="per_replica", pss_evaluation_shards=2)
    model.save(tmp_path / "per_replica.keras")
    loaded = kd.load_model(tmp_path / "per_replica.keras")
    assert (loaded.batch_norm, loaded.pss_evaluation_shards) == ("per_replica", 2)
    # Keras's load_model gives kd's class, compiled with Keras's arguments only
    # (the file keeps kd's apart, where plain Keras does not read them).
    plain_loaded = keras.saving.load_model(tmp_path / "per_replica.keras")
    assert isinstance(plain_loaded, kd.Model) and plain_loaded.batch_norm == "global"
    # Defaults stay out of the config, which is then Keras's own.
    model.compile(optimizer="sgd", loss="mse")
    assert "batch_norm" not in model.get_compile_config()
    model.save(tmp_path / "global.keras")
    assert keras.saving.load_model(tmp_path / "global.keras").batch_norm == "global"


class Unregistered(kd.DistributedModelMixin, keras.Model):
    """A user's subclass of an existing keras.Model subclass, not registered."""

    def __init__(self, units=2, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = keras.layers.Dense(units)

    def call(self, x):
        return self.dense(x)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(package="test_models")
class Registered(Unregistered):
    pass


def _saved(model_class, path):
    model = model_class()
    model.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(0).normal(size=(5, 3)).astype("float32")
    model.fit(x, x[:, :2], batch_size=2, verbose=0)
    model.save(path)
    return model, x


def test_a_mixin_subclass_reloads_registered_or_with_custom_objects_and_saving_says_so(tmp_path):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, x = _saved(Registered, tmp_path / "registered.keras")
    assert not [w for w in caught if "registered" in str(w.message)]  # nothing to say
    loaded = keras.saving.load_model(tmp_path / "registered.keras")
    assert type(loaded) is Registered and loaded.units == 2
    assert int(loaded.optimizer.iterations.numpy()) == 3
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))

    with pytest.warns(UserWarning, match=r"Unregistered is not registered with Keras, so "
                      r"keras.saving.load_model will not find it.*register_keras_serializable.*"
                      r"custom_objects=\{'Unregistered': Unregistered\}"):
        model, x = _saved(Unregistered, tmp_path / "plain.keras")
    with pytest.raises(TypeError, match="Could not locate class 'Unregistered'"):
        keras.saving.load_model(tmp_path / "plain.keras")
    loaded = keras.saving.load_model(tmp_path / "plain.keras",
                                     custom_objects={"Unregistered": Unregistered})
    assert type(loaded) is Unregistered
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


class _OwnDraws(kd.Model):
    """A kd model holding a SeedGenerator of its own (for `keras.random` in its train_step)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seed_generator = keras.random.SeedGenerator(11)


def _drawing_model(cls, seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    h = keras.layers.Dropout(0.5, seed=7)(keras.layers.Dense(6)(inputs))
    model = cls(inputs, keras.layers.GaussianNoise(0.3, seed=9)(h))
    model.compile(optimizer="adam", loss="mse")
    return model


def test_a_checkpoint_of_a_kd_model_holds_every_seed_state(tmp_path):
    x = np.ones((5, 4), "float32")
    model = _drawing_model(_OwnDraws, 1)
    for _ in range(3):  # move every seed state on, as training does
        model(x, training=True)
        keras.random.uniform((), seed=model.seed_generator)
    path = tf.train.Checkpoint(model=model).write(str(tmp_path / "state"))
    # What the saved model draws next: its masks and noise, and its own draw.
    outputs, draw = model(x, training=True), float(keras.random.uniform((), seed=model.seed_generator))
    fresh = _drawing_model(_OwnDraws, 1)
    fresh.set_weights(model.get_weights())
    assert not np.array_equal(fresh(x, training=True), outputs)  # the weights alone are not enough
    restored = _drawing_model(_OwnDraws, 1)
    tf.train.Checkpoint(model=restored).read(path).assert_existing_objects_matched()
    names = sorted(draws_lib.random_states(restored))
    assert len(names) == 3 and "layer_0_seed_generator" in names, names
    np.testing.assert_array_equal(restored(x, training=True), outputs)
    assert float(keras.random.uniform((), seed=restored.seed_generator)) == draw
    # Contrast: Keras's own model does not put its seed states in a checkpoint.
    plain = _drawing_model(keras.Model, 1)
    keys = [key for key, _ in tf.train.list_variables(tf.train.Checkpoint(model=plain).write(
        str(tmp_path / "plain")))]
    assert not [key for key in keys if "seed" in key], keys
    assert len([key for key, _ in tf.train.list_variables(path) if "seed_generator" in key]) == 3


@pytest.mark.cluster
def test_global_batch_norm_costs_one_all_reduce_each_way_per_layer():
    """Issue 37: a BatchNormalization layer's global statistics in one all-reduce.

    Counted as collective ops in the traced training step, per replica, on a
    ResNet of 9 layers: each adds one forward and one backward all-reduce to
    what the same network without them costs (before: 39 = 4 per layer + 3).
    `batch_norm="per_replica"` adds none.
    """
    code, output = _harness.run_script("batch_norm_moments.py", "counts", timeout=600)
    assert code == 0, output[-4000:]
    counted = {r["case"]: r for r in _harness.results_of(output)}
    layers = counted["kd"]["batch_norm_layers"]
    assert layers == 9, counted
    rest = counted["kd_without_batch_norm"]["train_collectives"]
    assert counted["kd"]["train_collectives"] == 2 * layers + rest, counted
    assert counted["kd_per_replica"]["train_collectives"] == rest, counted


@pytest.mark.cluster
def test_global_batch_norm_matches_one_device_far_from_zero_with_an_empty_replica():
    """Chan's merge of every replica's count, mean and squared deviations.

    Inputs of mean 1e5 (float64), uneven replica batches (3 + 2 rows), a
    replica left empty, and a BatchNormalization after a trained layer
    (its gradient crosses replicas). Plain Keras's synchronized layers on
    the same replicas are the contrast.
    """
    code, output = _harness.run_script("batch_norm_moments.py", "exact", timeout=600)
    assert code == 0, output[-4000:]
    results = {(r["case"], r["floatx"]): r for r in _harness.results_of(output)}
    for floatx, tolerance in (("float64", 1e-9), ("float32", 2e-5)):
        ours = results["kd", floatx]
        assert ours["dtype"] == floatx, ours
        assert max(ours["weights"], ours["predict"]) <= tolerance, ours
        assert results["keras_synchronized", floatx]["weights"] > 1e-3, results
