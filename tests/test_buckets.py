"""Gradient buckets (keras_distrib/training/buckets.py): the automatic choice, the split, the setting.

That bucketed steps train as one device does is the exactness matrix's
(tests/test_exactness.py: mirrored4 and two worker processes run bucketed);
their collectives per step and what each waits for in the traced graph are
tests/test_collectives.py's.
"""

import logging

import keras
import numpy as np
import pytest

import keras_distrib as kd
from keras_distrib.training import buckets
from keras_distrib.training import gradients

MIB = 2**20


@pytest.mark.parametrize("gradient_mib, workers, expected", [
    (100, 2, buckets.DEFAULT_BUCKET_BYTES),  # ResNet-50's size across workers: buckets
    (50, 4, buckets.DEFAULT_BUCKET_BYTES),  # exactly two buckets' worth
    (49, 2, None),  # under two buckets: latency dominates, one all-reduce
    (0.1, 2, None),  # the benchmark MLP
    (400, 1, None),  # replicas in one process: no network to hide
])
def test_auto_buckets_only_a_large_gradient_across_workers(gradient_mib, workers, expected):
    plan = buckets.choose("auto", gradient_bytes=int(gradient_mib * MIB), workers=workers)
    assert plan.bucket_bytes == expected


def test_an_explicit_setting_overrides_the_choice():
    assert buckets.choose("one", gradient_bytes=400 * MIB, workers=4).bucket_bytes is None
    assert buckets.choose(1000, gradient_bytes=4000, workers=1).bucket_bytes == 1000


def test_buckets_fill_from_the_last_gradient_and_never_cut_one():
    # The backward pass produces the last variable's gradient first.
    assert buckets.split([10, 10, 10, 10, 10], 20) == [[4, 3], [2, 1], [0]]
    # A gradient larger than a bucket is a bucket of its own.
    assert buckets.split([5, 100, 5], 20) == [[2, 1], [0]]
    assert buckets.split([5, 5], None) == [[0, 1]]
    every = buckets.split(list(range(1, 30)), 17)
    assert sorted(i for bucket in every for i in bucket) == list(range(29))


def test_the_report_names_the_choice_and_why():
    auto = buckets.choose("auto", gradient_bytes=100 * MIB, workers=2)
    assert auto.describe(4) == (
        "kd: 100 MiB of gradients per replica, 2 worker(s): 4 all-reduces of up to 25 MiB, each "
        "started as the backward pass produces its gradients (gradient_buckets=\"auto\": 2 workers "
        "and at least 2 buckets of 25 MiB).")
    small = buckets.choose("auto", gradient_bytes=4 * MIB, workers=2)
    assert small.describe(1) == (
        "kd: 4 MiB of gradients per replica, 2 worker(s): one all-reduce after the backward pass "
        "(gradient_buckets=\"auto\": latency dominates (under 2 buckets of 25 MiB)).")


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "many", None])
def test_a_bad_setting_is_refused_at_compile_naming_it(bad):
    model = kd.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"`gradient_buckets`=.*expected \"auto\".*\"one\".*bytes >= 1"):
        model.compile("sgd", "mse", gradient_buckets=bad)
    assert not model.compiled  # refused before anything was compiled


def test_the_setting_travels_with_the_compile_config():
    model = kd.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse", gradient_buckets=4096)
    assert model.get_compile_config()["gradient_buckets"] == 4096
    model.compile("sgd", "mse")
    assert "gradient_buckets" not in model.get_compile_config()  # the default is not written


def test_fit_reports_nothing_with_one_replica(caplog):
    model = kd.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with caplog.at_level(logging.INFO, logger="keras_distrib"):
        model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
    assert not [r for r in caplog.records if "all-reduce" in r.getMessage()]
    assert gradients.report_bucket_plan(model) is None
