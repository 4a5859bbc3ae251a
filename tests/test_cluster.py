import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import keras_distrib as kd
from keras_distrib.cluster import info as cluster
from keras_distrib.cluster import sources as cluster_sources
from keras_distrib import files
from tests import _harness


def _config(task_type="worker", index=0, **cluster_spec):
    spec = cluster_spec or {"worker": ["localhost:1111", "localhost:2222"]}
    return json.dumps({"cluster": spec, "task": {"type": task_type, "index": index}})


def test_no_tf_config_is_single_process(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    info = kd.cluster_info()
    assert (info.task_type, info.num_workers, info.is_chief) == (None, 1, True)
    assert kd.is_chief()


def test_worker_zero_is_chief_without_chief_task():
    assert kd.cluster_info(_config("worker", 0)).is_chief
    second = kd.cluster_info(_config("worker", 1))
    assert not second.is_chief
    assert (second.task_type, second.task_index, second.num_workers) == ("worker", 1, 2)
    assert second.label == "worker 1"


def test_chief_task_is_chief_and_counts_as_worker():
    spec = {"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"]}
    chief = kd.cluster_info(_config("chief", 0, **spec))
    assert chief.is_chief and chief.num_workers == 3 and chief.num_ps == 1
    assert not kd.cluster_info(_config("worker", 0, **spec)).is_chief


def test_info_is_frozen():
    info = kd.cluster_info(_config())
    with pytest.raises(Exception):
        info.task_index = 3
    with pytest.raises(TypeError):
        info.cluster["worker"] = ()


def test_env_variable_is_read(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _config("worker", 1))
    assert not kd.is_chief()


@pytest.mark.parametrize(
    "tf_config,match",
    [
        ("{not json", r"`TF_CONFIG` is not valid JSON"),
        ('{"cluster": {"worker": ["h:1"]}}', r"'task' must be an object"),
        (_config("worker", 2), r"task index 2 is out of range.*0\.\.1"),
        (_config("boss", 0), r"task type 'boss' is unknown"),
        (_config("worker", 0, worker=["h:1"], gpu=["h:2"]), r"unknown task type 'gpu'"),
        (_config("worker", 0, worker=["nohost"]), r"is not 'host:port'"),
        (_config("worker", -1), r"task index -1 is not a whole number"),
        (_config("ps", 0), r"task type 'ps' is not in 'cluster'"),
        (_config("worker", 0, worker=["h:99999", "h:2"]), r"'h:99999': port 99999 is out of range \(expected 1\.\.65535\)"),
        (_config("worker", 0, worker=["h:0", "h:2"]), r"'h:0': port 0 is out of range"),
        (_config("worker", 0, worker=["h:1"], chief=["h:1"]),
         r"'h:1' is given to 2 tasks \(worker\[0\], chief\[0\]\); every task needs its own host:port"),
    ],
)
def test_malformed_tf_config_is_explained(tf_config, match):
    with pytest.raises(cluster.ClusterConfigError, match=match):
        kd.cluster_info(tf_config)


def test_every_problem_is_listed():
    bad = json.dumps({"cluster": {"worker": ["x"], "gpu": ["h:1"]}, "task": {"type": "boss", "index": 9}})
    with pytest.raises(cluster.ClusterConfigError) as error:
        kd.cluster_info(bad)
    message = str(error.value)
    for part in ("'gpu'", "'x' is not 'host:port'", "'boss' is unknown"):
        assert part in message


def test_writer_directory_chief_writes_in_place(tmp_path):
    target = tmp_path / "ckpt"
    with cluster.writer_directory(str(target), kd.cluster_info(_config("worker", 0))) as path:
        assert path == str(target)
    assert target.is_dir()


