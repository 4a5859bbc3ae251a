"""The local cluster launcher: real processes, timeouts, cleanup by pid."""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

import keras_distrib.cluster.launcher as kd_launch
import keras_distrib.cluster.node as kd_node
import keras_distrib.cluster.ports as kd_ports
from keras_distrib.cluster import sources as cluster_sources
from keras_distrib.cluster import failures
from keras_distrib.cluster import supervisor
from keras_distrib.cluster import task_process
from tests import _harness, launch_targets


def _pids(output):
    return [int(line.rsplit(" ", 1)[1]) for line in output.splitlines() if "] PID " in line]


@pytest.mark.cluster
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
    assert not _harness.survivors(pids)


class _Ended:
    """A task whose process ends with `code` after `polls` polls (None before)."""

    def __init__(self, label, code, polls=0, words=()):
        self.label, self._code, self._polls, self._words = label, code, polls, list(words)
        self.task_type = label.split()[0]
        self.process = self

    def poll(self):
        self._polls -= 1
        return self._code if self._polls < 0 else None

    def last_words(self, timeout):
        return self._words


# What a survivor's collective says when its peer (task 3) has gone (TensorFlow 2.21).
_PEER_3_LOST = ["tensorflow.python.framework.errors_impl.UnavailableError: Collective ops is "
                "aborted by: Socket closed. Additional GRPC error information from remote target "
                "/job:worker/replica:0/task:3"]
_SERVICE_LOST = ["tensorflow.python.framework.errors_impl.UnavailableError: Graph execution error:",
                 "Additional GRPC error information from remote target /job:worker/replica:0/task:0 "
                 "while calling /tensorflow.CoordinationService/Heartbeat:"]


@pytest.mark.parametrize("ends,named", [
    # r18: worker 1 was SIGKILLed, worker 0's collective then failed (exit 1), and the
    # launcher, seeing both at once, named worker 0. A killed task's end, relayed, can
    # even reach it after its peer's.
    ([("worker 0", 1, 0), ("worker 1", -9, 0)], "worker 1"),
    ([("worker 0", 1, 0), ("worker 1", -9, 3)], "worker 1"),
    # A task that saved for a preemption: the others are saving the same step.
    ([("worker 0", -9, 0), ("worker 1", 42, 0)], "worker 1"),
    # A task that failed on its own, and its peers within moments: the first seen.
    ([("worker 0", 1, 2), ("worker 1", 1, 2), ("worker 2", 1, 0)], "worker 2"),
    # A task that crashed (SIGSEGV) ended its peers, as a killed one does.
    ([("worker 0", 1, 0), ("worker 1", -11, 0)], "worker 1"),
    # A peer that TensorFlow aborts (SIGABRT) is not a task killed from outside.
    ([("worker 0", -6, 1), ("worker 1", 1, 0)], "worker 1"),
    # Seen together, ended alike: task order.
    ([("worker 0", 1, 0), ("worker 1", 3, 0), ("worker 2", None, 0)], "worker 0"),
    # r33 (loaded machine): worker 3 crashed (exit 1, no words), worker 0's collective
    # then failed naming task 3 as lost; seen in one poll, task order named worker 0.
    ([("worker 0", 1, 0, _PEER_3_LOST), ("worker 3", 1, 0)], "worker 3"),
    ([("worker 0", 1, 0, _PEER_3_LOST), ("worker 3", 1, 2)], "worker 3"),
    # ... and worker 2 lost worker 0 next (the coordination service's host), as measured.
    ([("worker 0", 1, 0, _PEER_3_LOST), ("worker 1", 1, 0, _PEER_3_LOST),
      ("worker 2", 1, 0, _SERVICE_LOST), ("worker 3", 1, 1)], "worker 3"),
])
def test_the_task_named_is_the_one_whose_end_ended_the_others(ends, named):
    tasks = [_Ended(*end) for end in ends]
    seen = [task for task, (_, code, polls, *_) in zip(tasks, ends) if code and not polls]
    assert failures.first_cause(tasks, seen).label == named


def test_a_follower_stopped_as_asked_is_not_the_cause():
    evaluator, worker = _Ended("evaluator 0", -15), _Ended("worker 0", 1)
    assert failures.first_cause([evaluator, worker], [worker], [evaluator]).label == "worker 0"
    assert failures.first_cause([evaluator, worker], [worker]).label == "evaluator 0"


