"""Training that can be killed mid-epoch and resumed from its backup.

Usage: resume.py MODE BACKUP_DIR OUT_NPZ KILL_STEP SIGNAL
MODE: fit (Model.fit + BackupAndRestore), loop (TrainLoop.fit(backup_dir=)),
manual (a hand-written loop with kd.CheckpointManager). On its first run
(no marker file next to OUT_NPZ) the process sends itself SIGNAL (KILL or
TERM) after global step KILL_STEP (on worker 1 when there are several);
KILL_STEP < 0 trains uninterrupted. The chief writes the final weights.
"""

import os
import signal
import sys

import keras_distrib as kd

mode, backup_dir, out, kill_step, signame = sys.argv[1:6]
kill_step = int(kill_step)
info = kd.cluster_info()
strategy = kd.make_strategy("multi_worker" if info.num_workers > 1 else "default")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

GLOBAL_BATCH, EPOCHS = 16, 3
rng = np.random.default_rng(0)
x = rng.normal(size=(90, 5)).astype("float32")  # 6 steps per epoch, last one 10 rows
y = (x @ rng.normal(size=(5, 1))).astype("float32")
marker = out + ".killed"
killer_task = 1 if info.num_workers > 1 else 0


class Killer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.step = 0

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if self.step == kill_step and not os.path.exists(marker) and info.task_index == killer_task:
            open(marker, "w").close()
            os.kill(os.getpid(), getattr(signal, "SIG" + signame))


with strategy.scope():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    model = kd.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(inputs)))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])

if mode == "fit":
    history = model.fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
        callbacks=[kd.callbacks.BackupAndRestore(backup_dir, save_freq=2), Killer()],
    )
elif mode == "loop":
    loop = kd.TrainLoop(model, steps_per_loop=2)
    history = loop.fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
        callbacks=[Killer()], backup_dir=backup_dir, backup_freq=2,
    )
else:
    loop = kd.TrainLoop(model)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = dataset.with_options(options)
    manager = kd.CheckpointManager(
        tf.train.Checkpoint(model=model, optimizer=model.optimizer), backup_dir, max_to_keep=2
    )
    loop.build(loop.distribute(dataset).element_spec)
    progress = manager.restore_or_initialize() or {"epoch": 0, "step": 0}
    killer, global_step = Killer(), 0
    for epoch in range(progress["epoch"], EPOCHS):
        iterator = iter(loop.distribute(dataset))
        start = progress["step"] if epoch == progress["epoch"] else 0
        for _ in range(start):
            next(iterator)  # the data position: skip what the checkpoint holds
        for step in range(start, 6):
            loop.train_step(iterator)
            if (step + 1) % 2 == 0:
                manager.save(epoch=epoch + (step + 1) // 6, step=(step + 1) % 6)
            killer.on_train_batch_end(step)
    history = None

with kd.cluster.writer_directory(os.path.dirname(out)) as directory:
    np.savez(os.path.join(directory, os.path.basename(out)), *model.get_weights())
print("DONE", model.optimizer.iterations.numpy(), flush=True)