def test_writer_directory_non_chief_gets_removed_scratch(tmp_path):
    target = tmp_path / "ckpt"
    with cluster.writer_directory(str(target), kd.cluster_info(_config("worker", 1))) as path:
        assert path != str(target)
        # Named for its owner, so a later process removes it if this one is killed.
        assert os.path.basename(path).startswith(f"kd-scratch-{files.host_tag()}-{os.getpid()}-")
        open(os.path.join(path, "f"), "w").close()
    assert not os.path.exists(path)
    assert not target.exists()


def test_progress_bars_on_the_chief_only(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _config("worker", 1))
    assert cluster.chief_verbose("auto") == 0
    assert cluster.chief_verbose(2) == 2  # an explicit choice is kept
    monkeypatch.setenv("TF_CONFIG", _config("worker", 0))
    assert cluster.chief_verbose("auto") == "auto"


# Cluster managers: Slurm, Kubernetes, TPU (simulated environments).

_CLEAN = [name for name in cluster_sources.ENVIRONMENT if name != "PATH"]


@pytest.fixture
def environ(monkeypatch, tmp_path):
    """A clean environment without scontrol on PATH; returns a setter.

    The simulated nodes' names (n9, n10) do not resolve here: each stands for
    a machine of its own (name resolution is tested on its own below, and for
    real in tests/test_slurm.py).
    """
    for name in _CLEAN:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setattr(cluster_sources, "resolve", lambda host, what, timeout=None: host)

    def set_env(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))

    return set_env


def _slurm(rank, ntasks=4, nodes="n[9-10]", per_node="2(x2)", **extra):
    values = dict(SLURM_PROCID=rank, SLURM_STEP_NUM_TASKS=ntasks, SLURM_STEP_ID=0,
                  SLURM_STEP_NODELIST=nodes, SLURM_STEP_TASKS_PER_NODE=per_node,
                  SLURM_JOB_ID=1234)
    values.update(extra)
    return values


def test_slurm_block_distribution_keeps_the_node_order(environ):
    environ(**_slurm(2, KD_PORT=7000))
    info = kd.cluster_info()
    # n9 before n10 (TensorFlow's SlurmClusterResolver sorts names: n10 first).
    assert info.cluster["worker"] == ("n9:7000", "n9:7001", "n10:7000", "n10:7001")
    assert (info.source, info.task_type, info.task_index, info.is_chief) == ("slurm", "worker", 2, False)
    assert (info.local_index, info.local_tasks, info.num_workers) == (0, 2, 4)
    assert info.tf_config == {"cluster": {"worker": list(info.cluster["worker"])},
                              "task": {"type": "worker", "index": 2}}


def test_slurm_cyclic_distribution_and_default_ports(environ):
    environ(**_slurm(1, SLURM_DISTRIBUTION="cyclic", SLURM_LOCALID=0, SLURMD_NODENAME="n10"))
    info = kd.cluster_info()
    base = 15000 + 1234 * 8
    assert info.cluster["worker"] == (f"n9:{base}", f"n10:{base}", f"n9:{base + 1}", f"n10:{base + 1}")
    assert info.task_index == 1 and info.local_index == 0


def test_slurm_reserved_ports_keep_jobs_apart_whose_ids_differ_by_6000(environ):
    # Without a reservation both jobs would take 15000 + (id mod 6000) * 8 on
    # the same nodes. Slurm reserves disjoint ports per step (MpiParams).
    seen = []
    for job, reserved in ((1, "31001-31002"), (6001, "31003-31004")):
        environ(**_slurm(1, SLURM_JOB_ID=job, SLURM_STEP_RESV_PORTS=reserved))
        seen.append(kd.cluster_info().cluster["worker"])
    assert seen[0] == ("n9:31001", "n9:31002", "n10:31001", "n10:31002")
    assert seen[1] == ("n9:31003", "n9:31004", "n10:31003", "n10:31004")
    assert "SLURM_STEP_RESV_PORTS=31003-31004" in cluster_sources.detect().detail


