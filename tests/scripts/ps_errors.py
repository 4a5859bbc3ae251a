import json

import keras_distrib as kd

strategy = kd.make_strategy("parameter_server", cluster_resolver=kd.local_cluster(workers=1, ps=1))
import keras  # noqa: E402
import numpy as np  # noqa: E402

with strategy.scope():
    inputs = keras.Input((2,))
    model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
try:
    model.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=4, verbose=0)
    error = ""
except ValueError as exc:
    error = str(exc)
print("RESULT " + json.dumps({"error": error}), flush=True)
