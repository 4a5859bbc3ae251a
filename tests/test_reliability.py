"""Round 3 of the hostile user: process faults (orphans, hangs), data safety, security.

Every process test has a timeout and kills what it started by pid.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

import keras_distrib.launcher as kd_launch
from tests import _harness

FAMILY = os.path.join(_harness.SCRIPTS, "family.py")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _families(text):
    return [[int(p) for p in line.split("FAMILY ", 1)[1].split()[:3]]
            for line in text.splitlines() if "FAMILY " in line]


def _kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _survivors(pids, wait=5.0):
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        left = [pid for pid in pids if _alive(pid)]
        if not left:
            return []
        time.sleep(0.1)
    return left


def _start_launcher(*args):
    return subprocess.Popen(
        [sys.executable, "-m", "keras_distrib", "launch", "--workers", "2", "--grace-period", "2",
         FAMILY, *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_harness._env(),
        start_new_session=True,
    )


def _read_families(launcher, count, timeout=60):
    lines, families = [], []
    deadline = time.monotonic() + timeout
    while len(families) < count and time.monotonic() < deadline:
        line = launcher.stdout.readline().decode("utf-8", "replace")
        if not line:
            break
        lines.append(line)
        families += _families(line)
    return families, lines


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGHUP, signal.SIGTERM])
def test_no_task_child_or_daemon_outlives_the_launcher(how):
    """SIGKILL, SIGHUP or SIGTERM of the launcher: tasks, their children and daemons all end."""
    launcher = _start_launcher("ignore" if how == signal.SIGTERM else "hang")
    pids = []
    try:
        families, lines = _read_families(launcher, 2)
        assert len(families) == 2, lines
        pids = [pid for family in families for pid in family]
        os.kill(launcher.pid, how)
        launcher.wait(timeout=30)
        assert _survivors(pids) == [], (how, families)
    finally:
        launcher.kill()
        launcher.wait(timeout=10)
        _kill_all(pids)
    if how == signal.SIGHUP:
        assert launcher.returncode == 128 + signal.SIGHUP


def test_daemons_left_by_a_finished_task_are_ended():
    lines = []
    pids = []
    try:
        result = kd_launch.launch(FAMILY, workers=2, args=["exit"], env=_harness._env(),
                                  sink=lines.append, timeout=60)
        pids = [pid for family in _families("\n".join(lines)) for pid in family]
        assert result.returncode == 0, lines
        assert len(pids) == 6, lines
        assert _survivors(pids) == []
    finally:
        _kill_all(pids)


def test_bytes_that_are_not_utf8_and_a_closed_output_do_not_hang_the_launcher():
    """A task prints invalid UTF-8 and 2000 long lines; the launcher's sink breaks (`| head`)."""
    seen = []

    def closed_after_three(line):
        seen.append(line)
        if len(seen) > 3:
            raise BrokenPipeError(32, "Broken pipe")

    pids = []
    try:
        started = time.monotonic()
        result = kd_launch.launch(FAMILY, workers=2, args=["exit", "2000"], env=_harness._env(),
                                  sink=closed_after_three, timeout=90)
        assert result.returncode == 0 and not result.timed_out
        assert time.monotonic() - started < 60
    finally:
        _kill_all(pids)
    lines = []
    result = kd_launch.launch(FAMILY, workers=1, args=["exit"], env=_harness._env(),
                              sink=lines.append, timeout=60)
    assert result.returncode == 0
    assert any(r"bytes \xff\xfe not utf-8" in line for line in lines), lines


def test_launcher_piped_into_head_ends():
    launcher = subprocess.Popen(
        f"{sys.executable} -m keras_distrib launch --workers 2 {FAMILY} exit 3000 | head -3",
        shell=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=_harness._env(),
        start_new_session=True,
    )
    try:
        out, _ = launcher.communicate(timeout=90)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    assert len(out.splitlines()) == 3


# Security: what other local users see, what the working directory can inject.


def test_function_arguments_are_not_on_the_command_line(tmp_path, monkeypatch):
    from tests import launch_targets

    secret = "hunter2-" + "s" * 20
    # A module of the working directory must not run inside the tasks (python -m put it first).
    (tmp_path / "argparse.py").write_text(
        f"open({str(tmp_path / 'INJECTED')!r}, 'w').write('ran')\nraise SystemExit(9)\n")
    monkeypatch.chdir(tmp_path)
    lines = []
    result = kd_launch.launch(launch_targets.command_lines, workers=1, args=(secret,),
                              env=_harness._env(), sink=lines.append, timeout=120)
    assert result.returncode == 0, lines
    value = result.values["worker 0"]
    assert value["got"] == secret
    assert "hunter2" not in value["own"] and "hunter2" not in value["parent"], value
    assert "-P" in value["own"].split()
    assert not (tmp_path / "INJECTED").exists()


# Restarts.


def test_quick_failures_back_off_before_restarting():
    started = time.monotonic()
    result, output = _harness.run_cluster("exit_code.py", workers=2, timeout=120, max_restarts=2)
    assert result.returncode == 3 and result.restarts == 2
    assert "restarting the cluster (1/2) in 1s" in output
    assert "restarting the cluster (2/2) in 2s" in output
    assert time.monotonic() - started >= 3.0


@pytest.mark.parametrize("value", [10**20, 1e20, 1001])
def test_absurd_max_restarts_is_refused(value):
    with pytest.raises(kd_launch.LaunchError, match=r"`max_restarts`=.*expected a whole number in 0\.\.1000"):
        kd_launch.launch(FAMILY, workers=1, max_restarts=value)
