"""Write a checkpoint under N replicas, or restore one under N replicas.

Usage: ckpt_replicas.py N write|read DIR
"""

import json
import os
import sys

import keras_distrib as kd

n, action, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
kd.virtual_devices(n)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

strategy = kd.make_strategy("mirrored")
with strategy.scope():
    keras.utils.set_random_seed(5 if action == "write" else 9)
    inputs = keras.Input((4,))
    model = kd.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(6)(inputs)))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
manager = kd.CheckpointManager(checkpoint, directory)
x = np.random.default_rng(0).normal(size=(40, 4)).astype("float32")
if action == "write":
    model.fit(x, x[:, :3], batch_size=8, epochs=2, verbose=0)
    manager.save(epoch=2)
    np.savez(os.path.join(directory, "..", "expected.npz"), *model.get_weights())
    result = {"iterations": int(model.optimizer.iterations.numpy())}
else:
    progress = manager.restore_or_initialize()
    expected = np.load(os.path.join(directory, "..", "expected.npz"))
    diff = max(float(np.abs(a - expected[f"arr_{i}"]).max()) for i, a in enumerate(model.get_weights()))
    result = {"diff": diff, "epoch": progress["epoch"], "iterations": int(model.optimizer.iterations.numpy())}
print("RESULT " + json.dumps(result), flush=True)
