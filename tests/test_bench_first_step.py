"""`keras-distrib bench --first-step`: its arguments, its arithmetic and a short run.

Speed itself is never asserted here (it is what the benchmark reports);
the tests check that a run prints its table and that the medians, ratios,
depth curve and profile parts are computed as documented.
"""

import re
import time

import pytest
import tensorflow as tf

from keras_distrib.commands import bench_first_step
from keras_distrib.commands import cli


def test_bad_arguments_are_refused_naming_each(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--first-step", "--repeats", "0", "--models", "mlp,resnet10,vgg",
                  "--frameworks", "kd,jax", "--timeout", "0"])
    error = capsys.readouterr().err
    assert "`--repeats`=0 must be >= 1" in error
    assert "`--timeout`=0.0 must be > 0" in error
    assert "'resnet10': a ResNet has 6b + 3 BatchNormalization layers" in error
    assert "unknown model 'vgg'" in error
    assert "unknown framework(s) ['jax']" in error
    with pytest.raises(SystemExit):
        cli.main(["bench", "--first-step", "--before", "/no/such/checkout"])
    assert "`--before`='/no/such/checkout' holds no keras_distrib package" in capsys.readouterr().err


def _run(cpu, wall=None):
    return {"cpu": cpu, "wall": cpu if wall is None else wall}


def test_ratios_are_medians_of_each_rounds_ratio_and_depth_is_a_least_squares_slope():
    runs = {
        # Round by round: kd / keras = 2.0, 1.0, 1.5 -> median 1.5 (the
        # ratio of the medians would be 4 / 2 = 2.0).
        ("keras", "resnet9"): [_run(2.0), _run(4.0), _run(1.0)],
        ("kd", "resnet9"): [_run(4.0), _run(4.0), _run(1.5)],
        ("keras", "resnet21"): [_run(5.0), "exit code 1: boom", _run(5.0)],
        ("kd", "resnet21"): [_run(7.0), _run(7.0), _run(9.0)],
    }
    table = bench_first_step.summarize(runs, ["keras", "kd"], ["resnet9", "resnet21"])
    assert table["resnet9"]["kd / Keras 3 (cpu)"] == pytest.approx(1.5)
    assert table["resnet9"]["kd"]["cpu"] == pytest.approx(4.0)
    # A failed run leaves its round out of the ratio: 7/5 and 9/5.
    assert table["resnet21"]["kd / Keras 3 (cpu)"] == pytest.approx(1.6)
    assert table["resnet21"]["keras"]["runs"] == 2
    assert table["resnet21"]["keras"]["failed"] == ["exit code 1: boom"]
    # Two points: the slope through them, (7 - 4) / (21 - 9) for kd.
    assert bench_first_step.depth_curve(table, "kd")["seconds_per_layer"] == pytest.approx(0.25)
    assert bench_first_step.depth_curve(table, "keras")["seconds_per_layer"] == pytest.approx(
        (5.0 - 2.0) / 12)
    lines = []
    bench_first_step.print_table(table, ["keras", "kd"], lines.append)
    assert lines[2] == "| resnet9 | 2.00 / 2.00 | 4.00 / 4.00 | 1.50 / 1.50 |"
    assert "resnet21 keras failed: exit code 1: boom" in lines
    # The check's share is of the rest of the same processes' first step.
    assert bench_first_step._check_cell({"check_cpu": 0.05, "cpu": 0.55, "runs": 1}) == "0.050 (10%)"


def test_the_sampler_puts_a_trace_in_the_tracing_part():
    sampler = bench_first_step._Sampler()
    sampler.start()

    @tf.function
    def traced(x):
        for _ in range(300):
            x = tf.math.sin(x) + 1.0
        return x

    traced.get_concrete_function(tf.TensorSpec([4]))
    started = time.process_time()
    while time.process_time() - started < 0.05:  # outside any part
        pass
    sampler.stop()
    parts = sampler.report()
    tracing = parts["tracing (every function traced)"]
    assert tracing > 0.02
    assert parts["sampled Python threads"] >= tracing + 0.04
    assert parts["  step traced per replica (all replicas)"] == 0.0


def test_every_part_names_functions_that_exist():
    # A part names functions by file and name: a function that moves (kd's
    # own, or TensorFlow's and Keras's in a new version) would leave its part
    # empty without a word.
    import importlib.util
    import os

    for part, places in bench_first_step.PARTS:
        for place in places:
            place = place.removeprefix("top:")
            path, _, name = place.partition(":")
            package = path.split("/")[0]
            root = os.path.dirname(importlib.util.find_spec(package).origin)
            where = os.path.join(os.path.dirname(root), path.removesuffix("/*"))
            assert os.path.exists(where), (part, place)
            if name and name != "*":
                with open(where) as source:
                    assert re.search(rf"^\s*def {name}\(", source.read(), re.M), (part, place)


@pytest.mark.cluster
def test_a_short_run_prints_its_table_and_profile(capsys):
    # One framework, one repeat: two processes (the timed run and the profiled one).
    assert cli.main(["bench", "--first-step", "--models", "mlp", "--frameworks", "kd",
                     "--repeats", "1", "--timeout", "300", "--profile"]) == 0
    out = capsys.readouterr().out
    # kd's check, timed inside its process: above nothing, below the first step.
    assert re.search(r"^\| mlp \| [0-9.]+ / [0-9.]+ \| 0\.\d{3} \(\d{1,2}%\) \|$", out, re.M), out
    assert re.search(r"^\| tracing \(every function traced\) \| [0-9.]+ \|$", out, re.M), out
    assert re.search(r"^\| · step traced per replica \(all replicas\) \| [0-9.]+ \|$", out, re.M), out
