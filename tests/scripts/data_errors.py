"""4 replicas in one process: the batch-size error, and describe_input against TensorFlow's real split.

Prints one 'RESULT {json}' line: the error for a global batch of 30, and for
several row counts the split `kd.describe_input` reports next to the rows
each replica really receives from `experimental_distribute_dataset` (and
from `kd.distribute_dataset`).
"""

import json

import keras_distrib as kd

kd.virtual_devices(4)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

strategy = kd.make_strategy("mirrored")
try:
    kd.distribute_dataset(np.zeros((64, 2)), strategy=strategy, global_batch_size=30)
    error = ""
except ValueError as exc:
    error = str(exc)
lines = []
report = kd.data.describe_input(np.arange(66), strategy=strategy, global_batch_size=32, print_fn=lines.append)


def real_batches(distributed):
    """The ids each replica receives, batch by batch."""
    return [[v.numpy().tolist() for v in strategy.experimental_local_results(batch)] for batch in distributed]


splits = []
for rows in (32 + 26, 32 + 2, 37, 5, 1, 64):
    described = kd.describe_input(np.arange(rows), strategy=strategy, global_batch_size=32, print_fn=lambda line: None)
    dataset = tf.data.Dataset.range(rows).batch(32)
    splits.append({
        "rows": rows,
        "described": described["last_batch_per_replica"],
        "tensorflow": real_batches(strategy.experimental_distribute_dataset(dataset)),
        "kd": real_batches(kd.distribute_dataset(np.arange(rows), strategy=strategy, global_batch_size=32)),
    })
print("RESULT " + json.dumps({"error": error, "report": report, "lines": lines, "splits": splits}), flush=True)
