"""The `train.py` of the Slurm guide's recipe (docs/guides/slurm.md), for tests/test_slurm.py.

Usage: slurm_train.py --backup-dir DIR [--out FILE.npz] [--reference]
kd `fit` with `kd.callbacks.BackupAndRestore(DIR, save_freq=2)` on the
cluster kd finds (Slurm, or the agent's TF_CONFIG); the chief writes the
final weights to `--out` (default `$KD_SLURM_OUT`). `--reference`: plain
Keras on one device instead, the independent result the tests compare
with. `KD_SLURM_SLOW=<seconds>` sleeps after each batch while the job has
not been requeued (`SLURM_RESTART_COUNT` unset or 0), so that a signal or
`scancel` finds it training. Every worker prints `READY <pid>` once
training runs, and `DONE <source> <workers> <task>` at the end.
"""

import argparse
import os
import time

parser = argparse.ArgumentParser()
parser.add_argument("--backup-dir", required=True)
parser.add_argument("--out", default=os.environ.get("KD_SLURM_OUT"))
parser.add_argument("--reference", action="store_true")
options = parser.parse_args()

import keras_distrib as kd  # noqa: E402

strategy = None if options.reference else kd.make_strategy("auto")
info = kd.cluster_info()
import keras  # noqa: E402
import numpy as np  # noqa: E402

GLOBAL_BATCH, EPOCHS = 8, 4  # 64 rows: 8 steps per epoch
rng = np.random.default_rng(5)
x = rng.normal(size=(64, 6)).astype("float32")
y = (np.tanh(x @ rng.normal(size=(6, 2)))).astype("float32")
requeued = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0
slow = 0.0 if requeued else float(os.environ.get("KD_SLURM_SLOW", "0"))


class Progress(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        print("READY", os.getpid(), flush=True)

    def on_train_batch_end(self, batch, logs=None):
        if slow:
            time.sleep(slow)


def build(model_class):
    keras.utils.set_random_seed(11)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = model_class(inputs, keras.layers.Dense(2)(hidden))
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse", metrics=["mae"])
    return model


if options.reference:
    model = build(keras.Model)
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    np.savez(options.out, *model.get_weights())
else:
    with strategy.scope():
        model = build(kd.Model)
    backup = kd.callbacks.BackupAndRestore(options.backup_dir, save_freq=2)
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[backup, Progress()])
    with kd.cluster.writer_directory(os.path.dirname(options.out)) as directory:
        np.savez(os.path.join(directory, os.path.basename(options.out)), *model.get_weights())
print("DONE", info.source, info.num_workers, info.label, flush=True)
