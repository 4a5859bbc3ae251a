"""Collective ops in the traced step graphs of kd models on two worker processes.

Run by kd.launch on 2 workers (one replica each). For each number of metrics
given (argv[1], e.g. '0,1,3'), each worker trains, evaluates and predicts one
epoch of a small MLP (rows divide evenly: one trace per step function) and
counts the collective ops in the graphs of its step functions, the functions
they call included (`keras_distrib.collectives.count`); then evaluates once
more with a callback that reads every batch's logs (the per-call read); then
the same from a `dataset_fn`, whose batch counts kd knows on every worker.
Prints 'RESULT {json}' per count on each worker.
"""

import json
import sys

import keras_distrib as kd

strategy = kd.make_strategy("multi_worker")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_distrib.training import collectives  # noqa: E402

ROWS = 32
METRICS = {0: lambda: [], 1: lambda: ["mae"],
           3: lambda: ["mae", "mse", keras.metrics.RootMeanSquaredError()]}


class BatchLogs(keras.callbacks.Callback):
    def on_test_batch_end(self, batch, logs=None):
        pass


def compiled_model(metrics, spe):
    with strategy.scope():
        model = kd.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                               keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(0.01), "mse", metrics=METRICS[metrics](),
                      steps_per_execution=spe)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = rng.normal(size=(ROWS, 1)).astype("float32")
    return model, x, y


def counted(metrics, spe):
    model, x, y = compiled_model(metrics, spe)
    counts = collectives.count(model, x, y, batch_size=8)
    model.evaluate(x, y, batch_size=8, verbose=0, callbacks=[BatchLogs()])
    counts["test_each_call"] = collectives.traced(model)["test"]
    return counts


def counted_dataset_fn(metrics, spe):
    """The same from a `dataset_fn` (every worker's batch count known: kd.join_workers)."""
    model, x, y = compiled_model(metrics, spe)

    def dataset_fn(context):
        shard = tf.data.Dataset.from_tensor_slices((x, y)).shard(
            context.num_input_pipelines, context.input_pipeline_id)
        return shard.batch(context.get_per_replica_batch_size(8))

    data = strategy.distribute_datasets_from_function(dataset_fn)
    model.fit(data, epochs=1, verbose=0)
    model.evaluate(data, verbose=0)
    return {kind: figures for kind, figures in collectives.traced(model).items()
            if kind != "predict"}


for metrics in map(int, sys.argv[1].split(",")):
    for spe in map(int, sys.argv[2].split(",")):
        print("RESULT " + json.dumps({"metrics": metrics, "spe": spe, "input": "arrays",
                                      **counted(metrics, spe)}), flush=True)
        print("RESULT " + json.dumps({"metrics": metrics, "spe": spe, "input": "dataset_fn",
                                      **counted_dataset_fn(metrics, spe)}), flush=True)