@pytest.mark.cluster
def test_timeout_stops_a_hung_cluster():
    result, output = _harness.run_cluster("hang.py", workers=2, timeout=3)
    assert result.returncode == 124 and result.timed_out
    assert "timeout after 3s; still running: worker 0, worker 1" in output
    assert not _harness.survivors(_pids(output))


@pytest.mark.cluster
def test_timeout_names_the_tasks_that_were_running_even_if_they_exit_cleanly():
    # The tasks exit 42 on the launcher's SIGTERM (they saved): they still ran at the timeout.
    result, output = _harness.run_cluster("exits_on_sigterm.py", workers=2, timeout=4)
    assert result.returncode == 124 and result.timed_out
    assert "timeout after 4s; still running: worker 0, worker 1" in output, output
    assert not _harness.survivors(_pids(output))  # reaped by whoever reaps them: soon, not at once


@pytest.mark.cluster
def test_a_backup_directory_in_use_ends_the_launch_with_the_configuration_exit_code(tmp_path):
    from keras_distrib import files

    backup = tmp_path / "backup"
    lock = files.DirectoryLock(backup, "backup")
    lock.acquire()  # another live run (this process) holds it
    try:
        result, output = _harness.run_cluster("backup_in_use.py", backup, workers=1, timeout=120)
    finally:
        lock.release()
    # 2: a rerun would meet the same error, so the recipe's loop does not rerun it (1 would).
    assert result.returncode == failures.CONFIG_EXIT_CODE == 2, output
    assert "is in use by another run" in output and "TRAINED" not in output
    assert "[launcher] worker 0 stopped on a configuration error that a rerun would meet again" in output


