"""kd.data.serve: input from tf.data service, exact or exactly-once, against one device.

In this process: a dispatcher and a data worker (TensorFlow's servers,
in-process) serve one device; fit, evaluate and predict equal plain
Keras's (float64), fit says what an epoch is, and bad input is named. On a
cluster: 2 training workers of 2 replicas each and 2 data workers, started
by kd.launch(data_workers=2, max_restarts=1) (tests/scripts/served_input.py):
exact against one device with a last batch of 1 row for 4 replicas, after a
training worker was killed mid-epoch and the run resumed from its backup;
exactly-once counted per example over 2 epochs with a data worker killed
in the first. The Slurm recipe runs in tests/test_slurm.py.
"""

import re
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_distrib as kd
from keras_distrib.validation import InputError
from tests import _harness


@pytest.fixture(scope="module")
def service():
    """An in-process tf.data service: a dispatcher and one data worker; its address."""
    data_service = tf.data.experimental.service
    dispatcher = data_service.DispatchServer()
    worker = data_service.WorkerServer(data_service.WorkerConfig(
        dispatcher_address=dispatcher.target.split("://")[1]))
    yield dispatcher.target
    # kd's reading threads end once the service has ended their epoch's job,
    # shortly after the epoch's last step: stopped before that, the dispatcher
    # would leave their iteration clients warning every second, for the rest
    # of the process, that they cannot reach it.
    for thread in threading.enumerate():
        if thread.name == "kd-served-read":
            thread.join(timeout=30)
    worker._stop()
    dispatcher._stop()


@pytest.fixture(scope="module")
def one_device():
    return kd.make_strategy("one_device")


@pytest.fixture()
def float64():
    keras.config.set_floatx("float64")
    yield
    keras.config.set_floatx("float32")


def _preprocess(x, y):
    return tf.tanh(x) * 2.0, y


def _layers():
    return [keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)]


def test_exact_mode_equals_one_device(service, one_device, float64):
    # 13 rows in global batches of 4 (the last has 1 row), put back in order
    # from the service's arrival order.
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(13, 3)), rng.normal(size=(13, 1))
    keras.utils.set_random_seed(2)
    reference = keras.Sequential(_layers())
    initial = reference.get_weights()
    reference.compile(keras.optimizers.SGD(0.1), "mse")
    local = tf.data.Dataset.from_tensor_slices((x, y)).map(_preprocess).batch(4)
    expected = reference.fit(local, epochs=2, verbose=0).history["loss"]
    with one_device.scope():
        model = kd.Sequential(_layers())
        model.set_weights(initial)
        model.compile(keras.optimizers.SGD(0.1), "mse")
    served = kd.data.serve((x, y), global_batch_size=4, service=service, preprocess=_preprocess,
                           strategy=one_device)
    history = model.fit(served, epochs=2, verbose=0).history["loss"]
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)
    np.testing.assert_allclose(history, expected, rtol=0, atol=1e-9)
    np.testing.assert_allclose(model.evaluate(served, verbose=0),
                               reference.evaluate(local, verbose=0), rtol=0, atol=1e-9)
    np.testing.assert_allclose(model.predict(served, verbose=0),
                               reference.predict(local, verbose=0), rtol=0, atol=1e-9)
    assert (served.steps, served.plan.local, served.recovered) == (4, 1, 0)


def test_fit_says_what_an_epoch_is(service, one_device, capsys):
    x = np.arange(8.0).reshape(8, 1)
    for mode, words in (("exact", "exact: one device's global batches in one device's order"),
                        ("exactly_once", "not one device's order")):
        served = kd.data.serve((x, x), global_batch_size=4, service=service, mode=mode,
                               strategy=one_device)
        with one_device.scope():
            model = kd.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse")
        capsys.readouterr()
        model.fit(served, epochs=1, verbose=0)
        line = capsys.readouterr().out.splitlines()[0]
        assert line.startswith(f"kd input: tf.data service at {service}") and words in line, line
    with pytest.raises(InputError, match=r"`mode`='exactly_once': its rows arrive .*mode='exact'"):
        model.predict(served, verbose=0)


