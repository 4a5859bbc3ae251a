"""Plain Keras under mirrored on an uneven last batch (the bug kd fixes)."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import keras_distrib as kd

kd.virtual_devices(int(sys.argv[1]))
import keras  # noqa: E402

import scenarios as sc  # noqa: E402

strategy = kd.make_strategy("mirrored")
reference = sc.train(keras.Model, "uneven_empty")
plain = sc.train(keras.Model, "uneven_empty", strategy=strategy)
result = {"weights": sc.max_diff(reference[0].get_weights(), plain[0].get_weights())}
print("RESULT " + json.dumps(result), flush=True)