def test_slurm_too_few_reserved_ports_is_an_error_naming_them(environ):
    environ(**_slurm(1, SLURM_STEP_RESV_PORTS="31001"))
    with pytest.raises(cluster.ClusterConfigError,
                       match=r"reserved 1 port\(s\).*SLURM_STEP_RESV_PORTS`=31001.*--resv-ports"):
        kd.cluster_info()
    environ(**_slurm(1, SLURM_STEP_RESV_PORTS="12x"))
    with pytest.raises(cluster.ClusterConfigError, match=r"`SLURM_STEP_RESV_PORTS`='12x'"):
        kd.cluster_info()


@pytest.mark.cluster
def test_slurm_uses_scontrol_when_on_path(environ, tmp_path):
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "scontrol"
    fake.write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] || exit 2\necho alpha; echo beta\n")
    fake.chmod(0o755)
    environ(**_slurm(3, nodes="weird[list", KD_PORT=9000))
    assert kd.cluster_info().cluster["worker"][-1] == "beta:9001"


def test_slurm_nodes_on_one_machine_get_different_ports(environ, monkeypatch):
    # Two Slurm nodes on one host (the usual multi-node test set-up): their
    # tasks share the machine, so each needs its own port.
    monkeypatch.setattr(cluster_sources, "resolve", lambda host, what, timeout=None: "127.0.0.1")
    environ(**_slurm(2, KD_PORT=7000))
    assert kd.cluster_info().cluster["worker"] == ("n9:7000", "n9:7001", "n10:7002", "n10:7003")


def test_an_unresolvable_slurm_node_is_named_within_seconds(environ, monkeypatch):
    monkeypatch.undo()  # the real resolution
    for name in _CLEAN:
        monkeypatch.delenv(name, raising=False)
    for name, value in _slurm(0, nodes="kd-no-such-node[1-2].invalid", per_node="2(x2)").items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("PATH", "/nonexistent")
    started = time.monotonic()
    with pytest.raises(kd.ClusterConfigError,
                       match=r"The Slurm node 'kd-no-such-node1\.invalid' does not resolve"):
        kd.cluster_info()
    assert time.monotonic() - started < cluster_sources.RESOLVE_SECONDS + 1


def test_slurm_parameter_servers(environ):
    environ(**_slurm(1, KD_PS=1, KD_PORT=7000))
    info = kd.cluster_info()
    assert dict(info.cluster) == {"chief": ("n9:7000",), "ps": ("n9:7001",),
                                  "worker": ("n10:7000", "n10:7001")}
    assert (info.task_type, info.task_index, info.num_workers, info.num_ps) == ("ps", 0, 3, 1)


@pytest.mark.parametrize(
    "values,match",
    [
        (_slurm(4), r"`SLURM_PROCID`=4 is not below `SLURM_STEP_NUM_TASKS`=4"),
        (_slurm(0, per_node="3,1", SLURM_LOCALID=0), None),
        (_slurm(0, per_node="2,1"), r"`SLURM_STEP_TASKS_PER_NODE`='2,1' adds up to 3 tasks, not `SLURM_STEP_NUM_TASKS`=4"),
        (_slurm(0, per_node="4"), r"gives 1 node\(s\) but `SLURM_STEP_NODELIST`='n\[9-10\]' names 2"),
        (_slurm(1, SLURM_LOCALID=0), r"`SLURM_LOCALID`='0', but a block distribution puts rank 1 at '1'"),
        (_slurm(0, SLURMD_NODENAME="n10"), r"`SLURMD_NODENAME`='n10'.*puts rank 0 at 'n9'"),
        (_slurm(0, SLURM_DISTRIBUTION="arbitrary"), r"`SLURM_DISTRIBUTION`='arbitrary'"),
        (_slurm(0, nodes="n[3-1]"), r"bad range '3-1'"),
        (_slurm("x"), r"`SLURM_PROCID`='x': expected a whole number"),
        (_slurm(0, KD_PORT=70000), r"`KD_PORT`=70000: expected a port"),
        (_slurm(0, KD_PS=3), r"`KD_PS`=3 parameter servers leave no worker among the 4 slurm task"),
    ],
)
def test_inconsistent_slurm_environments_name_the_variable(environ, values, match):
    environ(**values)
    if match is None:
        assert kd.cluster_info().local_tasks == 3
        return
    with pytest.raises(cluster.ClusterConfigError, match=match):
        kd.cluster_info()


