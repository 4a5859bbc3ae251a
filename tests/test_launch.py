"""The local cluster launcher: real processes, timeouts, cleanup by pid."""

import os
import subprocess
import sys
import time

import pytest

import keras_distrib.launcher as kd_launch
from tests import _harness, launch_targets


def _pids(output):
    return [int(line.rsplit(" ", 1)[1]) for line in output.splitlines() if "] PID " in line]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[1].split()[0] != "Z"


def test_first_failure_stops_everyone_with_its_code():
    started = time.monotonic()
    result, output = _harness.run_cluster("exit_code.py", workers=3, timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode == 3, output
    assert result.failed.label == "worker 1"
    assert elapsed < 30, elapsed
    assert "[worker 1] worker 1 giving up" in output
    assert "[launcher] worker 1 exited with code 3" in output
    pids = _pids(output)
    assert len(pids) == 3
    assert not [pid for pid in pids if _alive(pid)]


def test_timeout_stops_a_hung_cluster():
    result, output = _harness.run_cluster("hang.py", workers=2, timeout=3)
    assert result.returncode == 124 and result.timed_out
    assert "timeout after 3s; still running: worker 0, worker 1" in output
    assert not [pid for pid in _pids(output) if _alive(pid)]


def test_function_target_returns_values():
    lines = []
    result = kd_launch.launch(launch_targets.whoami, workers=2, args=("x",), sink=lines.append, timeout=120)
    assert result.returncode == 0, lines
    assert sorted(result.values) == ["worker 0", "worker 1"]
    assert result.values["worker 0"]["chief"] and not result.values["worker 1"]["chief"]
    assert {v["workers"] for v in result.values.values()} == {2}
    assert {v["tag"] for v in result.values.values()} == {"x"}


def test_restarts_the_cluster_after_a_failure():
    result, output = _harness.run_cluster("exit_code.py", workers=2, timeout=120, max_restarts=1)
    assert result.returncode == 3 and result.restarts == 1
    assert output.count("[launcher] worker 1 exited with code 3") == 2
    assert "restarting the cluster (1/1)" in output


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(workers=0), r"`workers`=0: expected a whole number >= 1"),
        (dict(workers=2, ps=-1), r"`ps`=-1"),
        (dict(workers=2, ps=1, chief=True), r"`chief` with `ps`"),
        (dict(workers=2, timeout=0), r"`timeout`=0"),
    ],
)
def test_bad_requests_start_nothing(kwargs, match, tmp_path):
    script = tmp_path / "never.py"
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    with pytest.raises(kd_launch.LaunchError, match=match):
        kd_launch.launch(str(script), **kwargs)
    assert not marker.exists()


def test_missing_script_is_explained():
    with pytest.raises(kd_launch.LaunchError, match="is not a file"):
        kd_launch.launch("/no/such/script.py", workers=2)


def test_cli_reports_bad_arguments():
    process = subprocess.run(
        [sys.executable, "-m", "keras_distrib", "launch", "--workers", "0", "x.py"],
        capture_output=True, text=True, timeout=120,
    )
    assert process.returncode == 2
    assert "`workers`=0" in process.stderr
