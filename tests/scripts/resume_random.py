"""A float64 model full of random draws, interrupted after a backup and resumed.

Usage: resume_random.py REPLICAS MODE DATA BACKUP_DIR OUT_NPZ STOP_STEP [plain]

REPLICAS: 1 (one device, no strategy), the mirrored replicas (virtual CPUs),
`central<N>` (CentralStorageStrategy on N virtual CPUs), or
`workers` (one CPU per worker process, under `keras-distrib launch`; elastic:
in a cluster of 4, worker 3 ends with exit code 1 after STOP_STEP steps, then at
once in every later start: its node is gone, and the launcher's `min_workers`
goes on without it. The lost worker writes the time of its loss to
OUT_NPZ.lost, the chief of a smaller cluster the time its first step ended to
OUT_NPZ.back).
MODE: fit (Model.fit + BackupAndRestore(save_freq=2)), loop (kd.TrainLoop.fit
with `backup_dir`), manual (a hand-written loop with kd.CheckpointManager).
DATA: arrays (fit's own per-epoch shuffle) or dataset (a tf.data dataset that
reshuffles each epoch from a fixed seed).
STOP_STEP: the process ends itself (os._exit, no clean-up: a crash) after this
many steps; < 0 trains to the end. `plain` trains plain Keras on one device
(the reference). The model: random flips, BatchNormalization, Dropout,
GaussianNoise, and a `train_step` that draws a loss weight with
`keras.random` from the model's own SeedGenerator; Adam; 225 rows in global
batches of 32 (8 steps per epoch, the last of one row), 3 epochs.
"""

import os
import sys
import time

import keras_distrib as kd

replicas, mode, data_kind, backup_dir, out, stop = sys.argv[1:7]
stop = int(stop)
workers = replicas == "workers"
central = replicas.startswith("central")  # e.g. central2: CentralStorageStrategy on 2 CPUs
replicas = 0 if workers else int(replicas.removeprefix("central"))
plain = sys.argv[7:] == ["plain"]
info = kd.cluster_info()
if workers and info.num_workers == 4 and info.task_index == 3 and os.path.exists(out + ".lost"):
    os._exit(1)  # the node is gone: every restart of this worker fails at once
if replicas > 1:
    kd.virtual_devices(replicas)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

keras.config.set_floatx("float64")
ROWS, BATCH, EPOCHS, STEPS = 225, 32, 3, 8
rng = np.random.default_rng(0)
X = rng.normal(size=(ROWS, 8))
Y = np.tanh(X @ rng.normal(size=(8, 1))) + 0.1 * rng.normal(size=(ROWS, 1))


class JitteredLoss:
    """A train_step that weighs each step's loss by a draw from the model's SeedGenerator."""

    def train_step(self, data):
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        weight = 1.0 + keras.random.uniform((), seed=self.seed_generator, dtype="float64")
        with tf.GradientTape() as tape:
            predictions = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=predictions, training=True) * weight
        trainable = self.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(loss, trainable), trainable))
        return {"weight": weight}


class PlainModel(JitteredLoss, keras.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seed_generator = keras.random.SeedGenerator(11)


class KdModel(JitteredLoss, kd.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seed_generator = keras.random.SeedGenerator(11)


def build():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    h = keras.layers.Reshape((2, 4, 1))(inputs)
    h = keras.layers.RandomFlip("horizontal_and_vertical", seed=5)(h)
    h = keras.layers.Dense(16, activation="tanh")(keras.layers.Flatten()(h))
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dropout(0.3, seed=7)(h)
    h = keras.layers.GaussianNoise(0.1, seed=9)(h)
    model = (PlainModel if plain else KdModel)(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def dataset():
    rows = tf.data.Dataset.from_tensor_slices((X, Y))
    return rows.shuffle(ROWS, seed=3, reshuffle_each_iteration=os.environ.get("RR_RESHUFFLE", "1") == "1").batch(BATCH)


class Crash(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if workers:
            if info.num_workers == 4 and info.task_index == 3 and self.steps == stop:
                with open(out + ".lost", "w") as f:
                    f.write(repr(time.time()))
                os._exit(1)
            if info.num_workers < 4 and info.is_chief and self.steps == 1:
                with open(out + ".back", "w") as f:
                    f.write(repr(time.time()))
        elif self.steps == stop:
            os._exit(3)


if workers:
    strategy = kd.make_strategy("multi_worker")
elif central:
    strategy = kd.make_strategy("central_storage")
elif replicas == 1:
    strategy = tf.distribute.get_strategy()
else:
    strategy = kd.make_strategy("mirrored")
with strategy.scope():
    model = build()
inputs = dict(x=X, y=Y, batch_size=BATCH, shuffle=True) if data_kind == "arrays" else dict(x=dataset())
if plain and mode == "manual":
    data = dataset()
    for epoch in range(EPOCHS):  # one iterator per epoch, as the manual loop opens
        for x, y in data:
            model.train_on_batch(x, y)
elif plain:
    model.fit(**inputs, epochs=EPOCHS, verbose=0)
elif mode == "fit":
    model.fit(**inputs, epochs=EPOCHS, verbose=0,
              callbacks=[kd.callbacks.BackupAndRestore(backup_dir, save_freq=2), Crash()])
elif mode == "loop":
    kd.TrainLoop(model).fit(**inputs, epochs=EPOCHS, verbose=0, callbacks=[Crash()],
                            backup_dir=backup_dir, backup_freq=2)
else:
    loop = kd.TrainLoop(model)
    data = dataset()
    loop.build(loop.distribute(data).element_spec)
    manager = kd.CheckpointManager(tf.train.Checkpoint(model=model, optimizer=model.optimizer),
                                   backup_dir)
    progress = manager.restore_or_initialize() or {"epoch": 0, "step": 0}
    kd.replay_epochs(data, progress["epoch"])  # the resumed epoch's shuffle order
    crash = Crash()
    for epoch in range(progress["epoch"], EPOCHS):
        iterator = iter(loop.distribute(data))
        start = progress["step"] if epoch == progress["epoch"] else 0
        for _ in range(start):
            next(iterator)
        for step in range(start, STEPS):
            loop.train_step(iterator)
            if (step + 1) % 2 == 0:
                manager.save(epoch=epoch + (step + 1) // STEPS, step=(step + 1) % STEPS)
            crash.on_train_batch_end(step)
    manager.close()
with kd.cluster.writer_directory(os.path.dirname(out)) as directory:
    np.savez(os.path.join(directory, os.path.basename(out)), *model.get_weights())
print("DONE", int(model.optimizer.iterations.numpy()), flush=True)
