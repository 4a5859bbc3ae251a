"""The exactness matrix's features: Keras training settings real recipes use.

Each feature is a small training problem with an uneven last batch (33 rows,
global batch 16: the last batch has 1 row, so every replica but one is
empty). It gives data, a model builder taking the model class, compile
arguments (the optimizer is built fresh each time) and the fit, evaluate
and predict arguments. The same feature is trained with plain Keras on one
device (the reference) and with kd under each path of the matrix.
"""

import traceback

import keras
import numpy as np
import tensorflow as tf

import reference_cache

GLOBAL_BATCH = 16
ROWS = 2 * GLOBAL_BATCH + 1
EPOCHS = 3
FLOAT32_TOLERANCE = 2e-5
FLOAT16_TOLERANCE = 5e-3


def _rng(seed=0):
    return np.random.default_rng(seed)


def _regression(rows=ROWS, features=5, seed=0):
    rng = _rng(seed)
    x = rng.normal(size=(rows, features)).astype("float32")
    y = (x @ rng.normal(size=(features, 1)) + 0.1 * rng.normal(size=(rows, 1))).astype("float32")
    return x, y


def _mlp(cls, *, l2=0.0, activity=0.0, batch_norm=False, frozen=False, dtype=None):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    x = keras.layers.Dense(
        8,
        activation="tanh",
        kernel_regularizer=keras.regularizers.L2(l2) if l2 else None,
        activity_regularizer=keras.regularizers.L2(activity) if activity else None,
        trainable=not frozen,
    )(inputs)
    if batch_norm:
        x = keras.layers.BatchNormalization(synchronized=True, momentum=0.8)(x)
    x = keras.layers.Dense(6, activation="tanh")(x)
    outputs = keras.layers.Dense(1, dtype=dtype)(x)
    return cls(inputs, outputs)


def _regression_feature(optimizer, *, build=None, compile_extra=None, **extra):
    x, y = _regression()
    return dict(
        build=build or (lambda cls: _mlp(cls)),
        optimizer=optimizer,
        compile=dict(loss="mse", metrics=["mae"], **(compile_extra or {})),
        fit=dict(x=x, y=y),
        evaluate=dict(x=x, y=y),
        predict=dict(x=x),
        **extra,
    )


def base():
    return _regression_feature(lambda: keras.optimizers.Adam(0.01))


def clipnorm():
    return _regression_feature(lambda: keras.optimizers.SGD(0.05, momentum=0.9, clipnorm=0.5))


def global_clipnorm():
    return _regression_feature(
        lambda: keras.optimizers.SGD(0.05, momentum=0.9, global_clipnorm=0.5)
    )


def clipvalue():
    return _regression_feature(lambda: keras.optimizers.SGD(0.05, momentum=0.9, clipvalue=0.05))


def accumulation():
    # 3 batches per epoch, 2 micro-batches per update: updates straddle the
    # epoch boundary and the last micro-batch has 1 row.
    return _regression_feature(lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=2))


def accumulation_clip():
    return _regression_feature(
        lambda: keras.optimizers.SGD(
            0.05, momentum=0.9, global_clipnorm=0.3, gradient_accumulation_steps=2
        )
    )


def loss_scale_factor():
    return _regression_feature(lambda: keras.optimizers.SGD(0.05, loss_scale_factor=128.0))


def mixed_float16():
    # float16 compute, float32 variables, dynamic loss scaling. The initial
    # scale is one at which no float16 gradient overflows: where the full
    # batch overflows and a replica's part does not, the two runs skip
    # different steps (see docs/concepts/exactness.md).
    return _regression_feature(
        lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=256.0),
        build=lambda cls: _mlp(cls, dtype="float32"),
        policy="mixed_float16",
        tolerance=FLOAT16_TOLERANCE,
    )


