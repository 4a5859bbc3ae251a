"""The first-step check (keras_distrib/training/first_step.py), against one device.

tests/scripts/first_step.py trains each case under a strategy and on one
device (Keras's own `keras.Model`, no kd step) from the same initial
weights: an exact model with BatchNormalization and Dropout, with the check
on and off, and a model whose rows meet in a layer kd is blinded to
(`penalties._kind_of_op_output` patched to read it as rows), which the check must refuse
before anything is trained, naming that layer (called in the model's call,
or only in its own `train_step`). The same on a sub-batch,
as for a global batch too big for one device, and on two worker processes. A metric of the user's own
with `aggregation="sum"` state and a dict result logs one device's values
(the check passes). One process per strategy layout runs every case.
"""

import numpy as np
import pytest

from keras_distrib.training import first_step
from tests import _harness

TOLERANCE = {True: 1e-9, False: 2e-5}


def _check_results(results, expected_cases):
    by_case = {(r["case"], r["float64"]): r for r in results}
    assert set(by_case) == expected_cases, sorted(by_case)
    errors = [r for r in results if "error" in r]
    assert not errors, errors
    for (case, float64), result in by_case.items():
        if case.startswith("exact"):
            # Exact models pass the check and train as one device does ...
            assert result["weights"] <= TOLERANCE[float64], result
            assert result["logs"] <= TOLERANCE[float64], result
            # ... and the check changes nothing training computes: every
            # variable (moving statistics, optimizer slots, metric and seed
            # states too) is bitwise what training without it leaves.
            assert result["same_on_and_off"] is True, result
    blinded = by_case[("blinded", True)]
    # kd blinded to rows that meet: the check refuses the first step, naming
    # the loss and the layers, and nothing is trained ...
    refusal = blinded.get("refusal", "")
    assert refusal.startswith("FirstStepMismatch: The first training step of FunctionalModel"), blinded
    assert "differs from one device's on the same global batch: the logged 'loss' is off by" in refusal
    assert "the gradients of 3 layers differ too, from the first: 'embed', 'mix', 'head'" in refusal, refusal
    assert "first_step_check=False" in refusal, refusal
    # ... the first layer whose outputs differ, found from the forward outputs ...
    assert "Likely cause: the first layer whose outputs differ is 'centre' (Lambda): on each " \
        "replica's rows apart its outputs are off by" in refusal, refusal
    assert blinded["restored"] is True, blinded
    # ... while without the check the same model trains off one device's result.
    assert blinded["weights_off"] > 1e-3 and blinded["logs_off"] > 1e-3, blinded


@pytest.mark.cluster
def test_first_step_check_on_mirrored_replicas():
    code, output = _harness.run_script("first_step.py", "mirrored2", timeout=600)
    assert code == 0, output[-4000:]
    results = _harness.results_of(output)
    _check_results(results, {("exact", True), ("exact", False), ("exact_spe2", True),
                             ("exact_summed", True), ("blinded", True), ("subclassed", True),
                             ("ownstep", True), ("exact_sub", True), ("blinded_sub", True)})
    # A subclassed model: the layer is named from the outputs its call records.
    subclassed = {r["case"]: r for r in results}["subclassed"]
    assert subclassed.get("refusal", "").startswith(
        "FirstStepMismatch: The first training step of Centred on 2 replicas"), subclassed
    assert "Likely cause: the first layer whose outputs differ is 'centre' (Lambda)" \
        in subclassed["refusal"], subclassed
    assert subclassed["restored"] is True, subclassed
    # The layer called only in the model's own train_step: named from the
    # step's own calls, its input run on each replica's rows apart.
    own = {r["case"]: r for r in results}["ownstep"]
    assert own.get("refusal", "").startswith(
        "FirstStepMismatch: The first training step of OwnStep on 2 replicas"), own
    assert "Likely cause: the first layer whose outputs differ is 'centre' (Lambda) (called in the " \
        "model's own train_step, outside its call)" in own["refusal"], own
    assert own["restored"] is True, own
    _check_sub_batch(results)


def _check_sub_batch(results):
    # A global batch too big for one device (the bound forced to 0 bytes):
    # the check compares the step on a sub-batch, refuses the blinded model
    # there with nothing trained, naming the layer, and leaves the exact one
    # trained as without it (`_check_results`: one device's weights, every
    # variable bitwise as with the check off).
    sub = {r["case"]: r for r in results}["blinded_sub"]
    assert "differs from one device's on the same sub-batch (4 rows of each replica's): the " \
        "logged 'loss' is off by" in sub.get("refusal", ""), sub
    assert "the first layer whose outputs differ is 'centre' (Lambda)" in sub["refusal"], sub
    assert sub["restored"] is True, sub


