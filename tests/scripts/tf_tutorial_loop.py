"""TensorFlow's custom-training tutorial loop vs kd.TrainLoop, 2 replicas.

The tutorial loop: strategy.run over a distributed dataset with even
batches, per-example losses scaled by tf.nn.compute_average_loss with the
fixed global batch size, optimizer built in the scope. kd.TrainLoop with
`train_step(iterator)` and with `train_epoch(dataset)` must give the same
weights. Also records the errors the loop raises for misuse.
"""

import json

import keras_distrib as kd

kd.virtual_devices(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

GLOBAL_BATCH = 16
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 5)).astype("float32")
y = rng.integers(0, 3, size=(64,)).astype("int32")
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
strategy = kd.make_strategy("mirrored")


def build(cls):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return cls(inputs, keras.layers.Dense(3)(hidden))


loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
with strategy.scope():
    tutorial_model = build(keras.Model)
    optimizer = keras.optimizers.Adam(0.01)
    optimizer.build(tutorial_model.trainable_variables)


def tutorial_step(inputs):
    features, labels = inputs
    with tf.GradientTape() as tape:
        per_example = loss_fn(labels, tutorial_model(features, training=True))
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
    grads = tape.gradient(loss, tutorial_model.trainable_variables)
    optimizer.apply_gradients(zip(grads, tutorial_model.trainable_variables))
    return loss


@tf.function
def distributed_step(inputs):
    per_replica = strategy.run(tutorial_step, args=(inputs,))
    return strategy.reduce("SUM", per_replica, axis=None)


distributed = strategy.experimental_distribute_dataset(dataset)
for epoch in range(3):
    for batch in distributed:
        distributed_step(batch)


def kd_model():
    with strategy.scope():
        model = build(kd.Model)
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a.get_weights(), b.get_weights()))


stepped = kd_model()
loop = kd.TrainLoop(stepped)
for epoch in range(3):
    iterator = iter(loop.distribute(dataset))
    for _ in range(4):
        logs = loop.train_step(iterator)

whole = kd_model()
epoch_loop = kd.TrainLoop(whole)
for epoch in range(3):
    epoch_loop.train_epoch(epoch_loop.distribute(dataset))

errors = {}
try:
    loop.train_step(iter(dataset))
except ValueError as error:
    errors["not_distributed"] = str(error)
outside = build(kd.Model)
outside.compile(optimizer="adam", loss="mse")
try:
    kd.TrainLoop(outside, strategy=strategy)
except ValueError as error:
    errors["model_outside"] = str(error)
with strategy.scope():
    inside = build(kd.Model)
inside.compile(optimizer=keras.optimizers.Adam(), loss="mse")  # optimizer made outside
try:
    kd.TrainLoop(inside)
except ValueError as error:
    errors["optimizer_outside"] = str(error)

print("RESULT " + json.dumps({
    "step_vs_tutorial": diff(tutorial_model, stepped),
    "epoch_vs_tutorial": diff(tutorial_model, whole),
    "logs": sorted(logs),
    "errors": errors,
}), flush=True)
