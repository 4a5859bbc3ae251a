"""kd models under ParameterServerStrategy: fit / TrainLoop, evaluate, predict.

Usage: ps_fit.py local|launched fit|loop [kill]
With a KILL_WORKER argument the script prints 'KILL_NOW' after the first
epoch (the test kills a worker server then) and keeps training.
"""

import json
import sys

import keras_distrib as kd

where, how = sys.argv[1], sys.argv[2]
kill = len(sys.argv) > 3
import tensorflow as tf  # noqa: E402

partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=1024, max_shards=2)
if where == "local":
    strategy = kd.make_strategy("parameter_server", cluster_resolver=kd.local_cluster(workers=2, ps=2),
                                variable_partitioner=partitioner)
else:
    strategy = kd.make_strategy("parameter_server", variable_partitioner=partitioner)
import keras  # noqa: E402
import numpy as np  # noqa: E402

rng = np.random.default_rng(0)
x = rng.normal(size=(200, 32)).astype("float32")
w = rng.normal(size=(32, 1)).astype("float32") * 0.3
y = (x @ w + 0.5).astype("float32")
EPOCHS, STEPS, BATCH = 4, 25, 16


def build(cls):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32,))
    hidden = keras.layers.Dense(64, name="wide")(inputs)  # 32x64 floats = 8 KiB -> 2 shards
    return cls(inputs, keras.layers.Dense(1)(hidden))


from keras_distrib.training import first_step  # noqa: E402

with strategy.scope():
    model = build(kd.Model)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"],
                  steps_per_execution=5)


class Killer(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if kill and epoch == 0:
            print("KILL_NOW", flush=True)


import tempfile  # noqa: E402

checkpoints = tempfile.mkdtemp(prefix="kd_ps_ckpt_")
saver = kd.callbacks.ModelCheckpoint(
    checkpoints + "/ps-{epoch}.weights.h5", save_weights_only=True, monitor="val_loss"
)
kwargs = dict(batch_size=BATCH, epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0,
              validation_data=(x, y), callbacks=[Killer(), saver])
if how == "loop":
    history = kd.TrainLoop(model, steps_per_loop=5).fit(x, y, **kwargs)
else:
    history = model.fit(x, y, **kwargs)

logs = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
predictions = model.predict(x, batch_size=BATCH, verbose=0)
reference = build(keras.Model)
reference.compile(loss="mse", metrics=["mae"])
reference.set_weights([np.asarray(v) for v in model.get_weights()])
reference_logs = reference.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
reference_predictions = reference.predict(x, batch_size=BATCH, verbose=0)
kernel = model.get_layer("wide").kernel.value
shards = getattr(kernel, "variables", [kernel])
print("RESULT " + json.dumps({
    "history": history.history,
    "iterations": int(model.optimizer.iterations.numpy()),
    "steps": EPOCHS * STEPS,
    "evaluate_diff": max(abs(logs[k] - reference_logs[k]) for k in logs),
    "predict_diff": float(np.abs(predictions - reference_predictions).max()),
    "predict_rows": len(predictions),
    "kernel_devices": sorted(s.device.split("/device")[0] for s in shards),
    "checkpoints": sorted(__import__("os").listdir(checkpoints)),
    # Each worker's step is one replica's, on its own batch: one device's
    # step, which the first-step check has nothing to compare with.
    "replicas_in_sync": strategy.num_replicas_in_sync,
    "first_step_checked": first_step.applies(model, strategy),
}), flush=True)
