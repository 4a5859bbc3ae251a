"""Run a strategy configuration in its own process, or a cluster of them.

A process holds one device layout and one collective group size, so every
multi-replica configuration runs in a process of its own: a child forked from
a warm interpreter (tests/_warm.py: TensorFlow imported once, its runtime not
started), or a fresh interpreter where the environment differs in what is
read at import. A cluster's tasks run their script in warm children too
(tests/_warm_task.py), under kd's real launcher. Every process that is
started has a timeout and is killed (with its process group) on exit.
"""

import atexit
import json
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import keras_distrib.cluster.launcher as kd_launch
import keras_distrib.cluster.ports as kd_ports
from keras_distrib.cluster import network

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
    # A process that dies of SIGSEGV, SIGABRT or SIGBUS prints where its
    # threads were (Python's faulthandler): a crash then reads as more than a
    # return code of -11.
    env["PYTHONFAULTHANDLER"] = "1"
    env.pop("TF_CONFIG", None)
    return env


def run_script(name, *args, timeout=300, fresh=False):
    """Runs tests/scripts/<name> in a new process; returns (returncode, output).

    The process is a fork of the warm interpreter when its environment
    allows (see `_Warm`), else a fresh `python -u`; the script cannot tell.
    KD_TESTS_FRESH_PROCESSES=1 gives every script a fresh interpreter, and
    `fresh=True` this one (a script that must not find kd imported).
    """
    return run_python([os.path.join(SCRIPTS, name), *map(str, args)], _env(), timeout=timeout, fresh=fresh)


def run_python(argv, env, cwd=None, timeout=300, fresh=False):
    """`python -u argv...` with `env` in `cwd`, as `run_script` runs a script: (returncode, output).

    `argv[0]` is a script's path (a module's: `runpy`'s `__main__` file, such
    as pytest's `pytest/__main__.py`).
    """
    if not fresh and _WARM.serves(env):
        code, output = _WARM.run(argv, env, timeout, cwd=cwd)
    else:
        code, output = _run_fresh([sys.executable, "-u", *argv], env, timeout, cwd)
    _report_crash(output)
    return code, output


def _report_crash(output):
    """Writes a crash's whole report (Python's faulthandler) where pytest shows it on failure.

    A test's assertion shows only the end of the output; the report's first
    thread, the one that crashed, can be further up.
    """
    start = output.find("Fatal Python error")
    if start >= 0:
        sys.stderr.write(f"--- a process crashed; its report:\n{output[start:start + 20000]}\n")


def _run_fresh(argv, env, timeout, cwd=None):
    process = subprocess.Popen(
        argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process.pid)
        output, _ = process.communicate()
        raise AssertionError(f"{argv[2:]} timed out after {timeout}s:\n{output[-4000:]}")
    finally:
        _kill_group(process.pid)
    return process.returncode, output


