"""Hand-written loops with kd's recipe vs plain Keras on one device, float32 and float64.

Usage: python tests/scripts/loop_layout.py mirrored|central_storage|multi_worker [--float64-only] [case ...]
(multi_worker: run on 2 worker processes by kd.launch, one device each.)

225 rows in global batches of 32 (the last batch has 1 row: one of the 2
replicas is empty), 2 epochs, from the same initial weights. Each case
prints one `RESULT {json}` line per dtype (the contrasts: float64 only): `weights` (the largest
|a - b| / (1 + |a|) over every weight, moving statistics included),
`losses` (the same over the global loss of every step), or `error`.

The loop is the one kd documents (docs/guides/hand-written-loops.md, tutorials/custom_training_loop):
a `tf.function` around `strategy.run`, per-example losses through
`kd.losses.global_mean`, `model.losses` through
`kd.losses.scale_regularization(..., local_rows=rows)`, and
`kd.exact_optimizer`. The reference runs the same loop body on one device
with Keras's own arithmetic (the mean of the batch, `sum(model.losses)`).
"""

import json
import sys
import traceback

import keras_distrib as kd

KIND = sys.argv[1]
kd.virtual_devices(1 if KIND == "multi_worker" else 2)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras_distrib.training import replica  # noqa: E402

STRATEGY = kd.make_strategy(KIND)  # one per process: strategies would share collective keys
# --float64-only: the exact cases too run in float64 alone (1e-9 bounds the arithmetic).
FLOAT64_ONLY = "--float64-only" in sys.argv[2:]
CASES = [name for name in sys.argv[2:] if not name.startswith("--")]
EPOCHS = 2
BATCH = 32
rng = np.random.default_rng(3)
X = rng.normal(size=(225, 4))
Y = X @ np.array([[1.0], [-2.0], [0.5], [0.25]]) + 0.3


class RowSumPenalty(keras.layers.Layer):
    """A penalty summed over the batch's rows (the custom-loop guide's `add_loss`)."""

    def call(self, inputs):
        self.add_loss(1e-2 * tf.reduce_sum(inputs))
        return inputs


class ConstantPenalty(keras.layers.Layer):
    """A penalty that depends on no row: its weight's square, written as `add_loss`."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

    def call(self, inputs):
        self.add_loss(0.05 * tf.square(self.scale - 0.5))
        return inputs * self.scale


class BatchVariancePenalty(keras.layers.Layer):
    """A penalty on the spread of the batch: neither a sum nor a mean over rows."""

    def call(self, inputs):
        centred = inputs - tf.reduce_mean(inputs, axis=0)
        self.add_loss(1e-2 * tf.reduce_mean(tf.square(centred)))
        return inputs


def penalties_layers():
    return [keras.Input((4,)),
            keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(1e-2),
                               activity_regularizer=keras.regularizers.L2(1e-2)),
            RowSumPenalty(), ConstantPenalty(), keras.layers.Dense(1)]


def batch_norm_layers():
    return [keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
            keras.layers.BatchNormalization(momentum=0.8), keras.layers.Dropout(0.3),
            keras.layers.GaussianNoise(0.1), keras.layers.Dense(1)]


def variance_layers():
    return [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), BatchVariancePenalty(),
            keras.layers.Dense(1)]


def old_rule(losses, rows):
    """kd's former `scale_regularization`: every term weighted by n_r / N."""
    total = tf.add_n([tf.cast(l, keras.config.floatx()) for l in losses])
    rows = tf.cast(rows, total.dtype)
    return tf.math.divide_no_nan(rows, replica.replica_sum(rows)) * total


def train(model, optimizer, strategy, *, rule):
    """The recipe's loop; returns the global loss of every step."""
    dtype = keras.config.floatx()
    dataset = tf.data.Dataset.from_tensor_slices((X.astype(dtype), Y.astype(dtype))).batch(BATCH)
    if strategy is not None:
        dataset = strategy.experimental_distribute_dataset(dataset)

    def replica_step(batch):
        x, y = batch
        with tf.GradientTape() as tape:
            errors = keras.losses.mean_squared_error(y, model(x, training=True))
            if rule == "one_device":
                loss = tf.reduce_mean(errors) + tf.add_n([tf.constant(0.0, errors.dtype)] + model.losses)
            elif rule == "keras":  # plain Keras under a strategy: compute_loss's arithmetic
                context = tf.distribute.get_replica_context()
                penalty = tf.add_n([tf.constant(0.0, errors.dtype)] + model.losses)
                loss = (tf.reduce_mean(errors) + penalty) / context.num_replicas_in_sync
            elif rule == "late_read":  # model.losses read after a collective: refused
                loss = kd.losses.global_mean(errors)
                loss += kd.losses.scale_regularization(model.losses, local_rows=tf.shape(x)[0])
            else:
                # model.losses first: the replicas trace in turns, switching
                # at every collective, and Keras's terms live on the layers.
                rows = tf.shape(x)[0]
                if rule == "old_rule":
                    penalty = old_rule(model.losses, rows)
                else:
                    penalty = kd.losses.scale_regularization(model.losses, local_rows=rows)
                loss = kd.losses.global_mean(errors) + penalty
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(batch):
        if strategy is None:
            return replica_step(batch)
        return strategy.reduce("SUM", strategy.run(replica_step, args=(batch,)), axis=None)

    losses = []
    for _ in range(EPOCHS):
        for batch in dataset:
            losses.append(float(step(batch)))
    return [np.asarray(w) for w in model.get_weights()], np.array(losses)


