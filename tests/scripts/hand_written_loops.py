"""Hand-written loops on 2 replicas against plain Keras on one device.

Usage: python tests/scripts/hand_written_loops.py mirrored|central_storage

Each case trains with a loop written as TensorFlow's custom-training guide
writes it (a `tf.function` around `strategy.run`, the dataset iterated in
Python), once with kd's pieces (`kd.exact_optimizer`, `kd.losses`, a kd
model) under the strategy and once with plain Keras on one device, from the
same initial weights on the same global batches (66 rows in batches of 32:
the last batch has 2 rows). Prints one `RESULT {json}` line per case: the
largest |a - b| / (1 + |a|) over every weight (moving statistics included),
or the error. The contrast cases run plain Keras 3 under the strategy.
"""

import json
import sys

import keras_distrib as kd

kd.virtual_devices(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

KIND = sys.argv[1]
STRATEGY = kd.make_strategy(KIND)  # one per process: strategies would share collective keys
EPOCHS = 2
rng = np.random.default_rng(7)
X = rng.normal(size=(66, 3)).astype("float32")
Y = (X @ np.array([[1.0], [-2.0], [0.5]], "float32") + 0.3).astype("float32")


def layers(batch_norm):
    hidden = [keras.layers.Dense(8, activation="relu")]
    if batch_norm:
        hidden.append(keras.layers.BatchNormalization(synchronized=True, momentum=0.8))
    return [keras.Input((3,))] + hidden + [keras.layers.Dense(1)]


def make_optimizer(name):
    return {"adagrad": lambda: keras.optimizers.Adagrad(0.1),
            "adam": lambda: keras.optimizers.Adam(0.05),
            "nadam": lambda: keras.optimizers.Nadam(0.05)}[name]()


def train(model, optimizer, strategy, *, exact):
    """The guide's loop: a compiled step around strategy.run, batches from Python."""
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(32)
    if strategy is not None:
        dataset = strategy.experimental_distribute_dataset(dataset)

    def replica_step(batch):
        x, y = batch
        with tf.GradientTape() as tape:
            errors = keras.losses.mean_squared_error(y, model(x, training=True))
            loss = kd.losses.global_mean(errors) if exact else tf.reduce_mean(errors)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def step(batch):
        if strategy is None:
            replica_step(batch)
        else:
            strategy.run(replica_step, args=(batch,))

    for _ in range(EPOCHS):
        for batch in dataset:
            step(batch)
    return [np.asarray(w) for w in model.get_weights()]


def relative(a, b):
    return max(float(np.max(np.abs(x - y) / (1 + np.abs(x)))) for x, y in zip(a, b))


def case(name, optimizer_name, batch_norm, *, kd_side):
    keras.utils.set_random_seed(1)
    reference = keras.Sequential(layers(batch_norm))
    initial = reference.get_weights()
    expected = train(reference, make_optimizer(optimizer_name), None, exact=False)
    strategy = STRATEGY
    result = {"case": name}
    try:
        with strategy.scope():
            model = (kd.Sequential if kd_side else keras.Sequential)(layers(batch_norm))
            model.set_weights(initial)
            optimizer = make_optimizer(optimizer_name)  # not built: the loop's first step builds it
            if kd_side:
                optimizer = kd.exact_optimizer(optimizer)
        result["diff"] = relative(expected, train(model, optimizer, strategy, exact=kd_side))
    except Exception as error:  # reported, and checked by the test
        result["error"] = f"{type(error).__name__}: {error}"
    print("RESULT " + json.dumps(result), flush=True)


def train_epoch_twice():
    """kd.TrainLoop's whole-epoch call, twice on one distributed dataset (the shape never hangs)."""
    with STRATEGY.scope():
        model = kd.Sequential(layers(False))
        model.compile(keras.optimizers.SGD(0.01), "mse")
    loop = kd.TrainLoop(model)
    dataset = loop.distribute(tf.data.Dataset.from_tensor_slices((X, Y)).batch(32))
    logs = [float(loop.train_epoch(dataset)["loss"]) for _ in range(2)]
    print("RESULT " + json.dumps({"case": "train_epoch_twice", "losses": logs}), flush=True)


if KIND == "mirrored":
    for optimizer_name in ("adagrad", "adam"):
        case(f"kd_{optimizer_name}", optimizer_name, False, kd_side=True)
    case("keras_adagrad", "adagrad", False, kd_side=False)
    train_epoch_twice()
else:
    case("kd_batch_norm_adam", "adam", True, kd_side=True)
    case("keras_batch_norm_adam", "adam", True, kd_side=False)
    # Nadam assigns its momentum-cache product in each replica (no aggregation).
    case("kd_nadam", "nadam", False, kd_side=True)
    case("keras_nadam", "nadam", False, kd_side=False)
