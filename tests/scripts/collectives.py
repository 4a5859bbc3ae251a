"""Collectives per traced step of kd models and plain Keras, mirrored on 2 virtual devices."""

import json
import sys

import keras_distrib as kd

kd.virtual_devices(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_distrib import collectives  # noqa: E402

ROWS = 16


def _dense(model_class, strategy, outputs=1, dropout=False, compute_loss=None):
    with strategy.scope():
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="relu", kernel_regularizer="l2")(inputs)
        if dropout:
            hidden = keras.layers.Dropout(0.3)(hidden)
        heads = [keras.layers.Dense(1, name=f"out{i}")(hidden) for i in range(outputs)]
        model = model_class(inputs, heads if outputs > 1 else heads[0])
        if compute_loss is not None:
            model.compute_loss = compute_loss.__get__(model)
        model.compile(keras.optimizers.Adam(0.01), "mse", metrics=[["mae"]] * outputs if outputs > 1
                      else ["mae"])
    return model


def _masked(strategy):
    with strategy.scope():
        inputs = keras.Input((5,))
        hidden = keras.layers.Embedding(20, 4, mask_zero=True)(inputs)
        hidden = keras.layers.LSTM(4, return_sequences=True)(hidden)
        model = kd.Model(inputs, keras.layers.Dense(1)(hidden))
        model.compile("sgd", "mse")
    return model


def _embedding(strategy):
    with strategy.scope():
        inputs = keras.Input((5,))
        hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 4)(inputs))
        model = kd.Model(inputs, keras.layers.Dense(1)(hidden))
        model.compile("adam", "mse")
    return model


def count(strategy, case):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = rng.normal(size=(ROWS, 1)).astype("float32")
    sample_weight = None
    if case == "plain_keras":
        model = _dense(keras.Model, strategy)
    elif case == "mlp":
        model = _dense(kd.Model, strategy)
    elif case == "weighted":
        model = _dense(kd.Model, strategy)
        sample_weight = rng.uniform(size=ROWS).astype("float32")
    elif case == "multi_output":
        model = _dense(kd.Model, strategy, outputs=2)
        y = [y, y * 2]
    elif case == "dropout":
        model = _dense(kd.Model, strategy, dropout=True)
    elif case == "own_compute_loss":
        def compute_loss(self, *args, **kwargs):
            return kd.Model.compute_loss(self, *args, **kwargs)

        model = _dense(kd.Model, strategy, compute_loss=compute_loss)
    elif case == "masked":
        model = _masked(strategy)
        x = rng.integers(0, 20, size=(ROWS, 5))
        x[:, 3:] = 0
        y = rng.normal(size=(ROWS, 5, 1)).astype("float32")
    elif case == "embedding":
        model = _embedding(strategy)
        x = rng.integers(0, 20, size=(ROWS, 5))
    else:
        raise SystemExit(f"unknown case {case!r}")
    return collectives.count(model, x, y, sample_weight=sample_weight)


if __name__ == "__main__":
    strategy = kd.make_strategy("mirrored")
    for case in sys.argv[1].split(","):
        print("RESULT " + json.dumps({"case": case, **count(strategy, case)}), flush=True)
