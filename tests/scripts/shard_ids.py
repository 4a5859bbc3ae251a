"""Records the example ids each replica sees in one epoch of kd.distribute_dataset.

Usage: shard_ids.py DEVICES MODE ROWS FILES_DIR
MODE: data | file | fn | train. Prints 'RESULT {...}' with this worker's ids
per local replica (and, for train, the weight difference to one device).
"""

import dataclasses
import json
import os
import sys
import warnings

import keras_distrib as kd

devices, mode, rows, files_dir = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
if devices > 1:
    kd.virtual_devices(devices)
info = kd.cluster_info()
strategy = kd.make_strategy("multi_worker" if info.num_workers > 1 else "mirrored")
from keras_distrib.cluster import strategies  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

GLOBAL_BATCH = 8 * strategy.num_replicas_in_sync // 2
FEATURE = {"id": tf.io.FixedLenFeature([], tf.int64)}


def parse(record):
    return tf.io.parse_single_example(record, FEATURE)["id"]


caught = []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if mode == "data":
        dist = kd.distribute_dataset(np.arange(rows), strategy=strategy, global_batch_size=GLOBAL_BATCH, shard_policy="data")
    elif mode == "file":
        files = sorted(os.path.join(files_dir, f) for f in os.listdir(files_dir))
        dataset = tf.data.TFRecordDataset(files).map(parse)
        dist = kd.distribute_dataset(dataset, strategy=strategy, global_batch_size=GLOBAL_BATCH, shard_policy="file")
    elif mode == "fn":
        def dataset_fn(context):
            mine = kd.data.shard_files(os.path.join(files_dir, "*"), context)
            return tf.data.TFRecordDataset(mine).map(parse)

        dist = kd.distribute_dataset(dataset_fn, strategy=strategy, global_batch_size=GLOBAL_BATCH)
    else:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(rows, 5)).astype("float32")
        y = (x @ rng.normal(size=(5, 1))).astype("float32")

        def build(cls):
            keras.utils.set_random_seed(1)
            inputs = keras.Input((5,))
            model = cls(inputs, keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(inputs)))
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
            return model

        reference = build(keras.Model)
        reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
        with strategy.scope():
            model = build(kd.Model)
        model.fit(kd.distribute_dataset((x, y), strategy=strategy, global_batch_size=GLOBAL_BATCH, shard_policy="data"), epochs=2, verbose=0)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(reference.get_weights(), model.get_weights()))
        # A plain batched tf.data.Dataset handed to fit shards the same way.
        with strategy.scope():
            direct = build(kd.Model)
        direct.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH), epochs=2, verbose=0)
        direct_diff = max(float(np.abs(a - b).max()) for a, b in zip(reference.get_weights(), direct.get_weights()))
        print("RESULT " + json.dumps({"task": info.label, "diff": diff, "direct_diff": direct_diff}), flush=True)
        sys.exit(0)

per_replica = [[] for _ in range(len(strategy.extended.worker_devices))]
last = []
for batch in dist:
    last = [int(value.shape[0]) for value in strategy.experimental_local_results(batch)]
    for i, value in enumerate(strategy.experimental_local_results(batch)):
        per_replica[i].extend(value.numpy().tolist())
described = kd.describe_input(np.arange(rows), strategy=strategy, global_batch_size=GLOBAL_BATCH,
                              print_fn=lambda line: None)["last_batch_per_replica"]
print("RESULT " + json.dumps({
    "task": info.label, "ids": per_replica, "replicas": strategy.num_replicas_in_sync,
    "traits": dataclasses.astuple(strategies.traits(strategy)),
    "last_batch": last, "described": described,
    "warnings": [str(w.message) for w in caught if "sharding by DATA" in str(w.message)],
}), flush=True)
