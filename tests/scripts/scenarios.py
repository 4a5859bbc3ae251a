"""Training scenarios shared by the parity scripts.

Each scenario gives data, a model builder and fit arguments; the same
scenario is trained with plain Keras on one device (the reference) and with
kd under a strategy, and the scripts report the differences.
"""

import os
import pickle

import keras
import numpy as np

GLOBAL_BATCH = 16


def _rng():
    return np.random.default_rng(0)


def _regression(n):
    rng = _rng()
    x = rng.normal(size=(n, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1)) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def _mlp(cls, *, l2=0.0, activity=0.0):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(
        8,
        activation="tanh",
        kernel_regularizer=keras.regularizers.L2(l2) if l2 else None,
        activity_regularizer=keras.regularizers.L2(activity) if activity else None,
    )(inputs)
    return cls(inputs, keras.layers.Dense(1)(hidden))


def _two_heads(cls):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    value = keras.layers.Dense(1, name="value")(hidden)
    grid = keras.layers.Reshape((3, 2), name="grid")(keras.layers.Dense(6)(hidden))
    return cls(inputs, {"value": value, "grid": grid})


def _classifier(cls):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return cls(inputs, keras.layers.Dense(3, activation="softmax")(hidden))


def even():
    x, y = _regression(64)
    return dict(
        build=lambda cls: _mlp(cls),
        compile=dict(loss="mse", metrics=["mae"]),
        fit=dict(x=x, y=y),
        evaluate=dict(x=x, y=y),
        predict=x,
    )


def uneven_empty():
    # 33 rows: the last global batch has 1 row, so every replica but one is empty.
    x, y = _regression(2 * GLOBAL_BATCH + 1)
    return dict(
        build=lambda cls: _mlp(cls),
        compile=dict(loss="mse", metrics=["mae"]),
        fit=dict(x=x, y=y),
        evaluate=dict(x=x, y=y),
        predict=x,
    )


def weighted_l2():
    # Uneven (37 rows: last batch 5) with sample weights, an L2 weight penalty
    # and a batch-mean activity penalty (an add_loss term).
    x, y = _regression(37)
    weights = np.random.default_rng(3).uniform(0.2, 2.0, size=(37,)).astype("float32")
    return dict(
        build=lambda cls: _mlp(cls, l2=0.01, activity=0.01),
        compile=dict(loss="mse", metrics=["mae"], weighted_metrics=["mse"]),
        fit=dict(x=x, y=y, sample_weight=weights),
        evaluate=dict(x=x, y=y, sample_weight=weights),
        predict=x,
    )


def multi_output():
    # Two outputs, one with labels of shape (n, 3, 2), weighted losses.
    rng = _rng()
    x, y = _regression(37)
    grid = rng.normal(size=(37, 3, 2)).astype("float32")
    labels = {"value": y, "grid": grid}
    return dict(
        build=_two_heads,
        compile=dict(
            loss={"value": "mse", "grid": "mae"},
            loss_weights={"value": 1.0, "grid": 0.5},
            metrics={"value": ["mae"]},
        ),
        fit=dict(x=x, y=labels),
        evaluate=dict(x=x, y=labels),
        predict=x,
    )


def class_weights():
    rng = _rng()
    x = rng.normal(size=(37, 5)).astype("float32")
    y = rng.integers(0, 3, size=(37,)).astype("int32")
    return dict(
        build=_classifier,
        compile=dict(loss="sparse_categorical_crossentropy", metrics=["accuracy"]),
        fit=dict(x=x, y=y, class_weight={0: 1.0, 1: 2.0, 2: 0.5}),
        evaluate=dict(x=x, y=y),
        predict=x,
    )


SCENARIOS = {
    "even": even,
    "uneven_empty": uneven_empty,
    "weighted_l2": weighted_l2,
    "multi_output": multi_output,
    "class_weights": class_weights,
}