def test_bad_input_is_named(service, one_device):
    x = np.zeros((8, 3))
    with pytest.raises(ValueError, match=r"no tf.data service dispatcher answers at localhost:1 "):
        kd.data.serve(x, global_batch_size=4, service="grpc://localhost:1", connect_timeout=0.2,
                      strategy=one_device)
    with pytest.raises(ValueError, match=r"(?s)`mode`='ordered'.*`global_batch_size`=0.*"
                                         r"`stall_timeout`=0: expected a finite number of seconds > 0.*"
                                         r"`data` is a _RangeDataset"):
        kd.data.serve(tf.data.Dataset.range(8), global_batch_size=0, service=service,
                      mode="ordered", stall_timeout=0)
    with pytest.raises(ValueError, match=r"`preprocess` calls Python"):
        kd.data.serve(x, global_batch_size=4, service=service, strategy=one_device,
                      preprocess=lambda row: tf.ensure_shape(
                          tf.py_function(lambda v: v, [row], tf.float64), [3]))
    with pytest.raises(ValueError, match=r"draws stateful random numbers .*`mode`='exact'"):
        kd.data.serve(x, global_batch_size=4, service=service, strategy=one_device,
                      preprocess=lambda row: row + tf.random.uniform([3], dtype=tf.float64))
    own = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).apply(
        tf.data.experimental.service.distribute("parallel_epochs", service)).batch(4)
    with one_device.scope():
        model = kd.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    with pytest.raises(InputError, match=r"`x` reads from tf.data service .*kd.data.serve"):
        model.fit(own, epochs=1, verbose=0)
    with pytest.raises(kd.LaunchError, match=r"`data_workers`=-1: expected a whole number >= 0"):
        kd.launch("train.py", workers=2, data_workers=-1)


@pytest.mark.cluster
@pytest.mark.long
def test_two_training_and_two_data_workers_exact_resumed_and_exactly_once_with_a_data_worker_killed(
        tmp_path):
    result, output = _harness.run_cluster("served_input.py", str(tmp_path), workers=2,
                                          data_workers=2, max_restarts=1, timeout=500)
    assert result.returncode == 0, output[-4000:]
    found = _harness.task_results(output)
    exact = [r for r in found if r["part"] == "exact"]
    assert sorted(r["task"] for r in exact) == ["worker 0", "worker 1"], output[-4000:]
    for item in exact:
        assert (item["replicas"], item["steps"], item["local"]) == (4, 6, 2), item
        assert item["weights"] < 1e-9 and item["restarted"], item
    assert result.restarts == 1 and "resumed after 2 step(s) of epoch 2 in slot order" in output
    once = {r["task"]: r for r in found if r["part"] == "exactly_once"}
    assert sorted(once) == ["worker 0", "worker 1"], output[-4000:]
    assert once["worker 0"]["killed"], once
    assert "data_worker 1 server exited with code -9" in output
    # The counts are summed over every replica when read: each worker reads the same.
    for item in once.values():
        assert item["counts"] == [[1] * 64, [1] * 64], item
        assert item["duplicates"] == 0, item
    assert "kd input: tf.data service at" in output and "not one device's order" in output


class _Stop(Exception):
    pass


class _StopAfter(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            raise _Stop()


def test_a_resume_mid_epoch_says_what_the_epoch_is(service, one_device, tmp_path, capsys):
    x = np.arange(16.0).reshape(16, 1)
    for mode, words in (("exactly_once", r"resumed after (\d) step\(s\) of epoch 1 in exactly-once "
                                         r"mode: the \1 step\(s\) skipped .* not at all"),
                        ("exact", r"resumed after \d step\(s\) of epoch 1 in slot order")):
        served = kd.data.serve((x, x), global_batch_size=4, service=service, mode=mode,
                               strategy=one_device)
        with one_device.scope():
            model = kd.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse")
        backup = kd.callbacks.BackupAndRestore(str(tmp_path / mode), save_freq=1)
        with pytest.raises(_Stop):
            model.fit(served, epochs=1, verbose=0, callbacks=[backup, _StopAfter()])
        capsys.readouterr()
        model.fit(served, epochs=1, verbose=0,
                  callbacks=[kd.callbacks.BackupAndRestore(str(tmp_path / mode), save_freq=1)])
        assert re.search(words, capsys.readouterr().out)