class _Warm:
    """This process's warm interpreter (tests/_warm.py), started at first use.

    Importing TensorFlow, Keras and kd is about 5 CPU seconds a process; a
    child forked after the imports starts in a fraction of a second. It
    serves scripts (`run_script`) and the tasks of launched clusters
    (`run_cluster`, through tests/_warm_task.py) at the same time; it
    answers FRESH to an environment that differs in what is read at import,
    and ends with this process.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._process = None
        self._control = None
        self._errors = None
        self._broken = False
        self.path = None

    def serves(self, env):
        # KD_TESTS_UNMARKED: a test without the cluster marker runs (tests/conftest.py
        # then refuses it the process, which only the fresh path asks for).
        return not (self._broken or env.get("KD_TESTS_FRESH_PROCESSES") == "1"
                    or "KD_TESTS_UNMARKED" in env)

    def start(self, env):
        """The socket's path; the first call starts the interpreter with `env`."""
        with self._lock:
            if self._process is None:
                folder = tempfile.mkdtemp(prefix="kd_warm_")
                atexit.register(shutil.rmtree, folder, ignore_errors=True)
                self.path = os.path.join(folder, "socket")
                # Bound here, so clients can connect (and wait) while it imports.
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                listener.bind(self.path)
                listener.listen(64)
                mine, theirs = socket.socketpair()
                self._errors = tempfile.TemporaryFile()
                self._process = subprocess.Popen(
                    [sys.executable, "-u", os.path.join(REPO, "tests", "_warm.py"),
                     str(listener.fileno()), str(theirs.fileno())],
                    env=env, pass_fds=[listener.fileno(), theirs.fileno()], stdin=subprocess.DEVNULL,
                    stdout=self._errors, stderr=self._errors, start_new_session=True,
                )
                listener.close()
                theirs.close()
                self._control = mine
                atexit.register(self.close)
            return self.path

    def close(self):
        if self._process is not None:
            self._control.close()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                kill_groups([self._process])

    def _ended(self, what):
        """The error for a warm interpreter that has ended: its exit status and last output."""
        self._broken = True
        try:
            status = self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            status = "still running"
        self._errors.seek(0)
        return AssertionError(f"the warm interpreter (tests/_warm.py) ended ({what}; exit status "
                              f"{status}):\n{self._errors.read()[-4000:].decode(errors='replace')}")

    def _answer(self, answers, prefixes):
        line = answers.readline()
        if not line.startswith(prefixes):
            raise self._ended(f"it answered {line!r}")
        return line

    def run(self, argv, env, timeout, cwd=None):
        """Like `_run_fresh`, in a child of the warm interpreter (or fresh, when it says so)."""
        path = self.start(env)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
            try:
                connection.connect(path)
            except ConnectionRefusedError:  # bound, no longer listening
                raise self._ended("it refused a connection") from None
            answers = connection.makefile("r")
            read, write = os.pipe()
            try:
                try:
                    request = json.dumps({"argv": argv, "env": env, "cwd": cwd or os.getcwd()})
                    socket.send_fds(connection, [request.encode()], [write])
                finally:
                    os.close(write)
                line = self._answer(answers, ("PID ", "FRESH"))
                if line.startswith("FRESH"):
                    return _run_fresh([sys.executable, "-u", *argv], env, timeout, cwd)
                pid = int(line.split()[1])
                output, ended = _read_until_closed(read, timeout)
            finally:
                os.close(read)
            if not ended:
                _kill_group(pid)
            status = int(self._answer(answers, "STATUS ").split()[1])  # the child was reaped
            if not ended:
                raise AssertionError(f"{argv} timed out after {timeout}s:\n{output[-4000:]}")
            return os.waitstatus_to_exitcode(status), output


def notebook_kernel(folder):
    """A Jupyter kernel manager whose kernel is a child of the warm interpreter.

    Its kernel spec, written in `folder`, starts `python -u _warm_task.py
    ipykernel_launcher.py -f CONNECTION`: the kernel runs as `python -m
    ipykernel_launcher` would, with TensorFlow, Keras and kd already imported
    (about 5 CPU seconds saved per notebook), or fresh where the warm
    interpreter is not served. The notebook's own environment is the harness's.
    """
    import ipykernel_launcher
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    env = {**_env(), "MPLBACKEND": "module://matplotlib_inline.backend_inline"}  # as ipykernel sets it
    argv = _warm_script([sys.executable, "-u", ipykernel_launcher.__file__, "-f", "{connection_file}"], env)
    spec = os.path.join(folder, "kernels", "kd_warm")
    os.makedirs(spec)
    with open(os.path.join(spec, "kernel.json"), "w") as f:
        json.dump({"argv": argv, "env": env, "display_name": "Python 3 (kd's tests)",
                   "language": "python"}, f)
    return KernelManager(kernel_name="kd_warm",
                         kernel_spec_manager=KernelSpecManager(kernel_dirs=[os.path.join(folder, "kernels")]))


