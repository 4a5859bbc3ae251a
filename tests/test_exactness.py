"""The exactness matrix: Keras training features x kd paths, against one device.

Every feature (tests/scripts/features.py) trains with plain Keras on one
device (the reference) and with kd on each path below, with the same initial
weights and global batches, an uneven last batch and empty replicas. Each
path runs in its own process (one device layout per process); a path's
features share the process, and the references are cached across processes.
Settings kd cannot make exact on a path must be refused with an error that
names them. A plain-Keras contrast shows the comparison can fail.
"""

import pytest

from tests import _harness

ALL = [
    "base", "clipnorm", "global_clipnorm", "clipvalue", "accumulation", "accumulation_clip",
    "loss_scale_factor", "mixed_float16", "nonfinite_on_one_replica", "ema", "adamw_schedule",
    "regularizers", "frozen_layer", "sync_batch_norm", "weights", "class_weights",
    "multi_output", "dict_inputs", "masks", "lstm_auc", "cnn", "reshuffled_dataset",
    "custom_train_step", "dropout_bn_noise", "resnet_bn", "two_sync_bn", "row_statistics",
    "running_mean", "custom_random_layer",
]
# Every feature runs under mirrored2 (ALL). Another path runs the features whose
# code differs there: how rows, steps and random draws are laid out over the
# replicas (base: the uneven last batch and an empty replica; accumulation;
# a non-finite step on one replica; synchronized batch statistics; random
# layers; layer state; a user's own step), not those whose kd code is the same
# once the gradients are reduced (clipnorm, masks, a CNN, a second BatchNormalization).
CORE = ["base", "accumulation", "nonfinite_on_one_replica", "sync_batch_norm",
        "custom_train_step", "dropout_bn_noise", "row_statistics"]
# parameter_server evaluates and predicts on the reference's weights: the features
# whose model, data, loss and metrics are base's (features.TRAINING_ONLY) repeat base there.
PS_REPEATS = ["clipnorm", "global_clipnorm", "clipvalue", "accumulation", "accumulation_clip",
              "loss_scale_factor", "ema", "adamw_schedule", "reshuffled_dataset"]
MATRIX = {
    "one_device": ALL,
    "mirrored1": ["base", "clipnorm", "accumulation", "mixed_float16", "ema", "custom_train_step",
                  "dropout_bn_noise", "running_mean"],
    "mirrored2": ALL + ["shared_dropout"],
    "mirrored4": CORE + ["masks"],
    "mirrored2_reduce_to_one_device": ["base", "global_clipnorm", "weights", "multi_output"],
    "central_storage2": [
        "base", "clipnorm", "accumulation", "mixed_float16", "ema", "sync_batch_norm",
        "class_weights", "multi_output", "cnn", "custom_train_step",
        "dropout_bn_noise", "dropout_bn_noise_loop", "resnet_bn", "two_sync_bn", "shared_dropout",
    ],
    "loop_mirrored2": CORE + ["masks", "reshuffled_dataset"],
    "loop_one_device": ["base", "accumulation", "masks"],
    "spe3_mirrored2": CORE + ["ema"],
    "jit_mirrored2": ["base", "clipnorm", "accumulation", "mixed_float16", "regularizers",
                      "sync_batch_norm", "masks", "cnn", "custom_train_step", "dropout_bn_noise",
                      "row_statistics"],
    "jit_one_device": ["base", "global_clipnorm", "accumulation", "sync_batch_norm", "lstm_auc",
                       "masks", "cnn", "custom_train_step"],
    "multi_worker1": ["base", "clipnorm", "weights"],
    "parameter_server": [f for f in ALL if f not in PS_REPEATS],
}
# Between worker processes: CORE, and the data sharded and reshuffled per worker.
MULTI_WORKER = CORE + ["reshuffled_dataset"]
# The rest of the cross product (docs/concepts/exactness.md's matrix; `python -m pytest -m full`):
# features whose code is the same on these paths as under mirrored2.
FULL_EXTRA = {
    "mirrored4": ["clipnorm", "cnn", "resnet_bn", "two_sync_bn"],
    "loop_mirrored2": ["clipnorm", "cnn", "resnet_bn", "two_sync_bn"],
    "spe3_mirrored2": ["clipnorm", "masks", "cnn"],
    # clipnorm: the code after the reduction; mixed_float16: the loss scale agreed over
    # the workers, as nonfinite_on_one_replica checks where one replica overflows.
    "multi_worker": ["clipnorm", "mixed_float16", "cnn", "masks", "resnet_bn", "two_sync_bn"],
    "parameter_server": PS_REPEATS,
}
LOOP_MULTI_WORKER = ["base", "accumulation", "masks", "dropout_bn_noise"]

