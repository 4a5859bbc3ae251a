"""Preemption: every worker saves at one agreed step, exits 42, and the restart resumes exactly."""

import signal
import sys
import time

import pytest

from keras_distrib.cluster import preemption
from tests import _harness


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The uninterrupted run on one device (the script picks it with "auto")."""
    folder = tmp_path_factory.mktemp("one_device")
    out = str(folder / "ref.npz")
    code, output = _harness.run_script("preempt.py", "fit", folder / "backup", out, -1)
    assert code == 0 and "DONE 18" in output, output[-3000:]
    return out


def _saves(output):
    return sorted(line.split("] ", 1)[0] + "] " + line.split("Preemption (", 1)[1].split("): ", 1)[1]
                  for line in output.splitlines()
                  if "): backed up epoch" in line and not line.startswith("[launcher]"))


@pytest.mark.cluster
def test_multi_worker_trainloop_saves_at_one_agreed_step_and_resumes_exactly(one_device, tmp_path):
    # Worker 1 gets SIGTERM after chunk 4 (of 2 steps); both back up the
    # same later chunk, exit 42, and the launcher restarts the cluster.
    out = str(tmp_path / "out.npz")
    result, output = _harness.run_cluster("preempt.py", "loop", tmp_path / "backup", out, 4,
                                          workers=2, max_restarts=1, timeout=240)
    assert result.returncode == 0 and result.restarts == 1, output[-4000:]
    assert "[launcher] worker 0 exited with code 42" in output or \
        "[launcher] worker 1 exited with code 42" in output, output[-4000:]
    # The signalled worker leads: it publishes a chunk after the one it is
    # in (which chunk depends on when its claim lands), and both save it.
    assert "[worker 1] WARNING:keras_distrib:Preemption (SIGTERM): every worker saves after step" in output
    saves = _saves(output)
    assert len(saves) == 2 and saves[0].startswith("[worker 0] ") and saves[1].startswith("[worker 1] ")
    assert saves[0].split("] ", 1)[1] == saves[1].split("] ", 1)[1], saves
    chunk = int(saves[0].rsplit("(chunk ", 1)[1].rstrip(")."))
    assert chunk > 4 and f"every worker saves after step {chunk}." in output, saves
    assert output.count("DONE 18") == 2
    assert _harness.saved_weights_diff(one_device, out) <= 1e-6


@pytest.mark.cluster
def test_parameter_server_coordinator_preempted_resumes_exactly(one_device, tmp_path):
    # One worker: a parameter server's asynchronous training is then
    # deterministic, and equal to one device's.
    out = str(tmp_path / "out.npz")
    result, output = _harness.run_cluster("preempt.py", "fit", tmp_path / "backup", out, 8,
                                          workers=1, ps=1, max_restarts=1, timeout=240)
    assert result.returncode == 0 and result.restarts == 1, output[-4000:]
    assert "[launcher] chief 0 exited with code 42" in output
    # Signalled in a callback after chunk 8; kd's hook runs after the callbacks, so it saves chunk 8.
    assert _saves(output) == ["[chief 0] backed up epoch 1, step 2 (chunk 8)."]
    assert "DONE 18" in output
    assert _harness.saved_weights_diff(one_device, out) <= 1e-6


# The handler alone, in this process (one process decides alone).


@pytest.mark.cluster
def test_signal_saves_at_the_next_check_then_exits():
    before = signal.getsignal(signal.SIGTERM)  # (not always SIG_DFL in a shared test process)
    handler = preemption.PreemptionHandler()
    with handler:
        assert handler.check(1) is None
        # raise_signal: the handler runs before it returns (os.kill may
        # reach another of the process's threads, and the handler run later).
        signal.raise_signal(signal.SIGTERM)  # handled: the test process lives on
        assert handler.preempted and handler.reason == "SIGTERM"
        assert handler.check(2) == preemption.EXIT
        with pytest.raises(SystemExit) as stop:
            handler.exit()
    assert stop.value.code == preemption.RESTART_EXIT_CODE == 42
    assert signal.getsignal(signal.SIGTERM) is before  # restored


def test_watcher_acts_like_the_signal():
    notice = []
    with preemption.PreemptionHandler(watcher=lambda: bool(notice), poll_interval=0.02) as handler:
        assert handler.check(1) is None
        notice.append(True)
        deadline = time.monotonic() + 10
        while not handler.preempted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert handler.reason == "the termination watcher"
        assert handler.check(2) == preemption.EXIT


def test_grace_period_saves_now_and_again_before_it_ends():
    with preemption.PreemptionHandler(grace_period=1.5) as handler:
        signal.raise_signal(signal.SIGTERM)
        signalled = time.monotonic()
        decisions, step = [], 0
        while time.monotonic() - signalled < 5 and preemption.EXIT not in [d for _, d, _ in decisions]:
            step += 1
            decision = handler.check(step)
            if decision:
                decisions.append((step, decision, time.monotonic() - signalled))
            time.sleep(0.01)
    assert [d for _, d, _ in decisions] == [preemption.SAVE, preemption.EXIT]
    assert decisions[0][0] == 1  # at once
    assert 0.2 < decisions[1][2] < 1.5  # before the grace period ends, with a margin


def test_no_signal_check_calls_no_tensorflow_and_no_key_value_store():
    # The per-chunk check reads flags only (before: an all-reduce per batch).
    # Counted by what it calls, not by a clock: a profiler records every
    # function entered in this thread while 1000 checks run, with the handler
    # set up as a multi-worker one.
    entered = set()

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            module = frame.f_globals.get("__name__", "") if event == "call" else getattr(arg, "__module__", "")
            entered.add(str(module))

    with preemption.PreemptionHandler() as handler:
        handler._multi = True  # as on a worker of a cluster; no thread started for it here
        sys.setprofile(profile)
        try:
            decisions = {handler.check(step) for step in range(1000)}
        finally:
            sys.setprofile(None)
    assert decisions == {None}
    touched = sorted(m for m in entered if m.startswith(("tensorflow", "keras.", "keras_distrib._keras_compat")))
    assert not touched, touched
    assert "keras_distrib.cluster.preemption" in entered  # the profiler saw the checks


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(grace_period=-1), r"`grace_period`=-1: expected a finite number of seconds >= 0"),
        (dict(grace_period=float("inf")), r"`grace_period`=inf"),
        (dict(watcher="yes"), r"`watcher`='yes': expected a callable"),
    ],
)
def test_bad_settings_are_refused_when_the_callback_is_made(kwargs, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        preemption.PreemptionHandler(**kwargs)
    from keras_distrib.callbacks import BackupAndRestore

    renamed = {"termination_watcher" if k == "watcher" else k: v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        BackupAndRestore(str(tmp_path / "b"), **renamed)
