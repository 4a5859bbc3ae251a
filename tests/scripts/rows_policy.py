"""What kd cannot read about the rows, and random layers whose rows meet, against one device.

Usage: rows_policy.py PATTERN[,PATTERN...] DTYPE[,DTYPE...]

On 2 mirrored replicas of virtual CPU devices, each pattern trains a small
model from the same initial weights as one device (the reference, a
`keras.Model` with no strategy) on 225 rows in global batches of 32 (the
last batch holds 1 row: a replica without rows), or on 224 rows of a
dataset batched with `drop_remainder=True` (static batch shapes) for the
`_static` patterns:

- `mixup`, `cutmix` (and `_static`): `keras.layers.MixUp` / `CutMix`
  inside the model, each image blended with another row's of the batch;
- `mixup_plain`: the same `mixup` model as a plain `keras.Model` under the
  strategy (the contrast: each replica mixes only its own rows);
- `while_loss`: a compiled loss that reads the batch through a while loop
  over its rows feeding a square root (an op kd's table does not read);
- `unread_loss`: a compiled loss through an op the table does not read
  (`Lgamma`), row by row, on a softmax output whose probabilities saturate
  (Keras reads the cross-entropy from its logits, which the global batch
  must keep);
- `unread_by_hand`: the same loss in a hand-written loop
  (`strategy.run`, `kd.losses.global_mean`), where kd cannot gather: refused;
- `draws`: a layer of the user's own drawing `keras.random.gamma`, `beta`,
  `binomial` for each row and `shuffle` over the rows in training (the
  draws of TensorFlow's backend that are no uniform or normal draw).

The contrast and the refusal run in the first dtype only. Prints one
'RESULT {json}' line per pattern and dtype: the largest relative
difference of the weights and of every logged value (History, evaluate,
predict), or the error.
"""

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras_distrib as kd
from features import differences
from features import failure

ROWS, BATCH, EPOCHS = 225, 32, 2


def _data(float_type):
    rng = np.random.default_rng(5)
    images = rng.normal(size=(ROWS, 4, 4, 2)).astype(float_type)
    labels = rng.integers(0, 3, size=(ROWS,)).astype("int32")
    targets = rng.normal(size=(ROWS, 1)).astype(float_type)
    return images, labels, targets


def build(pattern, base):
    import keras
    import tensorflow as tf

    if pattern.startswith(("mixup", "cutmix")):
        inputs = keras.Input((4, 4, 2))
        layer = keras.layers.MixUp(alpha=0.4, seed=7) if pattern.startswith("mixup") else \
            keras.layers.CutMix(factor=1.0, seed=7)
        hidden = keras.layers.Conv2D(3, 2, activation="tanh")(layer(inputs))
        outputs = keras.layers.Dense(3)(keras.layers.Flatten()(hidden))
        model = base(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model, "labels"

    def while_loss(y_true, y_pred):
        rows = tf.shape(y_pred)[0]

        def body(i, total):
            return i + 1, total + tf.reduce_sum(tf.square(y_pred[i] - y_true[i]))

        _, total = tf.while_loop(lambda i, total: i < rows, body, (0, tf.zeros((), y_pred.dtype)))
        return tf.sqrt(total + 1e-3)

    def unread_loss(y_true, y_pred):
        # Keras reads the cross-entropy from the softmax's logits (its
        # probabilities saturate); the second term passes `Lgamma`.
        cross_entropy = keras.losses.sparse_categorical_crossentropy(y_true, y_pred)
        return cross_entropy + 0.1 * tf.reduce_mean(tf.math.lgamma(2.0 + y_pred), axis=-1)

    class Draws(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.seed = keras.random.SeedGenerator(11)

        def call(self, x, training=False):
            if not training:
                return x
            rows = (keras.ops.shape(x)[0], 1)
            scale = (0.1 * keras.random.gamma(rows, alpha=2.0, dtype=x.dtype, seed=self.seed)
                     + 0.2 * keras.random.beta(rows, 2.0, 3.0, dtype=x.dtype, seed=self.seed)
                     + 0.1 * keras.random.binomial(rows, 3, 0.5, dtype=x.dtype, seed=self.seed))
            return x * (0.5 + scale) + 0.3 * keras.random.shuffle(x, axis=0, seed=self.seed)

    inputs = keras.Input((4, 4, 2))
    hidden = keras.layers.Dense(4, activation="tanh")(keras.layers.Flatten()(inputs))
    if pattern == "draws":
        outputs = keras.layers.Dense(3)(Draws()(hidden))
        model = base(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model, "labels"
    if pattern == "unread_loss":
        outputs = keras.layers.Dense(3, activation="softmax", kernel_initializer=keras.initializers.RandomNormal(stddev=5.0))(hidden)
        model = base(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss=unread_loss, metrics=["accuracy"])
        return model, "labels"
    model = base(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=while_loss, metrics=["mae"])
    return model, "targets"


def by_hand(strategy, initial=None):
    """`unread_loss` in a hand-written loop: each replica's `Lgamma` of its own rows."""
    import keras
    import tensorflow as tf

    images, _, targets = _data(keras.config.floatx())
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4, 4, 2)), keras.layers.Flatten(),
                                  keras.layers.Dense(1)])
        if initial is not None:
            for variable, value in zip(model.variables, initial):
                variable.assign(value)
        optimizer = kd.exact_optimizer(keras.optimizers.SGD(0.05))
    start = [np.array(v) for v in model.variables]
    data = tf.data.Dataset.from_tensor_slices((images, targets)).batch(BATCH)

    def step(x, y):
        with tf.GradientTape() as tape:
            per_row = tf.reduce_mean(tf.math.lgamma(2.0 + tf.square(model(x) - y)), axis=-1)
            loss = kd.losses.global_mean(per_row)
        variables = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    @tf.function
    def distributed(x, y):
        return strategy.reduce("SUM", strategy.run(step, args=(x, y)), axis=None)

    losses = [float(distributed(x, y)) for x, y in strategy.experimental_distribute_dataset(data)]
    return start, dict(history={"loss": losses}, weights=[np.array(v) for v in model.variables])


