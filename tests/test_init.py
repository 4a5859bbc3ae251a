import importlib
import os
import subprocess
import sys

import pytest

import keras_distrib as kd


def test_every_public_name_imports():
    module = importlib.import_module("keras_distrib")
    for name in kd.__all__:
        assert getattr(module, name) is not None, name


def test_all_is_sorted_and_unique():
    assert list(kd.__all__) == sorted(set(kd.__all__))


@pytest.mark.cluster
def test_kd_testing_loads_only_when_used():
    code = ("import sys, keras_distrib as kd; "
            "print('keras_distrib.testing' in sys.modules); "
            "kd.testing.assert_parity; print('keras_distrib.testing' in sys.modules)")
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "",
                                  "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))})
    assert process.stdout.split() == ["False", "True"], process.stdout + process.stderr[-2000:]
