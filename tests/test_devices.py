import pytest

import keras_distrib as kd
from tests import _harness


def test_bad_arguments_are_explained():
    with pytest.raises(ValueError, match=r"`n`=0 is not a valid device count"):
        kd.virtual_devices(0)
    with pytest.raises(ValueError, match=r"`device_type`='TPU' is not supported"):
        kd.virtual_devices(2, "TPU")


@pytest.mark.cluster
def test_split_then_late_call_errors():
    code, output = _harness.run_script("late_devices.py")
    assert code == 0, output[-4000:]
    (result,) = _harness.results_of(output)
    assert result["names"] == ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]
    assert result["same_again"] == result["names"]
    assert "was called after TensorFlow initialized its devices" in result["late_error"]
    assert "fresh process" in result["late_error"]
