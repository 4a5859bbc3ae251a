"""The `train.py` of the data-service guide's Slurm recipe (docs/guides/data-service.md), for tests/test_slurm.py.

kd `fit` on `kd.data.serve` (mode exact, the service from KD_DATA_SERVICE)
on the cluster kd finds under Slurm, float64, against the same model on one
device in this process; every worker prints 'RESULT {json}'.
"""

import json

import keras_distrib as kd

strategy = kd.make_strategy("auto")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

keras.config.set_floatx("float64")
rng = np.random.default_rng(4)
x, y = rng.normal(size=(19, 3)), rng.normal(size=(19, 1))


def preprocess(x, y):
    return tf.tanh(x), y


def layers():
    return [keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)]


keras.utils.set_random_seed(1)
reference = keras.Sequential(layers())
initial = reference.get_weights()
reference.compile(keras.optimizers.SGD(0.1), "mse")
reference.fit(tf.data.Dataset.from_tensor_slices((x, y)).map(preprocess).batch(4), epochs=2,
              verbose=0)
with strategy.scope():
    model = kd.Sequential(layers())
    model.set_weights(initial)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    served = kd.data.serve((x, y), global_batch_size=4, preprocess=preprocess)
model.fit(served, epochs=2, verbose=0)
print("RESULT " + json.dumps({
    "task": kd.cluster_info().label, "workers": kd.cluster_info().num_workers,
    "weights": max(float(np.max(np.abs(a - b))) for a, b in
                   zip(reference.get_weights(), model.get_weights())),
}), flush=True)
