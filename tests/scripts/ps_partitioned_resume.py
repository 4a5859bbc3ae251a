"""A parameter-server backup of partitioned weights: resumed, or refused by name.

In-process cluster (2 workers, 2 parameter servers). A run whose
`variable_partitioner` splits every weight in 2 is stopped after epoch 2 by
an exception, with `BackupAndRestore`; then the same backup is resumed by a
model built under 3 parts, under no partitioner (both refused: the
optimizer's state is per part), and under the same 2 parts (restored to the
stopped run's weights, trained on). Prints one RESULT line.
"""

import json
import os
import sys
import tempfile

import keras_distrib as kd

resolver = kd.local_cluster(workers=2, ps=2)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

SHARDS = tf.distribute.experimental.partitioners.FixedShardsPartitioner
rng = np.random.default_rng(0)
x = rng.normal(size=(96, 4)).astype("float32")
y = (x @ rng.normal(size=(4, 1))).astype("float32")
dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)
backup = tempfile.mkdtemp()
result = {}


def build(shards):
    strategy = kd.make_strategy("parameter_server", cluster_resolver=resolver,
                                variable_partitioner=SHARDS(shards) if shards else None)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = kd.Sequential([keras.Input((4,)), keras.layers.Dense(64, activation="tanh"),
                               keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


class Stop(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise KeyboardInterrupt


class RestoredWeights(keras.callbacks.Callback):
    """The weights when the resumed run's first epoch begins (after the restore)."""

    def on_epoch_begin(self, epoch, logs=None):
        if not hasattr(self, "weights"):
            self.weights = [np.asarray(w) for w in self.model.get_weights()]


model = build(2)
try:
    model.fit(dataset, epochs=4, steps_per_epoch=3, verbose=0,
              callbacks=[kd.callbacks.BackupAndRestore(backup), Stop()])
except KeyboardInterrupt:
    pass
stopped = [np.asarray(w) for w in model.get_weights()]


def checkpoints():
    """The backup's files (not the lock of the run that holds it)."""
    return sorted(name for name in os.listdir(backup) if not name.startswith(".kd-lock"))


files = checkpoints()
for shards in (3, None):
    try:
        build(shards).fit(dataset, epochs=4, steps_per_epoch=3, verbose=0,
                          callbacks=[kd.callbacks.BackupAndRestore(backup)])
        result[f"refusal_{shards}"] = "resumed"
    except Exception as error:  # reported; the test decides
        result[f"refusal_{shards}"] = f"{type(error).__name__}: {error}"
result["backup_kept"] = checkpoints() == files and bool(files)
restored = RestoredWeights()
history = build(2).fit(dataset, epochs=4, steps_per_epoch=3, verbose=0,
                       callbacks=[kd.callbacks.BackupAndRestore(backup), restored])
result["resumed_epochs"] = len(history.history["loss"])
result["restored_difference"] = max(float(np.max(np.abs(a - b)))
                                    for a, b in zip(stopped, restored.weights))
print("RESULT " + json.dumps(result), flush=True)
sys.stdout.flush()
os._exit(0)  # in-process servers do not shut down cleanly
