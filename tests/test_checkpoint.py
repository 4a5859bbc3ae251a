"""Chief-only, atomic checkpoints; exact resume after SIGKILL and SIGTERM."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_distrib as kd
from keras_distrib import files
from keras_distrib.checkpointing import checkpoint as checkpoint_lib
from keras_distrib.checkpointing.checkpoint import CheckpointError
from tests import _harness


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted single-process run every resume is compared with."""
    folder = tmp_path_factory.mktemp("reference")
    out = str(folder / "ref.npz")
    code, output = _harness.run_script("resume.py", "fit", folder / "backup", out, -1, "KILL")
    assert code == 0 and "DONE 18" in output, output[-3000:]
    return out


@pytest.mark.cluster
@pytest.mark.parametrize("mode", ["fit", "loop", "manual"])
def test_sigkill_mid_epoch_then_resume_is_exact(mode, reference, tmp_path):
    backup, out = tmp_path / "backup", str(tmp_path / "out.npz")
    code, output = _harness.run_script("resume.py", mode, backup, out, 9, "KILL")
    assert code == -9, output[-3000:]
    assert os.path.exists(backup / "latest")  # killed after the step-8 backup
    code, output = _harness.run_script("resume.py", mode, backup, out, 9, "KILL")
    assert code == 0 and "DONE 18" in output, output[-3000:]
    assert _harness.saved_weights_diff(reference, out) <= 1e-6
    if mode != "manual":
        assert not backup.exists()  # delete_checkpoint=True after success


@pytest.mark.cluster
def test_sigterm_saves_then_restart_resumes_at_the_saved_step(reference, tmp_path):
    backup, out = tmp_path / "backup", str(tmp_path / "out.npz")
    code, output = _harness.run_script("resume.py", "fit", backup, out, 9, "TERM")
    assert code == 42, output[-3000:]  # keras_distrib.cluster.preemption.RESTART_EXIT_CODE
    progress = kd.CheckpointManager(tf.train.Checkpoint(), backup).read_progress()
    # SIGTERM in a callback after global step 9; kd's backup hook runs after the
    # callbacks, so it backs up step 9 = epoch 1 (6 steps per epoch), step 3.
    assert (progress["epoch"], progress["step"]) == (1, 3)
    code, output = _harness.run_script("resume.py", "fit", backup, out, 9, "TERM")
    assert code == 0 and "DONE 18" in output, output[-3000:]
    assert _harness.saved_weights_diff(reference, out) <= 1e-6


@pytest.mark.cluster
@pytest.mark.parametrize("mode", ["fit", "manual"])
def test_two_workers_killed_and_restarted_resume_exactly(mode, reference, tmp_path):
    backup, out = tmp_path / "backup", str(tmp_path / "out.npz")
    result, output = _harness.run_cluster(
        "resume.py", mode, backup, out, 9, "KILL", workers=2, max_restarts=1, timeout=240
    )
    assert result.returncode == 0 and result.restarts == 1, output[-4000:]
    assert "[launcher] worker 1 exited with code -9" in output
    assert output.count("DONE 18") == 2
    assert _harness.saved_weights_diff(reference, out) <= 1e-6
    assert sorted(os.listdir(tmp_path)) == sorted(["out.npz", "out.npz.killed"] + (["backup"] if mode == "manual" else []))


