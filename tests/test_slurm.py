"""The Slurm guide's recipe (docs/guides/slurm.md), as written, on a real Slurm cluster on this machine.

munge, slurmctld and two slurmd (nodes kdn1 and kdn2, both 127.0.0.1) from
the system's packages (`tools/setup_slurm.sh`), started once for the session
and ended by pid (tests/_slurm.py). The batch script is the guide's, read
from docs/guides/slurm.md; `train.py` is tests/scripts/slurm_train.py. Every result is
compared with plain Keras on one device.
"""

import os
import re
import shutil
import signal
import time

import pytest

from tests import _harness
from tests import _slurm

# Every test here starts processes (the cluster's daemons, jobs).
pytestmark = [pytest.mark.cluster]
_MISSING = _slurm.missing_commands()
if _MISSING and os.environ.get("CI", "").lower() != "true":
    pytestmark.append(pytest.mark.skip(
        reason=f"Slurm or munge is not installed (missing {', '.join(_MISSING)}); "
               "`bash tools/setup_slurm.sh` installs them (apt-get, as root)"))

# Weights after 2 workers' exact training vs one device: float32 round-off.
_TOLERANCE = 1e-5


GUIDE = os.path.join("docs", "guides", "slurm.md")


def _guide_script(heading=r"^# Slurm\n"):
    """The first ```bash block after `heading` (a regular expression) in the Slurm guide."""
    with open(os.path.join(_harness.REPO, GUIDE)) as f:
        text = f.read()
    match = re.search(heading + r".*?^```bash\n(.*?)^```", text, re.S | re.M)
    assert match, f"{GUIDE} has no ```bash block after {heading!r}"
    return match.group(1)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """The running cluster; every daemon and whatever the jobs left is ended by pid at the end."""
    if _MISSING:
        pytest.fail(f"CI=true but Slurm or munge is missing ({', '.join(_MISSING)}): "
                    "tools/setup_slurm.sh did not install them (see its output)")
    # A short path: Slurm's and munge's sockets live under it.
    root = tmp_path_factory.mktemp("slurm")
    cluster = _slurm.Cluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
    assert not cluster.leftovers()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Plain Keras on one device, the same global batches and initial weights."""
    out = str(tmp_path_factory.mktemp("reference") / "one_device.npz")
    code, output = _harness.run_script("slurm_train.py", "--reference", "--backup-dir", "unused",
                                       "--out", out)
    assert code == 0, output[-3000:]
    return out


def _job_dir(tmp_path):
    """`train.sbatch` (the guide's script, verbatim) and `train.py` in a directory of their own."""
    (tmp_path / "train.sbatch").write_text(_guide_script())
    shutil.copy(os.path.join(_harness.SCRIPTS, "slurm_train.py"), tmp_path / "train.py")
    return tmp_path


def _submit(slurm, job_dir, *options, script="train.sbatch", **env):
    """sbatch in `job_dir`, the job's output in `job_dir/out.txt`; returns the job id."""
    values = {**_harness._env(), "BACKUP": str(job_dir / "backup"),
              "KD_SLURM_OUT": str(job_dir / "weights.npz"), **env}
    return slurm.sbatch(str(job_dir / script), f"--chdir={job_dir}", f"--output={job_dir}/out.txt",
                        *options, **values)


def _output(job_dir):
    path = job_dir / "out.txt"
    return path.read_text(errors="replace") if path.exists() else ""


def _wait_for(predicate, timeout, what, job_dir, slurm):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"no {what} after {timeout}s:\n{_output(job_dir)[-4000:]}\n{slurm.logs(10)}")


def _no_leftovers(slurm):
    deadline = time.monotonic() + 15
    while slurm.leftovers() and time.monotonic() < deadline:
        time.sleep(0.5)
    return slurm.leftovers()


def test_the_recipe_checks_itself():
    script = _guide_script()
    assert "--kill-on-bad-exit=1" in script and "KD_PORT" not in script
    assert "--gpus-per-node" not in script.split("\n# One task per GPU")[0]  # not a fixed #SBATCH line
    assert re.search(r"^#SBATCH --signal=USR1@\d+", script, re.M)
    assert re.search(r"^BACKUP=", script, re.M)


