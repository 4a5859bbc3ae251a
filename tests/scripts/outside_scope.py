"""A kd model created outside strategy.scope() but trained inside it."""

import json

import keras_distrib as kd

kd.virtual_devices(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402

strategy = kd.make_strategy("mirrored")
inputs = keras.Input((2,))
model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
model.compile(optimizer="sgd", loss="mse")
try:
    with strategy.scope():
        model.fit(np.ones((4, 2), "float32"), np.ones((4, 1), "float32"), verbose=0)
    error = ""
except ValueError as exc:
    error = str(exc)
print("RESULT " + json.dumps({"error": error}), flush=True)
