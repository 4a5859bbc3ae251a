import json
import os

import pytest

import keras_distrib as kd
from keras_distrib import cluster
from keras_distrib import files


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
