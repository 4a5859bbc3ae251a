"""Training on 2 workers with a sidecar evaluator (launched with evaluator=True).

Usage: sidecar_cluster.py CHECKPOINT_DIR BEST_MODEL_PATH
The workers train and back up every epoch; the evaluator task evaluates the
checkpoints as they come. Each prints one RESULT line.
"""

import json
import sys

import keras_distrib as kd

checkpoint_dir, best_model_path = sys.argv[1:3]
info = kd.cluster_info()
strategy = kd.make_strategy("auto")
import keras  # noqa: E402
import numpy as np  # noqa: E402

rng = np.random.default_rng(0)
x = rng.normal(size=(90, 5)).astype("float32")
y = (x @ rng.normal(size=(5, 1))).astype("float32")


def build():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    model = kd.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(inputs)))
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse", metrics=["mae"])
    return model


with strategy.scope():
    model = build()
if info.task_type == "evaluator":
    evaluator = kd.SidecarEvaluator(
        model, (x, y), checkpoint_dir, batch_size=16, best_model_path=best_model_path,
        poll_seconds=0.2, timeout=120,
    )
    results = evaluator.start()
    print("RESULT " + json.dumps({"task": info.label, "evaluations": [logs for _, logs in results],
                                  "checkpoints": [path for path, _ in results]}), flush=True)
else:
    model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0,
              callbacks=[kd.callbacks.BackupAndRestore(checkpoint_dir, delete_checkpoint=False)])
    logs = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    print("RESULT " + json.dumps({"task": info.label, "final": logs}), flush=True)
