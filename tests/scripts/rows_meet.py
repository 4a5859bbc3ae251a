"""Models whose rows meet in the batch, against one device.

Usage: rows_meet.py CONFIG[,CONFIG...] PATTERN[,PATTERN...] [DTYPE[,DTYPE...]]

Each pattern is a small model written the way contrastive, retrieval and
batch-statistics code is written (in-batch negatives with soft targets,
in-batch negatives with `arange` labels, a layer normalizing over the
batch, a loss that mines the batch for its hardest pairs): the same class
body on the base `keras.Model` trained on one device (the reference) and
on the base `kd.Model` under CONFIG's strategy, from the same initial
weights, on 225 rows in global batches of 32 (the last batch holds 1 row:
a replica without rows). CONFIG "plain-..." trains the `keras.Model` class
under the strategy (the contrast); "per_replica-..." compiles the kd model
with `rows_meet="per_replica"` (kd told to leave the rows alone);
"spe3-..." with `steps_per_execution=3`; both in the first dtype only
and without the hand-written loop, which compiles nothing. Configs of
one process share its device layout. The pattern `by_hand` is a hand-written
loop that gathers the global batch itself (`kd.losses.global_batch`): each
replica's queries against every replica's keys (`by_hand_local`: the same
without the gather, which kd refuses; `batch_statistics_jit`: the batch
layer with jit_compile=True on CPU replicas, refused). DTYPE: float32 (default)
or float64. Prints one 'RESULT {json}' line per config, dtype and pattern:
the largest relative difference of the weights and of every logged value
(History, evaluate, predict), the collectives of kd's traced steps, and
the CPU seconds the pair of runs took (where the test's time goes).
"""

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras_distrib as kd
import reference_cache
from features import differences
from features import failure

CONFIGS = {
    "one_device": (1, "one_device"),
    "mirrored2": (2, "mirrored"),
    "central_storage2": (2, "central_storage"),
    "multi_worker": (1, "multi_worker"),
    "plain-mirrored2": (2, "mirrored"),
    "per_replica-mirrored2": (2, "mirrored"),
    "spe3-mirrored2": (2, "mirrored"),
}
ROWS, BATCH, EPOCHS = 225, 32, 2
REFUSED = ("batch_statistics_jit", "by_hand_local")


def _data(float_type):
    rng = np.random.default_rng(11)
    first = rng.normal(size=(ROWS, 6)).astype(float_type)
    # A second view of each row: a noisy linear image of the first.
    second = (first @ rng.normal(size=(6, 5)) + 0.3 * rng.normal(size=(ROWS, 5))).astype(float_type)
    labels = rng.integers(0, 4, size=(ROWS,)).astype("int32")
    targets = (first @ rng.normal(size=(6, 1))).astype(float_type)
    return first, second, labels, targets


