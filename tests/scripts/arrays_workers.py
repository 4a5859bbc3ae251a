"""Arrays on worker processes with 2 replicas each, against one device, float64.

Run by kd.launch (2 workers). For 225 rows (the last batch of 32 has 1 row)
and 3 rows (one batch, 3 of the 4 replicas get a row), each worker fits a kd
model and the same model on one device (the reference, in this process,
from the same initial weights), then compares weights, History, `evaluate`,
`predict` and a `validation_split` epoch, and counts the collective ops per
step of the traced train and test functions. kd skips TensorFlow's per-batch
"any worker has a batch left?" agreement for arrays: every worker holds the
global batch count. Prints 'RESULT {json}' per row count on each worker.
"""

import json

import keras_distrib as kd

kd.virtual_devices(2)
strategy = kd.make_strategy("multi_worker")
import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_distrib.training import collectives  # noqa: E402

keras.config.set_floatx("float64")


def layers():
    return [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]


def largest(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)), initial=0.0)) for x, y in zip(a, b))


rng = np.random.default_rng(0)
for rows in (225, 3):
    x, y = rng.normal(size=(rows, 6)), rng.normal(size=(rows, 1))
    keras.utils.set_random_seed(1)
    reference = keras.Sequential(layers())
    initial = reference.get_weights()
    reference.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
    with strategy.scope():
        model = kd.Sequential(layers())
        model.set_weights(initial)
        model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
    runs = []
    for trained in (reference, model):
        history = trained.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False).history
        logs = [value for key in sorted(history) for value in history[key]]
        evaluated = trained.evaluate(x, y, batch_size=32, verbose=0)
        predicted = trained.predict(x, batch_size=32, verbose=0)
        validated = trained.fit(x, y, batch_size=32, epochs=1, verbose=0, validation_split=0.2).history
        runs.append((trained.get_weights(), logs, evaluated, predicted,
                     [validated[key][0] for key in sorted(validated)]))
    traced = collectives.traced(model)
    print("RESULT " + json.dumps({
        "rows": rows, "replicas": strategy.num_replicas_in_sync,
        **{name: largest(*[run[i] if isinstance(run[i], list) else [run[i]] for run in runs])
           for i, name in enumerate(("weights", "logs", "evaluate", "predict", "validation"))},
        "train": traced["train"]["step"], "test": traced["test"]["step"],
    }), flush=True)
