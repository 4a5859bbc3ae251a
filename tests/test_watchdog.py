"""Dead and stalled workers are named within a timeout, with what to do, and nothing is left running."""

import os
import re
import signal
import time

import pytest

from keras_distrib.cluster import watchdog
from tests import _harness


def _launch(workers, ps, act_on, signum, args=(), watchdog_seconds=None, timeout=150):
    """Launches stall.py; once every task trained a few steps, sends `signum` to `act_on`.

    Returns (result, output, seconds from the signal to the end, pids seen).
    """
    pids, lines, sent = {}, [], {}
    training = workers if not ps else 1

    def sink(line):
        lines.append(line)
        found = re.search(r"\[(\w+ \d)\] (?:.*server listening \(pid (\d+)\)|READY \S+ (\d+))", line)
        if found:
            pids[found.group(1)] = int(found.group(2) or found.group(3))
        ready = sum("] READY " in l for l in lines)
        if signum and ready >= training and "at" not in sent and act_on in pids:
            sent["at"] = time.monotonic()
            os.kill(pids[act_on], signum)

    env = {watchdog.ENV: str(watchdog_seconds)} if watchdog_seconds else {}
    started = time.monotonic()
    result, output = _harness.run_cluster("stall.py", *args, workers=workers, ps=ps, timeout=timeout,
                                          env=env, sink=sink)
    ended = time.monotonic()
    for label, pid in pids.items():  # the launcher left nothing behind
        assert not _harness.survivors([pid]), f"{label} (pid {pid}) is still there 5 s after the launcher returned"
    return result, output, ended - sent.get("at", started), pids


@pytest.mark.cluster
def test_stopped_worker_is_named_by_the_coordination_service_with_what_to_do():
    # SIGSTOP: the process lives on but answers nothing; TensorFlow's
    # coordination service ends the job once its heartbeats are missed.
    result, output, seconds, _ = _launch(2, 0, "worker 1", signal.SIGSTOP)
    assert not result.timed_out and result.returncode != 0, output[-4000:]
    assert "[launcher] worker 0 cannot go on: the cluster lost worker 1 (/job:worker/task:1)" in output, \
        output[-4000:]
    assert "--max-restarts" in output and "resumes training from its backup" in output
    assert seconds < 60, seconds
    print(f"stopped worker 1: survivor ended {seconds:.1f}s later")


@pytest.mark.cluster
def test_watchdog_names_a_worker_stuck_between_steps():
    # Worker 1's process stays healthy (heartbeats, coordination service
    # happy) but never starts step 10: without the watchdog this hangs forever.
    result, output, seconds, _ = _launch(2, 0, None, None, args=("worker-1", 10), watchdog_seconds=5)
    assert not result.timed_out and result.returncode == watchdog.STALL_EXIT_CODE, output[-4000:]
    assert "HANGING worker-1 before step 10" in output, output[-4000:]
    assert "[worker 0]   worker 1 is missing at step 11: its process is alive but still at epoch 2, " \
           "batch 1 (step 10)" in output, output[-4000:]
    assert "What to do: Restart the job: keras-distrib launch --max-restarts K" in output


@pytest.mark.cluster
def test_watchdog_names_the_worker_whose_batches_differ():
    # Worker 1 feeds labels of shape (n,) where worker 0 feeds (n, 1): the
    # workers compare their batches before the first step and stop with an
    # error showing both signatures (the launcher then stops the other).
    result, output, _, _ = _launch(2, 0, None, None, args=("mismatch", -1), watchdog_seconds=30)
    assert not result.timed_out and result.returncode != 0, output[-4000:]
    assert "the workers' batches differ" in output, output[-4000:]
    assert "worker 0: ('*', '*') float32[4], float32[1]" in output, output[-4000:]
    assert "worker 1: ('*', '*') float32[4], float32[]" in output, output[-4000:]
    assert "check the input pipeline (dataset_fn, files, preprocessing) of the workers named" in output


@pytest.mark.parametrize("workers,stopped,candidates", [
    (1, "ps 0", "one of ps 0, worker 0"),
    (2, "worker 1", "one of ps 0, worker 0, worker 1"),
])
@pytest.mark.cluster
def test_watchdog_on_a_parameter_server_coordinator_names_the_stall(workers, stopped, candidates):
    # A stopped ps task or worker: the coordinator's steps stop finishing
    # (a stopped worker raises no error either), nothing errors.
    result, output, seconds, _ = _launch(workers, 1, stopped, signal.SIGSTOP, watchdog_seconds=5)
    assert not result.timed_out and result.returncode == watchdog.STALL_EXIT_CODE, output[-4000:]
    assert "[chief 0] kd watchdog (KD_WATCHDOG=5): chief 0 has made no progress" in output, output[-4000:]
    assert f"{candidates} is stopped, hung or unreachable" in output
    assert seconds < 40, seconds


@pytest.mark.parametrize("value", ["soon", "0", "-3", "inf"])
def test_bad_watchdog_setting_is_refused(value):
    with pytest.raises(ValueError, match=rf"`KD_WATCHDOG`='{value}': expected the seconds a training step"):
        watchdog.from_environment(environ={"KD_WATCHDOG": value})


