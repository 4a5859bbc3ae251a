"""The hand-written loop shape that hung: `iter()` of a distributed dataset inside a `tf.function`.

Usage: python tests/scripts/loop_shape.py [THREADS]

As tf-keras's hand-written-loop correctness cases write it: a `tf.function`
opens the iterator of a mirrored distributed dataset and pulls `next()` for
a fixed number of steps, each step a nested `tf.function` in `strategy.run`,
on a kd model with BatchNormalization; 66 rows in global batches of 32, so
the last batch (2 rows) is partial. Two cases per epoch count: 3 steps (the
whole epoch, ending on the partial batch) and 2 (fewer batches than the
dataset holds), 2 in a `tf.range` loop, and AutoGraph's `for batch in
dataset:` inside the function.
Each against plain Keras on one device, from the same
weights, on the same batches. Prints `RESULT {json}` per case: the largest
|a - b| / (1 + |a|) over every weight (moving statistics included), or the
error. THREADS fixes TensorFlow's inter-op pool to that size first (else
kd.virtual_devices sizes it).
"""

import json
import sys

import keras_distrib as kd

kd.virtual_devices(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if len(sys.argv) > 1:
    tf.config.threading.set_inter_op_parallelism_threads(int(sys.argv[1]))
STRATEGY = kd.make_strategy("mirrored")
EPOCHS = 2
rng = np.random.default_rng(3)
X = rng.normal(size=(66, 3)).astype("float32")
Y = (X @ np.array([[1.0], [-2.0], [0.5]], "float32") + 0.3).astype("float32")


def layers():
    return [keras.Input((3,)), keras.layers.Dense(8, activation="relu"),
            keras.layers.BatchNormalization(momentum=0.8), keras.layers.Dense(1)]


def distributed(steps, weights):
    with STRATEGY.scope():
        model = kd.Sequential(layers())
        model.set_weights(weights)
        optimizer = kd.exact_optimizer(keras.optimizers.Adam(0.05))
    data = STRATEGY.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((X, Y)).batch(32))

    @tf.function
    def train_epoch(dataset):
        @tf.function
        def step(batch):
            x, y = batch
            with tf.GradientTape() as tape:
                loss = kd.losses.global_mean(keras.losses.mean_squared_error(y, model(x, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        total = 0.0
        if steps == "for-in":
            for batch in dataset:
                total += STRATEGY.reduce("SUM", STRATEGY.run(step, args=(batch,)), axis=None)
            return total
        iterator = iter(dataset)
        if steps == "tf.range":  # an AutoGraph loop of 2 steps
            for _ in tf.range(2):
                total += STRATEGY.reduce("SUM", STRATEGY.run(step, args=(next(iterator),)), axis=None)
            return total
        for _ in range(steps):
            total += STRATEGY.reduce("SUM", STRATEGY.run(step, args=(next(iterator),)), axis=None)
        return total

    for _ in range(EPOCHS):
        train_epoch(data)
    return model.get_weights()


def reference(steps, weights):
    model = keras.Sequential(layers())
    model.set_weights(weights)
    optimizer = keras.optimizers.Adam(0.05)
    for _ in range(EPOCHS):
        for x, y in tf.data.Dataset.from_tensor_slices((X, Y)).batch(32).take({"for-in": 3, "tf.range": 2}.get(steps, steps)):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(keras.losses.mean_squared_error(y, model(x, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return model.get_weights()


weights = keras.Sequential(layers()).get_weights()
for steps in (3, 2, "tf.range", "for-in"):
    try:
        got = distributed(steps, weights)
    except Exception as error:  # noqa: BLE001 - reported, the test reads it
        print("RESULT " + json.dumps({"steps": steps, "error": f"{type(error).__name__}: {error}"}),
              flush=True)
        continue
    want = reference(steps, weights)
    diff = max(float(np.max(np.abs(a - b) / (1 + np.abs(a)))) for a, b in zip(want, got))
    print("RESULT " + json.dumps({"steps": steps, "diff": diff}), flush=True)