def test_slurm_batch_script_without_srun_trains_alone(environ, caplog):
    environ(SLURM_PROCID=0, SLURM_NTASKS=4, SLURM_JOB_NODELIST="n[1-4]")
    with caplog.at_level("WARNING", logger="keras_distrib"):
        info = kd.cluster_info()
    assert info.source is None and info.num_workers == 1
    assert "Start the script with `srun`" in caplog.text


def test_slurm_hostlist_parser():
    assert cluster_sources.expand_hostlist("n[9-10],gpu-a[01-02,7],login") == [
        "n9", "n10", "gpu-a01", "gpu-a02", "gpu-a7", "login"]
    assert cluster_sources.expand_hostlist("rack[1-2]-node") == ["rack1-node", "rack2-node"]
    assert cluster_sources.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(cluster.ClusterConfigError, match=r"tasks-per-node list '2\(x\)'"):
        cluster_sources.expand_tasks_per_node("2(x)")


def test_kubernetes_indexed_job(environ):
    environ(JOB_COMPLETION_INDEX=1, KD_NUM_PODS=3, KD_SERVICE="svc", HOSTNAME="train-1")
    info = kd.cluster_info()
    assert info.cluster["worker"] == ("train-0.svc:2222", "train-1.svc:2222", "train-2.svc:2222")
    assert (info.source, info.task_index, info.is_chief) == ("kubernetes", 1, False)


def test_kubernetes_jobset_defaults_to_its_subdomain(environ):
    environ(JOB_COMPLETION_INDEX=0, KD_NUM_PODS=2, JOBSET_NAME="js", HOSTNAME="js-workers-0-0",
            KD_PORT=3000, KD_PS=0)
    assert kd.cluster_info().cluster["worker"] == ("js-workers-0-0.js:3000", "js-workers-0-1.js:3000")


@pytest.mark.parametrize(
    "values,match",
    [
        (dict(KD_NUM_PODS=2), r"`KD_NUM_PODS`=2 is set but `JOB_COMPLETION_INDEX` is not"),
        (dict(KD_NUM_PODS=2, JOB_COMPLETION_INDEX=2), r"`JOB_COMPLETION_INDEX`=2 is not below `KD_NUM_PODS`=2"),
        (dict(KD_NUM_PODS=2, JOB_COMPLETION_INDEX=0, HOSTNAME="train-0"), r"`KD_SERVICE` is not set"),
        (dict(KD_NUM_PODS=2, JOB_COMPLETION_INDEX=1, KD_SERVICE="s", HOSTNAME="train-0"),
         r"`HOSTNAME`='train-0' does not end with '-1'"),
        (dict(KD_NUM_PODS=2, JOB_COMPLETION_INDEX=0, KD_HOSTS="a:1"), r"`KD_HOSTS` lists 1 pod\(s\) but `KD_NUM_PODS`=2"),
        (dict(KD_NUM_PODS=1, JOB_COMPLETION_INDEX=0, KD_HOSTS="a:x"), r"`KD_HOSTS` has entries that are not 'host:port': \['a:x'\]"),
        (dict(KD_NUM_PODS=0), r"`KD_NUM_PODS`='0': expected a whole number >= 1"),
    ],
)
def test_inconsistent_kubernetes_environments_name_the_variable(environ, values, match):
    environ(**values)
    with pytest.raises(cluster.ClusterConfigError, match=match):
        kd.cluster_info()


