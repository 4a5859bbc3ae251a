"""A second MirroredStrategy in one process (a notebook cell run again).

Prints RESULT {...}: assert_parity's differences for models trained under a
second and third kd.make_strategy("mirrored") and for two models sharing one
tf.distribute.MirroredStrategy, kd's error for a second
tf.distribute.MirroredStrategy, and what plain Keras does there.
"""

import json

import keras
import numpy as np

import keras_distrib as kd

kd.virtual_devices(2)
import tensorflow as tf  # noqa: E402

rng = np.random.default_rng(0)
x = rng.normal(size=(33, 4)).astype("float32")


def model_fn(width, model_class=kd.Model):
    def build():
        inputs = keras.Input((4,))
        model = model_class(inputs, keras.layers.Dense(width)(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model
    return build


def parity(width, strategy):
    y = rng.normal(size=(33, width)).astype("float32")
    (difference,) = kd.testing.assert_parity(model_fn(width), (x, y), strategies=[strategy],
                                             batch_size=16).values()
    return difference


result = {}
# Each kd.make_strategy("mirrored") has collective keys of its own.
result["make_strategy"] = [parity(width, kd.make_strategy("mirrored")) for width in (3, 5, 2)]
# One tf.distribute.MirroredStrategy shared by models of different shapes.
first = tf.distribute.MirroredStrategy()
result["reused"] = [parity(width, first) for width in (3, 5)]
# A second one: kd refuses it before its first collective.
second = tf.distribute.MirroredStrategy()
y = np.zeros((33, 4), "float32")
with second.scope():
    model = model_fn(4)()
try:
    model.fit(x, y, batch_size=16, verbose=0)
    result["kd_second"] = "trained"
except RuntimeError as error:
    result["kd_second"] = str(error)
# Plain Keras under the second strategy: its first all-reduce aborts.
with second.scope():
    model = model_fn(4, keras.Model)()
try:
    model.fit(x, y, batch_size=16, verbose=0)
    result["keras_second"] = "trained"
except Exception as error:  # noqa: BLE001 - the contrast records whatever TF raises
    result["keras_second"] = f"{type(error).__name__}: {error}"
print("RESULT " + json.dumps(result), flush=True)
