"""The first-step check on the user's own models, against one device.

Usage: first_step.py CONFIG

CONFIG "mirrored2": two virtual CPU replicas in this process; "multi_worker":
one replica per worker process (run under kd.launch). Every case trains a
kd model under CONFIG's strategy and the same class body on `keras.Model`
on one device (the reference, Keras's own, no kd step), from the same
initial weights, on 72 rows in global batches of 32 (the last batch holds
8 rows). Prints one `RESULT {json}` line per case:

- `exact` (float64, float32): Dense, BatchNormalization and Dropout with an
  accuracy metric, trained with the check on and off: the largest relative
  difference of the weights and logs from one device (with the check on),
  and whether every variable (weights, moving statistics, optimizer slots,
  metric states, seed states) is bitwise the same with the check on and off
  (`same_on_and_off`). With steps_per_execution=2 too (`exact_spe2`).
- `exact_summed` (float64): the same with a metric of the user's own besides
  accuracy, whose state has `aggregation="sum"` and whose `result()` is a
  dict (a count of every row seen): its logs must be one device's (the
  whole batch's count, not one replica's), so the check passes.
- `blinded` (float64): a layer that centres its input on the batch mean (the
  rows meet), with kd's classifier blinded (`penalties._kind_of_op_output`
  reads what it cannot place as rows, so kd computes the layer on each
  replica's rows): with the check on,
  the error `fit` raises and whether every variable is bitwise as before
  `fit` (`restored`); with it off, the weights' and logs' difference from one
  device (the contrast: kd then trains another model without a word).
- `subclassed` (float64): the blinded model written as a subclass of the
  model class (its layers in `__init__`, chained in `call`): the refusal and
  `restored`, as for `blinded`.
- `ownstep` (float64): the blinded centring layer called only in the
  model's own `train_step`, outside its `call`: the refusal and `restored`.
- `exact_sub`, `blinded_sub` (float64): `exact` and `blinded` with the global
  batch counted as too big for one device (`first_step.WHOLE_BATCH_BYTES`
  = 0): the check compares the step on a sub-batch of a few rows of each
  replica's (across workers, each worker cuts its own replicas' rows). The
  reference and the run with the check off are `exact`'s (trained once);
  `blinded_sub` has no contrast run (`blinded`'s stands for it).
"""

import json
import os
import sys
import traceback

import numpy as np

import keras_distrib as kd

ROWS, BATCH, EPOCHS = 72, 32, 2


def _data(dtype):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(ROWS, 6)).astype(dtype)
    y = rng.integers(0, 3, size=(ROWS,)).astype("int32")
    return x, y


def build(case, base):
    import keras
    from keras import ops

    keras.utils.set_random_seed(3)
    if case == "subclassed":
        # The blinded model written as a subclass (no graph of layers to cut).
        class Centred(base):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.embed = keras.layers.Dense(8, activation="tanh", name="embed")
                self.centre = keras.layers.Lambda(lambda h: h - ops.mean(h, axis=0, keepdims=True),
                                                  name="centre")
                self.mix = keras.layers.Dense(5, name="mix")
                self.head = keras.layers.Dense(3, name="head")

            def call(self, x, training=False):
                return self.head(self.mix(self.centre(self.embed(x))))

        model = Centred()
        model(np.zeros((1, 6), keras.config.floatx()))
        return model
    if case == "ownstep":
        # The centring layer called only in the model's own train_step,
        # outside its call (which the diagnosis's forward runs).
        import tensorflow as tf

        class OwnStep(base):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.embed = keras.layers.Dense(8, activation="tanh", name="embed")
                self.centre = keras.layers.Lambda(lambda h: h - ops.mean(h, axis=0, keepdims=True),
                                                  name="centre")
                self.head = keras.layers.Dense(3, name="head")
                self.loss_tracker = keras.metrics.Mean(name="loss")

            @property
            def metrics(self):
                return [self.loss_tracker]

            def call(self, x, training=False):
                return self.head(self.embed(x))

            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    logits = self.head(self.centre(self.embed(x)))
                    loss = ops.mean(keras.losses.sparse_categorical_crossentropy(
                        y, logits, from_logits=True))
                grads = tape.gradient(loss, self.trainable_variables)
                self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
                self.loss_tracker.update_state(loss)
                return {"loss": self.loss_tracker.result()}

        model = OwnStep()
        model(np.zeros((1, 6), keras.config.floatx()))
        return model
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh", name="embed")(inputs)
    if case == "blinded":
        centred = keras.layers.Lambda(lambda h: h - ops.mean(h, axis=0, keepdims=True), name="centre")
        hidden = keras.layers.Dense(5, name="mix")(centred(hidden))
    else:
        hidden = keras.layers.Dense(8, use_bias=False, name="mix")(hidden)
        hidden = keras.layers.Dropout(0.3)(keras.layers.BatchNormalization()(hidden))
    return base(inputs, keras.layers.Dense(3, name="head")(hidden))