def test_tf_config_wins_over_a_cluster_manager(environ):
    environ(TF_CONFIG=_config("worker", 1), **_slurm(0))
    info = kd.cluster_info()
    assert (info.source, info.task_index) == ("tf_config", 1)


def test_tpu_pod_is_one_client(environ):
    environ(TPU_WORKER_HOSTNAMES="t0,t1")
    info = kd.cluster_info()
    assert (info.source, info.num_workers, info.is_chief, info.task_type) == ("tpu", 1, True, None)
    assert info.cluster["worker"] == ("t0:8470", "t1:8470")


def test_cluster_resolver_carries_the_detected_cluster(environ):
    environ(**_slurm(3, KD_PORT=7000))
    resolver = cluster.cluster_resolver()
    assert resolver.cluster_spec().as_dict() == {"worker": ["n9:7000", "n9:7001", "n10:7000", "n10:7001"]}
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 3, "grpc")
    environ(TF_CONFIG=_config("worker", 1))
    assert cluster.cluster_resolver() is None  # TensorFlow reads TF_CONFIG itself


# Simulated cluster managers, real processes on localhost.


@pytest.fixture(scope="module")
def one_device_run():
    """The script with no cluster: make_strategy("auto") picks one device."""
    code, output = _harness.run_script("cluster_manager.py")
    assert code == 0, output[-3000:]
    (result,) = _harness.results_of(output)
    assert (result["source"], result["strategy"]) == (None, "OneDeviceStrategy")
    return result


def _check_exact(results, one_device_run, source):
    assert sorted(r["task"] for r in results) == ["worker 0", "worker 1"]
    assert {(r["source"], r["strategy"], r["replicas"]) for r in results} == {
        (source, "CollectiveAllReduceStrategy", 2)}  # MultiWorkerMirroredStrategy
    assert len({r["digest"] for r in results}) == 1  # bit-identical on both workers
    for got, want in zip(results[0]["weights"], one_device_run["weights"]):
        np.testing.assert_allclose(got, want, atol=1e-5)  # and one device's


def _task_results(output):
    return _harness.results_of("\n".join(
        line.split("] ", 1)[1] if line.startswith("[") else line
        for line in output.splitlines() if "RESULT " in line
    ))


