"""Fails loudly when a new Keras changes what _keras_compat relies on."""

import inspect

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common import variables as keras_variables
from keras.src.losses import loss as keras_loss
from keras.src.trainers import compile_utils

from keras_distrib import _keras_compat


def test_keras_version_is_in_tested_range():
    assert _keras_compat.TESTED_KERAS[0] <= _keras_compat.KERAS_VERSION <= _keras_compat.TESTED_KERAS[1]


def test_keras_still_scales_losses_by_replica_count():
    # GlobalShareMean undoes exactly this multiplication by R.
    source = inspect.getsource(keras_loss.unscale_loss_for_distribution)
    assert "num_replicas_in_sync" in source and "multiply" in source


def test_keras_assign_add_is_still_assign_of_sum():
    # The central-storage fix exists because of this implementation.
    source = inspect.getsource(keras_variables.Variable.assign_add)
    assert "self.assign(self + value)" in source
    assert hasattr(keras.src.backend.tensorflow.core.Variable.assign_add, "__wrapped__")


def test_compile_loss_layout_is_as_expected():
    fields = compile_utils.CompileLoss.Loss._fields
    assert fields == ("path", "loss", "loss_weights", "name")
    for name in ("_user_loss", "_user_loss_weights", "output_names"):
        assert name in inspect.getsource(compile_utils.CompileLoss.__init__)
    assert "metric.update_state" in inspect.getsource(compile_utils.CompileLoss.call)


def test_global_reduction_loss_matches_keras_on_one_device():
    rng = np.random.default_rng(0)
    cases = [
        # labels with an extra dimension: per-element losses of shape (6, 3)
        ((6, 3, 2), rng.uniform(size=(6, 3)).astype("float32")),
        ((6, 4), rng.uniform(size=(6,)).astype("float32")),
    ]
    for shape, weights in cases:
        y_true = rng.normal(size=shape).astype("float32")
        y_pred = rng.normal(size=shape).astype("float32")
        for reduction in ("sum_over_batch_size", "sum", "mean_with_sample_weight", "mean"):
            inner = keras.losses.MeanSquaredError(reduction=reduction)
            wrapped = _keras_compat.GlobalReductionLoss(inner)
            for sample_weight in (None, weights):
                expected = float(inner(y_true, y_pred, sample_weight))
                actual = float(wrapped(y_true, y_pred, sample_weight))
                assert actual == np.float32(expected), (shape, reduction)


def test_global_reduction_loss_matches_keras_with_mask():
    y_true = tf.constant([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    y_pred = tf.constant([[1.5, 2.0, 0.0], [4.0, 1.0, 6.5]])
    mask = tf.constant([[True, True, False], [True, False, True]])
    y_pred._keras_mask = mask
    inner = keras.losses.MeanAbsoluteError()
    expected = float(inner(y_true[..., None], y_pred[..., None]))
    wrapped = _keras_compat.GlobalReductionLoss(inner)
    assert float(wrapped(y_true[..., None], y_pred[..., None])) == np.float32(expected)


def test_symbolic_build_reduction_is_still_in_keras():
    from keras.src.backend.tensorflow import trainer

    source = inspect.getsource(trainer.TensorFlowTrainer._maybe_symbolic_build)
    assert 'reduce(\n                        "MEAN"' in source or '"MEAN"' in source