def nonfinite_on_one_replica():
    # Row 9 has a huge label: its gradient overflows float16 on the replica
    # that holds it (replica 1 of 2, replica 2 of 4). One device skips that
    # step and halves the loss scale; so must every replica and worker.
    x, y = _regression()
    y_bad = y.copy()
    y_bad[9] = 3e4
    return dict(
        build=lambda cls: _mlp(cls, dtype="float32"),
        optimizer=lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=256.0),
        compile=dict(loss="mse", metrics=["mae"]),
        fit=dict(x=x, y=y_bad),
        evaluate=dict(x=x, y=y),
        predict=dict(x=x),
        policy="mixed_float16",
        tolerance=FLOAT16_TOLERANCE,
    )


def ema():
    return _regression_feature(
        lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2)
    )


def adamw_schedule():
    schedule = lambda: keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=2, decay_rate=0.7)
    return _regression_feature(lambda: keras.optimizers.AdamW(schedule(), weight_decay=0.1))


def regularizers():
    # An L2 weight penalty and a batch-mean activity penalty (an add_loss term).
    return _regression_feature(
        lambda: keras.optimizers.Adam(0.01), build=lambda cls: _mlp(cls, l2=0.01, activity=0.05)
    )


def frozen_layer():
    return _regression_feature(lambda: keras.optimizers.Adam(0.01), build=lambda cls: _mlp(cls, frozen=True))


def sync_batch_norm():
    return _regression_feature(
        lambda: keras.optimizers.Adam(0.01), build=lambda cls: _mlp(cls, batch_norm=True)
    )


def weights():
    # Sample weights, and weighted metrics.
    x, y = _regression()
    sample_weight = _rng(3).uniform(0.2, 2.0, size=(ROWS,)).astype("float32")
    return dict(
        build=lambda cls: _mlp(cls),
        optimizer=lambda: keras.optimizers.Adam(0.01),
        compile=dict(loss="mse", metrics=["mae"], weighted_metrics=["mse"]),
        fit=dict(x=x, y=y, sample_weight=sample_weight),
        evaluate=dict(x=x, y=y, sample_weight=sample_weight),
        predict=dict(x=x),
    )


def _classifier(cls):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return cls(inputs, keras.layers.Dense(3, activation="softmax")(hidden))


def class_weights():
    rng = _rng()
    x = rng.normal(size=(ROWS, 5)).astype("float32")
    y = rng.integers(0, 3, size=(ROWS,)).astype("int32")
    return dict(
        build=_classifier,
        optimizer=lambda: keras.optimizers.Adam(0.01),
        compile=dict(loss="sparse_categorical_crossentropy", metrics=["accuracy"]),
        fit=dict(x=x, y=y, class_weight={0: 1.0, 1: 2.0, 2: 0.5}),
        evaluate=dict(x=x, y=y),
        predict=dict(x=x),
    )


def _two_heads(cls):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    value = keras.layers.Dense(1, name="value")(hidden)
    grid = keras.layers.Reshape((3, 2), name="grid")(keras.layers.Dense(6)(hidden))
    return cls(inputs, {"value": value, "grid": grid})


def multi_output():
    # Two outputs, one with labels of shape (n, 3, 2), weighted losses.
    x, y = _regression()
    grid = _rng(4).normal(size=(ROWS, 3, 2)).astype("float32")
    labels = {"value": y, "grid": grid}
    return dict(
        build=_two_heads,
        optimizer=lambda: keras.optimizers.Adam(0.01),
        compile=dict(
            loss={"value": "mse", "grid": "mae"},
            loss_weights={"value": 1.0, "grid": 0.5},
            metrics={"value": ["mae"]},
        ),
        fit=dict(x=x, y=labels),
        evaluate=dict(x=x, y=labels),
        predict=dict(x=x),
    )


def _two_inputs(cls):
    keras.utils.set_random_seed(1)
    left = keras.Input((3,), name="left")
    right = keras.Input((2,), name="right")
    hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([left, right]))
    return cls({"left": left, "right": right}, keras.layers.Dense(1)(hidden))


