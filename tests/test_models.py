"""kd models under every strategy layout vs plain Keras on one device.

Each configuration runs in its own process (one device layout per process);
the script trains the reference and the kd model with the same initial
weights and global batches and reports max abs differences.
"""

import json

import keras
import numpy as np
import pytest

import keras_distrib as kd
from tests import _harness

TOLERANCE = 1e-5
CORE = "even,uneven_empty,weighted_l2"
ALL = CORE + ",multi_output,class_weights"
MULTI_WORKER = "uneven_empty,weighted_l2,multi_output,class_weights"

CONFIGS = [
    # (devices, kind, compile kwargs, scenarios, strategy options)
    (1, "default", {}, ALL, {}),
    (1, "one_device", {}, CORE, {}),
    (1, "mirrored", {}, CORE, {}),
    (2, "mirrored", {}, ALL, {}),
    (4, "mirrored", {}, CORE, {}),
    (2, "mirrored", {}, CORE, {"cross_device_ops": "reduce_to_one_device"}),
    (2, "central_storage", {}, ALL, {}),
    (2, "mirrored", {"steps_per_execution": 3}, CORE, {}),
    (2, "mirrored", {"jit_compile": True}, CORE, {}),
    (1, "multi_worker", {}, CORE, {}),
]


def _check(results, scenarios, replicas):
    assert [r["scenario"] for r in results] == scenarios.split(",")
    for result in results:
        assert result["replicas"] == replicas, result
        for key in ("weights", "history", "evaluate", "predict"):
            assert result[key] <= TOLERANCE, (key, result)
        assert np.isfinite(result["final_loss"]), result


@pytest.mark.parametrize(
    "devices,kind,compile_kwargs,scenarios,options",
    CONFIGS,
    ids=[f"{c[1]}{c[0]}-{json.dumps(c[2]) if c[2] else ''}{json.dumps(c[4]) if c[4] else ''}" for c in CONFIGS],
)
def test_parity_with_one_device(devices, kind, compile_kwargs, scenarios, options):
    code, output = _harness.run_script(
        "parity.py", devices, kind, json.dumps(compile_kwargs), scenarios, json.dumps(options)
    )
    assert code == 0, output[-4000:]
    _check(_harness.results_of(output), scenarios, max(devices, 1))


def test_parity_two_worker_processes():
    # 2 processes x 2 virtual devices: 4 replicas.
    result, output = _harness.run_cluster("parity.py", 2, "multi_worker", "{}", MULTI_WORKER, workers=2)
    assert result.returncode == 0, output[-4000:]
    results = _harness.results_of("\n".join(line.split("] ", 1)[1] for line in output.splitlines() if "] RESULT " in line))
    by_task = {}
    for r in results:
        by_task.setdefault(r["task"], []).append(r)
    assert sorted(by_task) == ["worker 0", "worker 1"]
    for task_results in by_task.values():
        _check(task_results, MULTI_WORKER, 4)


def test_plain_keras_contrast_is_wrong_on_uneven_batches():
    """The parity harness can fail: plain Keras under mirrored is off here."""
    code, output = _harness.run_script("contrast.py", 2)
    assert code == 0, output[-4000:]
    (result,) = _harness.results_of(output)
    assert result["weights"] > 1e-3, result


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


def test_model_created_outside_scope_is_refused():
    code, output = _harness.run_script("outside_scope.py")
    assert code == 0, output[-4000:]
    (result,) = _harness.results_of(output)
    assert "Create (and compile) the model inside" in result["error"]