def _seen_rows():
    """A metric of the user's own: rows seen per class, state summed over replicas, a dict result."""
    import keras
    from keras import ops

    class SeenRows(keras.metrics.Metric):
        def __init__(self, name="seen", **kwargs):
            super().__init__(name=name, **kwargs)
            self.counts = self.add_variable(shape=(3,), initializer="zeros", name="counts",
                                            aggregation="sum")

        def update_state(self, y_true, y_pred, sample_weight=None):
            hot = ops.one_hot(ops.cast(ops.reshape(y_true, [-1]), "int32"), 3, dtype=self.counts.dtype)
            self.counts.assign_add(ops.sum(hot, axis=0))

        def result(self):
            return {"seen_rows": ops.sum(self.counts), "seen_most": ops.max(self.counts)}

    return SeenRows()


def _compile(model, check=True, spe=1, summed=False):
    import keras

    options = {} if not hasattr(model, "replica_batch") else {"first_step_check": check}
    model.compile(optimizer=keras.optimizers.Adam(0.02),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"] + ([_seen_rows()] if summed else []),
                  steps_per_execution=spe, **options)


def _state(model):
    from keras_distrib import _keras_compat

    return [np.array(c.read_value()) for v in _keras_compat.model_variables(model)
            for c in _keras_compat.variable_copies(v)]


def _same(a, b):
    return len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


def relative(reference, candidate):
    a = np.asarray(reference, dtype="float64")
    b = np.asarray(candidate, dtype="float64")
    return float(np.max(np.abs(a - b) / (1.0 + np.abs(a)), initial=0.0))


def _train(case, base, strategy, dtype, start, check=True, spe=1, summed=False):
    x, y = _data(dtype)
    with strategy.scope():
        model = build(case, base)
        _compile(model, check=check, spe=spe, summed=summed)
    model.set_weights(start)
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history
    return model, history


# What several cases train alike (one device's reference, kd with the check
# off), trained once per process: `_sub` cases differ only in the check.
_TRAINED = {}


def _once(key, train):
    if key not in _TRAINED:
        _TRAINED[key] = train()
    return _TRAINED[key]


def _differences(reference, model, history):
    ref_model, ref_history = reference
    weights = max(relative(a, b) for a, b in zip(ref_model.get_weights(), model.get_weights()))
    logs = max(relative(ref_history[k], history[k]) for k in ref_history)
    return weights, logs


