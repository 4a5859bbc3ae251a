"""Several steps per compiled call on 2 replicas, against plain Keras on one device.

Usage: python tests/scripts/looped_steps.py float32|float64 CASE[,CASE...]

Cases:
    embedding: Embedding -> Flatten -> Dense, Adam (sparse gradients).
    transformer: Embedding -> self-attention with a residual -> LayerNorm ->
        pooling -> Dense, Adam (sparse and dense gradients).
    mlp: a Dense model with a metric (dense gradients only).

Each case trains a kd model under a 2-device mirrored strategy with
`steps_per_execution=5` and plain Keras on one device, from the same initial
weights on the same global batches: 97 rows in batches of 16, so an epoch is
one call of 5 steps and one of 2, whose last batch holds 1 row (one replica
empty). Prints one `RESULT {json}` line per case: the largest
|a - b| / (1 + |a|) over every weight, the same for the loss history, the
warnings kd gave (a step run one per call says so), and how many times the
model's `train_step` was traced (once per replica: one step function).
"""

import json
import sys
import warnings

import keras_distrib as kd

kd.virtual_devices(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402

FLOATX = sys.argv[1]
CASES = sys.argv[2].split(",")
keras.config.set_floatx(FLOATX)
STRATEGY = kd.make_strategy("mirrored")
ROWS, BATCH, EPOCHS, SPE = 97, 16, 2, 5
VOCABULARY, LENGTH = 30, 6


class CountingModel(kd.Model):
    """A kd model that counts the traces of its training step."""

    traces = 0

    def train_step(self, data):
        CountingModel.traces += 1
        return super().train_step(data)


def build(case, cls):
    keras.utils.set_random_seed(3)
    if case == "mlp":
        inputs = keras.Input((4,))
        x = keras.layers.Dense(8, activation="relu")(inputs)
        return cls(inputs, keras.layers.Dense(1)(x))
    inputs = keras.Input((LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCABULARY, 8)(inputs)
    if case == "embedding":
        x = keras.layers.Dense(8, activation="relu")(keras.layers.Flatten()(x))
    else:
        attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(x, x)
        x = keras.layers.LayerNormalization()(keras.layers.Add()([x, attended]))
        x = keras.layers.GlobalAveragePooling1D()(x)
    return cls(inputs, keras.layers.Dense(1)(x))


def data(case):
    rng = np.random.default_rng(11)
    if case == "mlp":
        x = rng.normal(size=(ROWS, 4)).astype(FLOATX)
    else:
        # Few distinct tokens: indices repeat within and across replicas.
        x = rng.integers(0, VOCABULARY, size=(ROWS, LENGTH)).astype("int32")
    return x, rng.normal(size=(ROWS, 1)).astype(FLOATX)


def compile_model(model, spe):
    # (kd's model without the first-step check, whose first step runs alone,
    # in a function of one step: the count is of the looped function's traces.)
    options = {"first_step_check": False} if isinstance(model, kd.Model) else {}
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse", metrics=["mae"],
                  steps_per_execution=spe, **options)


def relative(reference, candidate):
    return max(
        float(np.max(np.abs(a - b) / (1.0 + np.abs(a)))) if np.size(a) else 0.0
        for a, b in zip(reference, candidate)
    )


def run(case):
    x, y = data(case)
    reference = build(case, keras.Model)
    compile_model(reference, 1)
    initial = reference.get_weights()
    expected = reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    CountingModel.traces = 0
    with STRATEGY.scope():
        model = build(case, CountingModel)
        compile_model(model, SPE)
    model.set_weights(initial)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return {
        "case": case,
        "weights": relative(reference.get_weights(), model.get_weights()),
        "history": relative([np.array(expected.history["loss"])], [np.array(history.history["loss"])]),
        "warnings": [str(w.message) for w in caught if "steps per call" in str(w.message)],
        "traces": CountingModel.traces,
        "replicas": STRATEGY.num_replicas_in_sync,
    }


for name in CASES:
    try:
        result = run(name)
    except Exception as error:  # reported, so the test names the case
        result = {"case": name, "error": f"{type(error).__name__}: {error}"[-3000:]}
    print("RESULT " + json.dumps(result), flush=True)
