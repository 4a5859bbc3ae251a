import importlib

import keras_distrib as kd


def test_every_public_name_imports():
    module = importlib.import_module("keras_distrib")
    for name in kd.__all__:
        assert getattr(module, name) is not None, name


def test_all_is_sorted_and_unique():
    assert list(kd.__all__) == sorted(set(kd.__all__))
