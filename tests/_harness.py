"""Run a strategy configuration in its own process, or a cluster of them.

A process holds one device layout and one collective group size, so every
multi-replica configuration runs in a fresh interpreter. Every process that
is started has a timeout and is killed (with its process group) on exit.
"""

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

import keras_distrib.cluster.launcher as kd_launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "tests", "scripts")


# One-device reference runs are cached here, shared by every parity process:
# tests/conftest.py makes one folder for the whole run (every xdist worker's
# processes share it); a lone import makes its own.
REFERENCE_DIR = os.environ.get("KD_REFERENCE_DIR")
if not REFERENCE_DIR:
    REFERENCE_DIR = tempfile.mkdtemp(prefix="kd_reference_")
    atexit.register(shutil.rmtree, REFERENCE_DIR, ignore_errors=True)


def _env():
    env = dict(os.environ)
    env["KD_REFERENCE_DIR"] = REFERENCE_DIR
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("TF_CONFIG", None)
    return env


def run_script(name, *args, timeout=300):
    """Runs tests/scripts/<name> in a new process; returns (returncode, output)."""
    argv = [sys.executable, "-u", os.path.join(SCRIPTS, name), *map(str, args)]
    process = subprocess.Popen(
        argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"{name} {args} timed out after {timeout}s:\n{output[-4000:]}")
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return process.returncode, output


def results_of(output):
    """The JSON objects a script printed on lines starting with 'RESULT '."""
    return [json.loads(line[7:]) for line in output.splitlines() if line.startswith("RESULT ")]


def task_results(output):
    """The JSON objects launched tasks printed on 'RESULT ' lines (`[worker 0] RESULT {...}`)."""
    return results_of("\n".join(line.split("] ", 1)[1] for line in output.splitlines()
                                 if "] RESULT " in line))


def results_by_task(output):
    """`task_results(output)` by the `task` each names (a list per task)."""
    by_task = {}
    for item in task_results(output):
        by_task.setdefault(item["task"], []).append(item)
    return by_task


def run_cluster(name, *args, workers=2, timeout=300, **kwargs):
    """Runs tests/scripts/<name> on `workers` local processes (via kd.launch)."""
    lines = []
    result = kd_launch.launch(
        os.path.join(SCRIPTS, name), workers=workers, args=args, timeout=timeout,
        env=_env(), sink=lines.append, **kwargs,
    )
    return result, "\n".join(lines)


def free_port_block(count):
    """The first of `count` consecutive free localhost ports."""
    for _ in range(100):
        first = kd_launch.pick_ports(1)[0]
        if first + count <= 65535 and all(kd_launch.port_is_free(first + i) for i in range(count)):
            return first
    raise AssertionError(f"no {count} consecutive free ports")


def run_together(commands, timeout=240):
    """Starts every `(argv, extra_env)` at once, as a cluster manager would; waits for all.

    Returns [(returncode, output)] in order. Every process (and its group)
    is killed at the timeout or on the way out.
    """
    processes = []
    try:
        for argv, extra in commands:
            env = _env()
            env.update({k: str(v) for k, v in extra.items()})
            processes.append(subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True,
            ))
        results = []
        for process in processes:
            try:
                output, _ = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{process.args} timed out after {timeout}s") from None
            results.append((process.returncode, output))
        return results
    finally:
        kill_groups(processes)


def kill_groups(processes, timeout=30):
    """SIGKILL each process's group (started with start_new_session=True) and reap it."""
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=timeout)


def alive(pid):
    """Whether `pid` runs; a zombie, or a process that ends while we look, is gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # It ended between the two looks (ENOENT, ESRCH, or an empty read).
        return False


def survivors(pids, within=5.0):
    """The pids of `pids` still running after up to `within` seconds.

    A task killed together with its guard is re-parented and reaped by init,
    not by the launcher: it is gone soon after the launcher returns, not at
    once (later still on a loaded machine), so a test waits for it.
    """
    deadline = time.monotonic() + within
    while True:
        left = [pid for pid in pids if alive(pid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def saved_weights_diff(a, b):
    """The largest |a - b| between two weight files saved with np.savez(path, *weights) (arr_0, arr_1, ...)."""
    def weights(path):
        data = np.load(path)
        return [data[k] for k in sorted(data.files, key=lambda k: int(k[4:]))]

    return max(float(np.abs(x - y).max()) for x, y in zip(weights(a), weights(b)))
