"""Collectives per step (issue 26): counted while the step functions are traced.

Each collective is a barrier across replicas and, between workers, a network
round trip. kd's training step makes one (the gradients, with the row count
packed in), its evaluation and prediction steps none; reading the step's logs
costs one batched all-reduce per compiled call. What needs more says why.
"""

import pytest

from tests import _harness

# case -> {kind: (collectives in the step, collectives reading the logs)}
EXPECTED = {
    # The counter sees Keras 3's own gradient all-reduce (its logs are local values).
    "plain_keras": {"train": (1, 0), "test": (0, 0), "predict": (0, 0)},
    "mlp": {"train": (1, 1), "test": (0, 1), "predict": (0, 0)},
    "weighted": {"train": (1, 1), "test": (0, 1), "predict": (0, 0)},
    "embedding": {"train": (1, 1), "test": (0, 1), "predict": (0, 0)},
    # Keras logs each output's loss as a mean over batches: it needs N per
    # batch, which evaluation has no gradient all-reduce to bring.
    "multi_output": {"train": (1, 1), "test": (1, 1), "predict": (0, 0)},
    # Dropout draws for the global batch: each replica needs its row offset
    # before the forward pass.
    "dropout": {"train": (2, 1), "test": (0, 1), "predict": (0, 0)},
    # A masked loss's denominator (its unmasked count) is all-reduced with N.
    "masked": {"train": (2, 1), "test": (1, 1), "predict": (0, 0)},
    # A compute_loss of the user's own reads true loss shares: N first.
    "own_compute_loss": {"train": (2, 1), "test": (1, 1), "predict": (0, 0)},
}


@pytest.mark.cluster
def test_collectives_per_step_on_two_replicas():
    code, output = _harness.run_script("collectives.py", ",".join(EXPECTED), timeout=400)
    assert code == 0, output[-4000:]
    counted = {
        item["case"]: {kind: (item[kind]["step"], item[kind]["logs"]) for kind in EXPECTED["mlp"]}
        for item in _harness.results_of(output)
    }
    assert counted == EXPECTED


@pytest.mark.cluster
def test_collective_ops_in_the_step_graphs_of_two_workers():
    # In the traced graphs on each worker: the training step's one all-reduce,
    # the logs' one, and TensorFlow's own per-step all-reduce in a multi-worker
    # iterator (the workers agree whether any of them has a batch left; Keras
    # and tf-keras pay it too). Predictions are gathered to every worker.
    result, output = _harness.run_cluster("collectives_cluster.py", workers=2, timeout=300)
    assert result.returncode == 0, output[-4000:]
    lines = [line.split("] ", 1)[1] for line in output.splitlines() if "] RESULT " in line]
    counted = _harness.results_of("\n".join(lines))
    assert len(counted) == 2
    for ops in counted:
        assert ops == {
            "train": {"CollectiveReduceV2": 3},
            "test": {"CollectiveReduceV2": 2},
            "predict": {"CollectiveReduceV2": 1, "CollectiveGatherV2": 4},
        }


@pytest.mark.cluster
def test_deferred_scaling_keeps_every_loss_reduction_exact():
    # Reductions whose scale is not the row count times a constant take N from
    # an all-reduce of their own; all of them must match one device.
    code, output = _harness.run_script("deferred_scaling.py", timeout=400)
    assert code == 0, output[-4000:]
    results = _harness.results_of(output)
    assert [r["case"] for r in results] == ["sum", "mean_with_sample_weight", "none",
                                           "activity_regularizer", "add_loss", "two_outputs"]
    for result in results:
        assert max(result["weights"], result["history"], result["evaluate"]) <= 2e-5, result
