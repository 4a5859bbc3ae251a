"""Hostile input over the public API: every bad value gets a clear, early error.

Each row calls one public entry point with one bad value. The test asserts
the error type, that the message names the argument in backticks (and the
value or what is wrong), and that nothing in the working directory was
written or deleted: validation runs before any side effect.
"""

import hashlib
import json
import os
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_distrib as kd
from keras_distrib.validation import InputError

NAN, INF = float("nan"), float("inf")
X = np.ones((8, 3), "float32")
Y = np.ones((8, 1), "float32")


@pytest.fixture(scope="module")
def model():
    inputs = keras.Input((3,))
    model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _plain_model():
    inputs = keras.Input((3,))
    plain = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    plain.compile(optimizer="sgd", loss="mse")
    return plain


def _tf_config(**cluster):
    task_type = next(iter(cluster))
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": 0}})


def _dataset(*batches):
    dataset = tf.data.Dataset.from_tensor_slices((X, Y))
    for size in batches:
        dataset = dataset.batch(size)
    return dataset


def _read_only(c):
    """Makes `os.access` report `c.tmp` unwritable (as root, a 0o555 folder is writable)."""
    folder = c.tmp
    real = os.access
    c.monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if os.fspath(path) == str(folder)
                          else real(path, mode, **kw))
    return folder


def _launch(c, **kwargs):
    kwargs.setdefault("workers", 2)
    target = kwargs.pop("target", str(c.tmp / "train.py"))
    kd.launch(target, **kwargs)


def _fit(c, **kwargs):
    kwargs.setdefault("x", X)
    kwargs.setdefault("y", Y)
    kwargs.setdefault("verbose", 0)
    c.model.fit(**kwargs)


def _backup_plain_model(c):
    _plain_model().fit(X, Y, verbose=0, callbacks=[kd.callbacks.BackupAndRestore(str(c.tmp / "backup"))])


def _manager(c, **kwargs):
    kwargs.setdefault("checkpoint", tf.train.Checkpoint(v=tf.Variable(1.0)))
    kwargs.setdefault("directory", str(c.tmp / "ckpt"))
    return kd.CheckpointManager(kwargs.pop("checkpoint"), kwargs.pop("directory"), **kwargs)


