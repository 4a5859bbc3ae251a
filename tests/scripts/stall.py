"""Trains for a long time; one task stalls or is stopped by the test.

Usage: stall.py [HANG_TASK HANG_STEP]
make_strategy("auto"): multi-worker, or a parameter server (this process is
then the coordinator). Every process prints `READY <task> <pid>` once it
has trained a few steps (the test then SIGKILLs or SIGSTOPs a task). With
HANG_TASK (e.g. `worker-1`), that task hangs at the start of step
HANG_STEP while its process stays healthy (a stuck data loader or file
read between steps). With HANG_TASK `mismatch`, worker 1 feeds labels of
shape (n,) where the others feed (n, 1).
"""

import os
import sys
import time

import keras_distrib as kd

strategy = kd.make_strategy("auto")
info = kd.cluster_info()
import keras  # noqa: E402
import numpy as np  # noqa: E402

hang_task = sys.argv[1] if len(sys.argv) > 1 else None
hang_step = int(sys.argv[2]) if len(sys.argv) > 2 else -1
me = f"{info.task_type}-{info.task_index}"
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype("float32")
y = x.sum(axis=1, keepdims=True)
if hang_task == "mismatch" and me == "worker-1":
    y = y[:, 0]


class Progress(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = 0

    def on_train_batch_begin(self, batch, logs=None):
        if self.steps == hang_step and me == hang_task:
            print(f"HANGING {me} before step {self.steps}", flush=True)
            while True:
                time.sleep(1)

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == 5:
            print(f"READY {me} {os.getpid()}", flush=True)
        time.sleep(0.01)  # a few steps a second is enough; leaves the CPUs to the test


with strategy.scope():
    inputs = keras.Input((4,))
    model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
model.fit(x, y, batch_size=16, epochs=100000, steps_per_epoch=4 if info.num_ps else None,
          shuffle=False, verbose=0, callbacks=[Progress()])
