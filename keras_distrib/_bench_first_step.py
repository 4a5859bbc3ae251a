"""Launched by the benchmark: prints the time of the first training step."""

import time

import keras_distrib as kd

strategy = kd.make_strategy("multi_worker")
import keras  # noqa: E402
import numpy as np  # noqa: E402


class FirstStep(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            print(f"FIRST_STEP {time.time()}", flush=True)


with strategy.scope():
    inputs = keras.Input((8,))
    model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
x = np.zeros((64, 8), "float32")
model.fit(x, x[:, :1], batch_size=16, epochs=1, verbose=0, callbacks=[FirstStep()])
