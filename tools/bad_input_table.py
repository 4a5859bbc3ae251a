"""The hostile-input table over kd's public entry points: clear, raw or silent.

Each row calls one public entry point (a function, a class, a method, a
callback, a CLI command) with one hostile value: a wrong type, a negative
or NaN number, a huge or empty value, a missing file, a symlink. The call
is classified:

- clear: an error naming the argument in backticks (or, for the CLI,
  argparse's usage error naming the option), not a TensorFlow traceback;
- raw: any other error (a deep traceback, a message that names nothing);
- silent: the call returned (the bad value was accepted).

The rows of tests/test_bad_input.py are included, so the table grows with
it; the extra rows here are those the test table does not (or cannot
cheaply) assert on. Run it from a checkout:

    PYTHONPATH=$PWD python tools/bad_input_table.py [--rows]

It prints the counts and, with --rows, one line per row.
"""

import argparse
import contextlib
import io
import math
import os
import sys
import tempfile
import types
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_distrib as kd  # noqa: E402
from keras_distrib.commands import cli  # noqa: E402
from tests import test_bad_input  # noqa: E402

NAN = math.nan
X = np.ones((8, 3), "float32")
Y = np.ones((8, 1), "float32")
RAW_MARKS = ("{{function_node", "Graph execution error", "in user code", "Traceback")


def _model():
    inputs = keras.Input((3,))
    model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _cli(*argv):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            code = cli.main(list(argv))
        except SystemExit as stop:
            code = stop.code
    if code not in (0, None):
        raise _CliError(code, err.getvalue())
    return code


class _CliError(Exception):
    def __init__(self, code, text):
        super().__init__(f"exit {code}: {text.strip()[-300:]}")
        self.code, self.text = code, text


def _extra_rows():
    model = _model()
    loop = kd.TrainLoop(model)
    folder = tempfile.mkdtemp(prefix="kd_table_")
    link = os.path.join(folder, "dangling")
    os.symlink(os.path.join(folder, "nowhere"), link)
    missing = os.path.join(folder, "missing.py")
    return [
        # Model.evaluate / predict / fit
        ("evaluate batch_size=0", lambda: model.evaluate(X, Y, batch_size=0, verbose=0)),
        ("evaluate batch_size='4'", lambda: model.evaluate(X, Y, batch_size="4", verbose=0)),
        ("evaluate steps=nan", lambda: model.evaluate(X, Y, steps=NAN, verbose=0)),
        ("evaluate steps=-1", lambda: model.evaluate(X, Y, steps=-1, verbose=0)),
        ("evaluate sample_weight 3 rows", lambda: model.evaluate(X, Y, sample_weight=np.ones(3), verbose=0)),
        ("evaluate callbacks=class", lambda: model.evaluate(X, Y, verbose=0, callbacks=kd.callbacks.TensorBoard)),
        ("predict batch_size=-3", lambda: model.predict(X, batch_size=-3, verbose=0)),
        ("predict steps=0", lambda: model.predict(X, steps=0, verbose=0)),
        ("predict x=None", lambda: model.predict(None, verbose=0)),
        ("fit steps_per_epoch=1e3", lambda: model.fit(X, Y, steps_per_epoch=1e3, verbose=0)),
        ("fit validation_batch_size=0", lambda: model.fit(X, Y, validation_data=(X, Y), validation_batch_size=0,
                                                          verbose=0)),
        ("fit epochs=nan", lambda: model.fit(X, Y, epochs=NAN, verbose=0)),
        ("compile steps_per_execution=0", lambda: _model().compile("sgd", "mse", steps_per_execution=0)),
        # TrainLoop methods
        ("TrainLoop.fit epochs=-1", lambda: loop.fit(X, Y, epochs=-1, verbose=0)),
        ("TrainLoop.evaluate steps=0", lambda: loop.evaluate(X, Y, steps=0, verbose=0)),
        ("TrainLoop.predict batch_size=0", lambda: loop.predict(X, batch_size=0, verbose=0)),
        ("TrainLoop steps_per_loop=nan", lambda: kd.TrainLoop(model, steps_per_loop=NAN)),
        # kd.losses
        ("losses.global_mean weight strings", lambda: kd.losses.global_mean(tf.ones(4), sample_weight="w")),
        ("losses.scale_regularization 'a'", lambda: kd.losses.scale_regularization("a")),
        ("compile unknown loss reduction", lambda: _model().compile(
            "sgd", keras.losses.MeanSquaredError(reduction="avg"))),
        # kd.data
        ("distribute_dataset gbs=3.5", lambda: kd.distribute_dataset(X, global_batch_size=3.5)),
        ("distribute_dataset gbs='8'", lambda: kd.distribute_dataset(X, global_batch_size="8")),
        ("distribute_dataset gbs=nan", lambda: kd.distribute_dataset(X, global_batch_size=NAN)),
        ("distribute_dataset seed='x'", lambda: kd.distribute_dataset(X, global_batch_size=2, shuffle=True,
                                                                      seed="x")),
        ("data.shard_files missing", lambda: kd.data.shard_files(os.path.join(folder, "none-*.tfrecord"))),
        ("data.shard_files []", lambda: kd.data.shard_files([])),
        # kd.gradients
        ("gradients.all_reduce strings", lambda: kd.gradients.all_reduce(["a"])),
        ("gradients.exact_optimizer 'sgd'", lambda: kd.exact_optimizer("sgd")),
        # kd.cluster
        ("cluster.parse_tf_config list", lambda: kd.cluster.parse_tf_config("[1, 2]")),
        ("cluster.parse_tf_config no task", lambda: kd.cluster.parse_tf_config('{"cluster": {"worker": ["h:1"]}}')),
        # kd.testing
        ("testing.local_strategy kind", lambda: kd.testing.local_strategy("mirror")),
        ("testing.local_strategy replicas=0", lambda: kd.testing.local_strategy("mirrored", replicas=0)),
        ("testing.assert_parity path", lambda: kd.testing.assert_parity(_model, (X, Y), path="train")),
        ("testing.assert_parity tolerance=-1", lambda: kd.testing.assert_parity(_model, (X, Y), tolerance=-1)),
        ("testing.run_in_cluster workers=0", lambda: kd.testing.run_in_cluster(print, workers=0)),
        # callbacks, CheckpointManager, SidecarEvaluator
        ("BackupAndRestore dangling symlink", lambda: kd.callbacks.BackupAndRestore(link)),
        ("BackupAndRestore save_freq=nan", lambda: kd.callbacks.BackupAndRestore(folder + "/b", save_freq=NAN)),
        ("ModelCheckpoint save_freq=-1", lambda: kd.callbacks.ModelCheckpoint(folder + "/m.keras", save_freq=-1)),
        ("TensorBoard log_dir=None", lambda: kd.callbacks.TensorBoard(None)),
        ("CheckpointManager max_to_keep=nan", lambda: kd.CheckpointManager(
            tf.train.Checkpoint(v=tf.Variable(1.0)), folder + "/c", max_to_keep=NAN)),
        ("SidecarEvaluator poll_seconds=-1", lambda: kd.SidecarEvaluator(model, X, folder, y=Y, poll_seconds=-1)),
        ("SidecarEvaluator mode='best'", lambda: kd.SidecarEvaluator(model, X, folder, y=Y, mode="best")),
        ("SidecarEvaluator missing dir", lambda: kd.SidecarEvaluator(model, X, folder + "/none/x", y=Y,
                                                                      max_evaluations=0)),
        # kd.launch, local_cluster, virtual_devices
        ("launch missing script", lambda: kd.launch(missing)),
        ("launch grace_period=nan", lambda: kd.launch(__file__, grace_period=NAN)),
        ("launch private_network='yes'", lambda: kd.launch(__file__, private_network="yes")),
        ("launch evaluator=1", lambda: kd.launch(__file__, evaluator=1)),
        ("local_cluster worker_threads=nan", lambda: kd.local_cluster(worker_threads=NAN)),
        ("virtual_devices memory=-1", lambda: kd.virtual_devices(2, memory_limit_mb=-1)),
        # CLI commands
        ("cli launch --workers 0", lambda: _cli("launch", "--workers", "0", __file__)),
        ("cli launch --workers x", lambda: _cli("launch", "--workers", "x", __file__)),
        ("cli launch --timeout nan", lambda: _cli("launch", "--workers", "1", "--timeout", "nan", __file__)),
        ("cli launch missing script", lambda: _cli("launch", "--workers", "1", missing)),
        ("cli launch --max-restarts 1e20", lambda: _cli("launch", "--workers", "1", "--max-restarts", "1e20",
                                                        __file__)),
        ("cli unknown command", lambda: _cli("lanch")),
    ]


