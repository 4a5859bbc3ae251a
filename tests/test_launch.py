"""The local cluster launcher: real processes, timeouts, cleanup by pid."""

import os
import subprocess
import sys
import time

import pytest

import keras_distrib.launcher as kd_launch
from keras_distrib import supervisor
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
        (dict(workers=2, timeout=float("nan")), r"`timeout`=nan: expected a finite number of seconds > 0, or None"),
        (dict(workers=2, timeout=float("inf")), r"`timeout`=inf: expected a finite number"),
        (dict(workers=2, timeout=-5), r"`timeout`=-5"),
        (dict(workers=2, args="--epochs 3"),
         r"`args`='--epochs 3' is a string, which would be split into characters; pass a list "
         r"of arguments, e.g. `args`=\['--epochs', '3'\]"),
        (dict(workers=2, ports=[40001, 40001]), r"`ports` lists \[40001\] more than once"),
        (dict(workers=2, ports=[0, 99999]), r"`ports` \[0, 99999\]: expected whole numbers in 1\.\.65535"),
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
        [sys.executable, "-m", "keras_distrib", "launch", "--workers", "0", "--timeout", "nan", "x.py"],
        capture_output=True, text=True, timeout=120, env=_harness._env(),
    )
    assert process.returncode == 2
    assert "`workers`=0" in process.stderr
    assert "`timeout`=nan: expected a finite number of seconds > 0" in process.stderr


def test_parameter_server_cluster_runs_the_script_as_coordinator():
    result, output = _harness.run_cluster("ps_coordinator.py", "launched", workers=2, ps=1, timeout=180)
    assert result.returncode == 0, output[-4000:]
    lines = [line.split("] ", 1)[1] for line in output.splitlines() if "] RESULT " in line]
    (value,) = _harness.results_of("\n".join(lines))
    assert value == {"total": 10.0, "devices": ["/job:ps/replica:0"], "workers": 2}
    assert "[worker 1] worker 1 server listening" in output
    assert "[ps 0] ps 0 server listening" in output
    # The servers never exit by themselves: the launcher stopped them.
    assert {r.label for r in result.tasks} == {"chief 0", "worker 0", "worker 1", "ps 0"}


def test_local_cluster_in_process():
    code, output = _harness.run_script("local_ps.py")
    assert code == 0, output[-4000:]
    (value,) = _harness.results_of(output)
    assert value == {"total": 10.0, "devices": ["/job:ps/replica:0"], "workers": 2}


def test_log_dir_tees_each_task(tmp_path):
    result, output = _harness.run_cluster("exit_code.py", workers=2, timeout=60, log_dir=str(tmp_path))
    assert result.returncode == 3
    assert sorted(os.listdir(tmp_path)) == ["worker_0.log", "worker_1.log"]
    assert "worker 1 giving up" in (tmp_path / "worker_1.log").read_text()
    assert (tmp_path / "worker_0.log").read_text().startswith("PID ")


def test_taken_port_is_refused_before_starting(tmp_path):
    import socket

    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    with socket.socket() as busy:
        busy.bind(("localhost", 0))
        busy.listen()
        port = busy.getsockname()[1]
        free = kd_launch.pick_ports(1)[0]
        with pytest.raises(kd_launch.LaunchError, match=rf"`ports` \[{port}\] already in use"):
            kd_launch.launch(str(script), workers=2, ports=[free, port])
        with pytest.raises(kd_launch.LaunchError, match=r"`ports` lists 1 port\(s\) but the cluster has 2"):
            kd_launch.launch(str(script), workers=2, ports=[free])
    assert not marker.exists()


def test_sigterm_to_the_launcher_stops_every_task(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-m", "keras_distrib", "launch", "--workers", "2",
         os.path.join(_harness.SCRIPTS, "hang.py")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_harness._env(),
    )
    pids, lines = [], []
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:
            line = launcher.stdout.readline()
            lines.append(line)
            if "] PID " in line:
                pids.append(int(line.rsplit(" ", 1)[1]))
        assert len(pids) == 2, lines
        launcher.terminate()
        launcher.wait(timeout=30)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + 15
    time.sleep(0.5)
    assert not [pid for pid in pids if _alive(pid)]


def test_gpus_are_split_between_training_tasks():
    assert supervisor.split_gpus(["0", "1", "2", "3"], ["worker 0", "worker 1"]) == {
        "worker 0": "0,1", "worker 1": "2,3"}
    assert supervisor.split_gpus(["0"], ["worker 0", "worker 1"]) == {"worker 0": "", "worker 1": ""}
    assert supervisor.visible_gpus({"CUDA_VISIBLE_DEVICES": "4,5"}) == ["4", "5"]
    assert supervisor.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


@pytest.mark.parametrize("workers", [3])  # 2 workers: test_models, test_loop, test_checkpoint
def test_workers_train_to_identical_weights(workers):
    code, output = _harness.run_script("train_identical.py")
    assert code == 0, output[-3000:]
    (single,) = _harness.results_of(output)
    result, output = _harness.run_cluster("train_identical.py", workers=workers, timeout=240)
    assert result.returncode == 0, output[-4000:]
    lines = [line.split("] ", 1)[1] for line in output.splitlines() if "] RESULT " in line]
    results = _harness.results_of("\n".join(lines))
    assert sorted(r["task"] for r in results) == [f"worker {i}" for i in range(workers)]
    assert len({r["digest"] for r in results}) == 1  # bit-identical on every worker
    import numpy as np

    for got, want in zip(results[0]["weights"], single["weights"]):
        np.testing.assert_allclose(got, want, atol=1e-5)  # and the one-process run
