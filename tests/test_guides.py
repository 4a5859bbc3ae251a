"""The TF2 code of TensorFlow's four distributed-training guides, run with kd.

Each script keeps the guide's code and changes only the model class
(`tf.keras.Sequential` -> `kd.Sequential`) and Keras 3 renames, plus, in the
two custom-loop guides, the one line Keras 3 needs there: building the
optimizer in the strategy's scope. Where the guide trains synchronously,
the result is compared with the same code on one device.
"""


import pytest

from tests import _harness

TOLERANCE = 1e-5


def _worker_results(output):
    return {r["task"]: r for r in _harness.task_results(output)}


@pytest.mark.cluster
def test_migrate_multi_worker_training_parameter_server_section():
    code, output = _harness.run_script("guide_migrate.py", "ps", timeout=400)
    assert code == 0, output[-4000:]
    (result,) = _harness.results_of(output)
    # No partitioner and the guide's three partitioners; asynchronous
    # training, so no one-device weights to compare: it trains, every step
    # counts, and evaluation is exact.
    assert sorted(result) == ["fixed_shards", "max_size", "min_size", "none"]
    for name, run in result.items():
        assert run["loss"][-1] < run["loss"][0], (name, run)
        assert run["iterations"] == 50, (name, run)
        assert abs(run["evaluate"]["loss"] - run["reference_evaluate"]["loss"]) <= 1e-6, (name, run)


@pytest.mark.cluster
def test_migrate_multi_worker_training_multi_worker_section():
    result, output = _harness.run_cluster("guide_migrate.py", "multi_worker", workers=2, timeout=400)
    assert result.returncode == 0, output[-4000:]
    by_task = _worker_results(output)
    assert sorted(by_task) == ["worker 0", "worker 1"]
    for run in by_task.values():
        assert run["weights"] <= TOLERANCE and run["losses"] <= TOLERANCE and run["evaluate"] <= TOLERANCE, run


@pytest.mark.cluster
def test_multi_worker_custom_training_loop(tmp_path):
    checkpoints = str(tmp_path / "checkpoints")  # removed with the test's tmp_path, not left in /tmp
    result, output = _harness.run_cluster("guide_multi_worker_loop.py", checkpoints, workers=2, timeout=400)
    assert result.returncode == 0, output[-4000:]
    by_task = _worker_results(output)
    assert sorted(by_task) == ["worker 0", "worker 1"]
    for run in by_task.values():
        assert run["replicas"] == 2
        assert run["weights"] <= TOLERANCE and run["losses"] <= TOLERANCE, run


@pytest.mark.cluster
def test_distributed_training_overview():
    code, output = _harness.run_script("guide_overview.py", timeout=300)
    assert code == 0, output[-4000:]
    (result,) = _harness.results_of(output)
    for section in ("fit", "loop"):
        run = result[section]
        assert run["replicas"] == 2
        assert run["weights"] <= TOLERANCE and run["losses"] <= TOLERANCE, (section, run)
    assert result["fit"]["evaluate"] <= TOLERANCE


@pytest.mark.cluster
def test_custom_training_with_tf_distribute():
    code, output = _harness.run_script("guide_custom_training.py", timeout=300)
    assert code == 0, output[-4000:]
    (result,) = _harness.results_of(output)
    assert result["weights"] <= TOLERANCE and result["history"] <= TOLERANCE, result