@pytest.mark.cluster
def test_slurm_step_runs_the_per_node_agent_and_trains_exactly(tmp_path, one_device_run):
    # `srun -N1 -n1 keras-distrib launch --per-node 2 script.py`: one agent
    # on one node starts two workers. scontrol is faked on PATH.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\n[ \"$1 $2 $3\" = 'show hostnames kdnode[1]' ] && echo localhost && exit 0\nexit 1\n")
    (bin_dir / "scontrol").chmod(0o755)
    port = _harness.free_port_block(2)
    env = dict(SLURM_PROCID=0, SLURM_STEP_NUM_TASKS=1, SLURM_STEP_ID=0, SLURM_JOB_ID=7,
               SLURM_STEP_NODELIST="kdnode[1]", SLURM_STEP_TASKS_PER_NODE=1, SLURM_LOCALID=0,
               KD_PORT=port, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    agent = [sys.executable, "-m", "keras_distrib", "launch", "--per-node", "2", "--timeout", "200",
             os.path.join(_harness.SCRIPTS, "cluster_manager.py")]
    ((code, output),) = _harness.run_together([(agent, env)])
    assert code == 0, output[-4000:]
    assert "[launcher] slurm node: starting worker 0, worker 1 of 2 task(s)" in output
    results = _task_results(output)
    # The agent wrote each task's TF_CONFIG from Slurm's variables.
    _check_exact(results, one_device_run, "tf_config")


@pytest.mark.cluster
def test_kubernetes_indexed_job_pods_train_exactly(one_device_run):
    # Two pods of an Indexed Job run the script directly; on localhost the
    # pods' names are given in KD_HOSTS (in a cluster: <job>-<i>.<KD_SERVICE>).
    port = _harness.free_port_block(2)
    script = [sys.executable, "-u", os.path.join(_harness.SCRIPTS, "cluster_manager.py")]
    pods = [(script, dict(JOB_COMPLETION_INDEX=i, KD_NUM_PODS=2, HOSTNAME=f"train-{i}",
                          KD_HOSTS=f"localhost:{port},localhost:{port + 1}"))
            for i in range(2)]
    outputs = _harness.run_together(pods)
    for code, output in outputs:
        assert code == 0, output[-4000:]
    results = [r for _, output in outputs for r in _task_results(output)]
    _check_exact(results, one_device_run, "kubernetes")


# The Kubernetes guide's recipe (docs/guides/kubernetes.md): its environment, backup volume
# and restart policy.


def _kubernetes_recipe():
    import yaml

    with open(os.path.join(_harness.REPO, "docs", "guides", "kubernetes.md")) as f:
        text = f.read()
    match = re.search(r"^# Kubernetes.*?^```yaml\n(.*?)^```", text, re.S | re.M)
    assert match, "docs/guides/kubernetes.md has no ```yaml block under '# Kubernetes'"
    service, job = yaml.safe_load_all(match.group(1))
    return service, job


def test_the_kubernetes_recipe_agrees_with_itself_and_with_kd():
    service, job = _kubernetes_recipe()
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}
    # The pods' names: the headless Service is the pods' subdomain, its selector the Job.
    assert service["spec"]["clusterIP"] == "None" and service["metadata"]["name"] == pod["subdomain"]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert env["KD_SERVICE"] == pod["subdomain"]
    assert int(env["KD_NUM_PODS"]) == job["spec"]["completions"] == job["spec"]["parallelism"]
    assert job["spec"]["completionMode"] == "Indexed"
    # Every task of a pod listens: KD_PORT + j for its j-th task (one per GPU).
    port = int(env.get("KD_PORT", cluster_sources.KUBERNETES_PORT))
    command = container["command"]
    tasks = (container["resources"]["limits"]["nvidia.com/gpu"]
             if command[command.index("--per-node") + 1] == "gpu"
             else int(command[command.index("--per-node") + 1]))
    listening = set(range(port, port + tasks))
    assert {p["containerPort"] for p in container["ports"]} == listening
    assert {p["port"] for p in service["spec"]["ports"]} == listening
    # The backup: on the volume every pod mounts, a claim shared by all (ReadWriteMany),
    # in a folder of this Job's own (its uid, which restarted pods keep).
    backup = command[command.index("--backup-dir") + 1]
    (mount,) = container["volumeMounts"]
    assert backup == mount["mountPath"] + "/$(KD_RUN)"
    assert env["KD_RUN"] == {"fieldRef": {
        "fieldPath": "metadata.labels['batch.kubernetes.io/controller-uid']"}}
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert "persistentVolumeClaim" in volume
    # Restarts: a failed or preempted container (exit 42) is restarted in its pod, and the
    # kill comes after the launcher's grace period.
    assert pod["restartPolicy"] == "OnFailure" and job["spec"]["backoffLimit"] >= 1
    grace = float(command[command.index("--grace-period") + 1])
    assert pod["terminationGracePeriodSeconds"] > grace
    assert command[:2] == ["keras-distrib", "launch"]
    if command[command.index("--per-node") + 1] == "gpu":
        assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1