def _tower(keras, width, name, dropout=0.0):
    inputs = keras.Input((width,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    if dropout:
        hidden = keras.layers.Dropout(dropout)(hidden)
    return keras.Model(inputs, keras.layers.Dense(4)(hidden), name=name)


def build(pattern, base, per_replica=False, steps_per_execution=1):
    """(model, how to train it) for `pattern`, its classes derived from `base`."""
    import keras
    import tensorflow as tf
    from keras import ops

    options = {"rows_meet": "per_replica"} if per_replica else {}
    if steps_per_execution > 1:
        options["steps_per_execution"] = steps_per_execution

    if pattern == "dual_encoder":
        # Two towers whose embeddings meet in the loss: every row's negatives are
        # the other rows of the batch, its targets the softmax of the towers'
        # own similarities (soft targets).
        class TwoTowers(base):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.left = _tower(keras, 6, "left", dropout=0.25)
                self.right = _tower(keras, 5, "right")
                self.temperature = 0.5
                self.tracked = keras.metrics.Mean(name="loss")

            @property
            def metrics(self):
                return [self.tracked]

            def call(self, inputs, training=False):
                return self.left(inputs["a"], training=training), self.right(inputs["b"], training=training)

            def compute_loss(self, a, b):
                logits = ops.einsum("ie,je->ij", a, b) / self.temperature
                same_a = ops.einsum("ie,je->ij", a, a)
                same_b = ops.einsum("ie,je->ij", b, b)
                soft = keras.activations.softmax((same_a + same_b) / (2 * self.temperature))
                forward = keras.losses.categorical_crossentropy(soft, logits, from_logits=True)
                backward = keras.losses.categorical_crossentropy(
                    ops.transpose(soft), ops.transpose(logits), from_logits=True)
                return (forward + backward) / 2

            def train_step(self, data):
                with tf.GradientTape() as tape:
                    a, b = self(data, training=True)
                    loss = self.compute_loss(a, b)
                grads = tape.gradient(loss, self.trainable_variables)
                self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
                self.tracked.update_state(loss)
                return {"loss": self.tracked.result()}

            def test_step(self, data):
                a, b = self(data, training=False)
                self.tracked.update_state(self.compute_loss(a, b))
                return {"loss": self.tracked.result()}

        model = TwoTowers()
        model.compile(optimizer=keras.optimizers.Adam(0.01), **options)
        return model, "towers"

    if pattern == "info_nce":
        # Two augmented views of each row, projected; row i of one view must pick
        # row i of the other among all rows of the batch (labels: arange of the
        # batch size). Its compile sets its own state after super().compile().
        class Contrastive(base):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.augment = keras.Sequential(
                    [keras.layers.GaussianNoise(0.2), keras.layers.Dropout(0.1)], name="augment")
                self.encoder = _tower(keras, 6, "encoder")
                self.head = keras.Sequential(
                    [keras.Input((4,)), keras.layers.Dense(4, activation="relu"),
                     keras.layers.Dense(3)], name="head")
                self.probe = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)], name="probe")
                self.temperature = 0.2

            def compile(self, contrastive_optimizer, probe_optimizer, **kwargs):
                super().compile(**kwargs)
                self.contrastive_optimizer = contrastive_optimizer
                self.probe_optimizer = probe_optimizer
                self.probe_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
                self.contrastive_tracker = keras.metrics.Mean(name="c_loss")
                self.contrastive_accuracy = keras.metrics.SparseCategoricalAccuracy(name="c_acc")
                self.probe_tracker = keras.metrics.Mean(name="p_loss")
                self.probe_accuracy = keras.metrics.SparseCategoricalAccuracy(name="p_acc")

            @property
            def metrics(self):
                return [self.contrastive_tracker, self.contrastive_accuracy,
                        self.probe_tracker, self.probe_accuracy]

            def contrastive_loss(self, first, second):
                first = ops.normalize(first, axis=1)
                second = ops.normalize(second, axis=1)
                similarity = ops.matmul(first, ops.transpose(second)) / self.temperature
                labels = ops.arange(ops.shape(first)[0])
                self.contrastive_accuracy.update_state(labels, similarity)
                self.contrastive_accuracy.update_state(labels, ops.transpose(similarity))
                one_way = keras.losses.sparse_categorical_crossentropy(labels, similarity, from_logits=True)
                other_way = keras.losses.sparse_categorical_crossentropy(
                    labels, ops.transpose(similarity), from_logits=True)
                return (one_way + other_way) / 2

            def train_step(self, data):
                x, labels = data
                view_1 = self.augment(x, training=True)
                view_2 = self.augment(x, training=True)
                with tf.GradientTape() as tape:
                    projected_1 = self.head(self.encoder(view_1, training=True), training=True)
                    projected_2 = self.head(self.encoder(view_2, training=True), training=True)
                    loss = self.contrastive_loss(projected_1, projected_2)
                variables = self.encoder.trainable_weights + self.head.trainable_weights
                self.contrastive_optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
                self.contrastive_tracker.update_state(loss)
                with tf.GradientTape() as tape:
                    logits = self.probe(self.encoder(x, training=False), training=True)
                    probe_loss = self.probe_loss(labels, logits)
                variables = self.probe.trainable_weights
                self.probe_optimizer.apply_gradients(zip(tape.gradient(probe_loss, variables), variables))
                self.probe_tracker.update_state(probe_loss)
                self.probe_accuracy.update_state(labels, logits)
                return {m.name: m.result() for m in self.metrics}

            def test_step(self, data):
                x, labels = data
                logits = self.probe(self.encoder(x, training=False), training=False)
                self.probe_tracker.update_state(self.probe_loss(labels, logits))
                self.probe_accuracy.update_state(labels, logits)
                return {m.name: m.result() for m in self.metrics[2:]}

        model = Contrastive()
        model.compile(keras.optimizers.Adam(0.01), keras.optimizers.Adam(0.01), **options)
        return model, "views"

    if pattern in ("batch_statistics", "batch_statistics_jit"):
        # A layer of one's own that standardizes its input over the batch.
        class Standardize(keras.layers.Layer):
            def call(self, x):
                centered = x - ops.mean(x, axis=0, keepdims=True)
                return centered / ops.sqrt(ops.mean(ops.square(centered), axis=0, keepdims=True) + 1e-3)

        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(5, activation="tanh")(inputs)
        hidden = Standardize()(hidden)
        model = base(inputs, keras.layers.Dense(1)(hidden))
        if pattern.endswith("_jit"):
            options["jit_compile"] = True
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"], **options)
        return model, "regression"

    if pattern == "batch_context":
        # A layer of one's own returns a statistic of the batch; Keras's own layer
        # combines it with the rows.
        class BatchContext(keras.layers.Layer):
            def call(self, x):
                return ops.mean(x, axis=0, keepdims=True)

        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(5, activation="tanh")(inputs)
        hidden = keras.layers.Subtract()([hidden, BatchContext()(hidden)])
        model = base(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"], **options)
        return model, "regression"

    if pattern == "mined_triplets":
        # The hardest positive and negative of each row, mined in the batch.
        def hardest_triplets(labels, embeddings):
            labels = ops.reshape(ops.cast(labels, "int32"), (-1,))
            squared = ops.sum(ops.square(embeddings), axis=1)
            distances = squared[:, None] - 2 * ops.matmul(embeddings, ops.transpose(embeddings)) \
                + squared[None, :]
            distances = ops.sqrt(ops.maximum(distances, 1e-9))
            same = ops.cast(ops.equal(labels[:, None], labels[None, :]), distances.dtype)
            positive = ops.max(distances * same, axis=1)
            negative = ops.min(distances + 1e3 * same, axis=1)
            return ops.relu(positive - negative + 0.5)

        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        model = base(inputs, keras.layers.Dense(3)(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss=hardest_triplets, **options)
        return model, "labels"

    raise ValueError(f"unknown pattern {pattern!r}")


def by_hand(strategy, initial=None, gathered=True):
    """A hand-written loop whose in-batch negatives span the global batch (kd.losses.global_batch).

    `gathered=False`: the same loop without the gather (each replica's keys
    only), which kd refuses.
    """
    import keras
    import tensorflow as tf

    float_type = keras.config.floatx()
    first, second, _, _ = _data(float_type)
    keras.utils.set_random_seed(3)
    with strategy.scope():
        left, right = _tower(keras, 6, "left"), _tower(keras, 5, "right")
        left(first[:1]), right(second[:1])
        variables = left.trainable_weights + right.trainable_weights
        if initial is not None:
            for variable, value in zip(variables, initial):
                variable.assign(value)
        optimizer = kd.exact_optimizer(keras.optimizers.SGD(0.1))
    start = [np.array(v) for v in variables]
    data = tf.data.Dataset.from_tensor_slices((first, second)).batch(BATCH)
    losses = []

    def step(a, b):
        with tf.GradientTape() as tape:
            queries = left(a, training=True)
            if gathered:
                keys, offset = kd.losses.global_batch(right(b, training=True))
            else:
                keys, offset = right(b, training=True), 0
            logits = tf.matmul(queries, keys, transpose_b=True) / 0.5
            labels = offset + tf.range(tf.shape(queries)[0])
            per_row = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
            loss = kd.losses.global_mean(per_row)
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    @tf.function
    def distributed(a, b):
        return strategy.reduce("SUM", strategy.run(step, args=(a, b)), axis=None)

    for _ in range(EPOCHS):
        for a, b in strategy.experimental_distribute_dataset(data):
            losses.append(float(distributed(a, b)))
    return start, dict(history={"loss": losses}, weights=[np.array(v) for v in variables])


def train(pattern, base, strategy, initial=None, per_replica=False, steps_per_execution=1):
    import keras

    if pattern in ("by_hand", "by_hand_local"):
        return by_hand(strategy, initial, gathered=pattern == "by_hand")

    float_type = keras.config.floatx()
    first, second, labels, targets = _data(float_type)
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model, how = build(pattern, base, per_replica, steps_per_execution)
        if how == "towers":
            model({"a": first[:2], "b": second[:2]})
        elif how == "views":
            model.probe(model.encoder(first[:2]))
            model.head(model.encoder(first[:2]))
        if initial is not None:
            for variable, value in zip(model.variables, initial):
                variable.assign(value)
    start = [np.array(v) for v in model.variables]
    arguments = dict(batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    inputs, outputs = {
        "towers": ({"a": first, "b": second}, None),
        "views": (first, labels),
        "regression": (first, targets),
        "labels": (first, labels),
    }[how]
    history = model.fit(inputs, outputs, **arguments).history
    result = dict(history=history, weights=[np.array(w) for w in model.trainable_weights])
    result["evaluate"] = model.evaluate(inputs, outputs, batch_size=BATCH, verbose=0, return_dict=True)
    if how in ("regression", "labels"):
        result["predict"] = model.predict(inputs, batch_size=BATCH, verbose=0)
    if hasattr(model, "replica_batch"):
        from keras_distrib.training import collectives

        result["collectives"] = collectives.traced(model)
    return start, result


# The contrast (kd told to leave each replica its rows) runs the patterns whose
# difference from one device tests/test_rows_meet.py asserts.
CONTRASTED = ("dual_encoder", "info_nce", "batch_statistics", "mined_triplets")


def main(configs, patterns, dtypes):
    devices, kind = CONFIGS[configs[0]]
    if devices > 1:
        kd.virtual_devices(devices)
    import keras

    strategy = kd.make_strategy(kind)
    runs = []
    for config in configs:
        for dtype in dtypes:
            for pattern in patterns:
                # What kd refuses is refused once: in the first config and dtype;
                # steps_per_execution and the contrast run in the first dtype
                # (the stricter one).
                if pattern in REFUSED and (config, dtype) != (configs[0], dtypes[0]):
                    continue
                if config.startswith(("spe3-", "per_replica-")) and (
                        dtype != dtypes[0] or pattern == "by_hand"):
                    continue
                if config.startswith("per_replica-") and pattern not in CONTRASTED:
                    continue
                runs.append((config, dtype, pattern))
    if kind != "multi_worker":  # (workers take the runs together)
        runs = reference_cache.in_ready_order(runs, lambda run: f"rows_meet-{run[2]}-{run[1]}")
    for config, dtype, pattern in runs:
        keras.config.set_floatx(dtype)
        keras.config.set_dtype_policy(dtype)  # (cached at its first use otherwise)
        report(config, pattern, dtype, strategy)


def report(config, pattern, dtype, strategy):
    import keras
    import tensorflow as tf

    base = keras.Model if config.startswith("plain-") else kd.Model
    per_replica = config.startswith("per_replica-")
    steps_per_execution = 3 if config.startswith("spe3-") else 1
    item = dict(pattern=pattern, config=config, float64=dtype == "float64",
                replicas=strategy.num_replicas_in_sync, task=kd.cluster_info().label)
    began = time.process_time()
    try:
        # One device's run: shared by the configs of this process and by the
        # test run's other processes (their layouts and strategies differ).
        start, expected = reference_cache.cached(
            f"rows_meet-{pattern}-{dtype}", lambda: train(pattern, keras.Model, tf.distribute.get_strategy()))
        _, actual = train(pattern, base, strategy, initial=start, per_replica=per_replica,
                          steps_per_execution=steps_per_execution)
        item["collectives"] = actual.pop("collectives", None)
        item.update(differences(expected, actual))
        item["keys"] = sorted(actual["history"])
    except Exception as error:  # reported; the test decides
        item.update(failure(error))
    item["cpu_seconds"] = round(time.process_time() - began, 1)
    print("RESULT " + json.dumps(item), flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(","), sys.argv[2].split(","),
         sys.argv[3].split(",") if len(sys.argv) > 3 else ["float32"])