def report(case, dtype, strategy):
    import keras
    import tensorflow as tf

    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)
    from keras_distrib.training import first_step

    item = dict(case=case, float64=dtype == "float64", task=kd.cluster_info().label)
    # `_sub`: the global batch counts as too big for one device, so the
    # check compares the step on a sub-batch of a few rows of each replica's.
    whole_batch_bytes = first_step.WHOLE_BATCH_BYTES
    if case.endswith("_sub"):
        first_step.WHOLE_BATCH_BYTES = 0
    try:
        summed = case == "exact_summed"
        start = build(case.split("_")[0], keras.Model).get_weights()
        def reference():
            return _once(("reference", case.split("_")[0], dtype, summed), lambda: _train(
                case.split("_")[0], keras.Model, tf.distribute.get_strategy(), dtype, start,
                summed=summed))

        if case.startswith("exact"):
            spe = 2 if case == "exact_spe2" else 1
            on, on_history = _train("exact", kd.Model, strategy, dtype, start, spe=spe, summed=summed)
            off, _ = _once(("off", dtype, spe, summed), lambda: _train(
                "exact", kd.Model, strategy, dtype, start, check=False, spe=spe, summed=summed))
            item["weights"], item["logs"] = _differences(reference(), on, on_history)
            item["same_on_and_off"] = _same(_state(on), _state(off))
        else:
            from keras_distrib.training import penalties

            # kd's classifier blinded: what it finds the rows meeting in (the
            # centring layer's batch mean) it reads as rows, as a classifier
            # that missed an op would.
            original = penalties._kind_of_op_output

            def blinded(op, index, kinds):
                kind = original(op, index, kinds)
                return penalties.ROWS if isinstance(kind, penalties.Unknown) else kind

            penalties._kind_of_op_output = blinded
            try:
                with strategy.scope():
                    model = build(case.split("_")[0], kd.Model)
                    _compile(model)
                model.set_weights(start)
                x, y = _data(dtype)
                model.build_from_data(data_batch=(x[:BATCH], y[:BATCH]))
                before = _state(model)
                try:
                    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
                except ValueError as error:
                    item["refusal"] = f"{type(error).__name__}: {error}"
                item["restored"] = _same(before, _state(model))
                if case == "blinded":  # (the functional model's contrast stands for all)
                    off, off_history = _train("blinded", kd.Model, strategy, dtype, start, check=False)
                    item["weights_off"], item["logs_off"] = _differences(reference(), off, off_history)
            finally:
                penalties._kind_of_op_output = original
    except Exception as error:  # reported; the test decides
        item["error"] = f"{type(error).__name__}: {error}"[:3000]
        item["trace"] = traceback.format_exc()[-6000:]
    finally:
        first_step.WHOLE_BATCH_BYTES = whole_batch_bytes
    print("RESULT " + json.dumps(item), flush=True)


# keras-io's self-supervised examples, as their code is written: a subclassed
# model with its own `train_step` (a `tf.GradientTape` and the optimizer's
# `apply_gradients`), two augmented views of each row, a loss where the
# batch's rows meet. Small dense stand-ins for their images and encoders.
EXAMPLES = ("simclr", "barlow_twins", "vicreg", "mixup_own", "mixup_tf")