def dict_inputs():
    x, y = _regression()
    inputs = {"left": x[:, :3], "right": x[:, 3:]}
    return dict(
        build=_two_inputs,
        optimizer=lambda: keras.optimizers.Adam(0.01),
        compile=dict(loss="mse", metrics=["mae"]),
        fit=dict(x=inputs, y=y),
        evaluate=dict(x=inputs, y=y),
        predict=dict(x=inputs),
    )


def _sequences(rows=ROWS, length=6, vocabulary=12, seed=5):
    rng = _rng(seed)
    tokens = rng.integers(1, vocabulary, size=(rows, length))
    lengths = rng.integers(2, length + 1, size=(rows,))
    tokens[np.arange(length)[None, :] >= lengths[:, None]] = 0  # padding, masked
    return tokens.astype("int32")


def _masked_tagger(cls):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,), dtype="int32")
    x = keras.layers.Embedding(12, 4, mask_zero=True)(inputs)
    x = keras.layers.LSTM(5, return_sequences=True)(x)
    return cls(inputs, keras.layers.Dense(1)(x))


def masks():
    # A per-timestep loss over padded sequences: the mask decides the
    # denominator, so each replica holds a different number of real steps.
    tokens = _sequences()
    targets = (tokens[..., None] % 3).astype("float32")
    return dict(
        build=_masked_tagger,
        optimizer=lambda: keras.optimizers.Adam(0.01),
        compile=dict(loss="mse", metrics=["mae"]),
        fit=dict(x=tokens, y=targets),
        evaluate=dict(x=tokens, y=targets),
        predict=dict(x=tokens),
    )


def _sentiment(cls):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,), dtype="int32")
    x = keras.layers.Embedding(12, 4)(inputs)
    x = keras.layers.LSTM(5)(x)
    return cls(inputs, keras.layers.Dense(1, activation="sigmoid")(x))


def lstm_auc():
    tokens = _sequences(seed=6)
    labels = (tokens.sum(axis=1) % 2).astype("float32")[:, None]
    return dict(
        build=_sentiment,
        optimizer=lambda: keras.optimizers.Adam(0.01),
        compile=dict(loss="binary_crossentropy", metrics=[keras.metrics.AUC(name="auc"), "accuracy"]),
        fit=dict(x=tokens, y=labels),
        evaluate=dict(x=tokens, y=labels),
        predict=dict(x=tokens),
    )


def _cnn(cls):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(4, 3, activation="relu")(inputs)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Flatten()(x)
    return cls(inputs, keras.layers.Dense(3)(x))


def cnn():
    # Conv2D + ReLU: oneDNN's CPU kernels mishandle a replica with 0 rows.
    rng = _rng(7)
    images = rng.normal(size=(ROWS, 8, 8, 1)).astype("float32")
    labels = rng.integers(0, 3, size=(ROWS,)).astype("int32")
    return dict(
        build=_cnn,
        optimizer=lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        compile=dict(
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
        ),
        fit=dict(x=images, y=labels),
        evaluate=dict(x=images, y=labels),
        predict=dict(x=images),
    )


def reshuffled_dataset():
    # A seeded tf.data shuffle that reshuffles every pass, as TF's guides
    # write it: building the model must not consume or reorder the data.
    x, y = _regression()

    def dataset():
        data = tf.data.Dataset.from_tensor_slices((x, y))
        data = data.shuffle(ROWS, seed=11, reshuffle_each_iteration=True)
        return data.batch(GLOBAL_BATCH)

    return dict(
        build=lambda cls: _mlp(cls),
        optimizer=lambda: keras.optimizers.Adam(0.01),
        compile=dict(loss="mse", metrics=["mae"]),
        fit=dict(x=dataset),
        evaluate=dict(x=x, y=y),
        predict=dict(x=x),
    )


