"""Trains with kd.callbacks.BackupAndRestore(argv[1]); the test holds that directory's lock."""

import sys

import keras
import numpy as np

import keras_distrib as kd

strategy = kd.make_strategy("auto")
with strategy.scope():
    inputs = keras.Input((2,))
    model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
model.fit(np.zeros((8, 2), "float32"), np.zeros((8, 1), "float32"), batch_size=4, verbose=0,
          callbacks=[kd.callbacks.BackupAndRestore(sys.argv[1])])
print("TRAINED", flush=True)
