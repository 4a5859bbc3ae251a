"""Loss reductions kd's deferred scaling must keep exact, mirrored 2 against one device.

Usage: deferred_scaling.py

Each case trains plain Keras on one device (the reference) and a kd model under
a mirrored strategy on 2 virtual devices, same initial weights and batches (37
rows, batch 8: an uneven last batch), and prints 'RESULT {json}' with the
largest relative difference of weights, last-epoch logs and evaluate. The cases
are the losses whose scale is not rows times a constant (reduction "sum",
"mean_with_sample_weight", per-example "none"), penalties that add to the loss
(activity regularizer, add_loss), and two outputs with different reductions.
"""

import json

import keras_distrib as kd

kd.virtual_devices(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

CASES = ("sum", "mean_with_sample_weight", "none", "activity_regularizer", "add_loss",
         "two_outputs")


class Penalty(keras.layers.Layer):
    def call(self, x):
        self.add_loss(0.01 * tf.reduce_mean(tf.square(x)))
        return x


def build(model_class, case):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    regularizer = "l2" if case == "activity_regularizer" else None
    hidden = keras.layers.Dense(8, activation="tanh", activity_regularizer=regularizer)(inputs)
    if case == "add_loss":
        hidden = Penalty()(hidden)
    if case == "two_outputs":
        model = model_class(inputs, [keras.layers.Dense(1, name="a")(hidden),
                                     keras.layers.Dense(1, name="b")(hidden)])
        model.compile(keras.optimizers.Adam(0.01),
                      [keras.losses.MeanSquaredError(reduction="sum"), keras.losses.MeanAbsoluteError()],
                      loss_weights=[0.3, 1.0], metrics=[["mae"], ["mse"]])
        return model
    model = model_class(inputs, keras.layers.Dense(1)(hidden))
    reduction = case if case in ("sum", "mean_with_sample_weight", "none") else "sum_over_batch_size"
    model.compile(keras.optimizers.Adam(0.01), keras.losses.MeanSquaredError(reduction=reduction),
                  metrics=["mae"])
    return model


def relative(a, b):
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    return float(np.max(np.abs(a - b) / (1 + np.abs(a)))) if a.size else 0.0


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(37, 6)).astype("float32")
    y = rng.normal(size=(37, 1)).astype("float32")
    weights = rng.uniform(size=(37,)).astype("float32")
    strategy = kd.make_strategy("mirrored")
    for case in CASES:
        targets = [y, 2 * y] if case == "two_outputs" else y
        sample_weight = weights if case in ("sum", "mean_with_sample_weight") else None
        fit = dict(sample_weight=sample_weight, batch_size=8, epochs=2, shuffle=False, verbose=0)
        reference = build(keras.Model, case)
        expected = reference.fit(x, targets, **fit).history
        with strategy.scope():
            model = build(kd.Model, case)
        history = model.fit(x, targets, **fit).history
        result = {
            "case": case,
            "weights": max(relative(a, b) for a, b in zip(reference.get_weights(), model.get_weights())),
            "history": max(relative(expected[k][-1], history[k][-1]) for k in expected),
            "evaluate": relative(reference.evaluate(x, targets, batch_size=8, verbose=0),
                                 model.evaluate(x, targets, batch_size=8, verbose=0)),
        }
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