def _keras_guide_train_step(self, data):
    """A `train_step` override written as Keras's guide writes it."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    with tf.GradientTape() as tape:
        y_pred = self(x, training=True)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
        loss = self.optimizer.scale_loss(loss)
    gradients = tape.gradient(loss, self.trainable_variables)
    self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
    return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _custom_step_model(cls):
    # The reference is the same override on a plain keras.Model.
    model_class = type("CustomStep", (cls,), {"train_step": _keras_guide_train_step})
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(
        8, activation="tanh", activity_regularizer=keras.regularizers.L2(0.05)
    )(inputs)
    return model_class(inputs, keras.layers.Dense(1)(hidden))


def custom_train_step():
    return _regression_feature(
        lambda: keras.optimizers.SGD(0.05, momentum=0.9, clipnorm=0.5), build=_custom_step_model
    )


def _noisy_mlp(cls):
    # Dropout, BatchNormalization (Keras's default: not synchronized),
    # GaussianNoise and GaussianDropout: randomness and batch statistics.
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    x = keras.layers.Dense(8, activation="tanh")(inputs)
    x = keras.layers.Dropout(0.3)(x)
    x = keras.layers.BatchNormalization(momentum=0.8)(x)
    x = keras.layers.GaussianNoise(0.2)(x)
    x = keras.layers.Dense(6, activation="tanh")(x)
    x = keras.layers.GaussianDropout(0.2)(x)
    return cls(inputs, keras.layers.Dense(1)(x))


def dropout_bn_noise():
    return _regression_feature(lambda: keras.optimizers.Adam(0.01), build=_noisy_mlp)


def dropout_bn_noise_loop():
    # The same through kd.TrainLoop (3 steps per compiled call) on any kd path.
    return dict(dropout_bn_noise(), steps_per_loop=3)


def _shared_dropout(cls):
    # One Dropout layer called twice in a step: two draws from one seed state.
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    dropout = keras.layers.Dropout(0.3)
    x = dropout(keras.layers.Dense(8, activation="tanh")(inputs))
    x = dropout(keras.layers.Dense(8, activation="tanh")(x))
    return cls(inputs, keras.layers.Dense(1)(x))


def shared_dropout():
    return _regression_feature(lambda: keras.optimizers.Adam(0.01), build=_shared_dropout)


def _images(rows=ROWS, size=8, channels=3, classes=3, seed=7):
    rng = _rng(seed)
    images = rng.normal(size=(rows, size, size, channels)).astype("float32")
    return images, rng.integers(0, classes, size=(rows,)).astype("int32")


def _image_feature(build):
    images, labels = _images()
    return dict(
        build=build,
        optimizer=lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        compile=dict(
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
        ),
        fit=dict(x=images, y=labels),
        evaluate=dict(x=images, y=labels),
        predict=dict(x=images),
    )


def _resnet(cls):
    # A residual block with BatchNormalization on both paths, inside a nested
    # backbone (a plain keras.Model), behind random augmentation, with
    # SpatialDropout2D on its output.
    keras.utils.set_random_seed(1)
    image = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(image)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    x = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization()(x)
    shortcut = keras.layers.BatchNormalization()(keras.layers.Conv2D(4, 1, use_bias=False)(image))
    backbone = keras.Model(image, keras.layers.ReLU()(keras.layers.Add()([x, shortcut])), name="backbone")
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.RandomFlip("horizontal")(inputs)
    x = keras.layers.SpatialDropout2D(0.25)(backbone(x))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return cls(inputs, keras.layers.Dense(3)(x))


def resnet_bn():
    return _image_feature(_resnet)


def _two_sync_bn(cls):
    # tf-keras's image correctness model: two synchronized BatchNormalization
    # layers on the same convolution output, summed, and a softmax output.
    keras.utils.set_random_seed(1)
    image = keras.Input((8, 8, 3))
    c1 = keras.layers.Conv2D(8, 3, strides=2, kernel_regularizer=keras.regularizers.L2(1e-4))(image)
    bn1 = keras.layers.BatchNormalization(synchronized=True)(c1)
    bn2 = keras.layers.BatchNormalization(synchronized=True)(c1)
    x = keras.layers.MaxPooling2D()(keras.layers.Add()([bn1, bn2]))
    return cls(image, keras.layers.Dense(3, activation="softmax")(keras.layers.Flatten()(x)))


def two_sync_bn():
    # Cross-entropy on probabilities, at a step size that saturates them:
    # Keras computes the loss from the softmax's logits (no clipping of the
    # probabilities to [1e-7, 1 - 1e-7]); kd once lost that route on several
    # replicas and trained 0.13 off one device.
    feature = _image_feature(_two_sync_bn)
    feature.update(
        optimizer=lambda: keras.optimizers.SGD(0.5),
        compile=dict(loss="sparse_categorical_crossentropy", metrics=["accuracy"]),
    )
    return feature


class RowStatistics(keras.layers.Layer):
    """Counts the rows it sees and sums its inputs (state assigned in `call`)."""

    def build(self, input_shape):
        self.rows = self.add_weight(shape=(), initializer="zeros", trainable=False, name="rows")
        self.total = self.add_weight(shape=(input_shape[-1],), initializer="zeros",
                                     trainable=False, name="total")
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")

    def call(self, x, training=None):
        if training:
            self.rows.assign_add(keras.ops.cast(keras.ops.shape(x)[0], self.rows.dtype))
            self.total.assign_add(keras.ops.sum(x, axis=0))
            self.calls.assign_add(1.0)  # once per step, whatever the batch
        return x


class RunningMean(keras.layers.Layer):
    """Keeps a running mean of its inputs with `assign` (no replica-free meaning)."""

    def build(self, input_shape):
        self.mean = self.add_weight(shape=(input_shape[-1],), initializer="zeros",
                                    trainable=False, name="running_mean")

    def call(self, x, training=None):
        if training:
            self.mean.assign(0.9 * self.mean + 0.1 * keras.ops.mean(x, axis=0))
        return x


class NoisyScale(keras.layers.Layer):
    """A user's random layer: scales its input by noise from its own generator."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(3)

    def call(self, x, training=None):
        if not training:
            return x
        return x * (1.0 + 0.1 * keras.random.normal(keras.ops.shape(x), seed=self.seed_generator))


