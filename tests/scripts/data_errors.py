import json

import keras_distrib as kd

kd.virtual_devices(4)
import numpy as np  # noqa: E402

strategy = kd.make_strategy("mirrored")
try:
    kd.distribute_dataset(np.zeros((64, 2)), strategy=strategy, global_batch_size=30)
    error = ""
except ValueError as exc:
    error = str(exc)
lines = []
report = kd.data.describe_input(np.arange(66), strategy=strategy, global_batch_size=32, print_fn=lines.append)
print("RESULT " + json.dumps({"error": error, "report": report, "lines": lines}), flush=True)