def _classify(call):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            call()
        except _CliError as error:
            return ("clear" if "usage:" in error.text or "--" in error.text or "`" in error.text
                    else "raw"), str(error)
        except BaseException as error:  # noqa: BLE001 - every outcome is a row
            text = f"{type(error).__name__}: {error}"
            named = "`" in str(error) or isinstance(error, SystemExit)
            return ("clear" if named and not any(m in str(error) for m in RAW_MARKS) else "raw"), text
    return "silent", "returned"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", action="store_true", help="print every row")
    options = parser.parse_args()
    counts = {"clear": 0, "raw": 0, "silent": 0}
    rows = []
    model = _model()
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.delenv("TF_CONFIG", raising=False)
        for name, call, *_ in test_bad_input.CASES:
            tmp = tempfile.mkdtemp(prefix="kd_table_")
            with open(os.path.join(tmp, "keep.txt"), "w") as f:
                f.write("existing data")
            with open(os.path.join(tmp, "train.py"), "w") as f:
                f.write("pass\n")
            context = types.SimpleNamespace(tmp=__import__("pathlib").Path(tmp), monkeypatch=monkeypatch,
                                            model=model)
            with pytest.MonkeyPatch.context() as inner:
                context.monkeypatch = inner
                rows.append((f"[test table] {name}", *_classify(lambda: call(context))))
        for name, call in _extra_rows():
            rows.append((name, *_classify(call)))
    for name, kind, text in rows:
        counts[kind] += 1
        if options.rows:
            print(f"{kind:6} | {name} | {text.splitlines()[0][:160] if text else ''}")
    print(f"{len(rows)} rows: {counts['clear']} clear, {counts['raw']} late or raw, "
          f"{counts['silent']} silently accepted")


if __name__ == "__main__":
    main()