def custom_random_layer():
    return _regression_feature(lambda: keras.optimizers.Adam(0.01),
                               build=lambda cls: _stateful_mlp(cls, NoisyScale))


def _stateful_mlp(cls, layer):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    x = layer()(keras.layers.Dense(8, activation="tanh")(inputs))
    return cls(inputs, keras.layers.Dense(1)(x))


def row_statistics():
    return _regression_feature(lambda: keras.optimizers.Adam(0.01),
                               build=lambda cls: _stateful_mlp(cls, RowStatistics))


def running_mean():
    return _regression_feature(lambda: keras.optimizers.Adam(0.01),
                               build=lambda cls: _stateful_mlp(cls, RunningMean))


# Features whose model, data and compiled loss and metrics are base's: only the
# optimizer, or how fit takes the data, differs. Their evaluate and predict
# would repeat base's on the same path, so they compare the weights and the
# history (a path running one runs base too; parameter_server, which only
# evaluates, runs them with `-m full`).
TRAINING_ONLY = ("clipnorm", "global_clipnorm", "clipvalue", "accumulation", "accumulation_clip",
                 "loss_scale_factor", "ema", "adamw_schedule", "reshuffled_dataset")

FEATURES = {
    "base": base,
    "clipnorm": clipnorm,
    "global_clipnorm": global_clipnorm,
    "clipvalue": clipvalue,
    "accumulation": accumulation,
    "accumulation_clip": accumulation_clip,
    "loss_scale_factor": loss_scale_factor,
    "mixed_float16": mixed_float16,
    "nonfinite_on_one_replica": nonfinite_on_one_replica,
    "ema": ema,
    "adamw_schedule": adamw_schedule,
    "regularizers": regularizers,
    "frozen_layer": frozen_layer,
    "sync_batch_norm": sync_batch_norm,
    "weights": weights,
    "class_weights": class_weights,
    "multi_output": multi_output,
    "dict_inputs": dict_inputs,
    "masks": masks,
    "lstm_auc": lstm_auc,
    "cnn": cnn,
    "reshuffled_dataset": reshuffled_dataset,
    "custom_train_step": custom_train_step,
    "dropout_bn_noise": dropout_bn_noise,
    "dropout_bn_noise_loop": dropout_bn_noise_loop,
    "shared_dropout": shared_dropout,
    "resnet_bn": resnet_bn,
    "two_sync_bn": two_sync_bn,
    "row_statistics": row_statistics,
    "running_mean": running_mean,
    "custom_random_layer": custom_random_layer,
}


