"""kd.step: one traced step function per kind.

The looped step's exactness is tested by tests/test_exactness.py (path
`spe3_mirrored2`) and tests/test_gradients.py (sparse gradients).
"""

import pytest

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