@pytest.mark.cluster
@pytest.mark.parametrize("victim,signum", [(1, signal.SIGKILL), (0, signal.SIGSTOP)])
def test_pod_survivor_names_the_lost_task_without_a_launcher(victim, signum):
    # Two Kubernetes pods run the script directly (no kd launcher watches
    # them); worker 1 is killed, or worker 0 (the chief, which hosts the
    # coordination service) is stopped. The survivor's error says which
    # task was lost and what to do.
    port = _harness.free_port_block(2)
    processes, lines, ready = [], {0: [], 1: []}, set()

    def pump(index):
        for line in processes[index].stdout:
            lines[index].append(line.rstrip())
            if line.startswith("READY"):
                ready.add(index)

    import subprocess
    import sys
    import threading

    try:
        for index in range(2):
            env = _harness._env()
            env.update(JOB_COMPLETION_INDEX=str(index), KD_NUM_PODS="2", HOSTNAME=f"train-{index}",
                       KD_HOSTS=f"localhost:{port},localhost:{port + 1}")
            processes.append(subprocess.Popen(
                [sys.executable, "-u", os.path.join(_harness.SCRIPTS, "stall.py")], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True))
        pumps = [threading.Thread(target=pump, args=(index,), daemon=True) for index in range(2)]
        for thread in pumps:
            thread.start()
        deadline = time.monotonic() + 120
        while len(ready) < 2 and time.monotonic() < deadline and all(p.poll() is None for p in processes):
            time.sleep(0.05)
        assert len(ready) == 2, "\n".join(lines[0][-30:] + lines[1][-30:])
        os.kill(processes[victim].pid, signum)
        sent = time.monotonic()
        survivor = processes[1 - victim]
        survivor.wait(timeout=90)
        seconds = time.monotonic() - sent
    finally:
        _harness.kill_groups(processes)  # the stopped or surviving process and its group
    for thread in pumps:  # every line read (the pipes closed with their processes)
        thread.join(timeout=30)
    output = "\n".join(lines[1 - victim])
    assert survivor.returncode == 1, output[-4000:]
    assert (f"worker {1 - victim} cannot go on: the cluster lost worker {victim} "
            f"(/job:worker/task:{victim})") in output, output[-4000:]
    assert "--max-restarts" in output
    assert seconds < 45, seconds
    print(f"{signal.Signals(signum).name} worker {victim}: survivor ended {seconds:.1f}s later")


# TensorFlow's messages as the survivor of a pod test got them (the metric's
# read at an epoch's end, an eager collective, failed rather than a step).
_HEARTBEAT_TO_A_STOPPED_CHIEF = (
    "{{function_node __wrapped__CollectiveReduceV2_Nordering_token_1_device_/job:worker/replica:0/task:1/"
    "device:CPU:0}} Collective ops is aborted by: Deadline Exceeded\nRPC: /tensorflow.CoordinationService/"
    "Heartbeat\nThe error could be from a previous operation. Restart your program to reset. "
    "[Op:CollectiveReduceV2] name: ")
_UNHEALTHY_PEER = (
    "{{function_node __wrapped__CollectiveReduceV2_Nordering_token_1_device_/job:worker/replica:0/task:0/"
    "device:CPU:0}} Collective ops is aborted by: Error reported from /job:worker/task:1: The following "
    "tasks are unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1\nThe tasks have "
    "crashed. [Op:CollectiveReduceV2] name: ")


def test_the_failed_ops_own_device_is_not_taken_for_the_lost_task():
    # Before: worker 1's own device in the op's name hid the stopped chief.
    assert watchdog.lost_tasks(_HEARTBEAT_TO_A_STOPPED_CHIEF, "worker 1") == ["worker 0"]
    assert watchdog.lost_tasks(_HEARTBEAT_TO_A_STOPPED_CHIEF, "worker 1", service_task="chief 0") == ["chief 0"]
    assert watchdog.lost_tasks(_UNHEALTHY_PEER, "worker 0") == ["worker 1"]
    assert watchdog.lost_tasks("Deadline Exceeded [Op:CollectiveReduceV2]", "worker 1") == []


def test_fit_names_the_lost_task_wherever_it_meets_the_error():
    # Not only a step's collective: the epoch-end read of a metric, a
    # callback's save or the validation pass can be the one that fails.
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_distrib as kd

    class PeerLostAtEpochEnd(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raise tf.errors.UnavailableError(None, None, _UNHEALTHY_PEER)

    inputs = keras.Input((2,))
    model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((4, 2), "float32")
    with pytest.raises(tf.errors.UnavailableError, match=r"cannot go on: the cluster lost worker 1 "
                                                         r"\(/job:worker/task:1\).*--max-restarts") as caught:
        model.fit(x, x[:, :1], epochs=2, verbose=0, callbacks=[PeerLostAtEpochEnd()])
    assert "The following tasks are unhealthy" in str(caught.value.__cause__)
