"""Training that is preempted (SIGTERM) mid-epoch, saves, exits 42, and resumes.

Usage: preempt.py MODE BACKUP_DIR OUT_NPZ SIGNAL_CHUNK
MODE: fit (Model.fit + BackupAndRestore) or loop (TrainLoop.fit(backup_dir=)).
make_strategy("auto"): one device, multi-worker, or a parameter server
(then this process is the coordinator). On the first run (no marker file
next to OUT_NPZ) worker 1 (the coordinator under a parameter server, the
only process alone otherwise) sends itself SIGTERM after chunk
SIGNAL_CHUNK; SIGNAL_CHUNK < 0 trains uninterrupted. The chief writes the
final weights; every worker prints the position it saved at.
"""

import os
import signal
import sys

import keras_distrib as kd

mode, backup_dir, out, signal_chunk = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
strategy = kd.make_strategy("auto")
info = kd.cluster_info()
import keras  # noqa: E402
import numpy as np  # noqa: E402

GLOBAL_BATCH, EPOCHS, STEPS = 16, 3, 6
rng = np.random.default_rng(0)
x = rng.normal(size=(96, 5)).astype("float32")
y = (x @ rng.normal(size=(5, 1))).astype("float32")
marker = out + ".signalled"
signaller = info.num_workers > 1 and info.task_type == "worker" and info.task_index == 1 or (
    info.num_workers == 1 or info.num_ps) and info.is_chief


class Signal(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.chunks = 0

    def on_train_batch_end(self, batch, logs=None):
        self.chunks += 1
        if self.chunks == signal_chunk and signaller and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGTERM)


class Saved(keras.callbacks.Callback):
    def on_train_end(self, logs=None):
        print("ITERATIONS", int(self.model.optimizer.iterations.numpy()), flush=True)


with strategy.scope():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    model = kd.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(inputs)))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])

kwargs = dict(batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              steps_per_epoch=STEPS if info.num_ps else None)
if mode == "fit":
    model.fit(x, y, callbacks=[kd.callbacks.BackupAndRestore(backup_dir, save_freq=4), Signal(), Saved()], **kwargs)
else:
    kd.TrainLoop(model, steps_per_loop=2).fit(x, y, callbacks=[Signal(), Saved()], backup_dir=backup_dir,
                                              backup_freq=4, **kwargs)

with kd.cluster.writer_directory(os.path.dirname(out)) as directory:
    np.savez(os.path.join(directory, os.path.basename(out)), *model.get_weights())
print("DONE", model.optimizer.iterations.numpy(), flush=True)