@pytest.mark.cluster
def test_callbacks_on_two_workers_leave_only_the_chiefs_files(tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    out = tmp_path / "out"
    monkeypatch.setenv("TMPDIR", str(scratch))  # the workers' (this process chose its own)
    result, output = _harness.run_cluster("callbacks_cluster.py", out, workers=2, timeout=240)
    monkeypatch.undo()
    assert result.returncode == 0, output[-4000:]
    assert sorted(os.listdir(out / "ckpt")) == ["best.weights.h5", "model-01.keras", "model-02.keras"]
    assert list(scratch.iterdir()) == []  # workers' scratch directories are gone
    events = [os.path.join(d, f) for d, _, files in os.walk(out / "tb") for f in files]
    assert events and all("events.out.tfevents" in e for e in events)
    # One writer per run directory (train/validation): the chief alone.
    assert sorted(os.path.basename(os.path.dirname(e)) for e in events) == ["train", "validation"]
    assert (out / "backup" / "latest").exists()
    # Written by another process: kd's classes must be registered here, as in a user's
    # process that loads the file without having used a kd model yet (docs/guides/saving.md).
    kd.Model  # noqa: B018  (loading kd's model classes registers them with Keras)

    loaded = keras.models.load_model(out / "ckpt" / "model-02.keras", compile=False)
    assert loaded.count_params() == 6


@pytest.mark.cluster
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
    with pytest.raises(CheckpointError, match=r"`directory`=.*/file/sub' is under .*, which is a file"):
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


@pytest.mark.cluster
def test_manager_keeps_max_and_never_exposes_partial_saves(tmp_path):
    step = tf.Variable(0)
    manager = kd.CheckpointManager(tf.train.Checkpoint(step=step), tmp_path, max_to_keep=2)
    for value in range(1, 5):
        step.assign(value)
        manager.save(epoch=value)
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["ckpt-3", "ckpt-4", "latest"]
    # A crash mid-save leaves a staging directory, never a new checkpoint.
    dead, live = _dead_pid(), os.getppid()
    crashed = tmp_path / f".tmp-kd-{files.host_tag()}-{dead}-1-ckpt-5-crashed"
    other_run = tmp_path / f".tmp-kd-{files.host_tag()}-{live}-{files.process_start_ticks(live)}-ckpt-5-x"
    foreign = tmp_path / ".tmp-not-ours"
    for entry in (crashed, other_run, foreign):
        entry.mkdir()
    step.assign(0)
    assert manager.restore_or_initialize()["epoch"] == 4 and int(step.numpy()) == 4
    manager.save(epoch=5)
    # The dead run's staging goes; a live run's, and what kd did not name, stay.
    assert not crashed.exists() and other_run.exists() and foreign.exists()
    manager.close()


# Faults: markers, damaged files, crashes mid-save, concurrent runs.


def _dead_pid():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait(timeout=60)
    return process.pid


def _saved(tmp_path, count, max_to_keep=3):
    """A manager over a variable saved `count` times (values 1..count)."""
    value = tf.Variable(0.0)
    manager = kd.CheckpointManager(tf.train.Checkpoint(value=value), tmp_path, max_to_keep=max_to_keep)
    for i in range(1, count + 1):
        value.assign(float(i))
        manager.save(epoch=i)
    value.assign(0.0)
    return manager, value


def _damage(path, how):
    data = next(path.glob("state.data-*"))
    if how == "truncated data file":
        with open(data, "r+b") as f:
            f.truncate(10)
    elif how == "flipped byte":
        content = bytearray(data.read_bytes())
        content[len(content) // 2] ^= 0xFF
        data.write_bytes(bytes(content))
    elif how == "broken progress.json":
        (path / "progress.json").write_text('{"epoch": 3, "st')
    elif how == "missing index":
        (path / "state.index").unlink()
    elif how == "missing data file":
        data.unlink()
    elif how == "missing manifest":
        (path / "manifest.json").unlink()
    elif how == "rewritten to another valid value":
        # What TensorFlow itself would write for another value: every checksum right.
        other = path.parent / "other"
        tf.train.Checkpoint(value=tf.Variable(-7.0)).write(str(other / "state"))
        for written in other.glob("state.*"):
            shutil.copyfile(written, path / written.name)
        shutil.rmtree(other)
    else:
        raise AssertionError(how)


_WHAT_IS_WRONG = {
    "truncated data file": r"state\.data-00000-of-00001' is truncated: 10 bytes, the manifest says \d+",
    "flipped byte": r"state\.data-00000-of-00001' has changed since kd wrote it",
    "broken progress.json": r"progress\.json' is truncated",
    "missing index": r"state\.index' is missing \(the manifest lists it\)",
    "missing data file": r"state\.data-00000-of-00001' is missing",
    "missing manifest": r"manifest\.json' is missing: kd writes it last into every checkpoint",
    "rewritten to another valid value": r"state\.(data-00000-of-00001|index)' has changed since kd wrote it",
}


def test_restore_ignores_the_latest_marker_and_keeps_the_intact_checkpoint(tmp_path, caplog):
    manager, value = _saved(tmp_path, 2, max_to_keep=1)
    assert sorted(os.listdir(tmp_path)) == [".kd-lock.json", ".kd-run.json", "ckpt-2", "latest"]
    (tmp_path / "latest").unlink()
    with caplog.at_level("INFO", logger="keras_distrib"):
        assert manager.restore_or_initialize()["epoch"] == 2 and float(value.numpy()) == 2.0
    assert "the `latest` marker is missing" in caplog.text
    (tmp_path / "latest").write_text("ckpt-9")
    caplog.clear()
    with caplog.at_level("INFO", logger="keras_distrib"):
        assert manager.restore_or_initialize()["epoch"] == 2
    assert "names 'ckpt-9', which is not there" in caplog.text
    # A save that fails midway (max_to_keep=1) leaves the intact checkpoint
    # and no staging directory behind.
    with mock.patch.object(tf.train.Checkpoint, "write", side_effect=OSError("disk full")):
        with pytest.raises(CheckpointError, match=r"Could not write the checkpoint .*ckpt-3.* \(OSError: "
                           r"disk full\); nothing was replaced, the older checkpoints were kept"):
            manager.save(epoch=3)
    assert sorted(n for n in os.listdir(tmp_path) if n[0] != ".") == ["ckpt-2", "latest"]
    assert manager.restore_or_initialize()["epoch"] == 2
    # The next complete save replaces it; only then is ckpt-2 removed.
    value.assign(3.0)
    manager.save(epoch=3)
    assert sorted(n for n in os.listdir(tmp_path) if n[0] != ".") == ["ckpt-3", "latest"]
    manager.close()


@pytest.mark.parametrize("how", sorted(_WHAT_IS_WRONG))
def test_a_damaged_newest_checkpoint_is_refused_naming_the_file_and_the_whole_one_before(how, tmp_path):
    """Every file is checked against the manifest kd wrote last; nothing is taken in its place silently.

    On 4c0b8d4 the rewritten value restored silently (-7.0), and the other
    damages fell back to ckpt-2 with a warning.
    """
    manager, value = _saved(tmp_path, 3)
    _damage(tmp_path / "ckpt-3", how)
    before = _tree_digest(tmp_path)
    with pytest.raises(kd.CheckpointError, match=r"The checkpoint '.*ckpt-3' fails its manifest check, so "
                       r"nothing was restored or changed:\n  - .*" + _WHAT_IS_WRONG[how]) as error:
        manager.restore_or_initialize()
    assert isinstance(error.value, checkpoint_lib.DamagedCheckpointError)
    assert error.value.previous == str(tmp_path / "ckpt-2")
    assert re.search(r"The checkpoint before it, '.*ckpt-2' \(epoch 2, step 0\), is whole\. To resume "
                     r"from it, move the damaged one away: `mv \S+ckpt-3 \S+damaged-ckpt-3`",
                     str(error.value)), str(error.value)
    assert float(value.numpy()) == 0.0 and _tree_digest(tmp_path) == before
    # The same for a path given explicitly (an evaluator, a manual restore).
    with pytest.raises(checkpoint_lib.DamagedCheckpointError, match=_WHAT_IS_WRONG[how]):
        manager.restore(str(tmp_path / "ckpt-3"))
    assert float(value.numpy()) == 0.0 and _tree_digest(tmp_path) == before
    # The advice works: moved away as it says, the run resumes from ckpt-2.
    command = re.search(r"`mv (\S+) (\S+)`", str(error.value))
    os.rename(command.group(1), command.group(2))
    assert manager.restore_or_initialize()["epoch"] == 2 and float(value.numpy()) == 2.0
    manager.close()


def test_the_last_whole_checkpoint_damaged_offers_no_other_and_relabel_keeps_the_manifest_true(tmp_path):
    manager, value = _saved(tmp_path, 1)
    # `relabel` rewrites progress.json: the manifest follows, and a resume is whole.
    manager.relabel(epoch=2, step=0)
    assert manager.restore_or_initialize()["epoch"] == 2 and float(value.numpy()) == 1.0
    assert checkpoint_lib.manifest_problems(str(tmp_path / "ckpt-1")) == []
    _damage(tmp_path / "ckpt-1", "flipped byte")
    with pytest.raises(checkpoint_lib.DamagedCheckpointError, match=r"No older checkpoint there is whole\. "
                       r"Put the file\(s\) back from a copy, or move the checkpoint away"):
        manager.restore_or_initialize()
    manager.close()


_HOLD_LOCK = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("kd_files", sys.argv[1])
files = importlib.util.module_from_spec(spec)
spec.loader.exec_module(files)
files.DirectoryLock(sys.argv[2], "backup").acquire()
print("LOCKED", flush=True)
time.sleep(120)
"""


def _hold_lock(directory):
    """A live process (not TensorFlow: it starts in milliseconds) holding `directory`'s lock."""
    process = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, files.__file__, str(directory)],
        stdout=subprocess.PIPE, text=True,
    )
    assert process.stdout.readline().strip() == "LOCKED"
    return process


