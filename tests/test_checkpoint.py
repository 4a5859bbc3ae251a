"""Chief-only, atomic checkpoints; exact resume after SIGKILL and SIGTERM."""

import hashlib
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_distrib as kd
from keras_distrib.checkpoint import CheckpointError
from tests import _harness


def _weights(path):
    data = np.load(path)
    return [data[k] for k in sorted(data.files, key=lambda k: int(k[4:]))]


def _diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(_weights(a), _weights(b)))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted single-process run every resume is compared with."""
    folder = tmp_path_factory.mktemp("reference")
    out = str(folder / "ref.npz")
    code, output = _harness.run_script("resume.py", "fit", folder / "backup", out, -1, "KILL")
    assert code == 0 and "DONE 18" in output, output[-3000:]
    return out


@pytest.mark.parametrize("mode", ["fit", "loop", "manual"])
def test_sigkill_mid_epoch_then_resume_is_exact(mode, reference, tmp_path):
    backup, out = tmp_path / "backup", str(tmp_path / "out.npz")
    code, output = _harness.run_script("resume.py", mode, backup, out, 9, "KILL")
    assert code == -9, output[-3000:]
    assert os.path.exists(backup / "latest")  # killed after the step-8 backup
    code, output = _harness.run_script("resume.py", mode, backup, out, 9, "KILL")
    assert code == 0 and "DONE 18" in output, output[-3000:]
    assert _diff(reference, out) <= 1e-6
    if mode != "manual":
        assert not backup.exists()  # delete_checkpoint=True after success


def test_sigterm_saves_then_restart_resumes_at_the_saved_step(reference, tmp_path):
    backup, out = tmp_path / "backup", str(tmp_path / "out.npz")
    code, output = _harness.run_script("resume.py", "fit", backup, out, 9, "TERM")
    assert code == 143, output[-3000:]
    progress = kd.CheckpointManager(tf.train.Checkpoint(), backup).read_progress()
    # SIGTERM after global step 9; the backup is taken at the next batch, step 10
    # = epoch 1 (6 steps per epoch), step 4, though save_freq=2 had saved step 8.
    assert (progress["epoch"], progress["step"]) == (1, 4)
    code, output = _harness.run_script("resume.py", "fit", backup, out, 9, "TERM")
    assert code == 0 and "DONE 18" in output, output[-3000:]
    assert _diff(reference, out) <= 1e-6


@pytest.mark.parametrize("mode", ["fit", "manual"])
def test_two_workers_killed_and_restarted_resume_exactly(mode, reference, tmp_path):
    backup, out = tmp_path / "backup", str(tmp_path / "out.npz")
    result, output = _harness.run_cluster(
        "resume.py", mode, backup, out, 9, "KILL", workers=2, max_restarts=1, timeout=240
    )
    assert result.returncode == 0 and result.restarts == 1, output[-4000:]
    assert "[launcher] worker 1 exited with code -9" in output
    assert output.count("DONE 18") == 2
    assert _diff(reference, out) <= 1e-6
    assert sorted(os.listdir(tmp_path)) == sorted(["out.npz", "out.npz.killed"] + (["backup"] if mode == "manual" else []))


def test_callbacks_on_two_workers_leave_only_the_chiefs_files(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    out = tmp_path / "out"
    os.environ["TMPDIR"] = str(scratch)
    try:
        result, output = _harness.run_cluster("callbacks_cluster.py", out, workers=2, timeout=240)
    finally:
        del os.environ["TMPDIR"]
    assert result.returncode == 0, output[-4000:]
    assert sorted(os.listdir(out / "ckpt")) == ["best.weights.h5", "model-01.keras", "model-02.keras"]
    assert list(scratch.iterdir()) == []  # workers' scratch directories are gone
    events = [os.path.join(d, f) for d, _, files in os.walk(out / "tb") for f in files]
    assert events and all("events.out.tfevents" in e for e in events)
    # One writer per run directory (train/validation): the chief alone.
    assert sorted(os.path.basename(os.path.dirname(e)) for e in events) == ["train", "validation"]
    assert (out / "backup" / "latest").exists()
    loaded = keras.models.load_model(out / "ckpt" / "model-02.keras", compile=False)
    assert loaded.count_params() == 6


def test_checkpoint_restores_without_strategy_and_into_other_replica_counts(tmp_path):
    directory = tmp_path / "ckpt"
    code, output = _harness.run_script("ckpt_replicas.py", 2, "write", directory)
    assert code == 0, output[-3000:]
    (written,) = _harness.results_of(output)
    code, output = _harness.run_script("ckpt_replicas.py", 3, "read", directory)
    assert code == 0, output[-3000:]
    (read,) = _harness.results_of(output)
    assert read == {"diff": 0.0, "epoch": 2, "iterations": written["iterations"]}
    # And here, with no strategy at all.
    keras.utils.set_random_seed(9)
    inputs = keras.Input((4,))
    model = kd.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(6)(inputs)))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.optimizer.build(model.trainable_variables)
    manager = kd.CheckpointManager(tf.train.Checkpoint(model=model, optimizer=model.optimizer), directory)
    assert manager.restore_or_initialize()["epoch"] == 2
    expected = np.load(tmp_path / "expected.npz")
    for i, weights in enumerate(model.get_weights()):
        np.testing.assert_array_equal(weights, expected[f"arr_{i}"])


def _tree_digest(directory):
    digest = hashlib.sha256()
    for root, _, files in sorted(os.walk(directory)):
        for name in sorted(files):
            with open(os.path.join(root, name), "rb") as f:
                digest.update(name.encode() + f.read())
    return digest.hexdigest()


def test_incompatible_checkpoint_is_refused_and_left_untouched(tmp_path):
    def model_of(width):
        inputs = keras.Input((3,))
        model = kd.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(width)(inputs)))
        model.compile(optimizer="adam", loss="mse")
        model.optimizer.build(model.trainable_variables)
        return model

    first = model_of(4)
    manager = kd.CheckpointManager(tf.train.Checkpoint(model=first, optimizer=first.optimizer), tmp_path)
    manager.save(epoch=1)
    before = _tree_digest(tmp_path)
    other = model_of(7)
    wrong = kd.CheckpointManager(tf.train.Checkpoint(model=other, optimizer=other.optimizer), tmp_path)
    with pytest.raises(CheckpointError, match="does not fit this model"):
        wrong.restore_or_initialize()
    assert _tree_digest(tmp_path) == before


def test_bad_directories_are_refused_before_writing(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("keep me")
    with pytest.raises(CheckpointError, match=r"`backup_dir`=.* is a file"):
        kd.callbacks.BackupAndRestore(str(a_file))
    with pytest.raises(CheckpointError, match="is not writable"):
        kd.CheckpointManager(tf.train.Checkpoint(), str(a_file / "sub"))
    with pytest.raises(CheckpointError, match=r"`max_to_keep`=0"):
        kd.CheckpointManager(tf.train.Checkpoint(), str(tmp_path / "ok"), max_to_keep=0)
    assert a_file.read_text() == "keep me"
    with pytest.raises(ValueError, match=r"`save_freq`=0 must be 'epoch'"):
        kd.callbacks.BackupAndRestore(str(tmp_path / "b"), save_freq=0)
    with pytest.raises(ValueError) as error:
        kd.callbacks.ModelCheckpoint(str(tmp_path / "m.h5"), mode="best", save_freq=-1)
    for part in ("must end with '.keras'", "`mode`='best'", "`save_freq`=-1"):
        assert part in str(error.value)


def test_manager_keeps_max_and_never_exposes_partial_saves(tmp_path):
    step = tf.Variable(0)
    manager = kd.CheckpointManager(tf.train.Checkpoint(step=step), tmp_path, max_to_keep=2)
    for value in range(1, 5):
        step.assign(value)
        manager.save(epoch=value)
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["ckpt-3", "ckpt-4", "latest"]
    # A crash mid-save leaves a staging directory, never a new 'latest'.
    os.makedirs(tmp_path / ".tmp-ckpt-5-crashed")
    step.assign(0)
    assert manager.restore_or_initialize()["epoch"] == 4 and int(step.numpy()) == 4
    manager.save(epoch=5)
    assert not (tmp_path / ".tmp-ckpt-5-crashed").exists()