@pytest.mark.cluster
@pytest.mark.long
def test_the_kubernetes_recipes_pods_restart_resume_and_go_on_with_the_survivors(tmp_path):
    # The container's command, as written, in 2 "pods" (processes) with the
    # recipe's environment plus what Kubernetes sets (JOB_COMPLETION_INDEX,
    # HOSTNAME, one GPU each in CUDA_VISIBLE_DEVICES: this machine has none,
    # so TensorFlow runs on CPU) and KD_HOSTS (the pods' DNS names do not
    # exist here). The backup volume is a directory both mount. A drain
    # (SIGTERM to both) makes them save and exit 42; OnFailure restarts the
    # containers, which resume from the volume. Then pod 1's node is lost for
    # good (SIGKILL, never restarted): pod 0 fails, and the Kubernetes guide's elastic
    # step (a new Job of 1 pod, KD_NUM_PODS=1, the old Job's KD_RUN) resumes
    # from the volume and ends as one device does.
    service, job = _kubernetes_recipe()
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # What Kubernetes gives the pods: the Job's uid (the same for restarted pods),
    # expanded in the command where it says $(KD_RUN).
    env = {item["name"]: item.get("value", "3f6c-job-uid") for item in container["env"]}
    volume = tmp_path / "volume"
    mount = container["volumeMounts"][0]["mountPath"]
    command = [arg.replace(mount, str(volume), 1).replace("$(KD_RUN)", env["KD_RUN"])
               if arg.startswith(mount) else arg for arg in container["command"]]
    volume = volume / env["KD_RUN"]
    shutil.copy(os.path.join(_harness.SCRIPTS, "slurm_train.py"), tmp_path / "train.py")
    reference = str(tmp_path / "one_device.npz")
    code, output = _harness.run_script("slurm_train.py", "--reference", "--backup-dir", "unused",
                                       "--out", reference)
    assert code == 0, output[-3000:]
    port = _harness.free_port_block(2)
    pods = int(env["KD_NUM_PODS"])
    name = job["metadata"]["name"]

    def start(slow, pods=pods):
        processes = []
        for index in range(pods):
            pod_env = {**_harness._env(), **env, "JOB_COMPLETION_INDEX": str(index),
                       "KD_NUM_PODS": str(pods),
                       "HOSTNAME": f"{name}-{index}", "CUDA_VISIBLE_DEVICES": "0",
                       "KD_HOSTS": ",".join(f"localhost:{port + i}" for i in range(pods)),
                       "KD_SLURM_OUT": str(volume / "weights.npz"), "KD_SLURM_SLOW": slow}
            processes.append(subprocess.Popen(command, cwd=tmp_path, env=pod_env, text=True,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        return processes

    def finish(processes, timeout=180):
        results = []
        try:
            for process in processes:
                output, _ = process.communicate(timeout=timeout)
                results.append((process.returncode, output))
        finally:
            _harness.kill_groups(processes)
        return results

    def backups():
        return {n for n in os.listdir(volume) if n.startswith("ckpt")} if volume.is_dir() else set()

    def wait_for_backup(processes, besides=()):
        deadline = time.monotonic() + 120
        while not backups() - set(besides):
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes), (
                "no new backup", backups())
            time.sleep(0.3)

    processes = start("0.5")
    wait_for_backup(processes)
    for process in processes:
        process.send_signal(signal.SIGTERM)  # the node drain's SIGTERM to each container
    first = finish(processes)
    assert [code for code, _ in first] == [42, 42], "\n".join(out[-2000:] for _, out in first)
    assert not (volume / "weights.npz").exists()
    drained = backups()
    processes = start("0.5")  # restartPolicy: OnFailure
    wait_for_backup(processes, besides=drained)
    _harness.kill_groups(processes[1:])  # pod 1's node is gone: it never comes back
    second = finish(processes)
    assert second[0][0] not in (0, 42), second[0][1][-3000:]
    assert not (volume / "weights.npz").exists()
    third = finish(start("0", pods=1))  # a new Job: 1 pod, the old Job's KD_RUN
    assert [code for code, _ in third] == [0], third[0][1][-3000:]
    assert "[launcher] kubernetes node: starting worker 0 of 1 task(s)" in third[0][1]
    assert _harness.saved_weights_diff(reference, str(volume / "weights.npz")) <= 1e-5
