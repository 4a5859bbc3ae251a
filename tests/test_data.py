"""Exactly-once input: the ids every replica saw, across 2 workers x 2 devices."""

import os

import numpy as np
import pytest
import tensorflow as tf

import keras_distrib as kd
from tests import _harness


def _write_files(folder, rows, count):
    folder.mkdir()
    for index, chunk in enumerate(np.array_split(np.arange(rows), count)):
        with tf.io.TFRecordWriter(str(folder / f"part-{index:02d}.tfrecord")) as writer:
            for value in chunk:
                feature = {"id": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(value)]))}
                writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    return folder


def _ids_across_workers(*args):
    result, output = _harness.run_cluster("shard_ids.py", 2, *args, workers=2, timeout=180)
    assert result.returncode == 0, output[-4000:]
    results = _harness.task_results(output)
    assert sorted(r["task"] for r in results) == ["worker 0", "worker 1"]
    assert {r["replicas"] for r in results} == {4}
    # The traits record kd's modules compare (strategies.traits), asked of a real cluster.
    assert {tuple(r["traits"]) for r in results} == {("multi_worker", 4, 2)}
    ids = [i for r in results for replica in r["ids"] for i in replica]
    return ids, results


@pytest.mark.cluster
@pytest.mark.parametrize("rows", [64, 37])
def test_data_sharding_sees_every_example_once(rows, tmp_path):
    ids, results = _ids_across_workers("data", rows, tmp_path)
    assert sorted(ids) == list(range(rows))
    # describe_input's split of the last batch (by global replica id) is the real one.
    for result in results:
        worker = int(result["task"].split()[1])
        assert result["last_batch"] == result["described"][2 * worker: 2 * worker + 2], result


@pytest.mark.cluster
@pytest.mark.parametrize("files", [4, 1])
def test_file_sharding_sees_every_example_once(files, tmp_path):
    folder = _write_files(tmp_path / "files", 37, files)
    ids, results = _ids_across_workers("file", 37, folder)
    assert sorted(ids) == list(range(37))
    if files == 1:  # fewer files than workers: DATA instead, said out loud
        assert all(r["warnings"] for r in results)
    else:
        assert not any(r["warnings"] for r in results)
        # Whole files per worker: each worker's ids come from its own files.
        per_worker = [sorted(i for replica in r["ids"] for i in replica) for r in results]
        chunks = [c.tolist() for c in np.array_split(np.arange(37), 4)]
        assert sorted(per_worker) == sorted([chunks[0] + chunks[2], chunks[1] + chunks[3]])


@pytest.mark.cluster
def test_dataset_fn_with_shard_files(tmp_path):
    folder = _write_files(tmp_path / "files", 30, 4)
    ids, _ = _ids_across_workers("fn", 30, folder)
    assert sorted(ids) == list(range(30))


@pytest.mark.cluster
def test_training_on_distributed_pipeline_matches_one_device(tmp_path):
    result, output = _harness.run_cluster("shard_ids.py", 2, "train", 37, tmp_path, workers=2, timeout=180)
    assert result.returncode == 0, output[-4000:]
    for value in _harness.task_results(output):
        assert value["diff"] <= 1e-5, value
        assert value["direct_diff"] <= 1e-5, value


def test_bad_inputs_are_explained(tmp_path):
    strategy = kd.make_strategy("one_device")
    with pytest.raises(ValueError, match="`data` is empty"):
        kd.distribute_dataset(np.zeros((0, 2)), strategy=strategy, global_batch_size=4)
    with pytest.raises(ValueError, match=r"`global_batch_size`=0 must be"):
        kd.distribute_dataset(np.zeros((8, 2)), strategy=strategy, global_batch_size=0)
    with pytest.raises(ValueError, match=r"`shard_policy`='rows' is not a shard policy"):
        kd.distribute_dataset(np.zeros((8, 2)), strategy=strategy, global_batch_size=4, shard_policy="rows")
    with pytest.raises(TypeError, match="Expected a tf.data.Dataset, NumPy"):
        kd.distribute_dataset("data.csv", strategy=strategy, global_batch_size=4)
    with pytest.raises(ValueError, match="matches no file"):
        kd.data.shard_files(str(tmp_path / "*.tfrecord"))
    with pytest.raises(ValueError, match="does not read a list of files"):
        kd.distribute_dataset(np.zeros((8, 2)), strategy=strategy, global_batch_size=4, shard_policy="file")
    with pytest.raises(TypeError, match="`dataset_fn` returned a list"):
        kd.distribute_dataset(lambda context: [1, 2, 3], strategy=strategy)


