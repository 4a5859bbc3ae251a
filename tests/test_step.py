"""kd.step: one traced step function per kind.

The looped step's exactness is tested by tests/test_exactness.py (path
`spe3_mirrored2`) and tests/test_gradients.py (sparse gradients).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_distrib as kd
from tests import _harness


@pytest.mark.cluster
def test_several_steps_per_call_trace_the_replica_step_once():
    # steps_per_execution=5 over 7 batches: a call of 5 steps and one of 2.
    # Both go through one function, which runs every step inside its loop:
    # `train_step` is traced once per replica, as with one step per call.
    code, output = _harness.run_script("looped_steps.py", "float32", "mlp,embedding")
    assert code == 0, output[-4000:]
    results = _harness.results_of(output)
    assert [r["case"] for r in results] == ["mlp", "embedding"], output[-4000:]
    for result in results:
        assert "error" not in result, result
        assert result["traces"] == result["replicas"] == 2, result


class ExtrasModel(kd.Model):
    def train_step(self, data):
        logs = super().train_step(data)
        logs["rows"] = tf.cast(tf.shape(data[0])[0], "float32")
        return logs


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_a_looped_call_returns_the_last_steps_own_values_and_stops_when_empty(run_eagerly):
    # A value the step returns besides metrics is carried out of the loop
    # (the function is traced again once to learn its shape).
    inputs = keras.Input((2,))
    model = ExtrasModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"], steps_per_execution=3,
                  run_eagerly=run_eagerly)
    x = np.ones((5, 2), "float32")
    history = model.fit(x, x[:, :1], batch_size=2, epochs=2, verbose=0)  # calls of 3 steps
    assert sorted(history.history) == ["loss", "mae", "rows"]
    assert history.history["rows"] == [1.0, 1.0]  # the last batch's rows, each epoch
    empty = iter(tf.data.Dataset.from_tensor_slices((x[:0], x[:0, :1])).batch(2))
    with pytest.raises(StopIteration):
        model.make_train_function()(empty)