def relative(a, b):
    return max(float(np.max(np.abs(x - y) / (1 + np.abs(x)))) for x, y in zip(a, b))


def use(dtype):
    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)


def case(name, make_layers, *, model_class, rule, dtype):
    use(dtype)
    keras.utils.set_random_seed(1)
    reference = keras.Sequential(make_layers())
    initial = reference.get_weights()
    expected, expected_losses = train(reference, keras.optimizers.Adam(0.02), None, rule="one_device")
    result = {"case": name, "dtype": dtype}
    try:
        keras.utils.set_random_seed(1)  # the same seed states as the reference
        with STRATEGY.scope():
            model = model_class(make_layers())
            model.set_weights(initial)
            optimizer = keras.optimizers.Adam(0.02)
            if rule != "keras":
                optimizer = kd.exact_optimizer(optimizer)
            else:  # plain Keras 3 cannot build Adam's slots in the first step on 2 replicas
                optimizer.build(model.trainable_variables)
        weights, losses = train(model, optimizer, STRATEGY, rule=rule)
        result["weights"] = relative(expected, weights)
        result["losses"] = float(np.max(np.abs(losses - expected_losses) / (1 + np.abs(expected_losses))))
    except Exception as error:  # reported, and checked by the test
        traceback.print_exc()
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
    print("RESULT " + json.dumps(result), flush=True)


def trainloop_case(name, make_layers, *, dtype):
    """`kd.TrainLoop.train_step` on a compiled kd model, against Keras's `fit` on one device."""
    use(dtype)
    keras.utils.set_random_seed(1)
    reference = keras.Sequential(make_layers())
    reference.compile(keras.optimizers.Adam(0.02), "mse")
    initial = reference.get_weights()
    dtype = keras.config.floatx()
    reference.fit(X.astype(dtype), Y.astype(dtype), batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    result = {"case": name, "dtype": dtype}
    keras.utils.set_random_seed(1)
    with STRATEGY.scope():
        model = kd.Sequential(make_layers())
        model.compile(keras.optimizers.Adam(0.02), "mse")
        model.set_weights(initial)
    loop = kd.TrainLoop(model)
    for _ in range(EPOCHS):
        data = tf.data.Dataset.from_tensor_slices((X.astype(dtype), Y.astype(dtype)))
        iterator = iter(loop.distribute(data.batch(BATCH)))
        for _ in range(-(-len(X) // BATCH)):
            loop.train_step(iterator)
    result["weights"] = relative(reference.get_weights(), model.get_weights())
    print("RESULT " + json.dumps(result), flush=True)


ALL = {
    # The recipe on a plain keras.Model (as the tutorial writes it): every kind of penalty.
    "penalties": lambda d: case("penalties", penalties_layers, model_class=keras.Sequential,
                                rule="kd", dtype=d),
    "penalties_old_rule": lambda d: case("penalties_old_rule", penalties_layers,
                                         model_class=keras.Sequential, rule="old_rule", dtype=d),
    "penalties_keras": lambda d: case("penalties_keras", penalties_layers,
                                      model_class=keras.Sequential, rule="keras", dtype=d),
    "penalties_late_read": lambda d: case("penalties_late_read", penalties_layers,
                                          model_class=keras.Sequential, rule="late_read", dtype=d),
    "variance_penalty": lambda d: case("variance_penalty", variance_layers,
                                       model_class=keras.Sequential, rule="kd", dtype=d),
    # BatchNormalization, Dropout and GaussianNoise: a kd model in the recipe.
    "batch_norm": lambda d: case("batch_norm", batch_norm_layers, model_class=kd.Sequential,
                                 rule="kd", dtype=d),
    "batch_norm_keras_model": lambda d: case("batch_norm_keras_model", batch_norm_layers,
                                             model_class=keras.Sequential, rule="kd", dtype=d),
    "penalties_trainloop": lambda d: trainloop_case("penalties_trainloop", penalties_layers,
                                                    dtype=d),
    "batch_norm_trainloop": lambda d: trainloop_case("batch_norm_trainloop", batch_norm_layers,
                                                     dtype=d),
}

# The exact cases in both dtypes (round-off is what differs); the contrasts and
# refusals once, in float64 (what they show does not depend on the dtype).
EXACT = ("penalties", "batch_norm", "penalties_trainloop", "batch_norm_trainloop")
for name in CASES or ALL:
    for dtype in ("float64", "float32") if name in EXACT and not FLOAT64_ONLY else ("float64",):
        ALL[name](dtype)