def _stop_while_starting(pid, timeout=60):
    """SIGSTOPs `pid` at a moment it catches SIGUSR1 and has started no process; returns then.

    Checked while the process is stopped, so nothing moves between the check
    and the signal that follows.
    """
    import signal as signals
    from keras_distrib.cluster import _guard

    usr1 = 1 << (signals.SIGUSR1 - 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        os.kill(pid, signals.SIGSTOP)
        while _proc_field(pid, "State").split()[0] not in ("T", "t"):
            time.sleep(0.0005)
        caught = int(_proc_field(pid, "SigCgt"), 16) & usr1
        assert not _guard.descendants(pid), "the launcher started its tasks before it was seen starting"
        if caught:
            return
        os.kill(pid, signals.SIGCONT)
        time.sleep(0.001)
    raise AssertionError(f"the launcher caught no SIGUSR1 within {timeout}s")


def _proc_field(pid, name):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(name + ":"):
                return line.split(":", 1)[1].strip()
    raise AssertionError(f"/proc/{pid}/status has no {name}")


def _descendants_with_tasks(pid, tasks):
    from keras_distrib.cluster import _guard

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = _guard.descendants(pid)
        # The launcher's guards and, under each, its task.
        if len(found) >= 2 * tasks:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no {tasks} tasks under the launcher after 60s")


@pytest.mark.cluster
@pytest.mark.parametrize("when", ["launcher starting", "tasks starting"])
def test_a_warning_signal_while_starting_asks_for_a_restart(when):
    # Slurm's --signal=USR1@<s> reaches every process of the step: the agent
    # while it imports TensorFlow, or its tasks while they do. Nothing trained
    # yet, so the answer is a restart (42, the recipe requeues), not 138.
    import signal as signals

    launcher = subprocess.Popen(
        [sys.executable, "-m", "keras_distrib", "launch", "--workers", "2",
         os.path.join(_harness.SCRIPTS, "hang.py")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_harness._env(),
        start_new_session=True,
    )
    try:
        if when == "launcher starting":
            # The launcher starts in a fraction of a second: it is held still
            # once it catches the signal and before it starts a task, and the
            # signal waits for it there.
            _stop_while_starting(launcher.pid)
            launcher.send_signal(signals.SIGUSR1)
            launcher.send_signal(signals.SIGCONT)
            pids = []
        else:
            pids = _descendants_with_tasks(launcher.pid, 2)
            for pid in [*pids, launcher.pid]:  # the tasks first: they must survive it
                os.kill(pid, signals.SIGUSR1)
        output, _ = launcher.communicate(timeout=90)
    finally:
        _harness.kill_groups([launcher])
    assert launcher.returncode == 42, output
    assert "got SIGUSR1" in output, output
    if when == "launcher starting":
        assert "got SIGUSR1 before any task started; none runs" in output, output
    assert not [pid for pid in pids if _harness.alive(pid)]


def test_a_warning_signal_while_the_launch_is_made_ready_asks_for_a_restart(monkeypatch):
    # Between the launcher's handler and its first task (ports, task specs, a
    # private network) the signal is kept, not raised out of `launch` (138):
    # no task starts and the answer is the restart of a signal while starting.
    import signal as signals

    make_specs = kd_launch.task_specs

    def specs_then_signal(*args, **kwargs):
        specs = make_specs(*args, **kwargs)
        signals.raise_signal(signals.SIGUSR1)  # its handler runs before this returns
        return specs

    monkeypatch.setattr(kd_launch, "task_specs", specs_then_signal)
    lines = []
    result = kd_launch.launch(os.path.join(_harness.SCRIPTS, "hang.py"), workers=2,
                              sink=lines.append, timeout=60, private_network=False)
    assert result.returncode == 42 and result.signalled, lines
    assert "[launcher] got SIGUSR1 before any task started; none runs" in lines, lines
    assert not [line for line in lines if line.startswith("[worker")], lines


@pytest.mark.cluster
def test_function_target_returns_values():
    lines = []
    result = kd_launch.launch(launch_targets.whoami, workers=2, args=("x",), sink=lines.append, timeout=120)
    assert result.returncode == 0, lines
    assert sorted(result.values) == ["worker 0", "worker 1"]
    assert result.values["worker 0"]["chief"] and not result.values["worker 1"]["chief"]
    assert {v["workers"] for v in result.values.values()} == {2}
    assert {v["tag"] for v in result.values.values()} == {"x"}


@pytest.mark.cluster
@pytest.mark.parametrize("how,signame,trace", [
    ("segv", "SIGSEGV", "Fatal Python error: Segmentation fault"),
    ("abort", "SIGABRT", "Fatal Python error: Aborted"),
])
def test_a_crash_is_named_a_crash_with_its_last_lines_and_its_faulthandler_trace(how, signame, trace):
    """A task that ends on SIGSEGV or SIGABRT is reported as a crash, not "killed (out of memory...)"."""
    lines = []
    result = kd_launch.launch(launch_targets.crash, workers=2, args=(how,), env=_harness._env(),
                              sink=lines.append, timeout=120)
    output = "\n".join(lines)
    assert result.failed.label == "worker 1" and result.failed.returncode < 0, output
    report = output[output.index("[launcher] worker 1 crashed"):]
    assert re.match(rf"\[launcher\] worker 1 crashed: {signame} \(signal \d+, ", report), report
    assert "[launcher]   about to crash" in report  # its last lines
    stacks = report[report.index("faulthandler trace"):]
    assert f"[launcher]   {trace}" in stacks, report
    assert re.search(r"File \".*launch_targets\.py\", line \d+ in crash", stacks), report
    assert "out of memory" not in output and "killed by signal" not in output, output


@pytest.mark.cluster
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
        (dict(workers=2, min_workers=3), r"`min_workers`=3 is more than the 2 workers launched"),
        (dict(workers=2, min_workers=0), r"`min_workers`=0: expected a whole number >= 1, or None"),
        (dict(workers=2, ps=1, min_workers=1), r"`min_workers`=1 with `ps`=1: a parameter-server"),
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


@pytest.mark.cluster
def test_cli_reports_bad_arguments():
    process = subprocess.run(
        [sys.executable, "-m", "keras_distrib", "launch", "--workers", "0", "--timeout", "nan", "x.py"],
        capture_output=True, text=True, timeout=120, env=_harness._env(),
    )
    assert process.returncode == 2
    assert "`workers`=0" in process.stderr
    assert "`timeout`=nan: expected a finite number of seconds > 0" in process.stderr


@pytest.mark.cluster
def test_parameter_server_cluster_runs_the_script_as_coordinator():
    result, output = _harness.run_cluster("ps_coordinator.py", "launched", workers=2, ps=1, timeout=180)
    assert result.returncode == 0, output[-4000:]
    (value,) = _harness.task_results(output)
    assert value == {"total": 10.0, "devices": ["/job:ps/replica:0"], "workers": 2,
                     "kind": "parameter_server"}
    assert "[worker 1] worker 1 server listening" in output
    assert "[ps 0] ps 0 server listening" in output
    # The servers never exit by themselves: the launcher stopped them.
    assert {r.label for r in result.tasks} == {"chief 0", "worker 0", "worker 1", "ps 0"}


@pytest.mark.cluster
def test_local_cluster_in_process():
    code, output = _harness.run_script("local_ps.py")
    assert code == 0, output[-4000:]
    (value,) = _harness.results_of(output)
    assert value == {"total": 10.0, "devices": ["/job:ps/replica:0"], "workers": 2,
                     "kind": "parameter_server"}


@pytest.mark.cluster
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
        free = kd_ports.pick_ports(1)[0]
        with pytest.raises(kd_launch.LaunchError, match=rf"`ports` \[{port}\] already in use"):
            kd_launch.launch(str(script), workers=2, ports=[free, port])
        with pytest.raises(kd_launch.LaunchError, match=r"`ports` lists 1 port\(s\) but the cluster has 2"):
            kd_launch.launch(str(script), workers=2, ports=[free])
    assert not marker.exists()


def test_port_locks_are_private_removed_when_released_and_a_non_file_is_refused(tmp_path, monkeypatch):
    import stat
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the shared temporary directory
    port = kd_ports.pick_ports(1)[0]
    folder = tmp_path / f"kd-locks-{os.getuid()}"
    with kd_ports.reserve_ports([port]):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert (folder / f"kd-port-{port}.lock").read_text().strip() == str(os.getpid())
        with pytest.raises(kd_launch.LaunchError, match=rf"port {port} is taken by another kd launch"):
            with kd_ports.reserve_ports([port]):
                pass
    assert os.listdir(folder) == []  # removed when released
    assert not [n for n in os.listdir(tmp_path) if n.startswith("kd-port-")]
    os.mkfifo(folder / f"kd-port-{port}.lock")
    with pytest.raises(kd_launch.LaunchError, match=rf"kd-port-{port}\.lock' is not a regular file "
                                                    r"\(a FIFO.*Remove it"):
        with kd_ports.reserve_ports([port]):
            pass
    os.remove(folder / f"kd-port-{port}.lock")
    folder.chmod(0o777)
    with pytest.raises(kd_launch.LaunchError, match=r"kd-locks-\d+' is writable by others \(mode 777\)"):
        with kd_ports.reserve_ports([port]):
            pass


@pytest.mark.cluster
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
    assert not _harness.survivors(pids)


def test_gpus_are_split_between_training_tasks():
    assert supervisor.split_gpus(["0", "1", "2", "3"], ["worker 0", "worker 1"]) == {
        "worker 0": "0,1", "worker 1": "2,3"}
    assert supervisor.split_gpus(["0"], ["worker 0", "worker 1"]) == {"worker 0": "", "worker 1": ""}
    assert supervisor.visible_gpus({"CUDA_VISIBLE_DEVICES": "4,5"}) == ["4", "5"]
    assert supervisor.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


@pytest.mark.cluster
@pytest.mark.parametrize("workers", [3])  # 2 workers: test_models, test_loop, test_checkpoint
def test_workers_train_to_identical_weights(workers):
    code, output = _harness.run_script("train_identical.py")
    assert code == 0, output[-3000:]
    (single,) = _harness.results_of(output)
    result, output = _harness.run_cluster("train_identical.py", workers=workers, timeout=240)
    assert result.returncode == 0, output[-4000:]
    results = _harness.task_results(output)
    assert sorted(r["task"] for r in results) == [f"worker {i}" for i in range(workers)]
    assert len({r["digest"] for r in results}) == 1  # bit-identical on every worker
    import numpy as np

    for got, want in zip(results[0]["weights"], single["weights"]):
        np.testing.assert_allclose(got, want, atol=1e-5)  # and the one-process run


# The per-node agent (`keras-distrib launch` under srun or a Kubernetes Job).

_SLURM_TWO_NODES = dict(SLURM_PROCID="1", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_ID="0",
                        SLURM_STEP_NODELIST="n[1-2]", SLURM_STEP_TASKS_PER_NODE="1(x2)",
                        KD_PORT="7000", PATH="/nonexistent")


@pytest.fixture
def fake_names(monkeypatch):
    """The simulated nodes n1, n2 stand for two machines (their names do not resolve here)."""
    monkeypatch.setattr(cluster_sources, "resolve", lambda host, what, timeout=None: host)


def test_agent_places_its_tasks_after_the_other_nodes(fake_names):
    source, spec, local = kd_node.node_tasks(2, environ=_SLURM_TWO_NODES)
    assert source == "slurm"
    assert spec == {"worker": ["n1:7000", "n1:7001", "n2:7000", "n2:7001"]}
    assert local == ["worker 2", "worker 3"]
    _, spec, local = kd_node.node_tasks(2, ps=1, environ={**_SLURM_TWO_NODES, "SLURM_PROCID": "0"})
    assert spec == {"chief": ["n1:7000"], "ps": ["n1:7001"], "worker": ["n2:7000", "n2:7001"]}
    assert local == ["chief 0", "ps 0"]


@pytest.mark.parametrize(
    "per_node,environ,match",
    [
        ("gpu", {**_SLURM_TWO_NODES, "CUDA_VISIBLE_DEVICES": ""},
         r"`per_node`='gpu': this node shows no GPU \(CUDA_VISIBLE_DEVICES is empty\)"),
        ("gpu", {**_SLURM_TWO_NODES, "CUDA_VISIBLE_DEVICES": "-1"},
         r"shows no GPU \(CUDA_VISIBLE_DEVICES='-1' hides every GPU\).*Use `--per-node N`"),
        (0, _SLURM_TWO_NODES, r"`per_node`=0: expected a whole number >= 1, or 'gpu'"),
        (1, {"PATH": "/nonexistent"}, r"shows no cluster \(no `srun` task, no KD_NUM_PODS, no TF_CONFIG\)"),
        (1, {"TPU_NAME": "t"}, r"shows a TPU pod, which TensorFlow drives from one process"),
        (1, {**_SLURM_TWO_NODES, "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"},
         r"2 agents run on this node.*srun --ntasks-per-node=1"),
        (2, {"TF_CONFIG": '{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}}'},
         r"TF_CONFIG names one task"),
        (1, {**_SLURM_TWO_NODES, "SLURM_PROCID": "5"}, r"`SLURM_PROCID`=5 is not below"),
    ],
)
def test_agent_refusals_say_why(per_node, environ, match, fake_names):
    with pytest.raises(kd_launch.LaunchError, match=match):
        kd_node.node_tasks(per_node, environ=environ)


def test_agents_of_two_nodes_on_one_machine_get_different_ports(monkeypatch):
    # Two Slurm nodes on one host (slurmd -N): every task needs its own port.
    monkeypatch.setattr(cluster_sources, "resolve", lambda host, what, timeout=None: "127.0.0.1")
    _, spec, local = kd_node.node_tasks(2, environ=_SLURM_TWO_NODES)
    assert spec == {"worker": ["n1:7000", "n1:7001", "n2:7002", "n2:7003"]}
    assert local == ["worker 2", "worker 3"]


def test_a_taken_port_of_this_node_is_named(fake_names):
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        _, spec, local = kd_node.node_tasks(1, environ={**_SLURM_TWO_NODES, "KD_PORT": str(port)})
        assert spec == {"worker": [f"n1:{port}", f"n2:{port}"]} and local == ["worker 1"]
        with pytest.raises(kd_launch.LaunchError,
                           match=rf"Port {port} \(worker 1: Address already in use\) cannot be bound.*KD_PORT"):
            kd_node._check_local_ports(spec, local)
    kd_node._check_local_ports(spec, local)  # free again


@pytest.mark.cluster
def test_a_worker_whose_port_is_taken_names_it():
    # `srun python train.py` (no agent to check first): TensorFlow says only
    # "Could not start gRPC server"; kd names the address.
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        config = {"cluster": {"worker": [f"localhost:{port}", f"localhost:{_harness.free_port_block(1)}"]},
                  "task": {"type": "worker", "index": 0}}
        process = subprocess.run(
            [sys.executable, "-c", "import keras_distrib as kd; kd.make_strategy('multi_worker')"],
            capture_output=True, text=True, timeout=120,
            env={**_harness._env(), "TF_CONFIG": json.dumps(config)})
    assert process.returncode != 0
    assert (f"ClusterConfigError: This task (worker 0) could not listen on localhost:{port}: "
            "the port is taken") in process.stderr, process.stderr[-3000:]


def test_lines_from_many_threads_are_never_merged(capfd):
    sink = supervisor.whole_lines(print)
    line = "x" * 5000  # longer than a pipe's atomic write (4096)

    def write(tag):
        for _ in range(50):
            sink(f"[{tag}] {line}")

    threads = [threading.Thread(target=write, args=(tag,)) for tag in "abcd"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out = capfd.readouterr().out.splitlines()
    assert len(out) == 200
    assert all(re.fullmatch(r"\[[abcd]\] x{5000}", got) for got in out)


@pytest.mark.cluster
def test_tf_config_command_prints_the_cluster_and_its_source():
    env = {**_harness._env(), "JOB_COMPLETION_INDEX": "1", "KD_NUM_PODS": "2", "KD_SERVICE": "svc",
           "HOSTNAME": "train-1"}
    process = subprocess.run([sys.executable, "-m", "keras_distrib", "tf-config", "--compact"],
                             capture_output=True, text=True, timeout=120, env=env)
    assert process.returncode == 0, process.stderr[-2000:]
    report = json.loads(process.stdout.strip().splitlines()[-1])
    assert report == {"source": "kubernetes", "task": "worker 1", "TF_CONFIG": {
        "cluster": {"worker": ["train-0.svc:2222", "train-1.svc:2222"]},
        "task": {"type": "worker", "index": 1}}}
    env["JOB_COMPLETION_INDEX"] = "2"
    process = subprocess.run([sys.executable, "-m", "keras_distrib", "tf-config"],
                             capture_output=True, text=True, timeout=120, env=env)
    assert process.returncode == 2
    assert "`JOB_COMPLETION_INDEX`=2 is not below `KD_NUM_PODS`=2" in process.stderr


@pytest.mark.cluster
def test_agents_end_their_servers_when_the_parameter_server_coordinator_is_killed():
    # Three Kubernetes pods, each running the per-node agent, KD_PS=1: pod 0
    # the coordinator, pod 1 a ps task, pod 2 a worker. The coordinator's
    # process is killed; its agent says so and what to do, and the other
    # pods' servers, which no launcher on their node could otherwise stop,
    # notice the coordinator is gone and end.
    import re
    import signal
    import threading

    port = _harness.free_port_block(3)
    agent = [sys.executable, "-m", "keras_distrib", "launch", "--per-node", "1", "--timeout", "150",
             os.path.join(_harness.SCRIPTS, "stall.py")]
    processes, lines, pumps = [], [[], [], []], []

    def pump(index):
        for line in processes[index].stdout:
            lines[index].append(line.rstrip())

    try:
        for index in range(3):
            env = _harness._env()
            env.update(JOB_COMPLETION_INDEX=str(index), KD_NUM_PODS="3", KD_PS="1",
                       HOSTNAME=f"train-{index}",
                       KD_HOSTS=",".join(f"localhost:{port + i}" for i in range(3)))
            processes.append(subprocess.Popen(agent, env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True,
                                              start_new_session=True))
            pumps.append(threading.Thread(target=pump, args=(index,), daemon=True))
            pumps[-1].start()
        deadline = time.monotonic() + 120
        ready, up = None, False
        while not (ready and up) and time.monotonic() < deadline and processes[0].poll() is None:
            ready = next((m for m in map(re.compile(r"\[chief 0\] READY \S+ (\d+)").search, lines[0]) if m),
                         None)
            up = all(any("server: the coordinator (chief 0 at" in line and "is up" in line for line in found)
                     for found in lines[1:])
            time.sleep(0.1)
        assert ready and up, "\n".join(lines[0][-20:] + lines[1][-20:] + lines[2][-20:])
        os.kill(int(ready.group(1)), signal.SIGKILL)
        killed = time.monotonic()
        codes = [process.wait(timeout=60) for process in processes]
        seconds = time.monotonic() - killed
    finally:
        _harness.kill_groups(processes)
    for thread in pumps:  # every line read (the pipes closed with their processes)
        thread.join(timeout=30)
    outputs = ["\n".join(found) for found in lines]
    assert codes[0] == 137, outputs[0][-3000:]
    assert "[launcher] chief 0 was killed by signal 9" in outputs[0] and "--max-restarts" in outputs[0]
    for index, label in ((1, "ps 0"), (2, "worker 0")):
        assert codes[index] == 0, outputs[index][-3000:]
        assert f"[{label}] {label} server: the coordinator (chief 0 at localhost:{port}) has not " \
               "accepted connections for 10s" in outputs[index], outputs[index][-3000:]
    assert seconds < 40, seconds


@pytest.mark.cluster
def test_a_task_that_stays_stopped_is_ended_and_named(monkeypatch):
    """A task stopped by SIGSTOP after its peers finished held the launcher forever (4c0b8d4,
    found by tools/chaos_soak.py): now it is ended after `STOPPED_TASK_SECONDS` and named."""
    monkeypatch.setattr(task_process, "STOPPED_TASK_SECONDS", 1.0)
    lines = []
    started = time.monotonic()
    result = kd_launch.launch(launch_targets.stop_self, workers=2, args=("worker 1",),
                              env=_harness._env(), sink=lines.append, timeout=60)
    output = "\n".join(lines)
    assert result.returncode == 137 and result.failed.label == "worker 1", output
    assert time.monotonic() - started < 30, output
    assert re.search(r"\[launcher\] worker 1 failed because it stayed stopped \(SIGSTOP\) for 1s "
                     r"\(pid \d+\), holding up the cluster; the launcher ended it", output), output
    assert "out of memory" not in output, output


@pytest.mark.cluster
def test_a_killed_tasks_temporary_files_are_removed(tmp_path):
    """Each task's TMPDIR is a directory of the launch's own, removed once the tasks end: a task
    killed outright leaves nothing (the chaos soak found TensorFlow's AutoGraph files left)."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    lines = []
    result = kd_launch.launch(launch_targets.leave_temporary_file, workers=1,
                              env=dict(_harness._env(), TMPDIR=str(temporary)), sink=lines.append,
                              timeout=60)
    assert result.returncode == 137, lines
    (wrote,) = [line.rsplit(" ", 1)[1] for line in lines if "] WROTE " in line]
    assert wrote.startswith(str(temporary)) and not os.path.exists(wrote), lines
    assert os.listdir(temporary) == [], os.listdir(temporary)


@pytest.mark.cluster
@pytest.mark.parametrize("how,line", [("kill", "restarting the cluster (1/1)"),
                                      ("exit", "restarting the cluster (1/1) in 1s")])
def test_a_task_killed_from_outside_restarts_at_once_and_its_own_failure_backs_off(how, line, tmp_path):
    """Backing off is for crash loops: a kill from outside (a chaos soak's faults every 20-60 s
    waited up to 60 s each on 4c0b8d4) restarts at once."""
    lines = []
    result = kd_launch.launch(launch_targets.fail_once, workers=1, args=(how, str(tmp_path / "m")),
                              max_restarts=1, env=_harness._env(), sink=lines.append, timeout=60)
    assert result.returncode == 0 and result.restarts == 1, lines
    assert f"[launcher] {line}" in lines, lines


@pytest.mark.cluster
def test_a_run_that_min_workers_ends_says_so():
    """Worker 1 fails for good and one worker would be left of `min_workers`=2: the launcher says
    why the run ends (on 4c0b8d4 it ended on the failure alone, min_workers unnamed)."""
    lines = []
    result = kd_launch.launch(launch_targets.fail_on, workers=2, args=("worker 1", 3), min_workers=2,
                              env=_harness._env(), sink=lines.append, timeout=120)
    output = "\n".join(lines)
    assert result.returncode == 3 and result.lost == [], output
    assert ("[launcher] worker 1 failed 1 time(s) in a row, and going on without it would leave 1 "
            "worker(s), fewer than `min_workers`=2: the run ends here (exit code 3)") in output, output


@pytest.mark.cluster
def test_a_worker_lost_for_good_leaves_survivors_that_finish_the_one_device_model(tmp_path):
    # 4 workers, float64, every random state (tests/scripts/resume_random.py);
    # worker 3 fails after step 11 and again at once on the restart: the
    # launcher gives it up and 3 workers resume from the step-10 backup.
    reference = tmp_path / "reference.npz"
    code, output = _harness.run_script("resume_random.py", 1, "fit", "arrays", tmp_path / "unused",
                                       reference, -1, "plain")
    assert code == 0, output[-3000:]
    out = tmp_path / "out.npz"
    result, output = _harness.run_cluster(
        "resume_random.py", "workers", "fit", "arrays", tmp_path / "backup", out, 11,
        workers=4, max_restarts=1, min_workers=3, timeout=600)
    assert result.returncode == 0 and result.lost == ["worker 3"], output[-4000:]
    assert output.count("[launcher] worker 3 exited with code 1") == 2
    assert "going on with 3 worker(s) from the last backup" in output
    assert _harness.saved_weights_diff(str(reference), str(out)) <= 1e-9
    lost, back = (float((tmp_path / f"out.npz.{end}").read_text()) for end in ("lost", "back"))
    assert lost < back  # the survivors trained again after the loss
