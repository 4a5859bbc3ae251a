"""The suite's process harness: a warm child is what a fresh interpreter is.

tests/_harness.py runs each script in a child forked from a warm interpreter
(TensorFlow imported once). These tests run a script that reports what it
sees both ways, and compare the warm child with a fresh `python -u`. A
launched task (tests/_warm_task.py in the script's place) is compared with a
fresh task the same way, and must end, and be ended, as one.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from tests import _harness


def _facts(output):
    (facts,) = _harness.results_of(output)
    return facts


def _run(*args):
    code, output = _harness.run_script("interpreter_facts.py", *args, timeout=120)
    return code, output, _facts(output)


@pytest.mark.cluster
def test_a_warm_child_sees_what_a_fresh_interpreter_sees(monkeypatch, tmp_path):
    monkeypatch.delenv("KD_TESTS_FRESH_PROCESSES", raising=False)  # these tests are about the warm path
    monkeypatch.setenv("KD_PROBE", "set by this test")  # not read at import: the warm path serves it
    # Not the warm interpreter's own (Python chose it there, while importing).
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    results = {}
    for fresh in (False, True):
        if fresh:
            monkeypatch.setenv("KD_TESTS_FRESH_PROCESSES", "1")
        for mode, args, expected_code, text in (
            ("exit", [3], 3, None),
            ("exit", [-1], 255, None),  # not a signal: Python keeps the low byte
            ("exit_text", [], 1, "the script's own exit message"),
            ("raise", [], 1, "RuntimeError: the script's own error"),
            ("interrupt", [], -2, "KeyboardInterrupt"),
        ):
            code, output, facts = _run(mode, *args)
            assert code == expected_code, output[-3000:]
            assert "to stderr" in output, output[-3000:]
            assert text is None or text in output, output[-3000:]
            # The interpreter's end: threads joined, then atexit, then the output flushed.
            assert "thread ended" in output and "atexit ran after the thread" in output, output[-3000:]
            results[fresh, mode] = facts
    for mode in ("exit", "exit_text", "raise", "interrupt"):
        warm, fresh = results[False, mode], results[True, mode]
        assert warm["tempdir"] == str(tmp_path), warm
        assert warm.pop("parent") != os.getpid(), warm  # forked by the warm interpreter
        assert fresh.pop("parent") == os.getpid(), fresh
        assert warm == fresh, (warm, fresh)
        assert warm["devices"] == 2 and warm["own_session"] and warm["name"] == "__main__", warm
        assert warm["probe"] == "set by this test" and warm["path0"] == _harness.SCRIPTS, warm


@pytest.mark.cluster
def test_os_exit_and_an_import_time_variable(monkeypatch, tmp_path):
    monkeypatch.delenv("KD_TESTS_FRESH_PROCESSES", raising=False)
    code, output, facts = _run("os_exit", 5)
    assert code == 5 and facts["parent"] != os.getpid(), output[-3000:]
    # KERAS_HOME is read while Keras imports: a fresh interpreter, not the warm one.
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    code, output, facts = _run("exit", 0)
    assert code == 0 and facts["parent"] == os.getpid(), output[-3000:]


@pytest.mark.cluster
def test_a_script_past_its_timeout_is_killed_with_its_group(monkeypatch):
    monkeypatch.delenv("KD_TESTS_FRESH_PROCESSES", raising=False)
    with pytest.raises(AssertionError, match=r"timed out after 3s") as caught:
        _harness.run_script("hang.py", timeout=3)
    pid = int(str(caught.value).split("PID ")[1].split()[0])
    assert not _harness.survivors([pid]), pid
    # The warm interpreter serves the next script.
    code, output, facts = _run("exit", 0)
    assert code == 0 and facts["parent"] != os.getpid(), output[-3000:]


@pytest.mark.cluster
def test_a_client_gone_with_its_answer_unread_leaves_the_warm_interpreter_serving(monkeypatch):
    # A launcher kills its tasks (tests/_warm_task.py) when one fails, maybe
    # before a task has read the warm interpreter's "PID" answer. Its socket
    # then closes with data unread, the server's next read of it raises
    # ECONNRESET, and that once ended the warm interpreter: every later
    # script of the pytest worker failed (r28: 12 tests, "Connection refused").
    monkeypatch.delenv("KD_TESTS_FRESH_PROCESSES", raising=False)
    env = _harness._env()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
        connection.settimeout(120)
        connection.connect(_harness._WARM.start(env))
        read, write = os.pipe()
        request = {"argv": [os.path.join(_harness.SCRIPTS, "hang.py")], "env": env, "cwd": os.getcwd()}
        socket.send_fds(connection, [json.dumps(request).encode()], [write])
        os.close(write)
        line = connection.recv(64, socket.MSG_PEEK).decode()  # answered, left unread
    os.close(read)
    assert line.startswith("PID "), line
    assert not _harness.survivors([int(line.split()[1])], within=30), "the script outlived its client"
    code, output, facts = _run("exit", 0)
    assert code == 0 and facts["parent"] != os.getpid(), output[-3000:]


def test_an_unmarked_test_cannot_start_a_script():
    # tests/conftest.py refuses a process to a test without the marker, the warm path too.
    with pytest.raises(AssertionError, match="is not marked `@pytest.mark.cluster`"):
        _harness.run_script("interpreter_facts.py", "exit", 0)


@pytest.mark.cluster
def test_a_warm_task_is_what_a_fresh_task_is(monkeypatch):
    monkeypatch.delenv("KD_TESTS_FRESH_PROCESSES", raising=False)
    facts = {}
    for warm in (True, False):
        result, output = _harness.run_cluster("interpreter_facts.py", "exit", 3, workers=1,
                                              warm=warm, timeout=120)
        assert result.returncode == 3 and "[launcher] worker 0 exited with code 3" in output, output
        assert "[worker 0] to stderr" in output and "[worker 0] atexit ran after the thread" in output
        (facts[warm],) = _harness.task_results(output)
    warm, fresh = facts[True], facts[False]
    assert warm.pop("parent") != fresh.pop("parent")  # forked by the warm interpreter, or the guard's child
    # Each leads a process group of its own; the warm child also a session (the guard's task does not).
    assert warm.pop("own_session") and not fresh.pop("own_session")
    # Each launch gives each task a temporary directory of its own (removed when it ends).
    for facts in (warm, fresh):
        assert re.search(r"/kd-scratch-[^/]*-tasks-[^/]+/worker_0$", facts.pop("tempdir")), facts
    assert warm == fresh, (warm, fresh)


def _start_warm_task(script):
    env = {**_harness._env(), _harness.WARM_SOCKET: _harness._WARM.start(_harness._env())}
    client = subprocess.Popen(
        [sys.executable, "-u", os.path.join(_harness.REPO, "tests", "_warm_task.py"),
         os.path.join(_harness.SCRIPTS, script)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    line = client.stdout.readline()
    assert line.startswith("PID "), line
    return client, int(line.split()[1])


@pytest.mark.cluster
def test_a_warm_task_passes_signals_on_and_takes_its_script_along(monkeypatch):
    monkeypatch.delenv("KD_TESTS_FRESH_PROCESSES", raising=False)
    started = []
    try:
        # The launcher's SIGTERM reaches the script, which exits 42 (it saved).
        client, script = _start_warm_task("exits_on_sigterm.py")
        started.append(client)
        assert script != client.pid
        client.send_signal(signal.SIGTERM)
        assert client.wait(timeout=60) == 42
        assert not _harness.survivors([script])
        # A script killed by a signal: the task ends by the same signal.
        client, script = _start_warm_task("hang.py")
        started.append(client)
        os.kill(script, signal.SIGKILL)
        assert client.wait(timeout=60) == -signal.SIGKILL
        # The task killed (the launcher's last resort): its script goes with it.
        client, script = _start_warm_task("hang.py")
        started.append(client)
        client.kill()
        assert client.wait(timeout=60) == -signal.SIGKILL
        assert not _harness.survivors([script]), "the script outlived its killed task"
    finally:
        _harness.kill_groups(started)
