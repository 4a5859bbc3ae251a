"""`keras-distrib bench --network`: refusals, a short run over a 1 ms link, and that nothing outlives a run.

Speed itself is never asserted; the link's added latency is (a TCP round
trip between two workers' namespaces takes at least twice the one-way delay).
"""

import importlib.util
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from keras_distrib.commands import bench
from keras_distrib.commands import bench_network
from keras_distrib.training import buckets
from keras_distrib.commands import cli


def _leftovers(pid):
    """The namespaces, devices and processes a benchmark run by process `pid` left behind."""
    prefix = f"{bench_network.PREFIX}-{pid}-"
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    devices = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30)
    processes = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if prefix in command:
            processes.append(f"{name}: {command[:200]}")
    return {
        "namespaces": [l for l in namespaces.stdout.splitlines() if l.startswith(prefix)],
        # Every device of a run lives in its namespaces; none may reach the host's list.
        "devices": [l for l in devices.stdout.splitlines() if "kdlink" in l or "kdbr" in l],
        "processes": processes,
    }


NOTHING_LEFT = {"namespaces": [], "devices": [], "processes": []}


@pytest.fixture(scope="module")
def network_ready():
    found, link, _ = bench_network.problems("auto", (1,))  # root, iproute2, namespaces, netem or tun
    if found:
        pytest.skip("the network benchmark cannot run here: " + " ".join(found))
    return link


def test_refuses_without_root_or_ip_naming_the_fix(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(bench_network, "_tool", lambda name: None)
    found, link, _ = bench_network.problems("auto", (1,))
    assert link is None and len(found) == 2
    assert "needs root" in found[0] and "sudo" in found[0]
    assert "`ip` is missing" in found[1] and "apt-get install iproute2" in found[1]
    with pytest.raises(bench_network.NetworkBenchError, match=r"(?s)cannot run here.*needs root.*iproute2"):
        bench_network.run(workers=(2,), delays=(1,))


def test_bad_arguments_are_refused_by_the_cli(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--network", "--steps", "0", "--repeats", "0", "--timeout", "-1"])
    error = capsys.readouterr().err
    assert "`--steps`=0 must be >= 2" in error and "`--repeats`=0 must be >= 1" in error
    assert "`--timeout`=-1.0 must be > 0" in error
    with pytest.raises(SystemExit):
        cli.main(["bench", "--network", "--workers", "1"])
    assert "expected numbers >= 2, got '1'" in capsys.readouterr().err


def test_every_model_times_variants_the_bench_builds():
    for model in bench_network.MODELS:
        variants, ratios = bench_network._variants(model)
        assert set(variants.values()) <= set(bench.VARIANTS), model
        assert {name for pair in ratios.values() for name in pair} <= set(variants), model
    # --model mlp_buckets forces the MLP (784x128, 128, 128x10, 10 float32) into
    # 2 buckets: the head's kernel and bias, then the hidden layer's.
    sizes = [4 * 784 * 128, 4 * 128, 4 * 128 * 10, 4 * 10]
    assert buckets.split(sizes, bench.SMALL_BUCKET_BYTES) == [[3, 2], [1, 0]]


def test_every_option_is_on_the_command_line_reference(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--network", "--help"])
    options = set(re.findall(r"(--[a-z][a-z-]+)", capsys.readouterr().out)) - {"--help"}
    tools = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
    sys.path.insert(0, tools)
    try:
        import docs_site  # the site's generated reference/cli.md
    finally:
        sys.path.remove(tools)
    page = docs_site.cli_page().split("## `keras-distrib bench --network`", 1)[1]
    assert {"--workers", "--delays", "--link", "--timeout"} <= options
    assert [option for option in sorted(options) if option not in page] == []


@pytest.mark.cluster
def test_veth_without_netem_is_refused_naming_the_fix(network_ready, monkeypatch):
    why = "the kernel has no netem qdisc (tc: unknown); load it with `modprobe sch_netem`"
    monkeypatch.setattr(bench_network, "_netem_missing", lambda: why)
    found, link, _ = bench_network.problems("veth", (1,))
    assert link is None and found == [f"`--link veth` delays packets with tc netem, but {why}; "
                                      f"or use `--link relay`."]
    found, link, note = bench_network.problems("auto", (0, 1))
    assert (found, link) == ([], "relay") and why in note
    # Without a delay the veth link needs no qdisc.
    assert bench_network.problems("veth", (0,))[:2] == ([], "veth")


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_short_run_over_a_1ms_link_measures_every_variant(network_ready):
    lines = []
    report = bench_network.run(workers=(2,), delays=(0, 1), steps=5, repeats=1, timeout=150,
                               print_fn=lines.append)
    expected = {"kd_fit", "tutorial_loop"} | (
        {"tf_keras_fit"} if importlib.util.find_spec("tf_keras") is not None else set())
    for delay in ("0", "1"):
        speeds = report["steps_per_second"]["2"][delay]
        assert set(speeds) == expected
        for cell in speeds.values():
            assert len(cell["runs"]) == 1 and 0 < cell["min"] <= cell["median"] <= cell["max"]
        assert report["ratios"]["2"][delay]["kd_fit / tutorial_loop"] > 0
    # The delay is real: one way 1 ms, so a round trip takes at least 2 ms.
    trips = report["round_trip_ms"]["2"]
    assert trips["1"]["min"] >= 2.0, trips
    assert trips["0"]["median"] < trips["1"]["median"], trips
    assert any("kd_fit / tf_keras_fit" in line for line in lines)
    assert _leftovers(os.getpid()) == NOTHING_LEFT


def _wait_for_line(process, text, timeout):
    found = queue.Queue()

    def read():
        for line in process.stdout:
            if text in line:
                found.put(line)

    threading.Thread(target=read, daemon=True).start()
    return found.get(timeout=timeout)


@pytest.mark.cluster
@pytest.mark.timeout(120)
@pytest.mark.parametrize("ending", ["sigterm", "timeout", "sigkill"])
def test_a_run_ended_midway_leaves_nothing(network_ready, ending):
    # The SIGTERM run takes the veth link (no delay: no netem needed), so its
    # bridge namespace and veth pairs are torn down under test too.
    link = ["--link", "veth", "--delays", "0"] if ending == "sigterm" else ["--delays", "1"]
    argv = [sys.executable, "-m", "keras_distrib.commands.bench_network", "--workers", "2", *link,
            "--steps", "200", "--repeats", "1", "--timeout", "5" if ending == "timeout" else "100"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    try:
        _wait_for_line(process, "workers started", timeout=60)
        made = _leftovers(process.pid)["namespaces"]
        assert len(made) == (3 if ending == "sigterm" else 2), made  # the workers' (and the bridge's)
        if ending != "timeout":
            time.sleep(3)  # the workers are starting TensorFlow
            os.kill(process.pid, getattr(signal, ending.upper()))
        _, error = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    if ending == "sigkill":
        # Nothing could clean up: the workers die with the benchmark
        # (PR_SET_PDEATHSIG), its namespaces stay until the next run.
        deadline = time.monotonic() + 20
        while _leftovers(process.pid)["processes"] and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _leftovers(process.pid)
        assert left["processes"] == [] and left["namespaces"], left
        bench_network._remove_stale()
    elif ending == "sigterm":
        assert process.returncode == 128 + signal.SIGTERM, error
        assert "stopped by SIGTERM; everything it started was removed" in error
    else:
        assert process.returncode == 2, error
        assert "ran past its `--timeout`" in error
    assert _leftovers(process.pid) == NOTHING_LEFT
