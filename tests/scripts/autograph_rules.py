"""Which modules AutoGraph converts while a hand-written step traces, with and without kd's rule.

Usage: python tests/scripts/autograph_rules.py

The step is the recipe kd documents (README, tutorials/custom_training_loop)
on 2 replicas: a kd model with BatchNormalization and penalties, per-example
losses through `kd.losses.global_mean`, `model.losses` through
`kd.losses.scale_regularization`, `kd.exact_optimizer`. It is traced twice,
in this order (AutoGraph caches a function it left alone, not one it
converted): first with kd's rule taken out of AutoGraph's rules (the
contrast: what a user's trace did before), then with it. While each trace
runs, a profiler records the module of every function AutoGraph generated
(a converted function runs with its original module's globals).

Prints one `RESULT {json}` line: `without` and `with` (the sorted modules
whose functions ran converted), `losses` (each trace's loss, the same model
and batch), `rule_first` (whether kd's rule leads AutoGraph's rules).
"""

import json
import sys
import threading

import keras_distrib as kd

kd.virtual_devices(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.autograph.core import config as autograph_config  # noqa: E402

strategy = kd.make_strategy("mirrored")
rng = np.random.default_rng(0)
x = rng.normal(size=(6, 4)).astype("float32")
y = rng.normal(size=(6, 1)).astype("float32")
batch = next(iter(strategy.experimental_distribute_dataset(
    tf.data.Dataset.from_tensor_slices((x, y)).batch(6))))


def make_step():
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
            penalty = kd.losses.scale_regularization(model.losses, local_rows=tf.shape(features)[0])
            loss = kd.losses.global_mean(errors) + penalty
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(batch):
        return strategy.reduce("SUM", strategy.run(replica_step, args=(batch,)), axis=None)

    return step


def converted_modules(step):
    """Runs `step` once (its trace) and returns the modules of the converted functions that ran."""
    modules = set()

    def profile(frame, event, arg):
        if event == "call" and "__autograph_generated_file" in frame.f_code.co_filename:
            modules.add(frame.f_globals.get("__name__"))

    sys.setprofile(profile)
    threading.setprofile(profile)  # the replicas trace on threads of their own
    try:
        loss = float(step(batch))
    finally:
        threading.setprofile(None)
        sys.setprofile(None)
    # The generated module's own body (`outer_factory`) names no original module.
    return sorted(m for m in modules if m and not m.startswith("__autograph_generated_file")), loss


kd_rules = [rule for rule in autograph_config.CONVERSION_RULES if rule.matches("keras_distrib")]
result = {"rule_first": autograph_config.CONVERSION_RULES[0].matches("keras_distrib")}
with_rule = autograph_config.CONVERSION_RULES
autograph_config.CONVERSION_RULES = tuple(r for r in with_rule if r not in kd_rules)
result["without"], loss_without = converted_modules(make_step())
autograph_config.CONVERSION_RULES = with_rule
result["with"], loss_with = converted_modules(make_step())
result["losses"] = [loss_without, loss_with]
print("RESULT " + json.dumps(result), flush=True)