@pytest.mark.long
def test_two_nodes_run_into_the_time_limit_and_resume_exactly(slurm, reference, tmp_path):
    # 2 nodes x 1 worker; both nodes are this host, so kd must give them
    # different ports. The script as written (its --signal=USR1@120); only
    # the time limit is the test's: Slurm checks limits every 30 s, so once
    # both workers train the test cuts the limit to the next whole minute at
    # least 40 s away. The warning then comes at the next check and the kill
    # at least one check (30 s) later. Slowed steps (first run only) keep the
    # job training: every task saves, exits 42, the script requeues the job,
    # and the requeued run resumes from the backup and ends as one device.
    job_dir = _job_dir(tmp_path)
    started = time.monotonic()
    job = _submit(slurm, job_dir, "--time=10", KD_SLURM_SLOW="2")
    _wait_for(lambda: _output(job_dir).count(" READY ") == 2, 150, "both workers training", job_dir, slurm)
    minutes = -(-(time.monotonic() - started + 40) // 60)
    slurm.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={int(minutes)}"])
    _wait_for(lambda: slurm.state(job)[2] >= 1, 150, "requeue", job_dir, slurm)
    # The requeued run trains at full speed, with a limit that does not bite.
    slurm.run(["scontrol", "update", f"JobId={job}", "TimeLimit=10"])
    state, exit_code, restarts = slurm.wait(job, 180)
    output = _output(job_dir)
    assert (state, exit_code, restarts) == ("COMPLETED", "0:0", 1), output[-5000:]
    assert output.count("[launcher] slurm node: starting worker") == 4, output[-5000:]  # 2 agents x 2 runs
    assert output.count("[launcher] got SIGUSR1; passing SIGTERM on") == 2, output[-5000:]
    # Slurm's warning reaches each worker and its agent, which passes SIGTERM on:
    # a worker names whichever came first (SIGTERM first under load), and both save.
    saves = re.findall(r"\[worker ([01])\] .*Preemption \(SIG(?:USR1|TERM)\): backed up epoch \d+, "
                       r"step", output)
    assert sorted(saves) == ["0", "1"], output[-5000:]
    assert output.count("DONE tf_config 2 worker") == 2, output[-5000:]
    assert _harness.saved_weights_diff(reference, str(job_dir / "weights.npz")) <= _TOLERANCE
    assert not _no_leftovers(slurm)


def test_one_node_two_workers_scancel_then_resubmit_resumes_exactly(slurm, reference, tmp_path):
    job_dir = _job_dir(tmp_path)
    job = _submit(slurm, job_dir, "--nodes=1", CPU_TASKS_PER_NODE="2", KD_SLURM_SLOW="0.5")
    backup = job_dir / "backup"
    _wait_for(lambda: backup.is_dir() and any(n.startswith("ckpt") for n in os.listdir(backup)),
              120, "backup", job_dir, slurm)
    slurm.run(["scancel", job])
    state, _, _ = slurm.wait(job, 60)
    first = _output(job_dir)
    assert state == "CANCELLED", first[-4000:]
    assert not _no_leftovers(slurm)
    assert re.search(r"\[worker 0\] .*Preemption \(SIGTERM\): backed up epoch", first), first[-4000:]
    # Slurm kills KillWait (10 s in this cluster) after its SIGTERM, whatever --grace-period says.
    assert ("got SIGTERM; passing SIGTERM on, the tasks have 10s to save and exit (Slurm's "
            "KillWait: SIGKILL 10s after its SIGTERM)") in first, first[-4000:]
    assert not (job_dir / "weights.npz").exists()
    job = _submit(slurm, job_dir, "--nodes=1", CPU_TASKS_PER_NODE="2")
    state, exit_code, _ = slurm.wait(job, 180)
    output = _output(job_dir)[len(first):]
    assert (state, exit_code) == ("COMPLETED", "0:0"), output[-5000:]
    assert "[launcher] slurm node: starting worker 0, worker 1 of 2 task(s)" in output
    assert _harness.saved_weights_diff(reference, str(job_dir / "weights.npz")) <= _TOLERANCE
    assert not _no_leftovers(slurm)


def test_a_killed_task_ends_the_job_with_a_message_and_leaves_nothing(slurm, tmp_path):
    # The recipe's step without the loop (which would rerun it): kill -9 the
    # training task on one node; its agent says which task died and how,
    # --kill-on-bad-exit ends the other node's agent, nothing stays behind.
    job_dir = _job_dir(tmp_path)
    step = re.search(r"^  (srun --kill-on-bad-exit=1 .*?\n.*?)\n", _guide_script(), re.S | re.M).group(1)
    (job_dir / "step.sbatch").write_text(
        "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\nper_node=1\n"
        f"{step}\necho STEP EXITED $?\n")
    job = _submit(slurm, job_dir, script="step.sbatch", KD_SLURM_SLOW="0.5")
    _wait_for(lambda: _output(job_dir).count(" READY ") == 2, 120, "both workers training", job_dir, slurm)
    victim = re.search(r"\[worker 1\] READY (\d+)", _output(job_dir)).group(1)
    os.kill(int(victim), signal.SIGKILL)
    state, exit_code, _ = slurm.wait(job, 90)
    output = _output(job_dir)
    assert "[launcher] worker 1 was killed by signal 9" in output, output[-4000:]
    assert re.search(r"STEP EXITED (?!0)\d+", output), output[-4000:]
    assert not _no_leftovers(slurm)


def test_keras_distrib_test_under_srun_names_slurm_and_passes(slurm):
    # Two nodes on one host: kd reads Slurm's variables (NodeAddr 127.0.0.1
    # for both), gives the two workers different ports, and the checks pass.
    result = slurm.run(["srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                        "keras-distrib", "test"], timeout=240, **_harness._env())
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    for worker in (0, 1):
        assert f"[worker {worker}] in the cluster of Slurm: 2 workers; this is worker {worker}" in output
        assert re.search(rf"\[worker {worker}\] All \d+ checks passed", output), output[-4000:]


@pytest.mark.long
def test_the_elastic_recipe_goes_on_with_the_node_left_and_ends_as_one_device(slurm, reference, tmp_path):
    # The guide's elastic script, verbatim, on both nodes (2 workers each);
    # after a backup node kdn2 is lost for good. Slurm ends the step and keeps
    # the job (--no-kill); the loop starts the step again on kdn1 alone, whose
    # 2 workers resume from the 4 workers' backup and end as one device.
    job_dir = _job_dir(tmp_path)
    (job_dir / "elastic.sbatch").write_text(_guide_script(r"^## An elastic Slurm job\n"))
    job = _submit(slurm, job_dir, "--nodes=2", script="elastic.sbatch", MIN_NODES="1",
                  CPU_TASKS_PER_NODE="2", KD_SLURM_SLOW="0.5")
    backup = job_dir / "backup"
    _wait_for(lambda: _output(job_dir).count(" READY ") == 4
              and any(n.startswith("ckpt") for n in os.listdir(backup)),
              180, "4 workers training and a backup", job_dir, slurm)
    try:
        slurm.lose_node("kdn2")
        state, exit_code, _ = slurm.wait(job, 240)
    finally:
        slurm.restore_node("kdn2")
    output = _output(job_dir)
    assert (state, exit_code) == ("COMPLETED", "0:0"), output[-5000:]
    assert "[launcher] slurm node: starting worker 2, worker 3 of 4 task(s)" in output, output[-5000:]
    assert "[launcher] slurm node: starting worker 0, worker 1 of 2 task(s)" in output, output[-5000:]
    assert output.count("DONE tf_config 2 worker") == 2 and "DONE tf_config 4" not in output, output[-5000:]
    assert _harness.saved_weights_diff(reference, str(job_dir / "weights.npz")) <= _TOLERANCE
    assert not _no_leftovers(slurm)


def test_the_data_service_recipe_trains_exactly_on_two_nodes(slurm, tmp_path):
    # docs/guides/data-service.md's second Slurm recipe, verbatim: the
    # service on the training nodes (--overlap), the model one device's.
    with open(os.path.join(_harness.REPO, "docs", "guides", "data-service.md")) as f:
        text = f.read()
    script = re.search(r"shares the training nodes.*?^```bash\n(.*?)^```", text, re.S | re.M).group(1)
    (tmp_path / "train.sbatch").write_text(script)
    shutil.copy(os.path.join(_harness.SCRIPTS, "slurm_served.py"), tmp_path / "train.py")
    job = _submit(slurm, tmp_path, DATA_PORT=str(_harness.free_port_block(1)))
    state, exit_code, _ = slurm.wait(job, 400)
    output = _output(tmp_path)
    assert state == "COMPLETED", output[-4000:]
    results = _harness.task_results(output)
    assert sorted(r["task"] for r in results) == ["worker 0", "worker 1"], output[-4000:]
    assert all(r["workers"] == 2 and r["weights"] < 1e-9 for r in results), results
    assert output.count("tf.data service worker serving at") == 2, output[-4000:]
    assert "kd input: tf.data service at grpc://" in output, output[-4000:]
    assert not _no_leftovers(slurm)
