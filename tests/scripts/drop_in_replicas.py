"""Drop-in behaviours under 2 mirrored replicas, against plain Keras on one device.

predict_on_batch (each row once, in order; plain Keras under mirrored as the
contrast), a reduction="none" loss with an uneven last batch, and the
refusal of Python-fed inputs for fit.
"""

import json

import keras_distrib as kd

kd.virtual_devices(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_distrib.validation import InputError  # noqa: E402

keras.config.set_floatx("float64")
strategy = kd.make_strategy("mirrored")
rng = np.random.default_rng(3)
x, y = rng.normal(size=(10, 3)), rng.normal(size=(10, 2))
result = {}


def dense(cls):
    inputs = keras.Input((3,))
    return cls(inputs, keras.layers.Dense(2, kernel_initializer="ones")(inputs))


class PerExample(keras.losses.Loss):
    def __init__(self, **kwargs):
        super().__init__(reduction="none", **kwargs)

    def call(self, y_true, y_pred):
        return tf.reduce_mean(tf.square(y_true - y_pred), axis=-1)


reference = dense(keras.Model)  # one device
expected = reference.predict_on_batch(x[:5])
reference.compile(optimizer="sgd", loss=PerExample())
reference_loss = reference.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history["loss"]

with strategy.scope():
    ours = dense(kd.Model)
    plain = dense(keras.Model)
got = ours.predict_on_batch(x[:5])
result["kd_rows"] = int(got.shape[0])
result["predict_on_batch_diff"] = float(np.abs(got - expected).max())
result["keras_rows"] = int(plain.predict_on_batch(x[:5]).shape[0])

with strategy.scope():
    ours.compile(optimizer="sgd", loss=PerExample())
# 10 rows in batches of 4: the last batch (2 rows) is uneven over 2 replicas only in count.
loss = ours.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history["loss"]
result["reduction_none_diff"] = max(
    float(np.abs(a - b).max()) for a, b in zip(ours.get_weights(), reference.get_weights())
)
result["reduction_none_loss_diff"] = float(np.abs(np.array(loss) - np.array(reference_loss)).max())


class Batches(keras.utils.PyDataset):
    def __len__(self):
        return 2

    def __getitem__(self, index):
        return x[index * 5:index * 5 + 5], y[index * 5:index * 5 + 5]


def generator():
    while True:
        yield x[:5], y[:5]


inputs = {
    "pydataset": Batches(),
    "generator": generator(),
    "from_generator": tf.data.Dataset.from_generator(
        generator, output_signature=(tf.TensorSpec((None, 3), tf.float64),
                                     tf.TensorSpec((None, 2), tf.float64))),
}
for name, data in inputs.items():
    try:
        ours.fit(data, steps_per_epoch=2, verbose=0)
        result[name] = "trained"
    except InputError as error:
        result[name] = str(error)
print("RESULT " + json.dumps(result), flush=True)