def _read_until_closed(descriptor, timeout):
    """(text, True) written to pipe `descriptor` until every writer closed it; (text so far, False) at the timeout."""
    deadline = time.monotonic() + timeout
    chunks = []
    with selectors.DefaultSelector() as selector:
        selector.register(descriptor, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            chunk = os.read(descriptor, 1 << 16) if left > 0 and selector.select(left) else None
            if not chunk:
                return b"".join(chunks).decode(errors="replace"), chunk is not None
            chunks.append(chunk)


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_WARM = _Warm()
WARM_SOCKET = "KD_TESTS_WARM_SOCKET"  # tests/_warm_task.py reads it


def results_of(output):
    """The JSON objects a script printed on lines starting with 'RESULT '."""
    return [json.loads(line[7:]) for line in output.splitlines() if line.startswith("RESULT ")]


def check_rows(output):
    """`keras-distrib test`'s table rows by check, each detail's wrapped lines joined back into one."""
    rows, check = {}, None
    for line in output.splitlines():
        if re.search(r"\s(PASS|FAIL|SKIP)\s", line):
            check = line.split("  ")[0]
            rows[check] = line
        elif check and line.startswith(" ") and line.strip():
            rows[check] += " " + line.strip()
        else:
            check = None
    return rows


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


def run_cluster(name, *args, workers=2, timeout=300, warm=True, env=None, sink=None, **kwargs):
    """Runs tests/scripts/<name> on `workers` local processes (via kd.launch).

    `env`: variables added to the harness's; `sink`: also called with each
    line as it comes (a test that acts while the cluster runs).

    With `warm`, each task is tests/_warm_task.py, which runs the script in a
    child of the warm interpreter; the launcher supervises it as it would the
    script (signals, exit status, kills). `warm=False` where a test looks at
    the task processes themselves. The warm interpreter's children live in
    this host's network namespace, so a warm launch says `private_network=False`;
    a test that passes `private_network` gets fresh processes in the network it asks for.
    """
    env, target = {**_env(), **(env or {})}, os.path.join(SCRIPTS, name)
    if warm and "private_network" not in kwargs and _WARM.serves(env):
        target, args = _warm_task(env), (target, *args)
        kwargs["private_network"] = False
    lines = []

    def take(line):
        lines.append(line)
        if sink is not None:
            sink(line)

    result = kd_launch.launch(
        target, workers=workers, args=args, timeout=timeout, env=env, sink=take, **kwargs,
    )
    output = "\n".join(lines)
    _report_crash(output)
    return result, output


def free_port_block(count):
    """The first of `count` consecutive free localhost ports."""
    for _ in range(100):
        first = kd_ports.pick_ports(1)[0]
        if first + count <= 65535 and all(kd_ports.port_is_free(first + i) for i in range(count)):
            return first
    raise AssertionError(f"no {count} consecutive free ports")


def run_together(commands, timeout=240):
    """Starts every `(argv, extra_env)` at once, as a cluster manager would; waits for all.

    A `python -u SCRIPT ...` runs its script in a child of the warm interpreter
    (through tests/_warm_task.py, which ends as the script ends) where it can.

    Returns [(returncode, output)] in order. Every process (and its group)
    is killed at the timeout or on the way out.
    """
    processes = []
    try:
        for argv, extra in commands:
            env = _env()
            env.update({k: str(v) for k, v in extra.items()})
            argv = _warm_script(argv, env)
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


def _warm_script(argv, env):
    """`argv`, a `python -u SCRIPT ...`, run as tests/_warm_task.py SCRIPT ... where the warm
    interpreter serves `env` (which then names its socket); any other command as it is."""
    if argv[:2] != [sys.executable, "-u"] or not str(argv[2]).endswith(".py") or not _WARM.serves(env):
        return argv
    return [sys.executable, "-u", _warm_task(env), *argv[2:]]


def _warm_task(env):
    """tests/_warm_task.py's path, after naming the warm interpreter's socket in `env` (started
    at first use): the command's script then runs in a warm child."""
    env[WARM_SOCKET] = _WARM.start(_env())
    return os.path.join(REPO, "tests", "_warm_task.py")


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


def hide_routes_out(monkeypatch):
    """Makes kd find neither of its routes out of a private network (slirp4netns, pasta)."""
    monkeypatch.setattr(network, "SLIRP", "kd-no-such-slirp4netns")
    monkeypatch.setattr(network, "PASTA", "kd-no-such-pasta")


class NoNamespaceHere:
    """Stands in for `network.PrivateNetwork` on a host whose kernel refuses network namespaces
    (a container's seccomp profile, say); tests/test_users_machine.py makes the kernel refuse."""

    def __init__(self, outbound=True):
        raise network.NoNamespace("`private_network`: could not create a network namespace (EPERM)",
                                  reason="this machine makes no network namespace (EPERM)")