# (path, feature) -> text the refusal must contain.
_CENTRAL = "CentralStorageStrategy keeps one copy of each variable"
_JIT = "compiles only the forward pass with XLA"
REFUSED = {
    ("central_storage2", "accumulation"): ("`gradient_accumulation_steps`=2", _CENTRAL),
    ("central_storage2", "accumulation_clip"): ("`gradient_accumulation_steps`=2", _CENTRAL),
    ("central_storage2", "ema"): ("`use_ema`=True", _CENTRAL),
    ("central_storage2", "mixed_float16"): ("LossScaleOptimizer", _CENTRAL),
    ("central_storage2", "nonfinite_on_one_replica"): ("LossScaleOptimizer", _CENTRAL),
    ("jit_mirrored2", "sync_batch_norm"): ("(BatchNormalization) all-reduces its global", _JIT),
    ("jit_mirrored2", "dropout_bn_noise"): ("(BatchNormalization) all-reduces its global", _JIT),
    ("mirrored2", "running_mean"): ("(RunningMean) assigns its variable", "`assign`"),
    ("jit_mirrored2", "masks"): ("(LSTM)", _JIT),
    ("jit_mirrored2", "row_statistics"): ("(RowStatistics) updates its variable", _JIT),
}


def _check(path, results, features):
    # (In any order: a process first takes the features whose reference waits for nobody.)
    assert sorted(r["feature"] for r in results) == sorted(features), results
    failures = []
    for result in results:
        feature = result["feature"]
        refusal = REFUSED.get((path, feature))
        if refusal is not None:
            error = result.get("error", "")
            if not all(text in error for text in refusal) or "ValueError" not in error:
                failures.append((feature, "expected a refusal naming", refusal, result))
            continue
        if "error" in result:
            failures.append((feature, result["error"]))
            continue
        keys = [k for k in ("weights", "history", "evaluate", "predict") if k in result]
        worst = {k: result[k] for k in keys if not result[k] <= result["tolerance"]}
        if worst:
            failures.append((feature, "tolerance", result["tolerance"], worst))
        if path != "parameter_server" and result["iterations"][0] != result["iterations"][1]:
            failures.append((feature, "optimizer iterations", result["iterations"]))
        if path != "parameter_server" and result["graphs_kept"]:
            failures.append((feature, "step graphs kept by TensorFlow's gradient registry",
                             result["graphs_kept"]))
    assert not failures, "\n".join(map(str, failures))


def _process_results(path, features):
    code, output = _harness.run_script("exactness.py", path, ",".join(features), timeout=600)
    assert code == 0, output[-4000:]
    return _harness.results_of(output)


def _cluster_results(path, features):
    result, output = _harness.run_cluster(
        "exactness.py", path, ",".join(features), workers=2, timeout=600
    )
    assert result.returncode == 0, output[-4000:]
    by_task = _harness.results_by_task(output)
    assert sorted(by_task) == ["worker 0", "worker 1"]
    return by_task


# The paths of a minute or more in the whole run (they start first).
LONG = ("central_storage2", "jit_mirrored2", "mirrored2", "mirrored4")


@pytest.mark.cluster
@pytest.mark.parametrize("path", [pytest.param(path, marks=pytest.mark.long) if path in LONG else path
                                  for path in sorted(MATRIX)])
def test_feature_matches_one_device(path):
    _check(path, _process_results(path, MATRIX[path]), MATRIX[path])


@pytest.mark.full
@pytest.mark.cluster
@pytest.mark.parametrize("path", sorted(FULL_EXTRA))
def test_the_rest_of_the_cross_product_matches_one_device(path):
    features = FULL_EXTRA[path]
    if path == "multi_worker":
        for task_results in _cluster_results(path, features).values():
            _check(path, task_results, features)
    else:
        _check(path, _process_results(path, features), features)


