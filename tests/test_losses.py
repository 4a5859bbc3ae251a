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
    # An empty replica contributes nothing, the other the whole penalty.
    assert result["reg_rows_with_empty"] == pytest.approx([0.8, 0.0])
