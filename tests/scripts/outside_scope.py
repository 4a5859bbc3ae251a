"""Models, layers and optimizers created outside strategy.scope() but trained inside it.

Prints one RESULT per case: the error message ("" when training ran).
"""

import json

import keras_distrib as kd

kd.virtual_devices(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402

strategy = kd.make_strategy("mirrored")
x, y = np.ones((4, 2), "float32"), np.ones((4, 1), "float32")


def model_outside():
    inputs = keras.Input((2,))
    model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    with strategy.scope():
        model.fit(x, y, verbose=0)


def layer_outside():
    layer = keras.layers.Dense(1, name="built_outside")
    layer.build((None, 2))
    with strategy.scope():
        inputs = keras.Input((2,))
        model = kd.Model(inputs, layer(inputs))
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, verbose=0)


def optimizer_outside():
    optimizer = keras.optimizers.Adam(0.1)
    with strategy.scope():
        inputs = keras.Input((2,))
        model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, verbose=0)


def everything_inside():  # the contrast: the same model trains
    with strategy.scope():
        inputs = keras.Input((2,))
        model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
        model.fit(x, y, verbose=0)


for case in (model_outside, layer_outside, optimizer_outside, everything_inside):
    try:
        case()
        error = ""
    except Exception as exc:  # noqa: BLE001 - the message is the result
        error = f"{type(exc).__name__}: {exc}"
    print("RESULT " + json.dumps({"case": case.__name__, "error": error}), flush=True)
