"""TensorFlow's start-up notices: recognized exactly, hidden by default, one switch to see them."""

import os
import subprocess
import sys

import pytest

from keras_distrib.cluster import launcher
from keras_distrib.cluster import supervisor
from keras_distrib import tf_logs

NOTICE = "I0000 00:00:1795439466.606127   18429 cudart_stub.cc:31] Could not find cuda drivers on your machine"


def test_startup_notices_are_recognized_and_nothing_else():
    notices = [
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
        "I0000 00:00:1795439466.604094   18429 port.cc:153] oneDNN custom operations are on. You may see",
        "I0000 00:00:1795439466.606127   18429 cudart_stub.cc:31] Could not find cuda drivers on your machine",
        "E0000 00:00:1795439485.205829   18767 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error",
        "To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild TensorFlow",
    ]
    kept = [
        "E0000 00:00:1795439485.205829   18767 collective_ops.cc:52] Collective failed",
        "I0000 00:00:1795439485.218725   18767 grpc_server_lib.cc:467] Started server with target: grpc://x",
        "Traceback (most recent call last):",
        "Epoch 1/3",
    ]
    assert all(tf_logs.is_startup_notice(line) for line in notices)
    assert not any(tf_logs.is_startup_notice(line) for line in kept)
    assert tf_logs.hides_notices({}) and tf_logs.hides_notices({"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert not tf_logs.hides_notices({"TF_CPP_MIN_LOG_LEVEL": "0"})
    assert tf_logs.task_environment({}, verbose=True)["TF_CPP_MIN_LOG_LEVEL"] == "0"
    assert tf_logs.task_environment({"TF_CPP_MIN_LOG_LEVEL": "1"})["TF_CPP_MIN_LOG_LEVEL"] == "1"
    assert tf_logs.is_command_line(["/usr/bin/keras-distrib", "demo"], [])
    assert tf_logs.is_command_line(["-m"], ["python", "-u", "-m", "keras_distrib", "test"])
    assert not tf_logs.is_command_line(["-m"], ["python", "-m", "pytest"])


def test_hidden_notices_drops_only_the_notices(capfd, monkeypatch):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    with tf_logs.hidden_notices():
        os.write(2, b"I0000 00:00:1.5 42 cudart_stub.cc:31] Could not find cuda drivers on your machine\n")
        os.write(2, b"a real problem\n")
    assert capfd.readouterr().err == "a real problem\n"
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    with tf_logs.hidden_notices():
        os.write(2, b"I0000 00:00:1.5 42 cudart_stub.cc:31] Could not find cuda drivers on your machine\n")
    assert "cudart_stub" in capfd.readouterr().err


def _relayed(env):
    """What the supervisor relays from a task that prints a notice and a line of its own."""
    lines = []
    code = f"print({NOTICE!r}); print('E0000 00:00:1.5 7 cuda_platform.cc:52] failed call to cuInit: x'); print('epoch 1')"
    spec = supervisor.TaskSpec("worker", 0, [sys.executable, "-c", code], env)
    result = supervisor.run_tasks([spec], timeout=60, sink=lines.append)
    assert result.returncode == 0, lines
    return lines


@pytest.mark.cluster
def test_launched_tasks_hide_notices_unless_asked():
    base = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    assert _relayed(tf_logs.task_environment(base)) == ["[worker 0] epoch 1"]
    shown = _relayed(tf_logs.task_environment(base, verbose=True))
    assert len(shown) == 3 and shown[-1] == "[worker 0] epoch 1"
    assert len(_relayed({**base, "TF_CPP_MIN_LOG_LEVEL": "1"})) == 3


@pytest.mark.parametrize("user_level,verbose,expected", [
    (None, False, "2"), (None, True, "0"), ("3", True, "3"), ("0", False, "0"),
])
def test_launcher_sets_the_level_unless_the_user_did(user_level, verbose, expected):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    if user_level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = user_level
    specs = launcher.task_specs(launcher.cluster_spec(2, ports=[1, 2]), lambda t, i: ["true"], ps=0,
                                 env=env, server_argv=None, verbose=verbose)
    assert {spec.env["TF_CPP_MIN_LOG_LEVEL"] for spec in specs} == {expected}


def test_command_line_level(monkeypatch):
    env = {}
    tf_logs.configure_command_line(env, argv=["/bin/keras-distrib", "demo"], orig_argv=[])
    assert env == {"TF_CPP_MIN_LOG_LEVEL": "2"}
    env = {}
    tf_logs.configure_command_line(env, argv=["/bin/keras-distrib", "demo", "--verbose"], orig_argv=[])
    assert env == {"TF_CPP_MIN_LOG_LEVEL": "0"}
    env = {"TF_CPP_MIN_LOG_LEVEL": "3"}
    tf_logs.configure_command_line(env, argv=["/bin/keras-distrib", "demo", "--verbose"], orig_argv=[])
    assert env == {"TF_CPP_MIN_LOG_LEVEL": "3"}
    env = {}
    tf_logs.configure_command_line(env, argv=["train.py"], orig_argv=["python", "train.py"])
    assert env == {}  # a user's own program: only the notices are hidden, the level is theirs


@pytest.mark.cluster
def test_launched_task_entry_runs_without_runpy_warning():
    # Launched tasks run `python -m keras_distrib.cluster._task_entry`; if importing the
    # package imported that module too, every task would print runpy's
    # "found in sys.modules" RuntimeWarning.
    process = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "keras_distrib.cluster._task_entry", "--help"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert process.returncode == 0 and "found in sys.modules" not in process.stderr, process.stderr[-2000:]