@pytest.mark.cluster
def test_features_on_two_worker_processes():
    # 2 processes x 2 virtual devices: 4 replicas, exact on both workers.
    for task_results in _cluster_results("multi_worker", MULTI_WORKER).values():
        assert {r["replicas"] for r in task_results} == {4}
        _check("multi_worker", task_results, MULTI_WORKER)


@pytest.mark.cluster
@pytest.mark.long
def test_train_loop_on_two_worker_processes():
    # kd.TrainLoop, 3 steps per compiled call, on 2 processes x 2 devices.
    for task_results in _cluster_results("loop_multi_worker", LOOP_MULTI_WORKER).values():
        assert {r["replicas"] for r in task_results} == {4}
        _check("loop_multi_worker", task_results, LOOP_MULTI_WORKER)


@pytest.mark.cluster
def test_plain_keras_contrast_fails_the_same_comparison():
    """The comparison can fail: plain Keras 3 under mirrored is far off."""
    features = ["base", "clipnorm", "global_clipnorm", "nonfinite_on_one_replica"]
    code, output = _harness.run_script("exactness.py", "plain-mirrored2", ",".join(features))
    assert code == 0, output[-4000:]
    results = {r["feature"]: r for r in _harness.results_of(output)}
    assert sorted(results) == sorted(features)
    # An uneven last batch: each replica divides by its own rows.
    assert results["base"]["weights"] > 1e-3, results["base"]
    # Keras 3 clips each replica's partial gradient before the all-reduce.
    assert results["clipnorm"]["weights"] > 1e-1, results["clipnorm"]
    assert results["global_clipnorm"]["weights"] > 1e-2, results["global_clipnorm"]
    # Only the first replica's finite check decides: the overflow on the
    # second replica is applied, and the weights become non-finite.
    overflow = results["nonfinite_on_one_replica"]
    assert overflow["iterations"][0] != overflow["iterations"][1], overflow
    assert overflow["weights"] == float("inf"), overflow
    # Each of plain Keras's step functions stays alive, held by the gradient
    # TensorFlow registered for its all-reduce; kd drops those (_check).
    assert all(r["graphs_kept"] >= 1 for r in results.values()), results


@pytest.mark.cluster
def test_per_replica_batch_norm_is_an_opt_out():
    """compile(batch_norm="per_replica"): Keras's per-replica statistics, not one device's.

    Synchronized layers stay exact; plain Keras 3 under mirrored is far off
    on the random and batch-statistics models (the contrast).
    """
    features = ["dropout_bn_noise", "sync_batch_norm"]
    code, output = _harness.run_script("exactness.py", "bn_per_replica_mirrored2", ",".join(features))
    assert code == 0, output[-4000:]
    results = {r["feature"]: r for r in _harness.results_of(output)}
    assert results["dropout_bn_noise"]["weights"] > 1e-3, results["dropout_bn_noise"]
    assert results["sync_batch_norm"]["weights"] <= 2e-5, results["sync_batch_norm"]
    layered = ["dropout_bn_noise", "resnet_bn", "two_sync_bn", "row_statistics"]
    code, output = _harness.run_script("exactness.py", "plain-mirrored2", ",".join(layered))
    assert code == 0, output[-4000:]
    for result in _harness.results_of(output):
        assert "error" in result or result["weights"] > 1e-3, result


@pytest.mark.cluster
def test_workers_with_unequal_batch_counts_take_every_step():
    """2 workers whose dataset_fn shards differ by a batch train as one device does.

    The worker that runs out steps on empty batches until the other is done
    (before: TensorFlow's raw "Collective instance ... data_type" error),
    and `optimizer.iterations` counts the steps one device takes (before:
    one more per epoch, the step that found the data's end).
    Plain Keras 3 under the same strategy fails on this input.
    """
    result, output = _harness.run_cluster("unequal_workers.py", workers=2, timeout=300)
    assert result.returncode == 0, output[-4000:]
    results = _harness.task_results(output)
    assert len(results) == 6, output[-4000:]
    for item in results:
        if item["mode"] == "plain":
            assert "error" in item or item["difference"] > 1e-3, item
        else:
            assert item.get("difference", 1.0) <= 2e-5, item
            # No step counted past the end of the data (LR schedules).
            assert item["iterations"][0] == item["iterations"][1], item
