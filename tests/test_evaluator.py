"""kd.SidecarEvaluator: every new checkpoint evaluated as the chief writes it."""

import os
import signal
import sys
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_distrib as kd
from keras_distrib.cluster import supervisor
from tests import _harness


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)).astype("float32")
    return x, (x.sum(axis=1, keepdims=True)).astype("float32")


def _model(model_class=kd.Model):
    keras.utils.set_random_seed(2)
    inputs = keras.Input((3,))
    model = model_class(inputs, keras.layers.Dense(1)(keras.layers.Dense(4, activation="tanh")(inputs)))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model


def test_evaluates_checkpoints_as_they_are_written(tmp_path):
    x, y = _data()
    trained = _model()
    trained.optimizer.build(trained.trainable_variables)
    directory = str(tmp_path / "checkpoints")
    manager = kd.CheckpointManager(
        tf.train.Checkpoint(model=trained, optimizer=trained.optimizer), directory, max_to_keep=5
    )
    evaluator = kd.SidecarEvaluator(
        _model(keras.Model), (x, y), directory, batch_size=8, log_dir=str(tmp_path / "tb"),
        best_model_path=str(tmp_path / "best.weights.h5"), monitor="loss", poll_seconds=0.05,
        timeout=60,
    )
    watcher = threading.Thread(target=evaluator.start)
    watcher.start()
    expected = []
    try:
        for epoch in range(3):
            trained.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
            # The reference: plain Keras evaluating these weights on one device.
            reference = _model(keras.Model)
            reference.set_weights(trained.get_weights())
            expected.append(reference.evaluate(x, y, batch_size=8, verbose=0, return_dict=True))
            manager.save(epoch=epoch + 1)
            deadline = time.monotonic() + 60
            while len(evaluator.results) < epoch + 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        manager.mark_finished()
    finally:
        watcher.join(timeout=60)
    assert not watcher.is_alive()
    assert [os.path.basename(path) for path, _ in evaluator.results] == ["ckpt-1", "ckpt-2", "ckpt-3"]
    for (_, logs), reference in zip(evaluator.results, expected):
        assert logs == pytest.approx(reference, rel=1e-6)
    events = [f for _, _, files in os.walk(tmp_path / "tb") for f in files]
    assert events and events[0].startswith("events.out.tfevents")
    best = min(range(3), key=lambda i: expected[i]["loss"])
    kept = _model(keras.Model)
    kept.load_weights(str(tmp_path / "best.weights.h5"))
    assert kept.evaluate(x, y, batch_size=8, verbose=0, return_dict=True) == pytest.approx(expected[best], rel=1e-6)


def test_stop_finishes_after_a_last_look(tmp_path):
    x, y = _data()
    evaluator = kd.SidecarEvaluator(_model(keras.Model), (x, y), str(tmp_path), poll_seconds=0.05)
    evaluator.stop()
    assert evaluator.start() == []


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="biggest"), r"`mode`='biggest' must be one of \['min', 'max'\]"),
    (dict(best_model_path="best.h5"), r"`best_model_path`='best.h5' must end with '.keras' or '.weights.h5'"),
    (dict(poll_seconds=float("nan")), r"`poll_seconds`=nan must be a finite number of seconds > 0"),
    (dict(max_evaluations=-1), r"`max_evaluations`=-1 must be a whole number >= 0"),
    (dict(monitor=3), r"`monitor`=3 must be a metric name"),
])
def test_bad_arguments_are_refused(tmp_path, kwargs, match):
    x, y = _data()
    with pytest.raises(ValueError, match=match):
        kd.SidecarEvaluator(_model(keras.Model), (x, y), str(tmp_path), **kwargs)


@pytest.mark.cluster
def test_evaluator_task_beside_two_workers(tmp_path):
    directory, best = str(tmp_path / "backup"), str(tmp_path / "best.keras")
    result, output = _harness.run_cluster(
        "sidecar_cluster.py", directory, best, workers=2, evaluator=True, timeout=300
    )
    assert result.returncode == 0, output[-4000:]
    by_task = {r["task"]: r for r in _harness.task_results(output)}
    assert sorted(by_task) == ["evaluator 0", "worker 0", "worker 1"]
    evaluations = by_task["evaluator 0"]["evaluations"]
    assert evaluations, output[-4000:]
    # The last checkpoint holds the final weights: the evaluator's numbers
    # are the chief's own final evaluation.
    assert evaluations[-1] == pytest.approx(by_task["worker 0"]["final"], rel=1e-5)
    assert by_task["evaluator 0"]["checkpoints"][-1].endswith("ckpt-4")
    assert os.path.exists(best)


def _follower_run(leader_code, follower_code):
    """The launcher's result for a worker and an evaluator (a follower) running these scripts."""
    def spec(task_type, code, **options):
        return supervisor.TaskSpec(task_type, 0, [sys.executable, "-c", code], dict(os.environ), **options)

    lines = []
    specs = [spec("worker", leader_code), spec("evaluator", follower_code, follower=True)]
    result = supervisor.run_tasks(specs, timeout=60, sink=lines.append)
    return result, lines


@pytest.mark.cluster
def test_an_evaluator_the_launcher_stops_on_its_way_out_ends_the_run_well():
    # The evaluator saw training end and restored Python's own SIGTERM action
    # on its way out: the launcher's SIGTERM then ends it with -15 (CI saw this
    # race once). It was asked to stop, so the run succeeded.
    result, lines = _follower_run("pass", "import time; time.sleep(60)")
    assert result.returncode == 0, lines
    assert [t.returncode for t in result.tasks] == [0, -signal.SIGTERM]
    assert "[launcher] training ended; stopping evaluator 0" in lines


@pytest.mark.cluster
def test_an_evaluator_killed_before_training_ended_fails_the_run():
    # The same -15, but not from the launcher: someone stopped it mid-training.
    result, lines = _follower_run("import time; time.sleep(3)",
                                  "import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert result.returncode == 128 + signal.SIGTERM, lines
    assert result.failed.label == "evaluator 0"
    assert not any("training ended" in line for line in lines)