def _views(dtype):
    """Two views of each row, as keras-io's pipelines augment them (in tf.data)."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(ROWS, 6)).astype(dtype)
    return x, (x + 0.2 * rng.normal(size=x.shape)).astype(dtype), \
        (x * rng.uniform(0.8, 1.2, size=x.shape)).astype(dtype)


def _classifier_around(mixup, base):
    """A small classifier with `mixup` between its input and its first layer (keras-io's MixUp examples)."""
    import keras

    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh", name="embed")(mixup(inputs))
    model = base(inputs, keras.layers.Dense(3, name="head")(hidden))
    model.compile(optimizer=keras.optimizers.Adam(0.02),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def build_example(case, base):
    import keras
    import tensorflow as tf
    from keras import ops

    keras.utils.set_random_seed(3)

    def encoder(name):
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.Dense(6)], name=name)

    def nt_xent(z_a, z_b, temperature=0.5):
        # SimCLR's NT-Xent: both views stacked (2N rows), each row's positive
        # its other view, its negatives the other 2N - 2 rows of the batch.
        z = tf.math.l2_normalize(tf.concat([z_a, z_b], axis=0), axis=1)
        n = tf.shape(z_a)[0]
        similarity = tf.matmul(z, z, transpose_b=True) / temperature
        similarity = similarity - 1e9 * tf.eye(2 * n, dtype=z.dtype)
        labels = tf.concat([tf.range(n, 2 * n), tf.range(n)], axis=0)
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            labels, similarity, from_logits=True))

    def barlow(z_a, z_b, lambda_=5e-3):
        # Barlow Twins (keras-io's BarlowLoss): each feature standardized over
        # the batch, the cross-correlation of the two views pulled to identity.
        n = tf.cast(tf.shape(z_a)[0], z_a.dtype)
        z_a = (z_a - tf.reduce_mean(z_a, axis=0)) / (tf.math.reduce_std(z_a, axis=0) + 1e-5)
        z_b = (z_b - tf.reduce_mean(z_b, axis=0)) / (tf.math.reduce_std(z_b, axis=0) + 1e-5)
        c = tf.matmul(z_a, z_b, transpose_a=True) / n
        on_diagonal = tf.reduce_sum(tf.square(tf.linalg.diag_part(c) - 1))
        off_diagonal = tf.reduce_sum(tf.square(c)) - tf.reduce_sum(tf.square(tf.linalg.diag_part(c)))
        return on_diagonal + lambda_ * off_diagonal

    def vicreg(z_a, z_b):
        # VICReg: invariance (MSE of the views), variance (each feature's std
        # over the batch held above 1), covariance (off-diagonal of the batch's).
        invariance = ops.mean(ops.square(z_a - z_b))
        terms = []
        for z in (z_a, z_b):
            n = ops.cast(ops.shape(z)[0], z.dtype)
            centred = z - ops.mean(z, axis=0)
            std = ops.sqrt(ops.var(z, axis=0) + 1e-4)
            covariance = ops.matmul(ops.transpose(centred), centred) / (n - 1)
            off = ops.sum(ops.square(covariance)) - ops.sum(ops.square(ops.diagonal(covariance)))
            terms.append((ops.mean(ops.relu(1 - std)), off / 6))
        variance = sum(t[0] for t in terms)
        covariance = sum(t[1] for t in terms)
        return 25 * invariance + 25 * variance + covariance

    if case == "mixup_tf":
        # keras-io's MixUp (its `sample_beta_distribution`, two tf.random.gamma
        # draws) moved from the tf.data pipeline into a layer of the model,
        # with tf.random.shuffle for the partner rows: TensorFlow's stateful
        # draws, not keras.random.
        class MixUp(keras.layers.Layer):
            def call(self, x, training=False):
                if not training:
                    return x
                n = tf.shape(x)[0]
                gamma_1 = tf.random.gamma([n, 1], 0.2, dtype=x.dtype)
                gamma_2 = tf.random.gamma([n, 1], 0.2, dtype=x.dtype)
                weight = gamma_1 / (gamma_1 + gamma_2)
                return weight * x + (1 - weight) * tf.gather(x, tf.random.shuffle(tf.range(n)))

        return _classifier_around(MixUp(name="mixup"), base)

    if case == "mixup_own":
        # MixUp written as one's own layer inside the model: a permutation of
        # the batch and a Beta weight drawn with keras.random (a SeedGenerator).
        class MixUp(keras.layers.Layer):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.seed = keras.random.SeedGenerator(1)

            def call(self, x, training=False):
                if not training:
                    return x
                n = ops.shape(x)[0]
                order = keras.random.shuffle(ops.arange(n), seed=self.seed)
                weight = keras.random.beta((n, 1), 0.2, 0.2, seed=self.seed, dtype=x.dtype)
                return weight * x + (1 - weight) * ops.take(x, order, axis=0)

        return _classifier_around(MixUp(name="mixup"), base)

    loss_of = {"simclr": nt_xent, "barlow_twins": barlow, "vicreg": vicreg}[case]

    class SelfSupervised(base):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.encoder = encoder("encoder")
            # Barlow Twins' and VICReg's projectors normalize over the batch too.
            normalized = [keras.layers.BatchNormalization()] if case != "simclr" else []
            self.projector = keras.Sequential(
                [keras.Input((6,)), keras.layers.Dense(6), *normalized, keras.layers.ReLU(),
                 keras.layers.Dense(4)], name="projector")
            self.loss_tracker = keras.metrics.Mean(name="loss")

        @property
        def metrics(self):
            return [self.loss_tracker]

        def call(self, x, training=False):
            return self.projector(self.encoder(x, training=training), training=training)

        def train_step(self, data):
            view_a, view_b = data
            with tf.GradientTape() as tape:
                loss = loss_of(self(view_a, training=True), self(view_b, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            self.loss_tracker.update_state(loss)
            return {"loss": self.loss_tracker.result()}

    model = SelfSupervised()
    model(np.zeros((1, 6), keras.config.floatx()))
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    return model


def _train_example(case, base, strategy, dtype, start):
    import tensorflow as tf

    x, view_a, view_b = _views(dtype)
    with strategy.scope():
        model = build_example(case, base)
    model.set_weights(start)
    if case.startswith("mixup"):
        history = model.fit(x, _data(dtype)[1], batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                            verbose=0).history
    else:
        data = tf.data.Dataset.from_tensor_slices((view_a, view_b)).batch(BATCH)
        history = model.fit(data, epochs=EPOCHS, verbose=0).history
    return model, history


def report_example(case, dtype, strategy, base=None):
    """A keras-io example against one device: exact (`weights`, `logs`) or refused (`refusal`).

    `base`: the class trained under `strategy` (`kd.Model`; `keras.Model`
    for the contrast, plain Keras on the replicas).
    """
    import keras
    import tensorflow as tf

    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)
    item = dict(case=case if base in (None, kd.Model) else f"{case}_plain", float64=dtype == "float64",
                task=kd.cluster_info().label)
    try:
        start = build_example(case, keras.Model).get_weights()
        reference = _train_example(case, keras.Model, tf.distribute.get_strategy(), dtype, start)
        from keras_distrib.training import first_step

        # How many first steps kd checked (read through the module, as step.py calls it).
        check, checked = first_step.check, []
        first_step.check = lambda *args, **kwargs: checked.append(1) or check(*args, **kwargs)
        try:
            model, history = _train_example(case, base or kd.Model, strategy, dtype, start)
            item["weights"], item["logs"] = _differences(reference, model, history)
            # The weights beyond float round-off, each with its difference.
            bound = 1e-9 if dtype == "float64" else 2e-5
            item["beyond"] = {w.path: off for w, a, b in zip(reference[0].weights,
                                                             reference[0].get_weights(),
                                                             model.get_weights())
                              if (off := relative(a, b)) > bound}
        except ValueError as error:
            item["refusal"] = f"{type(error).__name__}: {error}"
        finally:
            first_step.check = check
        item["checked"] = len(checked)
    except Exception as error:  # reported; the caller decides
        item["error"] = f"{type(error).__name__}: {error}"[:3000]
        item["trace"] = traceback.format_exc()[-6000:]
    print("RESULT " + json.dumps(item), flush=True)


def main(config):
    if config == "mirrored2":
        kd.virtual_devices(2)
        strategy = kd.make_strategy("mirrored")
        cases = [("exact", "float64"), ("exact", "float32"), ("exact_spe2", "float64"),
                 ("exact_summed", "float64"), ("blinded", "float64"), ("subclassed", "float64"),
                 ("ownstep", "float64"), ("exact_sub", "float64"), ("blinded_sub", "float64")]
    else:
        strategy = kd.make_strategy("multi_worker")
        cases = [("exact", "float64"), ("blinded", "float64"), ("exact_sub", "float64"),
                 ("blinded_sub", "float64")]
    for case, dtype in cases:
        report(case, dtype, strategy)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1])
