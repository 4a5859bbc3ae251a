"""`keras-distrib bench --network --rates`: the bandwidth sweep's arithmetic, its refusal, and a short run.

Speed itself is never asserted; the link's rate is (a bulk transfer between
two workers' namespaces is no faster than the rate set).
"""


import pytest

from keras_distrib.commands import bench_bandwidth
from keras_distrib.commands import bench_network
from keras_distrib.commands import cli


def test_the_models_hold_the_gradient_bytes_asked_for():
    for megabytes in (4, 40, 400):
        assert abs(bench_bandwidth.gradient_bytes(megabytes) / 1e6 - megabytes) / megabytes < 0.01


def test_a_sweep_the_memory_cannot_hold_is_refused_naming_the_fix():
    # 400 MB of gradient: a worker held 7.0 GB (docs/benchmarks/2026-11-29-bandwidth.md).
    per_worker = bench_bandwidth.memory_needed(400, 1)
    assert 6.5e9 < per_worker < 8e9
    problem = bench_bandwidth.memory_problem([4, 400], [2, 4], available=20e9)
    assert problem.startswith("4 workers at `--gradient-mb` 400 need about 29.")
    assert "but 20.0 GB is available: pass fewer `--workers` or a smaller `--gradient-mb`" in problem
    assert bench_bandwidth.memory_problem([4, 400], [2], available=20e9) is None


def test_the_report_puts_compute_comm_and_the_hidden_share_on_one_page():
    # compute 100 ms, one all-reduce 80 ms: serial 180, limit 100; kd 120 ms
    # hides (180 - 120) / 80 = 0.75 of the smaller one; a loop at 180 ms hides nothing.
    runs = {"compute_alone": [10.0], "all_reduce_alone": [12.5], "kd_fit": [1000 / 120],
            "kd_fit_one": [1000 / 180], "keras3_loop": [1000 / 180, 1000 / 200, 1000 / 170]}
    report = bench_bandwidth.summarize({"40": {"1": runs}, "trace": {"40": {}}}, {"1": 0.98})
    point = report["overlap"]["40 MB @ 1 Gbit/s"]
    assert point["compute_ms"] == pytest.approx(100) and point["all_reduce_ms"] == pytest.approx(80)
    assert (point["overlap_limit_ms"], point["serial_ms"]) == (pytest.approx(100), pytest.approx(180))
    assert point["kd_fit_hidden"] == pytest.approx(0.75)
    assert point["kd_fit_one_hidden"] == pytest.approx(0.0, abs=1e-12)
    assert point["keras3_loop_ms"] == pytest.approx(180)  # the median run
    assert report["ratios"]["40 MB @ 1 Gbit/s"]["kd_fit / keras3_loop"] == pytest.approx(1.5)
    assert point["measured_gbit"] == 0.98
    lines = []
    bench_bandwidth.print_table({"bandwidth": {"2": report}}, lines.append)
    assert "0.75" in lines[2] and "1.50" in lines[2]


def test_the_trace_finds_each_step_and_where_its_all_reduces_start():
    # Two backward passes (0-3 ms, 10-13 ms) and a third; all-reduces at 1 and
    # 3.5 ms, 11 and 13.5 ms: 2 ms before and 0.5 ms after each pass's end.
    backward = [(0.0, 1.0), (1.2, 3.0), (10.0, 11.0), (11.2, 13.0), (20.0, 21.0)]
    reduces = [(1.0, 4.0), (3.5, 5.0), (11.0, 14.0), (13.5, 15.0), (21.5, 22.0)]
    assert bench_bandwidth._per_step(backward, reduces) == {
        "backward_ms": [3.0, 3.0], "starts_ms": [[-2.0, 0.5], [-2.0, 0.5]]}


def test_a_sweep_over_several_delays_is_refused_naming_the_fix(capsys):
    assert cli.main(["bench", "--network", "--rates", "1", "--delays", "0,1"]) == 2
    assert "`rates`=[1.0] sweeps one delay; got `delays`=[0.0, 1.0]. Pass one delay" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "--network", "--rates", "1", "--workers", "2,4", "--batch", "66"])
    assert "`--batch`=66 must be a positive multiple of every worker count (2, 4)" in capsys.readouterr().err


@pytest.mark.cluster
@pytest.mark.long
@pytest.mark.timeout(300)
def test_a_short_sweep_shapes_the_link_and_measures_every_variant():
    found, _, _ = bench_network.problems("auto", (0,))  # root, iproute2, namespaces: each with its fix
    if found:
        pytest.skip("the network benchmark cannot run here: " + " ".join(found))
    lines = []
    report = bench_network.run(workers=(2,), delays=(0,), rates=(0.2,), gradient_mb=(0.5,), steps=3,
                               repeats=1, timeout=280, print_fn=lines.append)
    part = report["bandwidth"]["2"]
    point = part["overlap"]["0.5 MB @ 0.2 Gbit/s"]
    # The rate is real: a bulk transfer is no faster than 0.2 Gbit/s.
    assert 0 < point["measured_gbit"] <= 0.2 * 1.1, point
    for name in ("compute_ms", "all_reduce_ms", "kd_fit_ms", "kd_fit_one_ms", "keras3_loop_ms"):
        assert point[name] > 0, point
    # 0.5 MB over 2 workers: kd chooses one all-reduce, after the backward pass;
    # TensorFlow's multi-worker iterator adds its agreement (the next step's input).
    trace = part["trace"]["0.5"]["kd_fit"]
    assert trace["collectives"]["step"] == 2, trace
    assert trace["starts_ms"] and all(len(starts) == 2 and 0 <= starts[0] < starts[1]
                                      for starts in trace["starts_ms"]), trace
    assert any("hidden" in line for line in lines)
    # Each timed epoch is shown as it ends (a run stopped by its timeout still shows them).
    assert any(line.startswith("kdbench: 0.5 MB @ 0.2 Gbit/s, repeat 1: kd_fit ") and line.endswith(" ms/step")
               for line in lines), lines