def train(cls, scenario, *, strategy=None, compile_kwargs=None, epochs=2, steps_per_loop=None):
    """Builds, compiles and fits; returns (model, history, eval logs, predictions).

    With `steps_per_loop`, trains and evaluates through `kd.TrainLoop` instead
    of `Model.fit`.
    """
    spec = SCENARIOS[scenario]()

    def build():
        model = spec["build"](cls)
        model.compile(
            optimizer=keras.optimizers.Adam(0.01), **spec["compile"], **(compile_kwargs or {})
        )
        return model

    if strategy is None:
        model = build()
    else:
        with strategy.scope():
            model = build()
    if steps_per_loop:
        import keras_distrib as kd

        loop = kd.TrainLoop(model, steps_per_loop=steps_per_loop)
        history = loop.fit(
            **spec["fit"], batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0
        )
        logs = loop.evaluate(**spec["evaluate"], batch_size=GLOBAL_BATCH, verbose=0)
        predictions = loop.predict(spec["predict"], batch_size=GLOBAL_BATCH, verbose=0)
    else:
        history = model.fit(
            **spec["fit"], batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0
        )
        logs = model.evaluate(**spec["evaluate"], batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
        predictions = model.predict(spec["predict"], batch_size=GLOBAL_BATCH, verbose=0)
    return model, history.history, logs, predictions


def max_diff(a, b):
    """Largest absolute difference between two nests of arrays/numbers."""
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), (sorted(a), sorted(b))
        return max(max_diff(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), (len(a), len(b))
        return max((max_diff(x, y) for x, y in zip(a, b)), default=0.0)
    a, b = np.asarray(a, dtype="float64"), np.asarray(b, dtype="float64")
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def reference_run(scenario):
    """Plain Keras on one device; cached in $KD_REFERENCE_DIR across processes."""
    folder = os.environ.get("KD_REFERENCE_DIR")
    path = os.path.join(folder, f"{scenario}.pkl") if folder else None
    if path and os.path.exists(path):
        with open(path, "rb") as f:
            weights, history, logs, predictions = pickle.load(f)
        return _Weights(weights), history, logs, predictions
    model, history, logs, predictions = train(keras.Model, scenario)
    if path:
        temp = f"{path}.{os.getpid()}.tmp"
        with open(temp, "wb") as f:
            pickle.dump((model.get_weights(), history, logs, predictions), f)
        os.replace(temp, path)
    return model, history, logs, predictions


class _Weights:
    """Stands in for a model whose weights were cached."""

    def __init__(self, weights):
        self._weights = weights

    def get_weights(self):
        return self._weights


def compare(scenario, kd_cls, *, strategy, compile_kwargs=None, steps_per_loop=None):
    """Trains the reference and the kd model; returns the differences.

    With `steps_per_loop`, the kd model is trained with `kd.TrainLoop`, and a
    second kd model trained with `fit` gives the loop-vs-fit differences.
    """
    reference = reference_run(scenario)
    candidate = train(
        kd_cls, scenario, strategy=strategy, compile_kwargs=compile_kwargs,
        steps_per_loop=steps_per_loop,
    )
    extra = {}
    if steps_per_loop:
        fitted = train(kd_cls, scenario, strategy=strategy, compile_kwargs=compile_kwargs)
        extra = {
            "loop_vs_fit_weights": max_diff(fitted[0].get_weights(), candidate[0].get_weights()),
            "loop_vs_fit_history": max_diff(fitted[1], candidate[1]),
        }
    return extra | {
        "scenario": scenario,
        "weights": max_diff(reference[0].get_weights(), candidate[0].get_weights()),
        "history": max_diff(reference[1], candidate[1]),
        "evaluate": max_diff(reference[2], candidate[2]),
        "predict": max_diff(reference[3], candidate[3]),
        "history_keys": sorted(candidate[1]),
        "final_loss": candidate[1]["loss"][-1],
    }
