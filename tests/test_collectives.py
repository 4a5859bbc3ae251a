"""Collective ops per step (issue 37): counted in the graphs TensorFlow traced.

Each collective is a barrier across replicas and, between workers, a network
round trip. `keras_distrib.collectives` counts the collective ops in a kd
model's traced step functions, nested functions included, per replica:
(ops once per step, ops once per compiled call outside the steps, ops of the
separate read of an evaluation's logs).

kd's training step makes one all-reduce, its metrics' states packed in with
the gradients, whatever the number of metrics; evaluation steps make none,
and the logs cost one packed all-reduce per call when a callback reads each
batch's logs, else one per evaluation; prediction makes none in one process.
What needs more says why.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_distrib.training import collectives
from tests import _harness

METRIC_CASES = ["metrics0", "metrics1", "metrics3", "metrics3_spe3", "metrics3_outside"]


def _figures(item):
    return {kind: (item[kind]["step"], item[kind]["call"], item[kind]["read"])
            for kind in ("train", "test", "test_each_call", "predict")}


def _counted(kind, cases):
    code, output = _harness.run_script("collectives.py", kind, ",".join(cases), timeout=600)
    assert code == 0, output[-4000:]
    return {item["case"]: _figures(item) for item in _harness.results_of(output)}


# kind -> (step, call, read) per replica.
ONE_PER_STEP = {
    "train": (1, 0, 0),
    "test": (0, 0, 1),  # verbose=0: the logs read once, at the end
    "test_each_call": (1, 0, 1),  # a batch callback: each one-step call reads them
    "predict": (0, 0, 0),
}
LOOPED = {**ONE_PER_STEP, "test_each_call": (0, 1, 1)}  # 3 steps per call: once per call


@pytest.mark.cluster
def test_one_collective_per_training_step_whatever_the_metrics_mirrored():
    counted = _counted("mirrored", METRIC_CASES)
    # Metric objects made before the scope are made again in it (their
    # states then ride in the gradients' all-reduce: RootMeanSquaredError
    # made outside cost a collective of its own per step before).
    assert counted == {"metrics0": ONE_PER_STEP, "metrics1": ONE_PER_STEP,
                       "metrics3": ONE_PER_STEP, "metrics3_spe3": LOOPED,
                       "metrics3_outside": ONE_PER_STEP}


@pytest.mark.cluster
@pytest.mark.parametrize("kind", ["one_device", "central_storage"])
def test_no_collective_ops_on_one_device_or_central_storage(kind):
    # Central storage reduces by copies to its parameter device and adds
    # there: no collective op (and no round trip between processes).
    nothing = {k: (0, 0, 0) for k in ONE_PER_STEP}
    assert _counted(kind, METRIC_CASES) == {case: nothing for case in METRIC_CASES}


@pytest.mark.cluster
def test_what_needs_more_collectives_says_why():
    cases = ["weighted", "multi_output", "dropout", "masked", "own_compute_loss", "embedding",
             "mlp", "buckets"]
    code, output = _harness.run_script("collectives.py", "mirrored", ",".join(cases), timeout=600)
    assert code == 0, output[-4000:]
    results = {item["case"]: item for item in _harness.results_of(output)}
    counted = {case: _figures(item) for case, item in results.items()}
    assert counted == {
        "weighted": ONE_PER_STEP,
        # Keras logs each output's loss as a mean over batches: its tracker
        # waits for N, which the gradient all-reduce brings, so the metric
        # states are read after the step (+1 in training and evaluation).
        "multi_output": {**ONE_PER_STEP, "train": (2, 0, 0), "test": (1, 0, 1),
                         "test_each_call": (2, 0, 1)},
        # Dropout draws for the global batch: each replica needs its row
        # offset before the forward pass.
        "dropout": {**ONE_PER_STEP, "train": (2, 0, 0)},
        # An Embedding's sparse gradient is gathered (5 gather ops: values,
        # indices and their shapes); a masked loss's denominator is
        # all-reduced with N.
        "masked": {**ONE_PER_STEP, "train": (7, 0, 0), "test": (1, 0, 1),
                   "test_each_call": (2, 0, 1)},
        # A compute_loss of the user's own reads true loss shares: N first.
        "own_compute_loss": {**ONE_PER_STEP, "train": (2, 0, 0), "test": (1, 0, 1),
                             "test_each_call": (2, 0, 1)},
        "embedding": {**ONE_PER_STEP, "train": (6, 0, 0)},
        "mlp": ONE_PER_STEP,
        # compile(gradient_buckets=40): 2 buckets, the row count and the
        # metric states in the first: one collective per bucket, no more.
        "buckets": {**ONE_PER_STEP, "train": (2, 0, 0)},
    }
    # The step's backward pass has 3 MatMuls (the output layer's kernel and
    # input, the hidden layer's kernel). One all-reduce waits for all of
    # them; the first bucket (the last layers' gradients) not for the hidden
    # kernel's, so TensorFlow can start it while that one runs.
    assert results["mlp"]["backward_waits"] == [[3, 3]]
    assert results["buckets"]["backward_waits"] == [[2, 3], [3, 3]]
    # Reported once, at the start of the fit.
    assert results["mlp"]["reported"] == [
        "kd: 260 bytes of gradients per replica, 1 worker(s): one all-reduce after the backward "
        "pass (gradient_buckets=\"auto\": latency dominates (one worker process))."]
    assert results["buckets"]["reported"] == [
        "kd: 260 bytes of gradients per replica, 1 worker(s): 2 all-reduces of up to 40 bytes, "
        "each started as the backward pass produces its gradients (gradient_buckets=40)."]


@pytest.mark.cluster
def test_collective_ops_in_the_step_graphs_of_two_workers():
    # Per worker (one replica each). TensorFlow's multi-worker iterator
    # all-reduces at every batch whether any worker has one left (Keras and
    # tf-keras pay it: +1 per step); kd skips it where every worker's batch
    # count is known to be the same: from arrays (TensorFlow splits each global
    # batch into one per replica) and from a `dataset_fn` (loop.join_workers).
    # Predictions are gathered to every worker (4 gathers). No metric and three
    # (one a RootMeanSquaredError): the counts do not grow with the metrics.
    result, output = _harness.run_cluster("collectives_cluster.py", "0,3", "1,3",
                                          workers=2, timeout=600)
    assert result.returncode == 0, output[-4000:]
    counted = _harness.task_results(output)
    assert len(counted) == 2 * 2 * 2 * 2
    for item in counted:
        figures = {kind: (item[kind]["step"], item[kind]["call"], item[kind]["read"])
                   for kind in ("train", "test")}
        assert figures == {"train": (1, 0, 0), "test": (0, 0, 1)}, item
        if item["input"] == "dataset_fn":
            continue
        each_call = (0, 1, 1) if item["spe"] > 1 else (1, 0, 1)
        test_each_call = item["test_each_call"]
        assert (test_each_call["step"], test_each_call["call"], test_each_call["read"]) == each_call
        assert item["predict"]["ops"] == {"CollectiveGatherV2": 4}


def test_graph_collectives_counts_ops_in_nested_functions_and_loop_bodies():
    # A hand-built graph: an all-reduce at the top, one in a called function,
    # one in a While's body; the counter must find all three, by place.
    group = tf.constant(1)
    key = tf.constant(1)

    @tf.function
    def inner(x):
        return tf.raw_ops.CollectiveReduceV2(
            input=x, group_size=group, group_key=key, instance_key=tf.constant(2),
            ordering_token=[], merge_op="Add", final_op="Id")

    @tf.function
    def outer(x):
        x = tf.raw_ops.CollectiveReduceV2(
            input=x, group_size=group, group_key=key, instance_key=tf.constant(1),
            ordering_token=[], merge_op="Add", final_op="Id")
        x = inner(x)
        return tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, inner(v)), (0, x))[1]

    graph = outer.get_concrete_function(tf.TensorSpec([2], tf.float32)).graph.as_graph_def()
    assert collectives.graph_collectives(graph) == {
        "step": {"CollectiveReduceV2": 1}, "call": {"CollectiveReduceV2": 2},
    }


def test_count_refuses_a_model_that_is_not_kd():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with pytest.raises(ValueError, match=r"`model` is a Sequential; `count` counts the steps of a kd"):
        collectives.count(model, np.ones((4, 2)), np.ones((4, 1)))


@pytest.mark.cluster
def test_arrays_on_workers_with_two_replicas_each_skip_the_agreement_exactly():
    # 2 workers x 2 replicas: 225 rows (a last batch of 1 row) and 3 rows (an
    # empty replica), float64, against one device in each worker's process.
    result, output = _harness.run_cluster("arrays_workers.py", workers=2, timeout=600)
    assert result.returncode == 0, output[-4000:]
    found = _harness.task_results(output)
    assert sorted(r["rows"] for r in found) == [3, 3, 225, 225], output[-4000:]
    for item in found:
        assert item["replicas"] == 4, item
        for name in ("weights", "logs", "evaluate", "predict", "validation"):
            assert item[name] < 1e-12, item
        assert (item["train"], item["test"]) == (1, 0), item
