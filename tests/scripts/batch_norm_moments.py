"""Global BatchNormalization on 2 mirrored replicas: collective ops and exactness.

Usage: batch_norm_moments.py counts|exact

counts: a small ResNet (9 BatchNormalization layers) trains one step; the
collective ops TensorFlow traced into its `train_function` graphs (nested
functions included) are counted per replica: for kd (global statistics),
the same network without BatchNormalization (what the rest of kd's step
costs), kd with `batch_norm="per_replica"`, plain Keras, and Keras's
`synchronized=True`.

exact: a network of two BatchNormalization layers (the second after a
trained Dense layer, so gradients cross replicas) on inputs far from zero
(float64: mean 1e5, spread 1, where E[x^2] - E[x]^2 loses 10 digits)
trains on batches of 5, 5 and 1 rows (3 + 2 rows on the replicas, then 1 +
0: an empty replica), with kd on the mirrored replicas and with plain Keras
on one device; and plain Keras with `synchronized=True` on the replicas
(the contrast, on batches of 4 that split evenly). Prints the largest relative
difference of weights (moving statistics included) and predictions.

Prints one 'RESULT {json}' line per case.
"""

import json
import sys

import keras_distrib as kd

kd.virtual_devices(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402

BLOCKS = 4  # a stem and 4 residual blocks of 2: 9 BatchNormalization layers


def collective_ops(function):
    """Collective ops in the traced graphs of a step (kd's Step or a tf.function)."""
    functions = list(getattr(function, "_functions", {"one": function}).values())
    ops = 0
    while functions:
        each = functions.pop()
        if not hasattr(each, "_list_all_concrete_functions_for_serialization"):
            # Keras wraps its tf.function in a Python function.
            functions.extend(cell.cell_contents for cell in getattr(each, "__closure__", None) or ()
                             if callable(cell.cell_contents) and not isinstance(cell.cell_contents, keras.Model))
            continue
        for concrete in each._list_all_concrete_functions_for_serialization():
            graph = concrete.graph.as_graph_def()
            nodes = list(graph.node)
            for library_function in graph.library.function:
                nodes.extend(library_function.node_def)
            ops += sum(node.op.startswith(("Collective", "Nccl")) for node in nodes)
    return ops


def resnet(model_class, normalize=True, synchronized=False):
    keras.utils.set_random_seed(3)

    def norm(x):
        if not normalize:
            return x
        return keras.layers.BatchNormalization(synchronized=synchronized)(x)

    inputs = keras.Input((8, 8, 3))
    x = keras.layers.ReLU()(norm(keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(inputs)))
    for _ in range(BLOCKS):
        y = keras.layers.ReLU()(norm(keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(x)))
        y = norm(keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(y))
        x = keras.layers.ReLU()(keras.layers.Add()([x, y]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return model_class(inputs, keras.layers.Dense(2)(x))


def counts():
    strategy = kd.make_strategy("mirrored")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 8, 8, 3)).astype("float32")
    y = rng.normal(size=(8, 2)).astype("float32")
    cases = {
        "kd": (kd.Model, {}, {}),
        "kd_without_batch_norm": (kd.Model, {"normalize": False}, {}),
        "kd_per_replica": (kd.Model, {}, {"batch_norm": "per_replica"}),
        "keras": (keras.Model, {}, {}),
        "keras_synchronized": (keras.Model, {"synchronized": True}, {}),
    }
    for case, (model_class, build, compile_extra) in cases.items():
        with strategy.scope():
            model = resnet(model_class, **build)
            model.compile(keras.optimizers.SGD(0.1), "mse", **compile_extra)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        layers = sum(isinstance(layer, keras.layers.BatchNormalization) for layer in model.layers)
        per_replica = collective_ops(model.train_function) / strategy.num_replicas_in_sync
        print("RESULT " + json.dumps({"case": case, "batch_norm_layers": layers,
                                      "train_collectives": per_replica}), flush=True)


def _normalizing(model_class, synchronized=False):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((4, 3))
    x = keras.layers.BatchNormalization(momentum=0.5, synchronized=synchronized)(inputs)
    x = keras.layers.Dense(3, activation="tanh")(x)
    x = keras.layers.BatchNormalization(momentum=0.5, synchronized=synchronized)(x)
    x = keras.layers.Flatten()(x)
    return model_class(inputs, keras.layers.Dense(2)(x))


def _train(model_class, strategy, data, synchronized=False, batch_size=5):
    x, y = data
    with strategy.scope():
        model = _normalizing(model_class, synchronized)
        model.compile(keras.optimizers.SGD(0.05), "mse")
    model.fit(x, y, batch_size=batch_size, epochs=2, verbose=0, shuffle=False)
    return model.get_weights(), model.predict(x, batch_size=batch_size, verbose=0)


def _difference(expected, actual):
    worst = 0.0
    for a, b in zip(expected, actual, strict=True):
        a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
        worst = max(worst, float(np.max(np.abs(a - b) / np.maximum(np.abs(a), 1.0))))
    return worst


def exact():
    mirrored = kd.make_strategy("mirrored")
    one_device = kd.make_strategy("default")
    for floatx, offset in (("float64", 1e5), ("float32", 10.0)):
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(floatx)
        rng = np.random.default_rng(1)
        x = (offset + rng.normal(size=(11, 4, 3))).astype(floatx)
        y = rng.normal(size=(11, 2)).astype(floatx)
        # kd on batches of 5 (3 + 2 rows on the replicas), the last of 1
        # row (1 + 0); Keras's synchronized layers on batches of 4 (plain
        # Keras fails on uneven replica batches).
        for case, model_class, synchronized, batch_size in (
                ("kd", kd.Model, False, 5), ("keras_synchronized", keras.Model, True, 4)):
            weights, predictions = _train(keras.Model, one_device, (x, y), batch_size=batch_size)
            actual_weights, actual_predictions = _train(model_class, mirrored, (x, y), synchronized,
                                                        batch_size)
            print("RESULT " + json.dumps({
                "case": case, "floatx": floatx, "offset": offset, "batch_size": batch_size,
                "dtype": str(actual_weights[0].dtype),
                "weights": _difference(weights, actual_weights),
                "predict": _difference([predictions], [actual_predictions]),
            }), flush=True)


if __name__ == "__main__":
    {"counts": counts, "exact": exact}[sys.argv[1]]()
