"""kd.Model, kd.Sequential and DistributedModelMixin: construction and refusals.

Exactness under every strategy is tested by tests/test_exactness.py.
"""

import keras
import numpy as np
import pytest

import keras_distrib as kd
from tests import _harness


def test_functional_and_subclassed_models_both_work():
    inputs = keras.Input((3,))
    functional = kd.Model(inputs, keras.layers.Dense(2)(inputs))
    assert isinstance(functional, kd.Model)

    class Net(kd.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    net = Net()
    net.compile(optimizer="sgd", loss="mse")
    x = np.ones((4, 3), "float32")
    net.fit(x, np.zeros((4, 2), "float32"), verbose=0)
    assert net(x).shape == (4, 2)
    sequential = kd.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    sequential.compile(optimizer="sgd", loss="mse")
    sequential.fit(x, np.zeros((4, 1), "float32"), verbose=0)


def test_mixin_on_user_subclass():
    class Custom(kd.DistributedModelMixin, keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    model = Custom()
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(np.ones((8, 2), "float32"), np.ones((8, 1), "float32"), verbose=0, epochs=2)
    assert len(history.history["loss"]) == 2


@pytest.mark.cluster
def test_model_created_outside_scope_is_refused():
    code, output = _harness.run_script("outside_scope.py")
    assert code == 0, output[-4000:]
    (result,) = _harness.results_of(output)
    assert "Create (and compile) the model inside" in result["error"]
