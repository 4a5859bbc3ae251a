"""Two workers whose dataset_fn shards differ by a batch (issue 22).

Usage: unequal_workers.py

Worker 0 reads rows 0-11, worker 1 rows 12-19, each batched per replica
(global batch 8 over 2 workers x 2 replicas): worker 0 has 3 steps of data,
worker 1 has 2. The model (Dropout, BatchNormalization) trains with kd
(`fit`, then `kd.TrainLoop`), then as a plain keras.Model (the contrast,
last: its failure may leave the collectives unusable), and is compared with plain Keras on one device trained on the
same global batches: each step's batch is the replicas' pieces in
TensorFlow's order (piece r * W + w), a worker that ran out giving none.
Prints one 'RESULT {json}' per way: the largest difference and both
optimizer step counts (one device, this way), or the error.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras_distrib as kd

ROWS = 20
WORKER_ROWS = {0: list(range(0, 12)), 1: list(range(12, ROWS))}
PER_REPLICA = 2
REPLICAS_PER_WORKER = 2


def _model(cls):
    import keras

    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    x = keras.layers.Dense(8, activation="tanh")(inputs)
    x = keras.layers.BatchNormalization()(keras.layers.Dropout(0.3)(x))
    model = cls(inputs, keras.layers.Dense(1)(x))
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
    return model


def _global_batches(x, y):
    """One device's batches: per step, the pieces in TensorFlow's order."""
    import numpy as np

    batches = []
    step = 0
    while True:
        rows = []
        for replica in range(REPLICAS_PER_WORKER):
            for worker in sorted(WORKER_ROWS):
                first = (step * REPLICAS_PER_WORKER + replica) * PER_REPLICA
                rows += WORKER_ROWS[worker][first:first + PER_REPLICA]
        if not rows:
            return batches
        batches.append((x[rows], y[rows]))
        step += 1


def main():
    import keras
    import numpy as np
    import tensorflow as tf

    kd.virtual_devices(REPLICAS_PER_WORKER)
    strategy = kd.make_strategy("multi_worker")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 5)).astype("float32")
    y = x.sum(axis=1, keepdims=True).astype("float32")

    def dataset_fn(context):
        mine = WORKER_ROWS[context.input_pipeline_id]
        return tf.data.Dataset.from_tensor_slices((x[mine], y[mine])).batch(PER_REPLICA)

    with tf.device("/CPU:0"):
        reference = _model(keras.Model)
        for batch_x, batch_y in _global_batches(x, y):
            reference.train_on_batch(batch_x, batch_y)
    for mode in ("fit", "loop", "plain"):
        with strategy.scope():
            model = _model(keras.Model if mode == "plain" else kd.Model)
        data = kd.distribute_dataset(dataset_fn, strategy=strategy)
        result = dict(mode=mode)
        try:
            if mode == "loop":
                kd.TrainLoop(model).fit(data, epochs=1, verbose=0)
            else:
                model.fit(data, epochs=1, verbose=0)
            gaps = [np.max(np.abs(a - b) / (1 + np.abs(a)))
                    for a, b in zip(reference.get_weights(), model.get_weights())]
            result.update(difference=float(max(gaps)),
                          iterations=[int(reference.optimizer.iterations.numpy()),
                                      int(model.optimizer.iterations.numpy())])
        except Exception as error:
            result.update(error=f"{type(error).__name__}: {str(error)[:300]}")
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
