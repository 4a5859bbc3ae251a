"""Which functions AutoGraph converts while a hand-written step traces.

Usage: python tests/scripts/autograph_rules.py

The step is the recipe kd documents (docs/guides/hand-written-loops.md, tutorials/custom_training_loop)
on 2 replicas: a kd model with BatchNormalization and penalties, per-example
losses through `kd.losses.global_mean`, `model.losses` through
`kd.losses.scale_regularization` (inside a helper of the user's own),
`kd.exact_optimizer`. While it traces, a profiler records every function
AutoGraph generated, by the module of the original (a converted function
runs with its original module's globals) and name (`tf__<name>`).

The contrast traces the same step with the two `kd.losses` functions taken
out of their `do_not_convert` wrappers (`__wrapped__`): what a user's trace
ran before.

Prints one `RESULT {json}` line: `kd` and `kd_unwrapped` (the sorted
`module:name` of the converted functions that ran), and `losses` (each
trace's loss: the same model, weights and batch).
"""

import json
import sys
import threading

import keras_distrib as kd

kd.virtual_devices(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

strategy = kd.make_strategy("mirrored")
rng = np.random.default_rng(0)
x = rng.normal(size=(6, 4)).astype("float32")
y = rng.normal(size=(6, 1)).astype("float32")
batch = next(iter(strategy.experimental_distribute_dataset(
    tf.data.Dataset.from_tensor_slices((x, y)).batch(6))))


def scaled_penalty(model, rows, scale):
    """A helper of the user's own: AutoGraph converts it as part of the step."""
    return scale(model.losses, local_rows=rows)


def make_step(global_mean, scale_regularization):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = kd.Sequential([
            keras.Input((4,)),
            keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(1e-2),
                               activity_regularizer=keras.regularizers.L2(1e-2)),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(1),
        ])
        optimizer = kd.exact_optimizer(keras.optimizers.Adam(0.02))

    def replica_step(batch):
        features, labels = batch
        with tf.GradientTape() as tape:
            errors = keras.losses.mean_squared_error(labels, model(features, training=True))
            penalty = scaled_penalty(model, tf.shape(features)[0], scale_regularization)
            loss = global_mean(errors) + penalty
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(batch):
        return strategy.reduce("SUM", strategy.run(replica_step, args=(batch,)), axis=None)

    return step


def converted(step):
    """Runs `step` once (its trace); returns the converted functions that ran, and the loss."""
    names = set()

    def profile(frame, event, arg):
        name = frame.f_code.co_name
        if event == "call" and "__autograph_generated_file" in frame.f_code.co_filename \
                and name.startswith("tf__"):
            names.add(f"{frame.f_globals.get('__name__')}:{name[4:]}")

    sys.setprofile(profile)
    threading.setprofile(profile)  # the replicas trace on threads of their own
    try:
        loss = float(step(batch))
    finally:
        threading.setprofile(None)
        sys.setprofile(None)
    return sorted(names), loss


result = {}
result["kd"], loss = converted(make_step(kd.losses.global_mean, kd.losses.scale_regularization))
result["kd_unwrapped"], unwrapped_loss = converted(
    make_step(kd.losses.global_mean.__wrapped__, kd.losses.scale_regularization.__wrapped__))
result["losses"] = [loss, unwrapped_loss]
print("RESULT " + json.dumps(result), flush=True)