# (id, call, error type, argument named in backticks, more of the message)
CASES = [
    # kd.launch / keras-distrib launch
    ("launch-timeout-nan", lambda c: _launch(c, timeout=NAN), kd.LaunchError, "timeout", "nan: expected a finite"),
    ("launch-timeout-inf", lambda c: _launch(c, timeout=INF), kd.LaunchError, "timeout", "inf: expected a finite"),
    ("launch-timeout-negative", lambda c: _launch(c, timeout=-1), kd.LaunchError, "timeout", "-1"),
    ("launch-timeout-string", lambda c: _launch(c, timeout="10"), kd.LaunchError, "timeout", "'10'"),
    ("launch-args-string", lambda c: _launch(c, args="--epochs 3"), kd.LaunchError, "args",
     r"'--epochs 3' is a string"),
    ("launch-args-none-item", lambda c: _launch(c, args=["--x", None]), kd.LaunchError, "args",
     r"items \[None\]"),
    ("launch-ports-duplicate", lambda c: _launch(c, ports=[41001, 41001]), kd.LaunchError, "ports",
     r"\[41001\] more than once"),
    ("launch-ports-range", lambda c: _launch(c, ports=[0, 99999]), kd.LaunchError, "ports", "1..65535"),
    ("launch-ports-string", lambda c: _launch(c, ports="41001"), kd.LaunchError, "ports", "list of port"),
    ("launch-workers-zero", lambda c: _launch(c, workers=0), kd.LaunchError, "workers", ">= 1"),
    ("launch-workers-float", lambda c: _launch(c, workers=1.5), kd.LaunchError, "workers", "1.5"),
    ("launch-ps-negative", lambda c: _launch(c, ps=-1), kd.LaunchError, "ps", "-1"),
    ("launch-max-restarts", lambda c: _launch(c, max_restarts=-1), kd.LaunchError, "max_restarts", "-1"),
    ("launch-chief-string", lambda c: _launch(c, chief="yes"), kd.LaunchError, "chief", "True or False"),
    ("launch-env-values", lambda c: _launch(c, env={"A": 1}), kd.LaunchError, "env", r"\['A'\]"),
    ("launch-log-dir-file", lambda c: _launch(c, log_dir=str(c.tmp / "keep.txt")), kd.LaunchError, "log_dir",
     "is a file"),
    ("launch-sink", lambda c: _launch(c, sink=3), kd.LaunchError, "sink", "callable"),
    ("launch-missing-script", lambda c: _launch(c, target=str(c.tmp / "nope.py")), kd.LaunchError, "target",
     "is not a file"),
    ("launch-missing-module", lambda c: _launch(c, target="no_such_module_kd:main"), kd.LaunchError, "target",
     "cannot be found"),
    ("local-cluster-workers", lambda c: kd.local_cluster(workers=0), kd.LaunchError, "workers", "0"),
    ("local-cluster-ps", lambda c: kd.local_cluster(ps=0), kd.LaunchError, "ps", "at least 1"),
    ("local-cluster-threads", lambda c: kd.local_cluster(worker_threads=0), kd.LaunchError, "worker_threads",
     "0"),
    # kd.cluster_info / TF_CONFIG
    ("tf-config-port-99999", lambda c: kd.cluster_info(_tf_config(worker=["h:99999"])), kd.ClusterConfigError,
     "TF_CONFIG", "port 99999 is out of range"),
    ("tf-config-port-0", lambda c: kd.cluster_info(_tf_config(worker=["h:0"])), kd.ClusterConfigError,
     "TF_CONFIG", "port 0 is out of range"),
    ("tf-config-same-address", lambda c: kd.cluster_info(_tf_config(worker=["h:1", "h:1"])),
     kd.ClusterConfigError, "TF_CONFIG", r"'h:1' is given to 2 tasks"),
    ("tf-config-index", lambda c: kd.cluster_info(json.dumps(
        {"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 3}})), kd.ClusterConfigError,
     "TF_CONFIG", "task index 3 is out of range"),
    ("tf-config-json", lambda c: kd.cluster_info("{cluster"), kd.ClusterConfigError, "TF_CONFIG",
     "not valid JSON"),
    # kd.make_strategy
    ("strategy-missing-gpus", lambda c: kd.make_strategy("mirrored", devices=["/gpu:0", "/gpu:1"]), ValueError,
     "devices", r"no such device\(s\) \['/gpu:0', '/gpu:1'\].*available"),
    ("strategy-missing-cpu", lambda c: kd.make_strategy("mirrored", devices=["/cpu:5"]), ValueError, "devices",
     r"no such device\(s\) \['/cpu:5'\]"),
    ("strategy-devices-string", lambda c: kd.make_strategy("mirrored", devices="/cpu:0"), ValueError, "devices",
     "single device; pass a list"),
    ("strategy-devices-duplicate", lambda c: kd.make_strategy("mirrored", devices=["/cpu:0", "/cpu:0"]),
     ValueError, "devices", "more than once"),
    ("strategy-devices-malformed", lambda c: kd.make_strategy("mirrored", devices=["garbage"]), ValueError,
     "devices", "malformed"),
    ("strategy-kind", lambda c: kd.make_strategy("mirror"), ValueError, "kind", "not a strategy kind"),
    ("strategy-num-packs", lambda c: kd.make_strategy("mirrored", num_packs=0), ValueError, "num_packs", "0"),
    ("strategy-cross-device-ops", lambda c: kd.make_strategy("mirrored", cross_device_ops="ring"), ValueError,
     "cross_device_ops", "not supported"),
    # kd.CheckpointManager
    ("manager-max-to-keep", lambda c: _manager(c, max_to_keep=0), kd.CheckpointError, "max_to_keep", "0"),
    ("manager-directory-file", lambda c: _manager(c, directory=str(c.tmp / "keep.txt")), kd.CheckpointError,
     "directory", "is a file"),
    ("manager-directory-under-file", lambda c: _manager(c, directory=str(c.tmp / "keep.txt" / "d")),
     kd.CheckpointError, "directory", "which is a file"),
    ("manager-checkpoint-type", lambda c: _manager(c, checkpoint={"v": 1}), kd.CheckpointError, "checkpoint",
     "tf.train.Checkpoint"),
    ("manager-save-epoch", lambda c: _manager(c).save(epoch=-1), kd.CheckpointError, "epoch", "-1"),
    ("manager-save-step-nan", lambda c: _manager(c).save(epoch=1, step=NAN), kd.CheckpointError, "step", "nan"),
    # kd.callbacks
    ("backup-dir-file", lambda c: kd.callbacks.BackupAndRestore(str(c.tmp / "keep.txt")), kd.CheckpointError,
     "backup_dir", "is a file"),
    ("backup-save-freq", lambda c: kd.callbacks.BackupAndRestore(str(c.tmp / "b"), save_freq=0), ValueError,
     "save_freq", "0"),
    ("backup-plain-model", _backup_plain_model, ValueError, "model", r"plain Functional.*kd\.Model"),
    ("checkpoint-under-file", lambda c: kd.callbacks.ModelCheckpoint(str(c.tmp / "keep.txt" / "m.keras")),
     ValueError, "filepath", "which is a file"),
    ("checkpoint-placeholder-typo", lambda c: kd.callbacks.ModelCheckpoint(str(c.tmp / "m-{epch}.keras")),
     ValueError, "filepath", r"\{epch\} looks like a typo of \{epoch\}"),
    ("checkpoint-monitor-type", lambda c: kd.callbacks.ModelCheckpoint(str(c.tmp / "m.keras"), monitor=5),
     ValueError, "monitor", "5"),
    ("checkpoint-read-only", lambda c: kd.callbacks.ModelCheckpoint(str(_read_only(c) / "m.keras")), ValueError,
     "filepath", "is not writable"),
    ("checkpoint-format-spec", lambda c: kd.callbacks.ModelCheckpoint(str(c.tmp / "m-{loss:d}.keras")),
     ValueError, "filepath", r"format spec of \{loss:d\}"),
    ("checkpoint-batch-per-epoch", lambda c: kd.callbacks.ModelCheckpoint(str(c.tmp / "m-{batch}.keras")),
     ValueError, "filepath", r"\{batch\} is only filled"),
    ("checkpoint-positional", lambda c: kd.callbacks.ModelCheckpoint(str(c.tmp / "m-{}.keras")), ValueError,
     "filepath", "positional"),
    ("checkpoint-unbalanced", lambda c: kd.callbacks.ModelCheckpoint(str(c.tmp / "m-{epoch.keras")),
     ValueError, "filepath", "not a valid template"),
    ("checkpoint-mode", lambda c: kd.callbacks.ModelCheckpoint(str(c.tmp / "m.keras"), mode="best"), ValueError,
     "mode", "'best'"),
    ("checkpoint-ending", lambda c: kd.callbacks.ModelCheckpoint(str(c.tmp / "m.h5")), ValueError, "filepath",
     "must end with '.keras'"),
    ("checkpoint-threshold-nan", lambda c: kd.callbacks.ModelCheckpoint(str(c.tmp / "m.keras"),
                                                                        initial_value_threshold=NAN),
     ValueError, "initial_value_threshold", "finite"),
    ("tensorboard-under-file", lambda c: kd.callbacks.TensorBoard(str(c.tmp / "keep.txt" / "logs")),
     kd.CheckpointError, "log_dir", "which is a file"),
    # Model.fit / evaluate / predict
    ("fit-length-mismatch", lambda c: _fit(c, y=Y[:7]), InputError, "y", r"`x` 8, `y` 7"),
    ("fit-string-labels", lambda c: _fit(c, y=np.array(["cat"] * 8)), InputError, "y", "holds strings"),
    ("fit-batched-twice", lambda c: _fit(c, x=_dataset(2, 2), y=None), InputError, "x", "batched twice"),
    ("fit-not-batched", lambda c: _fit(c, x=_dataset(), y=None), InputError, "x", "not batched"),
    ("fit-no-rows", lambda c: _fit(c, x=X[:0], y=Y[:0]), InputError, "x", "0 rows"),
    ("fit-filtered-to-nothing", lambda c: _fit(c, x=_dataset(2).filter(lambda a, b: False), y=None),
     kd.EmptyDataError, "x", "no batch"),
    ("fit-feature-shape", lambda c: _fit(c, x=np.ones((8, 4))), InputError, "x", r"\(8, 4\).*\(None, 3\)"),
    ("fit-epochs", lambda c: _fit(c, epochs=-1), InputError, "epochs", "-1"),
    ("fit-batch-size", lambda c: _fit(c, batch_size=0), InputError, "batch_size", "0"),
    ("fit-validation-split", lambda c: _fit(c, validation_split=NAN), InputError, "validation_split", "nan"),
    ("fit-validation-data", lambda c: _fit(c, validation_data=(X, Y[:3])), InputError, "validation_data[1]",
     "3"),
    ("fit-callbacks-type", lambda c: _fit(c, callbacks=kd.callbacks.TensorBoard), InputError, "callbacks",
     "list"),
    ("fit-class-weight", lambda c: _fit(c, class_weight={0: -1.0}), InputError, "class_weight", "-1.0"),
    ("fit-verbose", lambda c: _fit(c, verbose=5), InputError, "verbose", "5"),
    ("fit-y-with-dataset", lambda c: _fit(c, x=_dataset(2)), InputError, "y", "Drop `y`"),
    ("fit-x-none", lambda c: _fit(c, x=None, y=None), InputError, "x", "None"),
    ("evaluate-length-mismatch", lambda c: c.model.evaluate(X, Y[:3], verbose=0), InputError, "y",
     r"`x` 8, `y` 3"),
    ("predict-feature-shape", lambda c: c.model.predict(np.ones((8, 5)), verbose=0), InputError, "x",
     r"\(8, 5\)"),
    ("evaluate-shards-off-ps", lambda c: c.model.evaluate(X, Y, shards=2, verbose=0), InputError, "shards",
     "ParameterServerStrategy"),
    ("evaluate-return-dict", lambda c: c.model.evaluate(X, Y, return_dict="yes", verbose=0), InputError,
     "return_dict", "'yes': expected True"),
    ("evaluate-unknown-argument", lambda c: c.model.evaluate(X, Y, verbose=0, sample_weights=Y), InputError,
     "sample_weights", "not recognized; `evaluate` takes"),
    ("evaluate-weight-shape", lambda c: c.model.evaluate(X, Y, sample_weight=np.ones((8, 5)), verbose=0),
     InputError, "sample_weight", r"shape \(8, 5\), which cannot weigh `y` of shape \(8, 1\)"),
    ("evaluate-weight-strings", lambda c: c.model.evaluate(X, Y, sample_weight=np.array(["a"] * 8), verbose=0),
     InputError, "sample_weight", "expected numbers"),
    ("evaluate-weight-not-array", lambda c: c.model.evaluate(X, Y, sample_weight="w", verbose=0), InputError,
     "sample_weight", "expected an array of weights"),
    ("fit-weight-shape", lambda c: _fit(c, sample_weight=np.ones((8, 5))), InputError, "sample_weight",
     r"\(8, 5\)"),
    ("fit-initial-epoch-past-epochs", lambda c: _fit(c, initial_epoch=5, epochs=2), InputError, "initial_epoch",
     "is past `epochs`=2.*nothing would train"),
    # kd.losses
    ("losses-mean-strings", lambda c: kd.losses.global_mean(["a", "b"]), ValueError, "per_example_loss",
     "holds string values"),
    ("losses-mean-none", lambda c: kd.losses.global_mean(None), ValueError, "per_example_loss", "None"),
    ("losses-mean-ragged", lambda c: kd.losses.global_mean([[1.0], [2.0, 3.0]]), ValueError, "per_example_loss",
     "cannot be a tensor"),
    ("losses-mean-weight-shape", lambda c: kd.losses.global_mean(tf.ones(4), sample_weight=tf.ones(3)),
     ValueError, "sample_weight", r"shape \(3,\) cannot weigh `per_example_loss` of shape \(4,\)"),
    ("losses-share-strings", lambda c: kd.losses.global_share("a", 2), ValueError, "numerator", "string"),
    ("losses-share-denominator", lambda c: kd.losses.global_share(1.0, "x"), ValueError, "local_denominator",
     "string"),
    ("losses-regularization-none", lambda c: kd.losses.scale_regularization(None), ValueError, "losses", "None"),
    ("losses-regularization-rows", lambda c: kd.losses.scale_regularization([1.0], local_rows=-1), ValueError,
     "local_rows", "-1: expected"),
    ("losses-regularization-rows-float", lambda c: kd.losses.scale_regularization([1.0], local_rows=1.5),
     ValueError, "local_rows", "1.5"),
    # kd.TrainLoop
    ("train-loop-plain-model", lambda c: kd.TrainLoop(_plain_model()), ValueError, "model", "plain Functional"),
    ("train-loop-steps", lambda c: kd.TrainLoop(c.model, steps_per_loop=0), ValueError, "steps_per_loop", "0"),
    ("train-loop-fit-lengths", lambda c: kd.TrainLoop(c.model).fit(X, Y[:5], verbose=0), InputError, "y",
     r"`y` 5"),
    # kd.distribute_dataset, kd.virtual_devices
    ("dataset-batch-size", lambda c: kd.distribute_dataset(X, global_batch_size=0), ValueError,
     "global_batch_size", "0"),
    ("dataset-shard-policy", lambda c: kd.distribute_dataset(X, global_batch_size=2, shard_policy="rows"),
     ValueError, "shard_policy", "'rows'"),
    ("dataset-drop-remainder", lambda c: kd.distribute_dataset(X, global_batch_size=2, drop_remainder="yes"),
     ValueError, "drop_remainder", "'yes'"),
    ("dataset-strategy", lambda c: kd.distribute_dataset(X, global_batch_size=2, strategy="mirrored"),
     ValueError, "strategy", "tf.distribute.Strategy"),
    ("replica-split-rows", lambda c: kd.data.replica_split(-1, 2), ValueError, "rows", "-1"),
    ("replica-split-replicas", lambda c: kd.data.replica_split(8, 0), ValueError, "replicas", "0"),
    ("file-count-array", lambda c: kd.data.file_count(X), ValueError, "dataset", "expected a tf.data.Dataset"),
    ("describe-input-steps", lambda c: kd.describe_input(X, global_batch_size=2, steps_per_epoch=-1,
                                                         print_fn=lambda *a: None), ValueError,
     "steps_per_epoch", "-1"),
    ("chief-verbose", lambda c: kd.cluster.chief_verbose(7), ValueError, "verbose", "7"),
    ("writer-directory-file", lambda c: kd.cluster.writer_directory(str(c.tmp / "keep.txt")).__enter__(),
     ValueError, "directory", "is a file"),
    ("save-for-keras-suffix", lambda c: kd.save_for_keras(c.model, str(c.tmp / "m.h5")), ValueError,
     "filepath", "does not end in .keras"),
    ("save-for-keras-overwrite", lambda c: kd.save_for_keras(c.model, str(c.tmp / "m.keras"), overwrite="no"),
     ValueError, "overwrite", "'no'"),
    ("load-model-missing", lambda c: kd.load_model(str(c.tmp / "none.keras")), ValueError, "filepath",
     "does not exist"),
    ("virtual-devices-count", lambda c: kd.virtual_devices(0), ValueError, "n", "0"),
    ("virtual-devices-type", lambda c: kd.virtual_devices(2, "TPU"), ValueError, "device_type", "'TPU'"),
]


def _digest(root):
    digest = hashlib.sha256()
    for folder, dirs, names in sorted(os.walk(root)):
        dirs.sort()
        digest.update(os.path.relpath(folder, root).encode())
        for name in sorted(names):
            with open(os.path.join(folder, name), "rb") as f:
                digest.update(name.encode() + f.read())
    return digest.hexdigest()


def test_the_table_is_large_and_ids_are_unique():
    assert len(CASES) >= 40
    assert len({case[0] for case in CASES}) == len(CASES)


@pytest.mark.parametrize("call,error,argument,detail", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_early_error(call, error, argument, detail, model, tmp_path, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    (tmp_path / "keep.txt").write_text("existing data")
    (tmp_path / "train.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    before = _digest(tmp_path)
    context = types.SimpleNamespace(tmp=tmp_path, monkeypatch=monkeypatch, model=model)
    with pytest.raises(error, match="(?s)" + detail) as raised:
        call(context)
    assert f"`{argument}`" in str(raised.value)
    assert _digest(tmp_path) == before  # nothing written, nothing deleted
