"""kd.gradients: the optimizer of a hand-written loop (kd.exact_optimizer).

Exactness of kd models' optimizers under every strategy is tested by
tests/test_exactness.py; here, the loop TensorFlow's guide writes by hand.
"""

import keras
import pytest

import keras_distrib as kd
from tests import _harness

TOLERANCE = 2e-5  # float32 round-off, relative


def test_exact_optimizer_leaves_an_unbuilt_optimizer_unbuilt_until_its_first_step():
    optimizer = kd.exact_optimizer(keras.optimizers.Adagrad(0.1))
    assert not optimizer.built
    weight = keras.Variable([1.0, 2.0])
    optimizer.apply_gradients([(keras.ops.convert_to_tensor([0.5, 0.5]), weight)])
    assert optimizer.built
    # Adagrad's first step from a 0.1 accumulator: w - lr * g / sqrt(0.1 + g^2).
    assert keras.ops.convert_to_numpy(weight)[0] == pytest.approx(1.0 - 0.1 * 0.5 / (0.35 ** 0.5), rel=1e-5)


@pytest.mark.cluster
def test_unbuilt_slot_optimizers_in_a_hand_written_mirrored_loop():
    code, output = _harness.run_script("hand_written_loops.py", "mirrored")
    assert code == 0, output[-4000:]
    results = {r["case"]: r for r in _harness.results_of(output)}
    # Adagrad and Adam, never built by the user, against plain Keras on one device.
    for name in ("kd_adagrad", "kd_adam"):
        assert "error" not in results[name], results[name]
        assert results[name]["diff"] <= TOLERANCE, results[name]
    # Contrast: plain Keras 3 builds the slots inside the replica's graph.
    assert "You must feed a value for placeholder tensor" in results["keras_adagrad"]["error"]
    # kd.TrainLoop iterates in Python and passes the iterator in: a second
    # whole-epoch call on the same dataset returns (the guide's shape with
    # iter() inside the tf.function hangs there).
    assert len(results["train_epoch_twice"]["losses"]) == 2


def _looped(floatx, cases):
    code, output = _harness.run_script("looped_steps.py", floatx, ",".join(cases))
    assert code == 0, output[-4000:]
    results = {r["case"]: r for r in _harness.results_of(output)}
    assert sorted(results) == sorted(cases), output[-4000:]
    for result in results.values():
        assert "error" not in result, result
        # Ran inside the compiled loop: no "run as 5 calls of one step".
        assert result["warnings"] == [], result
    return results


@pytest.mark.cluster
def test_sparse_gradients_inside_a_compiled_loop_match_one_device():
    # Embedding gradients, 5 steps per call on 2 replicas, an uneven last
    # batch and an empty replica, Adam (which squares each slice of a
    # repeated index: the slices must arrive as one device has them).
    result = _looped("float32", ["embedding"])["embedding"]
    assert result["weights"] <= TOLERANCE and result["history"] <= TOLERANCE, result
    # float64: an exact algorithm matches to round-off, the attention block too.
    for result in _looped("float64", ["embedding", "transformer"]).values():
        assert result["weights"] <= 1e-9 and result["history"] <= 1e-9, result