def train(model_class, name, *, strategy=None, compile_extra=None, steps_per_loop=None,
          weights=None, evaluate=None):
    """Builds, compiles and trains feature `name`; returns the comparable results.

    With `steps_per_loop`, trains and evaluates through `kd.TrainLoop`. With
    `weights`, does not train: loads them, then evaluates and predicts.
    `evaluate`: whether a trained model evaluates and predicts; `None`:
    unless the feature is `TRAINING_ONLY`.
    """
    if evaluate is None:
        evaluate = name not in TRAINING_ONLY
    spec = FEATURES[name]()
    if steps_per_loop is None and model_class is not keras.Model:
        steps_per_loop = spec.get("steps_per_loop")  # the reference trains with fit
    policy = spec.get("policy")
    previous = keras.config.dtype_policy()
    if policy:
        keras.config.set_dtype_policy(policy)
    try:
        scope = strategy.scope() if strategy is not None else _no_scope()
        with scope:
            model = spec["build"](model_class)
            model.compile(optimizer=spec["optimizer"](), **spec["compile"], **(compile_extra or {}))
        fit_args = dict(spec["fit"])
        if callable(fit_args.get("x")):
            fit_args["x"] = fit_args["x"]()
        else:
            fit_args.update(batch_size=GLOBAL_BATCH, shuffle=False)
        if weights is not None:
            model.set_weights(weights)
            history = None
            logs = model.evaluate(**spec["evaluate"], batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
            predictions = model.predict(**spec["predict"], batch_size=GLOBAL_BATCH, verbose=0)
        elif steps_per_loop:
            import keras_distrib as kd

            runner = kd.TrainLoop(model, steps_per_loop=steps_per_loop)
            history = runner.fit(**fit_args, epochs=EPOCHS, verbose=0)
            logs = predictions = None
            if evaluate:
                logs = runner.evaluate(**spec["evaluate"], batch_size=GLOBAL_BATCH, verbose=0)
                predictions = runner.predict(**spec["predict"], batch_size=GLOBAL_BATCH, verbose=0)
        else:
            history = model.fit(**fit_args, epochs=EPOCHS, verbose=0)
            logs = predictions = None
            if evaluate:
                logs = model.evaluate(**spec["evaluate"], batch_size=GLOBAL_BATCH, verbose=0,
                                      return_dict=True)
                predictions = model.predict(**spec["predict"], batch_size=GLOBAL_BATCH, verbose=0)
    finally:
        keras.config.set_dtype_policy(previous)
    return dict(
        weights=[np.asarray(w) for w in model.get_weights()],
        history=history.history if history is not None else None,
        evaluate=logs,
        predict=predictions,
        iterations=int(np.asarray(model.optimizer.iterations)),
    )


class _no_scope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def tolerance(name):
    return FEATURES[name]().get("tolerance", FLOAT32_TOLERANCE)


def relative_difference(reference, candidate):
    """max |a - b| / (1 + |a|) over two nests; `reference` is a."""
    if isinstance(reference, dict):
        if sorted(reference) != sorted(candidate):
            raise AssertionError(f"keys differ: {sorted(reference)} vs {sorted(candidate)}")
        return max((relative_difference(reference[k], candidate[k]) for k in reference), default=0.0)
    if isinstance(reference, (list, tuple)):
        if len(reference) != len(candidate):
            raise AssertionError(f"lengths differ: {len(reference)} vs {len(candidate)}")
        return max((relative_difference(a, b) for a, b in zip(reference, candidate)), default=0.0)
    a = np.asarray(reference, dtype="float64")
    b = np.asarray(candidate, dtype="float64")
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {a.shape} vs {b.shape}")
    if not a.size:
        return 0.0
    same = (a == b) | (np.isnan(a) & np.isnan(b))  # equal infinities count as equal
    if not np.all(same | (np.isfinite(a) & np.isfinite(b))):
        return float("inf")
    with np.errstate(invalid="ignore"):
        gaps = np.where(same, 0.0, np.abs(a - b) / (1.0 + np.abs(a)))
    return float(np.max(gaps))


def differences(expected, actual):
    """`relative_difference` of two runs' results: their `weights`, and the rest (`logs`)."""
    def logs(result):
        return {k: v for k, v in result.items() if k != "weights"}

    return dict(weights=relative_difference(expected["weights"], actual["weights"]),
                logs=relative_difference(logs(expected), logs(actual)))


def failure(error):
    """A RESULT's `error` and `trace` for a run that raised `error` (the test decides what it means)."""
    return dict(error=f"{type(error).__name__}: {error}"[:3000], trace=traceback.format_exc()[-6000:])


def reference(name):
    """Plain Keras on one device; cached in $KD_REFERENCE_DIR across processes.

    It evaluates and predicts for every feature: `parameter_server` compares those alone.
    """
    def compute():
        with tf.device("/CPU:0"):
            return train(keras.Model, name, evaluate=True)

    return reference_cache.cached(f"feature-{name}", compute)


def error_summary(error):
    """The informative line of an error (TensorFlow wraps it in a traceback)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for index, line in enumerate(lines[:-1]):
        if "Exception encountered when calling" in line:  # Keras wraps a layer's error
            return f"{line} {lines[index + 1]}"[:600]
    informative = [line for line in lines if "Error:" in line or "error" in line.lower()]
    return ((informative or lines or [""])[-1])[:600]


def in_ready_order(names):
    """The features `names`, those whose reference no other process is computing first."""
    return reference_cache.in_ready_order(names, lambda name: f"feature-{name}")


def _all_reduce_gradients():
    """The names of the gradients TensorFlow's registry holds for traced `ReplicaContext.all_reduce`s."""
    from keras_distrib._keras_compat import strategies

    return {name for name, owner in strategies.custom_gradients().items() if strategies.is_all_reduce(owner)}


def compare(name, model_class, *, evaluate_only=False, **kwargs):
    """Trains feature `name` with `model_class` and compares with the reference.

    With `evaluate_only`, loads the reference's trained weights instead of
    training, and compares evaluate and predict.
    """
    expected = reference(name)
    if evaluate_only:
        kwargs["weights"] = expected["weights"]
    registered = _all_reduce_gradients()
    try:
        actual = train(model_class, name, **kwargs)
    except Exception as error:  # reported, and the test decides
        return dict(feature=name, error=f"{type(error).__name__}: {error_summary(error)}")
    # TensorFlow's gradient registry keeps a step graph for each all-reduce
    # traced in it (plain Keras's stay; kd's step calls drop them).
    result = dict(feature=name, tolerance=tolerance(name),
                  graphs_kept=len(_all_reduce_gradients() - registered))
    keys = ("evaluate", "predict") if evaluate_only else \
        ("weights", "history") if name in TRAINING_ONLY else ("weights", "history", "evaluate", "predict")
    for key in keys:
        result[key] = relative_difference(expected[key], actual[key])
    result["iterations"] = [expected["iterations"], actual["iterations"]]
    return result
