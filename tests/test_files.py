"""Owner locks, scratch directories and staging entries outlive no process."""

import os
import signal
import subprocess
import sys
import tempfile

import pytest

from keras_distrib import files

# Runs keras_distrib/files.py alone (standard library only): a process that
# starts in milliseconds, without TensorFlow.
_STANDALONE = """
import importlib.util, os, signal, sys, time
spec = importlib.util.spec_from_file_location("kd_files", sys.argv[1])
files = importlib.util.module_from_spec(spec)
spec.loader.exec_module(files)
print(files.make_scratch("worker1"), flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
"""


def _standalone(tmp_path, action):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    process = subprocess.Popen([sys.executable, "-c", _STANDALONE, files.__file__, action],
                               stdout=subprocess.PIPE, text=True, env=env)
    path = process.stdout.readline().strip()
    return process, path


@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


@pytest.mark.cluster
def test_scratch_of_a_killed_process_is_removed_by_the_next_one(temp_root):
    killed, killed_path = _standalone(temp_root, "kill")
    killed.wait(timeout=30)
    assert killed.returncode == -signal.SIGKILL and os.path.isdir(killed_path)
    live, live_path = _standalone(temp_root, "sleep")
    try:
        mine = files.make_scratch("worker2")
        assert not os.path.exists(killed_path)  # a dead process's scratch: removed
        assert os.path.isdir(live_path)  # a live one's: kept
        files.remove_scratch(mine)
        assert sorted(os.listdir(temp_root)) == [os.path.basename(live_path)]
    finally:
        live.kill()
        live.wait(timeout=30)


@pytest.mark.cluster
def test_scratch_is_removed_at_exit(temp_root):
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('kd_files', sys.argv[1])\n"
        "files = importlib.util.module_from_spec(spec); spec.loader.exec_module(files)\n"
        "open(files.make_scratch('w') + '/f', 'w').close()\n"
        "raise SystemExit(3)\n"
    )
    process = subprocess.run([sys.executable, "-c", code, files.__file__], timeout=30,
                             env=dict(os.environ, TMPDIR=str(temp_root)))
    assert process.returncode == 3 and os.listdir(temp_root) == []


def test_lock_is_shared_in_a_process_and_released_for_all(tmp_path):
    # A process is one run: a second manager of the same directory (a fit
    # interrupted in a notebook, then run again) shares the hold, and the end
    # of training releases it, removing the lock file.
    first = files.DirectoryLock(tmp_path / "d").acquire()
    second = files.DirectoryLock(str(tmp_path / "d")).acquire()
    assert os.listdir(tmp_path / "d") == [files.LOCK_NAME] and first.held and second.held
    second.release()
    assert os.listdir(tmp_path / "d") == [] and not first.held
    first.acquire()
    assert first.held and os.listdir(tmp_path / "d") == [files.LOCK_NAME]
    first.release()


@pytest.mark.cluster
def test_process_alive_tells_dead_reused_and_live_pids():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait(timeout=30)
    assert not files.process_alive(process.pid)
    me = os.getpid()
    assert files.process_alive(me, files.process_start_ticks(me))
    assert not files.process_alive(me, files.process_start_ticks(me) + 1)  # a reused pid
    assert not files.process_alive("not a pid")


def test_atomic_write_gives_keras_permissions(tmp_path):
    previous = os.umask(0o002)
    try:
        files.atomic_write_text(str(tmp_path / "latest"), "ckpt-1")
    finally:
        os.umask(previous)
    assert (tmp_path / "latest").read_text() == "ckpt-1"
    assert os.stat(tmp_path / "latest").st_mode & 0o777 == 0o664
    assert os.listdir(tmp_path) == ["latest"]