@pytest.mark.cluster
def test_first_step_check_on_two_worker_processes():
    result, output = _harness.run_cluster("first_step.py", "multi_worker", workers=2, timeout=600)
    assert result.returncode == 0, output[-4000:]
    by_task = _harness.results_by_task(output)
    assert sorted(by_task) == ["worker 0", "worker 1"], output[-4000:]
    for results in by_task.values():
        # Every worker gathers every replica's rows: each names the layer as one worker does.
        _check_results(results, {("exact", True), ("blinded", True), ("exact_sub", True),
                                 ("blinded_sub", True)})
        # Each worker cut its own replicas' rows for the sub-batch.
        _check_sub_batch(results)


def test_difference_is_relative_to_the_largest_magnitude():
    reference = np.array([[4.0, -2.0], [0.0, 1.0]])
    assert first_step.difference(reference, reference) == 0.0
    assert first_step.difference(reference + [[0.0, 0.0], [0.0, 4e-9]], reference) == pytest.approx(1e-9)
    # A gradient that is round-off of zero, against the largest of its step.
    assert first_step.difference([1e-17], [-1e-17], scale=1.0) == pytest.approx(2e-17)
    assert first_step.difference([np.nan], [1.0]) == np.inf
    assert first_step.difference([np.inf, 1.0], [np.nan, 1.0]) == 0.0
    assert first_step.difference([1.0, 2.0], [1.0]) == np.inf


def test_compile_refuses_a_first_step_check_that_is_not_a_bool():
    import keras
    import keras_distrib as kd

    model = kd.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"`first_step_check`='no': expected True or False"):
        model.compile(optimizer="sgd", loss="mse", first_step_check="no")
    model.compile(optimizer="sgd", loss="mse", first_step_check=False)
    assert model.get_compile_config()["first_step_check"] is False


def test_first_layer_apart_needs_only_each_replicas_rows():
    # What a worker holds once the batch is gathered: each replica's rows, in
    # the split's order; no strategy. A layer centring on the batch's mean
    # reads other rows (named); a row-wise model has no such layer.
    import keras
    from keras import ops

    keras.utils.set_random_seed(1)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, name="embed")(inputs)
    centred = keras.layers.Lambda(lambda h: h - ops.mean(h, axis=0, keepdims=True), name="centre")
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(centred(hidden)))
    rows = np.random.default_rng(0).normal(size=(6, 3)).astype("float32")
    pieces = [(rows[:3], np.zeros(3)), (rows[3:], np.zeros(3))]
    name, kind, gap = first_step.first_layer_apart(model, pieces, 2e-5)
    assert (name, kind) == ("centre", "Lambda") and gap > 1e-3, (name, kind, gap)
    row_wise = keras.Model(inputs, model.get_layer("head")(hidden))
    assert first_step.first_layer_apart(row_wise, pieces, 2e-5) is None


def test_a_layer_called_only_in_train_step_on_other_rows_is_named_as_not_compared():
    # The centring layer runs only in the model's own train_step, on both
    # views stacked (twice the batch's rows): kd cannot split its input by
    # replica, so the refusal names it as not compared instead of guessing.
    # (Called on the batch's own rows, it is named: the cluster test's `ownstep`.)
    import keras
    import tensorflow as tf
    from keras import ops

    import keras_distrib as kd
    from keras_distrib.training import step as step_lib

    class Stacked(kd.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.embed = keras.layers.Dense(4, name="embed")
            self.centre = keras.layers.Lambda(lambda h: h - ops.mean(h, axis=0, keepdims=True),
                                              name="centre")
            self.head = keras.layers.Dense(2, name="head")

        def build(self, shape):
            self.head.build(self.embed.compute_output_shape(shape))
            self.embed.build(shape)

        def call(self, x, training=False):
            return self.head(self.embed(x))

        def train_step(self, data):
            x, _ = data
            with tf.GradientTape() as tape:
                loss = ops.mean(ops.square(self.head(self.centre(ops.concatenate(
                    [self.embed(x), self.embed(2 * x)], axis=0)))))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"loss": loss}

    keras.utils.set_random_seed(1)
    model = Stacked()
    model.build((None, 3))
    model.compile(optimizer="sgd")
    rows = tf.constant(np.random.default_rng(0).normal(size=(6, 3)), "float32")
    pieces = [(rows[:3], tf.zeros(3)), (rows[3:], tf.zeros(3))]
    named, seen = first_step._layers_apart(model, pieces, 2e-5)
    assert named is None and set(seen) == {id(model.embed), id(model.head)}, named
    found = first_step._step_layer_apart(
        model, step_lib.replica_function(model, "train", one_device=True), (rows, tf.zeros(6)),
        pieces, first_step.Snapshot(model), first_step.Snapshot(model, trainable_only=True), seen,
        2e-5)
    assert found == (None, ["centre"]), found
    assert "the model's own train_step also calls 'centre' on tensors whose rows are not the " \
        "batch's" in first_step._cause(None, False, found[1])