@pytest.mark.cluster
def test_a_second_live_run_is_refused_and_a_dead_runs_lock_is_taken_over(tmp_path, caplog):
    backup = tmp_path / "backup"
    holder = _hold_lock(backup)
    try:
        inputs = keras.Input((2,))
        model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
        weights = [w.copy() for w in model.get_weights()]
        with pytest.raises(CheckpointError, match=rf"in use by another run: pid {holder.pid} on host"):
            model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0,
                      callbacks=[kd.callbacks.BackupAndRestore(str(backup))])
        assert os.listdir(backup) == [".kd-lock.json"]  # nothing restored, nothing written
        assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights()))
    finally:
        holder.kill()
        holder.wait(timeout=30)
    # The holder died without releasing: its lock is taken over, and logged.
    manager = kd.CheckpointManager(tf.train.Checkpoint(v=tf.Variable(1.0)), backup)
    with caplog.at_level("WARNING", logger="keras_distrib"):
        assert manager.restore_or_initialize() is None
    assert f"Took over the lock of checkpoint {str(backup)!r} left by pid {holder.pid}" in caplog.text
    manager.save(epoch=1)
    manager.delete_all()
    # Emptied; the directory stays: the holder made it, not a kd CheckpointManager.
    assert os.listdir(backup) == []


