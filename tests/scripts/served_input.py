"""kd.data.serve on 2 training workers and the launcher's data workers, against one device.

Run by kd.launch(workers=2, data_workers=2, max_restarts=1), 2 replicas
per worker, with a directory as argument. Two parts, each printing
'RESULT {json}' on every worker:

- exact: 21 rows in global batches of 4 (the last batch has 1 row: three
  of the 4 replicas get an empty piece), 2 epochs, float64, preprocessed on the data
  workers; the kd model against the same model trained on one device in
  this process on the same rows preprocessed here, from the same initial
  weights. On the first attempt training worker 1 kills itself mid-epoch 2;
  the launcher restarts everything (the service too) and training resumes
  from the backup at its step.
- exactly_once: 64 rows, 2 epochs, with data worker 1 killed (SIGKILL) by
  worker 0 after the first step; a metric counts how often this worker
  trained on each row's id per epoch (the test adds the workers' counts).
"""

import json
import os
import signal
import sys

import keras_distrib as kd

kd.virtual_devices(2)
strategy = kd.make_strategy("multi_worker")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

keras.config.set_floatx("float64")
info = kd.cluster_info()
backup_dir = sys.argv[1]
marker = os.path.join(backup_dir, "killed")


def preprocess(x, y):
    # Costs some work on the data worker, the same on every process.
    return tf.tanh(x) * 2.0 + tf.reduce_sum(x) * 0.1, y


def layers():
    return [keras.Input((3,)), keras.layers.Dense(5, activation="relu"), keras.layers.Dense(1)]


def largest(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)), initial=0.0)) for x, y in zip(a, b))


# Exact.
rng = np.random.default_rng(0)
x, y = rng.normal(size=(21, 3)), rng.normal(size=(21, 1))
keras.utils.set_random_seed(1)
reference = keras.Sequential(layers())
initial = reference.get_weights()
reference.compile(keras.optimizers.SGD(0.1), "mse")
local = tf.data.Dataset.from_tensor_slices((x, y)).map(preprocess).batch(4)
reference.fit(local, epochs=2, verbose=0)
with strategy.scope():
    model = kd.Sequential(layers())
    model.set_weights(initial)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    served = kd.data.serve((x, y), global_batch_size=4, mode="exact", preprocess=preprocess)


class KillTrainingWorker(keras.callbacks.Callback):
    """On the first attempt, worker 1 kills itself after step 2 of epoch 2 (the backup holds step 8)."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch, info.task_index) == (1, 2, 1) and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


model.fit(served, epochs=2, verbose=0, callbacks=[
    kd.callbacks.BackupAndRestore(os.path.join(backup_dir, "backup"), save_freq=2),
    KillTrainingWorker()])
print("RESULT " + json.dumps({
    "part": "exact", "task": info.label, "replicas": strategy.num_replicas_in_sync,
    "weights": largest(reference.get_weights(), model.get_weights()),
    "restarted": os.path.exists(marker), "steps": served.steps, "local": served.plan.local,
    "recovered": served.recovered,
}), flush=True)


# Exactly once, a data worker killed.
ROWS = 64


class SeenIds(keras.metrics.Metric):
    """How often each row id was trained on this epoch: the least, the most, the total."""

    def __init__(self, name="seen", **kwargs):
        super().__init__(name=name, **kwargs)
        self.counts = self.add_variable(shape=(ROWS,), initializer="zeros", name="counts",
                                        aggregation="sum")

    def update_state(self, y_true, y_pred, sample_weight=None):
        ids = tf.cast(tf.reshape(y_true, [-1]), tf.int32)
        self.counts.assign_add(tf.reduce_sum(tf.one_hot(ids, ROWS, dtype=self.counts.dtype), 0))

    def result(self):
        return {"seen_min": tf.reduce_min(self.counts), "seen_max": tf.reduce_max(self.counts),
                "seen_sum": tf.reduce_sum(self.counts)}


def data_worker_pid(index):
    """The pid of this launch's data worker `index` (its KD_TASK and dispatcher address)."""
    port = os.environ["KD_DATA_SERVICE"].rpartition(":")[2]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if (f"localhost:{port}".encode() in argv and f"KD_TASK=data_worker {index}".encode() in environ):
            return int(pid)
    return None


class KillDataWorker(keras.callbacks.Callback):
    """Kills data worker 1 after worker 0's first step; keeps this worker's id counts per epoch."""

    killed = None
    counts = []

    def on_epoch_end(self, epoch, logs=None):
        self.counts.append(np.asarray(seen_ids.counts.numpy()).astype(int).tolist())

    def on_train_batch_end(self, batch, logs=None):
        if info.task_index == 0 and self.killed is None and batch == 0:
            self.killed = data_worker_pid(1)
            os.kill(self.killed, signal.SIGKILL)
            print(f"killed data worker 1 (pid {self.killed})", flush=True)


def slow(x, y):
    # A map that costs more than a step: the data workers are still busy
    # when one of them is killed.
    m = tf.reshape(tf.tile(x, [86]), [1, 258])[:, :256]
    m = tf.reshape(tf.tile(m, [256, 1]), [256, 256]) * 1e-3
    for _ in range(8):
        m = tf.matmul(m, m)
    return x + tf.reduce_sum(m) * 0.0, y


ids = np.arange(ROWS, dtype=np.float64).reshape(ROWS, 1)
with strategy.scope():
    counter = kd.Sequential(layers())
    seen_ids = SeenIds()
    counter.compile(keras.optimizers.SGD(0.01), "mse", metrics=[seen_ids])
    served = kd.data.serve((rng.normal(size=(ROWS, 3)), ids), global_batch_size=4,
                           mode="exactly_once", preprocess=slow, stall_timeout=10)
killer = KillDataWorker()
counter.fit(served, epochs=2, verbose=0, callbacks=[killer])
print("RESULT " + json.dumps({
    "part": "exactly_once", "task": info.label,
    "counts": killer.counts,
    "killed": killer.killed, "recovered": served.recovered, "duplicates": served.duplicates,
    "stalls": served.stalls,
}), flush=True)
