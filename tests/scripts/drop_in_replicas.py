"""Drop-in behaviours under 2 mirrored replicas, against plain Keras on one device.

predict_on_batch (each row once, in order; plain Keras under mirrored as the
contrast), a reduction="none" loss with an uneven last batch, and
Python-fed input (PyDataset, a generator, Dataset.from_generator) trained
three times each, every step compared with one device, and a plain Keras
`.keras` file trained on with kd.load_model.
"""

import json
import os
import tempfile

import keras_distrib as kd

kd.virtual_devices(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


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


# An optional input left out (None): refused under several replicas, naming it.
with strategy.scope():
    first, second = keras.Input((3,)), keras.Input((3,), optional=True)
    optional = kd.Model([first, second], keras.layers.Dense(1)(first))
    optional.compile(optimizer="sgd", loss="mse")
try:
    optional.fit([x, None], y[:, :1], verbose=0)
    result["optional_none"] = "trained"
except ValueError as error:
    result["optional_none"] = str(error)

# Python-fed input: each batch a view into arrays that must stay as they are.
features = rng.normal(size=(30, 3))
labels = rng.normal(size=(30, 2))
saved = features.copy(), labels.copy()


class Batches(keras.utils.PyDataset):
    """Six batches of five rows, reordered at every epoch's end."""

    def __init__(self):
        super().__init__()
        self.order = np.arange(6)
        self.rng = np.random.default_rng(0)

    def __len__(self):
        return 6

    def __getitem__(self, index):
        rows = slice(int(self.order[index]) * 5, int(self.order[index]) * 5 + 5)
        return features[rows], labels[rows]

    def on_epoch_end(self):
        self.order = self.rng.permutation(6)


def batches():
    for _ in range(3):
        for index in range(6):
            yield features[index * 5:index * 5 + 5], labels[index * 5:index * 5 + 5]


def python_fed(kind):
    if kind == "pydataset":
        return Batches(), {}
    if kind == "generator":
        return batches(), {"steps_per_epoch": 6}
    spec = (tf.TensorSpec((None, 3), tf.float64), tf.TensorSpec((None, 2), tf.float64))
    return tf.data.Dataset.from_generator(lambda: batches(), output_signature=spec), {"steps_per_epoch": 6}


def steps_of(model, kind):
    weights = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: weights.append(
            np.concatenate([w.ravel() for w in model.get_weights()]))
    )
    data, extra = python_fed(kind)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(data, epochs=3, shuffle=False, verbose=0, callbacks=[record], **extra)
    return np.array(weights)


for kind in ("pydataset", "generator", "from_generator"):
    expected = steps_of(dense(keras.Model), kind)  # one device, plain Keras
    diffs = []
    for run in range(3):
        with strategy.scope():
            model = dense(kd.Model)
        got = steps_of(model, kind)
        diffs.append(float(np.abs(got - expected).max()) if got.shape == expected.shape else float("inf"))
    result[kind] = {"steps": int(expected.shape[0]), "diffs": diffs}
result["arrays_unchanged"] = bool(np.array_equal(features, saved[0]) and np.array_equal(labels, saved[1]))


# A plain Keras file (Adam's state, BatchNormalization) trained on under 2
# replicas with kd.load_model, against plain Keras going on from it on one device.
def batch_norm_model():
    keras.utils.set_random_seed(5)
    inputs = keras.Input((3,))
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(4, activation="tanh")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


handed = os.path.join(tempfile.mkdtemp(), "plain.keras")
plain = batch_norm_model()
plain.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
plain.save(handed)
with strategy.scope():
    loaded = kd.load_model(handed)
result["loaded_class"] = type(loaded).__name__
result["loaded_steps"] = int(loaded.optimizer.iterations.numpy())
loaded.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
plain.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
result["handed_on_diff"] = max(float(np.abs(a - b).max()) for a, b in zip(plain.get_weights(), loaded.get_weights()))
print("RESULT " + json.dumps(result), flush=True)
