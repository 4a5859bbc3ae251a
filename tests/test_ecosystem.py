"""Models and tools from the ecosystem, each against one device (tests/scripts/ecosystem.py).

A KerasHub causal LM made exact with `kd.DistributedModelMixin` first in its
bases, KerasTuner trials under `distribution_strategy=kd.make_strategy("mirrored")`,
and kd's TensorBoard callback (against Keras's): mirrored on 2 virtual CPU
devices, 33 rows in global batches of 16 (one replica gets nothing at the
end), against plain Keras on one device from the same initial weights. The
same models on plain Keras under the same strategy are the contrast: they
fail or differ. Tiny configurations, random weights, nothing downloaded.

KerasHub's BERT classifier (with its reload) and a frozen MobileNetV2 backbone
run once, in tutorials/fine_tune_ecosystem_models.ipynb, whose test
(tests/test_tutorials.py) checks the same bounds and the plain-Keras contrast.
"""

import pytest

from tests import _harness


# The suite's two heaviest processes (KerasHub tasks, keras.applications
# backbones) take turns on one pytest worker rather than share the CPU.
@pytest.mark.xdist_group("keras_hub")
@pytest.mark.cluster
def test_kerashub_applications_and_kerastuner_match_one_device():
    code, output = _harness.run_script(
        "ecosystem.py", "gpt2_causal_lm", "keras_tuner", "tensorboard", timeout=540)
    assert code == 0, output[-4000:]
    results = {r["case"]: r for r in _harness.results_of(output)}
    assert sorted(results) == ["gpt2_causal_lm", "keras_tuner", "tensorboard"]
    # assert_parity passed (every step, the history); float32 round-off only.
    lm = results["gpt2_causal_lm"]
    assert lm["kd"] <= 2e-5 and not lm["float64_notes"], lm
    # Plain Keras 3: KerasHub's bool padding masks cannot cross replicas.
    assert isinstance(lm["keras"], str) and "Error" in lm["keras"], lm
    # KerasTuner: each of the 2 trials against one device with its hyperparameters.
    tuner = results["keras_tuner"]
    assert len(tuner["kd"]) == 2 and max(tuner["kd"]) <= 2e-5, tuner
    assert len(tuner["keras"]) == 2 and min(tuner["keras"]) > 1e-3, tuner  # clipnorm per replica
    # kd's TensorBoard under the strategy writes Keras's tags and steps (train and
    # validation scalars, the model graph) with one device's values.
    board = results["tensorboard"]
    assert board["same_tags_and_steps"] and board["summaries"] >= 10, board
    assert board["keras_graph"] == [True, True] and board["max_difference"] <= 2e-5, board
