"""Loads what kd handed on in a process where keras_distrib cannot be imported.

argv: a folder holding handed.keras (kd.save_for_keras), saved.keras (kd's
model.save), exported/ (model.export) and expected.npz (the kd model's
predictions, weights and optimizer variables). Prints RESULT with the
largest differences and what loading kd's own file said.
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


model = keras.saving.load_model(os.path.join(folder, "handed.keras"))
weights = [expected[f"weight_{i}"] for i in range(len(model.weights))]
slots = [expected[f"optimizer_{i}"] for i in range(int(expected["optimizer_count"]))]
served = tf.saved_model.load(os.path.join(folder, "exported"))
try:
    keras.saving.load_model(os.path.join(folder, "saved.keras"))
    own_file = "loaded"
except Exception as error:  # what kd's own file gives where kd is missing
    own_file = f"{type(error).__name__}: {error}"
print("RESULT " + json.dumps({
    "blocked": blocked,
    "kd_modules": sorted(m for m in sys.modules if m.startswith("keras_distrib")),
    "class": type(model).__name__,
    "compiled": bool(model.compiled),
    "weights": largest(zip(weights, model.get_weights())) if len(weights) == len(model.weights) else None,
    "optimizer": largest(zip(slots, [v.numpy() for v in model.optimizer.variables]))
    if len(slots) == len(model.optimizer.variables) else None,
    "optimizer_count": [len(slots), len(model.optimizer.variables)],
    "iterations": int(model.optimizer.iterations.numpy()),
    "predictions": largest([(expected["predictions"], model.predict(x, verbose=0))]),
    "served": largest([(expected["predictions"], served.serve(tf.constant(x)).numpy())]),
    "own_file": own_file[:300],
}))