@pytest.fixture(scope="module")
def four_replicas():
    """tests/scripts/data_errors.py's result: 4 virtual devices in one process."""
    code, output = _harness.run_script("data_errors.py")
    assert code == 0, output[-3000:]
    (result,) = _harness.results_of(output)
    return result


@pytest.mark.cluster
def test_global_batch_not_divisible_is_explained(four_replicas):
    assert "`global_batch_size`=30 is not divisible by the 4 replicas in sync" in four_replicas["error"]
    assert "Use a multiple of 4 (e.g. 28 or 32)" in four_replicas["error"]


@pytest.mark.cluster
def test_describe_input_reports_tensorflows_real_split(four_replicas):
    # The reference is TensorFlow itself: the rows each replica receives.
    for split in four_replicas["splits"]:
        real = [[len(ids) for ids in batch] for batch in split["tensorflow"]]
        assert split["described"] == real[-1], split
        assert split["kd"] == split["tensorflow"], split  # kd.distribute_dataset splits the same way
        # Every full batch splits evenly, in order: replica r holds rows [8r, 8r + 8).
        for step, batch in enumerate(split["tensorflow"][:-1]):
            assert batch == [list(range(32 * step + 8 * r, 32 * step + 8 * r + 8)) for r in range(4)]
    by_rows = {split["rows"]: split["described"] for split in four_replicas["splits"]}
    assert by_rows[58] == [7, 7, 7, 5] and by_rows[34] == [1, 1, 0, 0]
    assert by_rows[64] == [8, 8, 8, 8] and by_rows[1] == [1, 0, 0, 0]
    lines = four_replicas["lines"]  # 66 rows, global batch 32: a last batch of 2 rows
    assert any("last batch: 2 row(s), per replica [1, 1, 0, 0]" in line for line in lines), lines
    assert any("replica 1: rows [8, 16) of each global batch; of the last batch: rows [1, 2)" in line
               for line in lines), lines
    assert any("replica 3: rows [24, 32) of each global batch; of the last batch: none" in line
               for line in lines), lines


def test_describe_input_reports_and_warns():
    lines = []
    report = kd.data.describe_input(
        np.arange(33), strategy=kd.make_strategy("default"), global_batch_size=16, print_fn=lines.append
    )
    assert report["examples"] == 33 and report["steps"] == 3 and report["last_batch"] == 1
    assert report["policy"] == "DATA" and report["last_batch_per_replica"] == [1]
    assert any("steps per epoch: 3, last batch: 1 row(s)" in line for line in lines)
    unknown = tf.data.Dataset.range(10).filter(lambda v: v > 2)
    report = kd.data.describe_input(unknown, strategy=kd.make_strategy("default"), global_batch_size=4,
                                    print_fn=lines.append)
    assert any("size is unknown" in w for w in report["warnings"])


def _reshuffled(seed=4):
    return tf.data.Dataset.range(12).shuffle(12, seed=seed, reshuffle_each_iteration=True).batch(4)


def test_replay_epochs_gives_the_order_the_uninterrupted_run_draws_next():
    # An uninterrupted process draws orders 0, 1, 2, ...; a new process that
    # replays 2 epochs draws order 2 next, a fresh one order 0 (the contrast).
    uninterrupted = _reshuffled()
    orders = [np.concatenate(list(uninterrupted.as_numpy_iterator())) for _ in range(4)]
    assert not np.array_equal(orders[0], orders[2])
    resumed = _reshuffled()
    assert kd.replay_epochs(resumed, 2) is True
    np.testing.assert_array_equal(np.concatenate(list(resumed.as_numpy_iterator())), orders[2])
    np.testing.assert_array_equal(np.concatenate(list(resumed.as_numpy_iterator())), orders[3])
    fresh = _reshuffled()
    np.testing.assert_array_equal(np.concatenate(list(fresh.as_numpy_iterator())), orders[0])


def test_replay_epochs_opens_nothing_for_data_that_does_not_reshuffle():
    fixed = tf.data.Dataset.range(12).shuffle(12, seed=4, reshuffle_each_iteration=False).batch(4)
    assert kd.replay_epochs(fixed, 3) is False
    assert kd.replay_epochs(_reshuffled(), 0) is False


def test_replay_epochs_refuses_bad_arguments_naming_them():
    with pytest.raises(ValueError, match=r"`epochs`=-1: expected a whole number >= 0") as error:
        kd.replay_epochs([1, 2], -1)
    assert "`dataset` is a list" in str(error.value)
