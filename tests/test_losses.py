"""kd.losses on one device and across replicas (in a subprocess)."""

import numpy as np
import pytest
import tensorflow as tf

import keras_distrib as kd
from tests import _harness


def test_global_mean_single_device_is_mean():
    values = np.array([1.0, 2.0, 6.0], "float32")
    assert float(kd.losses.global_mean(values)) == pytest.approx(3.0)
    weighted = kd.losses.global_mean(values, sample_weight=np.array([1.0, 0.0, 2.0], "float32"))
    assert float(weighted) == pytest.approx((1.0 + 12.0) / 3.0)


def test_global_mean_of_empty_is_zero():
    assert float(kd.losses.global_mean(tf.zeros((0,)))) == 0.0


def test_scale_regularization_single_device():
    assert float(kd.losses.scale_regularization([tf.constant(1.5), tf.constant(0.5)])) == 2.0
    assert float(kd.losses.scale_regularization([])) == 0.0


@pytest.mark.cluster
def test_two_replicas_and_the_cross_replica_refusal():
    code, output = _harness.run_script("losses_replicas.py")
    assert code == 0, output[-4000:]
    (result,) = _harness.results_of(output)
    assert "needs a replica context" in result["cross_replica_error"]
    # Two replicas with rows [2, 3] and [4, 5, 9]: the global mean is 23/5.
    assert result["sum_of_shares"] == pytest.approx(23.0 / 5.0, rel=1e-6)
    # The classic mistakes give other numbers.
    assert result["mean_of_local_means"] == pytest.approx((2.5 + 6.0) / 2)
    # Regularization 0.8 on each replica counts once: shares sum to 0.8.
    assert result["reg_even"] == pytest.approx(0.8)
    assert result["reg_rows"] == pytest.approx(0.8)
    # Constant terms are the same on every replica: each contributes half,
    # whatever the rows (an empty replica included).
    assert result["reg_rows_with_empty"] == pytest.approx([0.4, 0.4])


@pytest.mark.cluster
def test_autograph_leaves_kds_functions_as_written_in_a_users_step():
    """Measured in the trace: which functions ran as AutoGraph's rewrites of themselves."""
    code, output = _harness.run_script("autograph_rules.py")
    assert code == 0, output[-4000:]
    (result,) = _harness.results_of(output)
    # The user's step and the helper it calls are converted, as AutoGraph
    # converts what a tf.function calls: the profiler sees a callee's rewrite.
    assert {"__main__:step", "__main__:replica_step", "__main__:scaled_penalty"} <= set(result["kd"])
    # kd's functions (losses, the model's call, the penalty walk, the
    # optimizer's build) run as written.
    assert not [name for name in result["kd"] if name.startswith("keras_distrib")], result["kd"]
    # The contrast: the same two kd.losses functions without their wrapper
    # are rewritten, with everything they call, on every new trace.
    assert {"keras_distrib.training.losses:global_mean",
            "keras_distrib.training.losses:scale_regularization"} <= set(result["kd_unwrapped"])
    assert result["losses"][0] == result["losses"][1]


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_every_function_keeps_the_losses_dtype(dtype):
    values = tf.constant([1.0, 2.0, 6.0], dtype)
    assert kd.losses.global_mean(values).dtype == dtype
    assert kd.losses.global_mean(values, sample_weight=np.ones(3)).dtype == dtype
    assert kd.losses.global_share(tf.reduce_sum(values), 3).dtype == dtype
    assert kd.losses.scale_regularization([values[0], values[1]], local_rows=3).dtype == dtype
    assert kd.losses.scale_regularization(values).dtype == dtype