def train(pattern, base, strategy, initial=None):
    import keras
    import tensorflow as tf

    if pattern == "unread_by_hand":
        return by_hand(strategy, initial)
    images, labels, targets = _data(keras.config.floatx())
    keras.utils.set_random_seed(3)
    name = pattern.replace("_static", "").replace("_plain", "")
    with strategy.scope():
        model, how = build(name, base)
        if initial is not None:
            for variable, value in zip(model.variables, initial):
                variable.assign(value)
    start = [np.array(v) for v in model.variables]
    outputs = labels if how == "labels" else targets
    if pattern.endswith("_static"):
        data = tf.data.Dataset.from_tensor_slices((images, outputs)).batch(BATCH, drop_remainder=True)
        history = model.fit(data, epochs=EPOCHS, verbose=0).history
        evaluated = model.evaluate(data, verbose=0, return_dict=True)
    else:
        history = model.fit(images, outputs, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                            verbose=0).history
        evaluated = model.evaluate(images, outputs, batch_size=BATCH, verbose=0, return_dict=True)
    result = dict(history=history, evaluate=evaluated,
                  weights=[np.array(w) for w in model.trainable_weights])
    result["predict"] = model.predict(images, batch_size=BATCH, verbose=0)
    return start, result


def main(patterns, dtypes):
    kd.virtual_devices(2)
    import keras
    import tensorflow as tf

    strategy = kd.make_strategy("mirrored")
    for dtype in dtypes:
        keras.config.set_floatx(dtype)
        keras.config.set_dtype_policy(dtype)
        references = {}
        for pattern in patterns:
            if pattern in ("mixup_plain", "unread_by_hand") and dtype != dtypes[0]:
                continue  # the contrast and the refusal: once, in the first dtype
            item = dict(pattern=pattern, float64=dtype == "float64")
            began = time.process_time()
            try:
                reference_key = pattern.replace("_plain", "")
                if reference_key not in references:
                    references[reference_key] = train(pattern, keras.Model,
                                                      tf.distribute.get_strategy())
                start, expected = references[reference_key]
                base = keras.Model if pattern.endswith("_plain") else kd.Model
                _, actual = train(pattern, base, strategy, initial=start)
                item.update(differences(expected, actual))
            except Exception as error:  # reported; the test decides
                item.update(failure(error))
            item["cpu_seconds"] = round(time.process_time() - began, 1)
            print("RESULT " + json.dumps(item), flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(","), sys.argv[2].split(","))
