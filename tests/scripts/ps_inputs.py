"""Parameter-server inputs as TensorFlow's guides write them, in-process cluster.

Prints one RESULT line with what the test checks.
"""

import json
import os
import sys
import tempfile

import keras_distrib as kd

resolver = kd.local_cluster(workers=2, ps=1)
strategy = kd.make_strategy("parameter_server", cluster_resolver=resolver)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_distrib.training import parameter_server  # noqa: E402

rng = np.random.default_rng(0)
x = rng.normal(size=(96, 4)).astype("float32")
y = (x @ rng.normal(size=(4, 1))).astype("float32")
result = {}


def build(model_class):
    keras.utils.set_random_seed(1)
    # No Input layer: built on the first batch, as the guides' models are.
    model = model_class([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


class BatchLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(sorted(logs or {}))


with strategy.scope():
    model = build(kd.Sequential)

# A Dataset instance, as the migration guide passes it to fit.
dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10).repeat().batch(16)
batch_logs = BatchLogs()
history = model.fit(dataset, epochs=3, steps_per_epoch=6, verbose=0, callbacks=[batch_logs],
                    validation_data=(x, y))
result["instance_history"] = history.history
result["batch_logs"] = batch_logs.seen

# dataset_fn(input_context): each worker gets its own pipeline id.
pipeline = parameter_server.WorkerData(
    strategy, lambda context: tf.data.Dataset.from_tensors(
        [context.input_pipeline_id, context.num_input_pipelines]).repeat()
)
iterator = pipeline.iterator(parameter_server.coordinator_for(strategy))


@tf.function
def next_element(iterator):
    return next(iterator)


coordinator = parameter_server.coordinator_for(strategy)
contexts = {tuple(coordinator.schedule(next_element, args=(iterator,)).fetch().tolist()) for _ in range(12)}
result["contexts"] = sorted(contexts)


def sharded_fn(context):
    rows = tf.data.Dataset.from_tensor_slices((x, y)).shard(context.num_input_pipelines, context.input_pipeline_id)
    return rows.batch(8)


history = model.fit(sharded_fn, epochs=1, steps_per_epoch=4, verbose=0)
result["dataset_fn_history"] = history.history

# Exact evaluation: on the coordinator, and sharded over the workers, both
# against plain Keras on one device with the same weights.
reference = build(keras.Sequential)
reference.build((None, 4))
reference.set_weights(model.get_weights())
expected = reference.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
result["evaluate_reference"] = expected
result["evaluate_coordinator"] = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
result["evaluate_sharded"] = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True, shards=5)
result["evaluate_sharded_dataset"] = model.evaluate(
    tf.data.Dataset.from_tensor_slices((x, y)).batch(16), verbose=0, return_dict=True, shards=3
)
result["predict_diff"] = float(np.max(np.abs(model.predict(x, verbose=0) - reference.predict(x, verbose=0))))

# What cannot be shipped to workers is refused with a reason.
errors = {}
generator = tf.data.Dataset.from_generator(
    lambda: iter([(x[:4], y[:4])]),
    output_signature=(tf.TensorSpec([None, 4]), tf.TensorSpec([None, 1])),
)
for name, data in (("generator_dataset", generator), ("python_generator", iter([(x, y)]))):
    try:
        model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
        errors[name] = ""
    except ValueError as error:
        errors[name] = str(error)
result["errors"] = errors

# Backup and resume under the parameter server: a run stopped after epoch 1
# resumes at epoch 2 with the optimizer's step counter.
backup = tempfile.mkdtemp()


class StopAfterFirstEpoch(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise KeyboardInterrupt


try:
    model.fit(dataset, epochs=4, steps_per_epoch=3, verbose=0,
              callbacks=[kd.callbacks.BackupAndRestore(backup), StopAfterFirstEpoch()])
except KeyboardInterrupt:
    pass
iterations_at_stop = int(model.optimizer.iterations.numpy())
with strategy.scope():
    resumed = build(kd.Sequential)
loop = kd.TrainLoop(resumed, steps_per_loop=3)
history = loop.fit(dataset, epochs=4, steps_per_epoch=3, verbose=0, backup_dir=backup)
result["resumed_epochs"] = len(history.history["loss"])
result["iterations_at_stop"] = iterations_at_stop
result["iterations_after_resume"] = int(resumed.optimizer.iterations.numpy())
# kd empties a backup directory it did not create (mkdtemp made it) and keeps it.
result["backup_cleared"] = os.listdir(backup) == []
print("RESULT " + json.dumps(result), flush=True)
sys.stdout.flush()
os._exit(0)  # in-process servers do not shut down cleanly
