"""fit with ModelCheckpoint, TensorBoard and BackupAndRestore on every worker.

Usage: callbacks_cluster.py OUT_DIR
"""

import os
import sys

import keras_distrib as kd

out = sys.argv[1]
strategy = kd.make_strategy("multi_worker")
import keras  # noqa: E402
import numpy as np  # noqa: E402

rng = np.random.default_rng(0)
x = rng.normal(size=(70, 5)).astype("float32")
y = (x.sum(axis=1, keepdims=True)).astype("float32")
with strategy.scope():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="adam", loss="mse")
model.fit(
    x, y, batch_size=16, epochs=2, verbose=0, validation_data=(x, y),
    callbacks=[
        kd.callbacks.ModelCheckpoint(os.path.join(out, "ckpt", "model-{epoch:02d}.keras"), monitor="loss"),
        kd.callbacks.ModelCheckpoint(
            os.path.join(out, "ckpt", "best.weights.h5"), save_weights_only=True,
            save_best_only=True, monitor="loss", save_freq=3,
        ),
        kd.callbacks.TensorBoard(os.path.join(out, "tb")),
        kd.callbacks.BackupAndRestore(os.path.join(out, "backup"), save_freq=2, delete_checkpoint=False),
    ],
)
print("DONE", flush=True)
