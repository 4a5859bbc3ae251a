"""kd models under ParameterServerStrategy: in-process and launched clusters."""

import os
import re
import signal

import pytest

from tests import _harness


def _check(result):
    assert result["iterations"] == result["steps"] == 100
    assert result["history"]["val_loss"][-1] < 0.05, result["history"]
    assert result["evaluate_diff"] <= 1e-6  # evaluation is exact: same as one device
    assert result["predict_diff"] <= 1e-6 and result["predict_rows"] == 200
    assert sorted(result["history"]) == ["loss", "mae", "val_loss", "val_mae"]
    # The coordinator (the chief) saved a checkpoint after every epoch.
    assert result["checkpoints"] == [f"ps-{e}.weights.h5" for e in range(1, 5)]
    # The partitioner split the wide kernel over both parameter servers.
    assert result["kernel_devices"] == ["/job:ps/replica:0/task:0", "/job:ps/replica:0/task:1"]
    # A worker's step is one device's step on its batch (one replica in
    # sync): the first-step check, on by default, has nothing to compare.
    assert result["replicas_in_sync"] == 1 and result["first_step_checked"] is False, result


@pytest.mark.cluster
@pytest.mark.parametrize("how", ["fit", "loop"])
def test_in_process_cluster(how):
    code, output = _harness.run_script("ps_fit.py", "local", how, timeout=300)
    assert code == 0, output[-4000:]
    (result,) = _harness.results_of(output)
    _check(result)


@pytest.mark.cluster
def test_launched_cluster_survives_a_killed_worker():
    pids, lines = {}, []

    def sink(line):
        lines.append(line)
        found = re.search(r"\[(worker \d)\] .* server listening \(pid (\d+)\)", line)
        if found:
            pids[found.group(1)] = int(found.group(2))
        if "[chief 0] KILL_NOW" in line:
            os.kill(pids["worker 1"], signal.SIGKILL)

    from keras_distrib.cluster import launcher

    result = launcher.launch(
        os.path.join(_harness.SCRIPTS, "ps_fit.py"), workers=2, ps=2, args=("launched", "fit", "kill"),
        timeout=300, env=_harness._env(), sink=sink,
    )
    output = "\n".join(lines)
    assert result.returncode == 0, output[-4000:]
    assert "[launcher] worker 1 server exited with code -9" in output
    (value,) = _harness.task_results(output)
    _check(value)


@pytest.mark.cluster
def test_missing_steps_per_epoch_is_explained():
    code, output = _harness.run_script("ps_errors.py", timeout=300)
    assert code == 0, output[-4000:]
    (result,) = _harness.results_of(output)
    assert "`steps_per_epoch` is required under ParameterServerStrategy" in result["error"]


@pytest.mark.cluster
def test_inputs_evaluation_and_resume_as_tensorflow_guides_write_them():
    code, output = _harness.run_script("ps_inputs.py", timeout=400)
    assert code == 0, output[-4000:]
    (result,) = _harness.results_of(output)
    # A Dataset instance (shuffle, repeat, batch) trains a model without an
    # Input layer, with validation_data.
    history = result["instance_history"]
    assert sorted(history) == ["loss", "mae", "val_loss", "val_mae"]
    assert history["loss"][-1] < history["loss"][0]
    # Batch callbacks get real logs (a chunk per worker behind, so the
    # first two of the 2-worker run are empty).
    assert result["batch_logs"][:2] == [[], []]
    assert all(keys == ["loss", "mae"] for keys in result["batch_logs"][2:])
    # dataset_fn(input_context) sees each worker's own pipeline id.
    assert result["contexts"] == [[0, 2], [1, 2]]
    assert result["dataset_fn_history"]["loss"][0] > 0
    # Evaluation is exact on the coordinator and sharded over the workers.
    expected = result["evaluate_reference"]
    for key in ("evaluate_coordinator", "evaluate_sharded", "evaluate_sharded_dataset"):
        assert sorted(result[key]) == sorted(expected)
        for name, value in expected.items():
            assert abs(result[key][name] - value) <= 2e-6 * (1 + abs(value)), (key, result[key])
    assert result["predict_diff"] <= 1e-6
    # What cannot be shipped to the workers is refused, with the reason.
    assert "built with Python code" in result["errors"]["generator_dataset"]
    assert "from_generator" in result["errors"]["generator_dataset"]
    assert "Python code producing batches" in result["errors"]["python_generator"]
    # BackupAndRestore (and TrainLoop.fit(backup_dir=)) resume at the saved
    # epoch with the optimizer's step counter, then remove the backup.
    assert result["resumed_epochs"] == 2
    assert result["iterations_after_resume"] == result["iterations_at_stop"] + 2 * 3
    assert result["backup_cleared"]


@pytest.mark.cluster
def test_a_backup_of_partitioned_weights_resumes_or_is_refused_by_name():
    # Keras's variable cannot write a ShardedVariable (AttributeError at the
    # first backup); kd writes each part. Another partitioning is refused
    # before anything is restored, naming the weight and the fix.
    code, output = _harness.run_script("ps_partitioned_resume.py", timeout=400)
    assert code == 0, output[-4000:]
    (result,) = _harness.results_of(output)
    for shards, now in ((3, "3 parts of [2, 1, 1] rows"), (None, "not partitioned")):
        error = result[f"refusal_{shards}"]
        assert error.startswith("CheckpointError: "), error
        # Layers are numbered anew in this process (`dense_2/kernel`).
        assert re.search(rf"the weight `sequential_\d+/dense_\d+/kernel` is {re.escape(now)} over "
                         r"the parameter servers, the backup's was 2 parts of \[2, 2\] rows", error), error
        assert "resume with the backup's `variable_partitioner`" in error, error
    assert result["backup_kept"]
    assert result["resumed_epochs"] == 2
    assert result["restored_difference"] == 0.0
