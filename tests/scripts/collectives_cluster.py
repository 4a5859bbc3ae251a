"""Collective ops in the traced step graphs of a kd model on two worker processes.

Run by kd.launch on 2 workers (one replica each). Each worker trains, evaluates
and predicts one epoch of a small MLP (rows divide evenly: one trace per step
function), then counts the collective ops (all-reduces, all-gathers, of any
version) in the graphs of its step functions, the functions they call
included. Prints 'RESULT {json}' on each worker.
"""

import json

import keras_distrib as kd

strategy = kd.make_strategy("multi_worker")
import keras  # noqa: E402
import numpy as np  # noqa: E402

ROWS = 32


def collective_ops(step):
    counts = {}
    for function in step._functions.values():
        for concrete in function._list_all_concrete_functions_for_serialization():
            graph_def = concrete.graph.as_graph_def()
            nodes = list(graph_def.node)
            for library_function in graph_def.library.function:
                nodes.extend(library_function.node_def)
            for node in nodes:
                if node.op.startswith("Collective"):
                    counts[node.op] = counts.get(node.op, 0) + 1

    return counts


with strategy.scope():
    model = kd.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                           keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
rng = np.random.default_rng(0)
x = rng.normal(size=(ROWS, 6)).astype("float32")
y = rng.normal(size=(ROWS, 1)).astype("float32")
model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
model.evaluate(x, y, batch_size=8, verbose=0)
model.predict(x, batch_size=8, verbose=0)
result = {kind: collective_ops(getattr(model, f"{kind}_function"))
          for kind in ("train", "test", "predict")}
print("RESULT " + json.dumps(result), flush=True)