def test_only_the_chief_writes_and_locks_the_real_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": {"worker": ["localhost:1", "localhost:2"]}, "task": {"type": "worker", "index": 1}}))
    manager = kd.CheckpointManager(tf.train.Checkpoint(v=tf.Variable(1.0)), tmp_path / "backup")
    assert manager.restore_or_initialize() is None
    manager.save(epoch=1)  # into scratch space, removed at once
    assert not (tmp_path / "backup").exists()


def test_checkpoint_files_get_the_permissions_keras_would_give(tmp_path):
    previous = os.umask(0o027)
    try:
        manager, _ = _saved(tmp_path / "ckpt", 1)
        inputs = keras.Input((2,))
        model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
        model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0, callbacks=[
            kd.callbacks.ModelCheckpoint(str(tmp_path / "m.keras")),
            kd.callbacks.ModelCheckpoint(str(tmp_path / "m.weights.h5"), save_weights_only=True),
        ])
    finally:
        os.umask(previous)
    modes = {os.path.relpath(os.path.join(root, name), tmp_path): os.stat(os.path.join(root, name)).st_mode & 0o777
             for root, folders, names in os.walk(tmp_path) for name in folders + names}
    expected = {path: 0o750 if os.path.isdir(tmp_path / path) else 0o640 for path in modes}
    assert modes == expected and len(modes) >= 7, modes
    manager.close()


def test_backup_and_restore_refuses_a_plain_keras_model_before_writing(tmp_path):
    inputs = keras.Input((2,))
    plain = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    plain.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"`model` is a plain Functional.*kd\.Model\(inputs, outputs\).*"
                                         r"kd\.DistributedModelMixin"):
        plain.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0,
                  callbacks=[kd.callbacks.BackupAndRestore(str(tmp_path / "backup"))])
    assert not (tmp_path / "backup").exists()


def test_keras_file_of_a_kd_model_reloads_compiled_with_optimizer_state(tmp_path):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((3,))
    model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    x, y = np.random.rand(8, 3).astype("float32"), np.ones((8, 1), "float32")
    model.fit(x, y, batch_size=4, epochs=2, verbose=0,
              callbacks=[kd.callbacks.ModelCheckpoint(str(tmp_path / "m.keras"))])
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert isinstance(loaded, kd.Model) and loaded.compiled
    assert int(loaded.optimizer.iterations.numpy()) == 4
    for saved, restored in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(saved.numpy(), restored.numpy())
    # And it trains on as the original does (kd's steps, same optimizer state).
    model.fit(x, y, batch_size=4, verbose=0)
    loaded.fit(x, y, batch_size=4, verbose=0)
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