def test_integers_and_no_terms_follow_floatx():
    import keras

    keras.config.set_floatx("float64")
    try:
        assert kd.losses.scale_regularization([]).dtype == tf.float64
        assert kd.losses.global_mean(tf.constant([1, 2])).dtype == tf.float64
        assert kd.losses.global_share(3, 2).dtype == tf.float64
        # float64 losses plus no penalty: the recipe's sum no longer raises TypeError.
        total = kd.losses.global_mean(tf.constant([1.0, 2.0], tf.float64)) + \
            kd.losses.scale_regularization([], local_rows=2)
        assert float(total) == 1.5
    finally:
        keras.config.set_floatx("float32")


LAYOUT_TOLERANCE = {"float64": 1e-9, "float32": 2e-5}
# float64 decides whether the recipe's arithmetic is the one device's (1e-9);
# float32 adds round-off only, and is checked on one layout (mirrored) rather
# than on each: central storage and worker processes run the float64 cases.
LAYOUT_DTYPES = {"mirrored": ("float64", "float32"), "central_storage": ("float64",)}


def _layout_results(kind):
    flags = () if "float32" in LAYOUT_DTYPES[kind] else ("--float64-only",)
    code, output = _harness.run_script("loop_layout.py", kind, *flags, timeout=1500)
    assert code == 0, output[-4000:]
    return {(r["case"], r["dtype"]): r for r in _harness.results_of(output)}


@pytest.mark.cluster
@pytest.mark.long
@pytest.mark.parametrize("kind", ["mirrored", "central_storage"])
def test_hand_written_recipe_matches_one_device(kind):
    """kd's documented loop on 2 replicas (an empty one) vs plain Keras on one device."""
    results = _layout_results(kind)
    assert {dtype for _, dtype in results} == set(LAYOUT_DTYPES[kind])
    for dtype in LAYOUT_DTYPES[kind]:
        tolerance = LAYOUT_TOLERANCE[dtype]
        # Every kind of penalty: a weight regularizer, an activity regularizer
        # (a mean over rows), a sum over rows, a term of a weight alone.
        for case in ("penalties", "batch_norm", "penalties_trainloop", "batch_norm_trainloop"):
            result = results[(case, dtype)]
            assert "error" not in result, result
            assert result["weights"] < tolerance, result
            assert result.get("losses", 0.0) < tolerance, result
    # The contrasts and refusals, in float64 (the script runs them once).
    # The former rule (every term by n_r / N) and plain Keras are off.
    assert results[("penalties_old_rule", "float64")]["weights"] > 1e-3
    assert results[("penalties_keras", "float64")]["weights"] > 1e-3
    # `model.losses` read after a collective holds the other replica's terms: refused.
    assert "Read `model.losses` right after the forward pass" in \
        results[("penalties_late_read", "float64")]["error"]
    # A penalty that is no sum or mean over rows is refused, naming the op.
    assert "batch_variance_penalty" in results[("variance_penalty", "float64")]["error"]
    assert "cannot split" in results[("variance_penalty", "float64")]["error"]
    # A plain Keras model's per-replica BatchNormalization is refused, naming the fix.
    # Under central storage Keras itself fails first (its moving statistics are
    # aggregating variables without an aggregation): loud, before kd sees a loss.
    error = results[("batch_norm_keras_model", "float64")]["error"]
    if kind == "central_storage":
        assert "You must specify an aggregation method" in error, error
    else:
        assert "batch_normalization" in error and "kd.Sequential" in error


@pytest.mark.cluster
def test_hand_written_recipe_on_two_workers():
    """The recipe's penalties and a kd model's BatchNormalization on 2 worker processes."""
    result, output = _harness.run_cluster(
        "loop_layout.py", "multi_worker", "--float64-only", "penalties", "batch_norm", workers=2,
        timeout=1500)
    assert result.returncode == 0, output[-4000:]
    results = _harness.task_results(output)
    assert len(results) == 4, output[-4000:]  # 2 cases, float64, 2 workers
    assert {item["dtype"] for item in results} == {"float64"}
    for item in results:
        assert "error" not in item, item
        assert item["weights"] < LAYOUT_TOLERANCE[item["dtype"]], item
        assert item["losses"] < LAYOUT_TOLERANCE[item["dtype"]], item
