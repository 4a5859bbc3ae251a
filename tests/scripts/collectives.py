"""Collective ops per traced step of kd models and plain Keras, on one strategy.

Usage: collectives.py KIND CASE[,CASE...]. KIND: one_device, mirrored or
central_storage (2 virtual devices but one_device). Cases: `metrics0`,
`metrics1`, `metrics3` (an MLP with 0, 1 or 3 compiled metrics; `_outside`: the metric
objects made before the strategy's scope; `_spe3`:
3 steps per call), and the models of `count` below (`buckets`: gradients summed in 2 buckets). Each case's evaluation
runs twice: with verbose=0 (its logs read once) and with a callback that
reads every batch's logs. Prints one 'RESULT {json}' line per case.
"""

import json
import logging
import sys

import keras_distrib as kd

KIND = sys.argv[1]
kd.virtual_devices(1 if KIND == "one_device" else 2)
import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_distrib.training import collectives  # noqa: E402

ROWS = 16


class Reports(logging.Handler):
    """kd's log lines (the bucket plan `fit` reports at its start)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


REPORTS = Reports()
logging.getLogger("keras_distrib").addHandler(REPORTS)
logging.getLogger("keras_distrib").setLevel(logging.INFO)


METRICS = {0: lambda: [], 1: lambda: ["mae"],
           3: lambda: ["mae", "mse", keras.metrics.RootMeanSquaredError()]}


class BatchLogs(keras.callbacks.Callback):
    """Reads every evaluation batch's logs (so each call reads them)."""

    def on_test_batch_end(self, batch, logs=None):
        pass


def _metrics_mlp(strategy, metrics, spe, outside=False):
    # `outside`: the metric objects made before the scope, as a user may make them.
    made = METRICS[metrics]() if outside else None
    with strategy.scope():
        model = kd.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                               keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(0.01), "mse", metrics=made or METRICS[metrics](),
                      steps_per_execution=spe)
    return model


def _dense(model_class, strategy, outputs=1, dropout=False, compute_loss=None, buckets="auto"):
    with strategy.scope():
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="relu", kernel_regularizer="l2")(inputs)
        if dropout:
            hidden = keras.layers.Dropout(0.3)(hidden)
        heads = [keras.layers.Dense(1, name=f"out{i}")(hidden) for i in range(outputs)]
        model = model_class(inputs, heads if outputs > 1 else heads[0])
        if compute_loss is not None:
            model.compute_loss = compute_loss.__get__(model)
        model.compile(keras.optimizers.Adam(0.01), "mse", metrics=[["mae"]] * outputs if outputs > 1
                      else ["mae"], gradient_buckets=buckets)
    return model


def backward_waits(model):
    """For each all-reduce of the first replica's training step, in graph order: the
    backward MatMuls (the tape's gradient ops) it waits for, of how many in the step.

    Read from the traced graph: an op runs once its inputs (data and control) are
    ready, so a collective that does not have a backward op among its ancestors
    can start before that op has run.
    """
    graph = model.train_function.compiled_functions()["one"][0].graph.as_graph_def()
    nodes = {node.name: node for node in graph.node}

    def ancestors(name):
        seen, stack = set(), [name]
        while stack:
            for source in nodes[stack.pop()].input:
                source = source.lstrip("^").split(":")[0]
                if source in nodes and source not in seen:
                    seen.add(source)
                    stack.append(source)
        return seen

    def backward(name):
        return name.startswith("gradient_tape/functional") and nodes[name].op == "MatMul"

    total = sum(map(backward, nodes))
    return [[sum(map(backward, ancestors(node.name))), total] for node in graph.node
            if node.op == "CollectiveReduceV2" and node.device.endswith("CPU:0")]


def _masked(strategy):
    with strategy.scope():
        inputs = keras.Input((5,))
        hidden = keras.layers.Embedding(20, 4, mask_zero=True)(inputs)
        hidden = keras.layers.LSTM(4, return_sequences=True)(hidden)
        model = kd.Model(inputs, keras.layers.Dense(1)(hidden))
        model.compile("sgd", "mse")
    return model


def _embedding(strategy):
    with strategy.scope():
        inputs = keras.Input((5,))
        hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 4)(inputs))
        model = kd.Model(inputs, keras.layers.Dense(1)(hidden))
        model.compile("adam", "mse")
    return model


def count(strategy, case):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = rng.normal(size=(ROWS, 1)).astype("float32")
    sample_weight = None
    batch_size = ROWS
    if case.startswith("metrics"):
        metrics, _, spe = case.removeprefix("metrics").removesuffix("_outside").partition("_spe")
        model = _metrics_mlp(strategy, int(metrics), int(spe or 1), case.endswith("_outside"))
        batch_size = ROWS // 4
    elif case == "mlp":
        model = _dense(kd.Model, strategy)
    elif case == "buckets":  # 40-byte buckets: [out bias, out kernel, hidden bias], [hidden kernel]
        model = _dense(kd.Model, strategy, buckets=40)
    elif case == "weighted":
        model = _dense(kd.Model, strategy)
        sample_weight = rng.uniform(size=ROWS).astype("float32")
    elif case == "multi_output":
        model = _dense(kd.Model, strategy, outputs=2)
        y = [y, y * 2]
    elif case == "dropout":
        model = _dense(kd.Model, strategy, dropout=True)
    elif case == "own_compute_loss":
        def compute_loss(self, *args, **kwargs):
            return kd.Model.compute_loss(self, *args, **kwargs)

        model = _dense(kd.Model, strategy, compute_loss=compute_loss)
    elif case == "masked":
        model = _masked(strategy)
        x = rng.integers(0, 20, size=(ROWS, 5))
        x[:, 3:] = 0
        y = rng.normal(size=(ROWS, 5, 1)).astype("float32")
    elif case == "embedding":
        model = _embedding(strategy)
        x = rng.integers(0, 20, size=(ROWS, 5))
    else:
        raise SystemExit(f"unknown case {case!r}")
    REPORTS.lines.clear()
    counts = collectives.count(model, x, y, sample_weight=sample_weight, batch_size=batch_size)
    model.evaluate(x, y, sample_weight=sample_weight, batch_size=batch_size, verbose=0,
                   callbacks=[BatchLogs()])
    counts["test_each_call"] = collectives.traced(model)["test"]
    if case in ("mlp", "buckets") and KIND == "mirrored":
        counts["backward_waits"] = backward_waits(model)
        counts["reported"] = [line for line in REPORTS.lines if "all-reduce" in line]
    return counts


if __name__ == "__main__":
    strategy = kd.make_strategy("default" if KIND == "one_device" else KIND)
    for case in sys.argv[2].split(","):
        print("RESULT " + json.dumps({"case": case, **count(strategy, case)}), flush=True)
