"""Loads what kd handed on in a process where keras_distrib cannot be imported.

argv: a folder holding handed.keras (kd.save_for_keras), saved.keras (kd's
model.save of the same functional model), sequential.keras (model.save of a
kd.Sequential), own_class.keras (model.save of a registered subclass of the
user's own), exported/ (model.export) and expected.npz (the kd models'
predictions, weights and optimizer variables). Prints RESULT with the
largest differences and what loading the subclass's file said.
"""

import importlib.abc
import json
import os
import sys


class _NoKd(importlib.abc.MetaPathFinder):
    """kd is pip-installed here (editable): blocked as if it were not."""

    def find_spec(self, name, path=None, target=None):
        if name == "keras_distrib" or name.startswith("keras_distrib."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


assert not any(m == "keras_distrib" or m.startswith("keras_distrib.") for m in sys.modules)
sys.meta_path.insert(0, _NoKd())
try:
    import keras_distrib  # noqa: F401
    blocked = False
except ModuleNotFoundError:
    blocked = True

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

folder = sys.argv[1]
expected = np.load(os.path.join(folder, "expected.npz"))
x = expected["x"]


def largest(pairs):
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)) / (1 + np.abs(np.asarray(a)))))
               for a, b in pairs)


weights = [expected[f"weight_{i}"] for i in range(int(expected["weight_count"]))]
slots = [expected[f"optimizer_{i}"] for i in range(int(expected["optimizer_count"]))]


def loaded(name):
    """What plain Keras gives for one file: the model's class and its differences from kd's."""
    model = keras.saving.load_model(os.path.join(folder, name))
    return {
        "class": type(model).__name__,
        "compiled": bool(model.compiled),
        "weights": largest(zip(weights, model.get_weights())) if len(weights) == len(model.weights) else None,
        "optimizer": largest(zip(slots, [v.numpy() for v in model.optimizer.variables]))
        if len(slots) == len(model.optimizer.variables) else None,
        "optimizer_count": [len(slots), len(model.optimizer.variables)],
        "iterations": int(model.optimizer.iterations.numpy()),
        "predictions": largest([(expected["predictions"], model.predict(x, verbose=0))]),
    }


served = tf.saved_model.load(os.path.join(folder, "exported"))
sequential = keras.saving.load_model(os.path.join(folder, "sequential.keras"))
try:
    keras.saving.load_model(os.path.join(folder, "own_class.keras"))
    own_class = "loaded"
except Exception as error:  # a subclass of the user's own needs its code, as in plain Keras
    own_class = f"{type(error).__name__}: {error}"
print("RESULT " + json.dumps({
    "blocked": blocked,
    "kd_modules": sorted(m for m in sys.modules if m.startswith("keras_distrib")),
    "handed": loaded("handed.keras"),
    "saved": loaded("saved.keras"),
    "sequential": [type(sequential).__name__,
                   largest([(expected["sequential"], sequential.predict(x, verbose=0))])],
    "served": largest([(expected["predictions"], served.serve(tf.constant(x)).numpy())]),
    "own_class": own_class[:300],
}))
