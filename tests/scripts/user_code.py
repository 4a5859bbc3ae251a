"""User code as Keras's guides and keras-io write it, under kd, against one device.

Usage: user_code.py PATTERN[,PATTERN...]

Float64, 2 mirrored replicas (virtual CPUs). Each pattern is written the way
the guide it names writes it (our own code): the class on `keras.Model`
trained on one device is the reference; the class on `kd.Model` under the
strategy starts from the reference's initial weights and sees the same
global batches (65 rows in batches of 16: the last batch has 1 row, so one
replica has none). "plain:PATTERN" trains the `keras.Model` class under the
strategy (the contrast). Prints one 'RESULT {json}' line per pattern: the
largest |a - b| / (1 + |a|) over the weights and over every logged value
(History, or the loop's loss per step), or the error.

Patterns:
  compiled        "Customizing what happens in fit()": compile's loss and
                  metrics, `self.optimizer.apply`, `{m.name: m.result()}`.
  sample_weight   the same step unpacking `(x, y, sample_weight)`.
  low_level       the guide's step without compile's loss: its own
                  `MeanSquaredError()`, `Mean` and `MeanAbsoluteError`.
  compute_loss    Keras's `Trainer.compute_loss` docstring: an override that
                  returns a plain mean plus `ops.sum(self.losses)` and feeds
                  its own tracker, under the default `train_step`.
  dcgan           keras-io's DCGAN: a discriminator with Dropout and a
                  sigmoid, `BinaryCrossentropy()`, latent vectors from
                  `keras.random.normal` with the model's SeedGenerator.
  vae_guide       keras-io's VAE: `Sampling` draws `(batch, dim)` from the
                  layer's SeedGenerator; kl and reconstruction losses summed
                  per row and averaged; three trackers.
  add_loss_fit    layers calling `add_loss`: a sum of squared activations
                  (activity regularization) and a batch mean, trained by fit.
  add_loss_loop   the same model in a hand-written `strategy.run` loop with
                  kd's recipe; the reference is the guide's loop on one
                  device (`loss_fn(y, logits) + sum(model.losses)`).
  add_loss_loop_verbatim  the guide's loop body unchanged inside
                  `strategy.run` (kd model, `kd.exact_optimizer`).
  loop:VARIANT    a hand-written `strategy.run` loop of a model with L2
                  weight regularizers, its loss reduced with plain ops (as
                  TensorFlow's guides write it), the same code on one device
                  as the reference; VARIANT (R: the replicas in sync):
                    tf_recipe    `tf.nn.compute_average_loss(l, global_batch_size=16)
                                 + tf.nn.scale_regularization_loss(model.losses)`
                    global_sum   `tf.reduce_sum(l) / 16 + sum(model.losses) / R`
                    mean_losses  `tf.reduce_mean(l) + sum(model.losses)` (refused)
                    mean         `tf.reduce_mean(l)` (refused)
                    no_global    `tf.nn.compute_average_loss(l)
                                 + tf.nn.scale_regularization_loss(model.losses)` (refused)
  centralized     keras-io's gradient centralization: an optimizer whose
                  `apply_gradients` override subtracts each kernel
                  gradient's mean over its inputs, then calls Keras's.
  normalized      an `apply_gradients` override that divides each gradient
                  by its norm: not linear, so each replica's normalized
                  gradients do not add up to one device's (refused).
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras_distrib as kd
from features import differences
from features import failure

ROWS, BATCH, EPOCHS = 65, 16, 2


def _data():
    rng = np.random.default_rng(11)
    x = rng.normal(size=(ROWS, 5))
    y = np.tanh(x @ rng.normal(size=(5, 1))) + 0.1 * rng.normal(size=(ROWS, 1))
    images = rng.uniform(size=(ROWS, 4, 4, 1))
    return x, y, images


def _compute_loss(base, keras, ops):
    class TrackedLoss(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            loss = ops.mean((y_pred - y) ** 2)
            loss += ops.sum(self.losses)
            self.loss_tracker.update_state(loss)
            return loss

        def reset_metrics(self):
            self.loss_tracker.reset_state()

        @property
        def metrics(self):
            return [self.loss_tracker]

    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(4, activation="tanh", kernel_regularizer=keras.regularizers.L2(1e-2))(inputs)
    hidden = _batch_mean(keras, ops)(hidden)
    model = TrackedLoss(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model


def _guide_steps(pattern, base, keras, ops):
    """The guide's first three `train_step`s: compile's loss and metrics, sample weights, no compile loss."""
    import tensorflow as tf

    class Compiled(base):
        def train_step(self, data):
            if pattern == "sample_weight" and len(data) == 3:
                x, y, sample_weight = data
            else:
                (x, y), sample_weight = data, None
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(gradients, self.trainable_variables)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred, sample_weight=sample_weight)
            return {m.name: m.result() for m in self.metrics}

    class LowLevel(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
            self.loss_fn = keras.losses.MeanSquaredError()

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.loss_fn(y, y_pred)
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(gradients, self.trainable_variables)
            self.loss_tracker.update_state(loss)
            self.mae_metric.update_state(y, y_pred)
            return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

        @property
        def metrics(self):
            return [self.loss_tracker, self.mae_metric]

    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    model = (LowLevel if pattern == "low_level" else Compiled)(inputs, keras.layers.Dense(1)(hidden))
    if pattern == "low_level":
        model.compile(optimizer=keras.optimizers.Adam(0.02))
    else:
        model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse", metrics=["mae"])
    return model


def _batch_mean(keras, ops, rate=0.05):
    class BatchMean(keras.layers.Layer):
        """The subclassing guide's `ActivityRegularizationLayer`: a mean over the batch."""

        def call(self, inputs):
            self.add_loss(rate * ops.mean(inputs))
            return inputs

    return BatchMean()


def _activity(keras, ops, rate=1e-2):
    class ActivitySum(keras.layers.Layer):
        """An activity penalty summed over the rows, as TF's guide once wrote it."""

        def call(self, inputs):
            self.add_loss(rate * ops.sum(ops.square(inputs)))
            return inputs

    return ActivitySum()


def _penalized(base, keras, ops):
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    hidden = _activity(keras, ops)(hidden)
    hidden = _batch_mean(keras, ops)(hidden)
    return base(inputs, keras.layers.Dense(1)(hidden))


def _dcgan(base, keras, ops):
    latent_dim = 3

    class GAN(base):
        def __init__(self, discriminator, generator, latent_dim):
            super().__init__()
            self.discriminator = discriminator
            self.generator = generator
            self.latent_dim = latent_dim
            self.seed_generator = keras.random.SeedGenerator(1337)

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile()
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer
            self.loss_fn = loss_fn
            self.d_loss_metric = keras.metrics.Mean(name="d_loss")
            self.g_loss_metric = keras.metrics.Mean(name="g_loss")

        @property
        def metrics(self):
            return [self.d_loss_metric, self.g_loss_metric]

        def train_step(self, real_images):
            import tensorflow as tf

            batch_size = ops.shape(real_images)[0]
            random_latent_vectors = keras.random.normal(
                shape=(batch_size, self.latent_dim), seed=self.seed_generator)
            generated_images = self.generator(random_latent_vectors)
            combined_images = ops.concatenate([generated_images, real_images], axis=0)
            labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
            labels += 0.05 * keras.random.uniform(ops.shape(labels), seed=self.seed_generator)
            with tf.GradientTape() as tape:
                predictions = self.discriminator(combined_images)
                d_loss = self.loss_fn(labels, predictions)
            grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
            self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))

            random_latent_vectors = keras.random.normal(
                shape=(batch_size, self.latent_dim), seed=self.seed_generator)
            misleading_labels = ops.zeros((batch_size, 1))
            with tf.GradientTape() as tape:
                predictions = self.discriminator(self.generator(random_latent_vectors))
                g_loss = self.loss_fn(misleading_labels, predictions)
            grads = tape.gradient(g_loss, self.generator.trainable_weights)
            self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))

            self.d_loss_metric.update_state(d_loss)
            self.g_loss_metric.update_state(g_loss)
            return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}

    discriminator = keras.Sequential([
        keras.Input((4, 4, 1)),
        keras.layers.Conv2D(4, 3, strides=2, padding="same"),
        keras.layers.LeakyReLU(negative_slope=0.2),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.2, seed=21),
        keras.layers.Dense(1, activation="sigmoid"),
    ], name="discriminator")
    generator = keras.Sequential([
        keras.Input((latent_dim,)),
        keras.layers.Dense(2 * 2 * 4),
        keras.layers.Reshape((2, 2, 4)),
        keras.layers.Conv2DTranspose(4, 3, strides=2, padding="same"),
        keras.layers.LeakyReLU(negative_slope=0.2),
        keras.layers.Conv2D(1, 3, padding="same", activation="sigmoid"),
    ], name="generator")
    model = GAN(discriminator, generator, latent_dim)
    model.compile(d_optimizer=keras.optimizers.Adam(0.01), g_optimizer=keras.optimizers.Adam(0.01),
                  loss_fn=keras.losses.BinaryCrossentropy())
    return model


def _vae(base, keras, ops):
    latent_dim = 2

    class Sampling(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.seed_generator = keras.random.SeedGenerator(1337)

        def call(self, inputs):
            z_mean, z_log_var = inputs
            batch = ops.shape(z_mean)[0]
            dim = ops.shape(z_mean)[1]
            epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
            return z_mean + ops.exp(0.5 * z_log_var) * epsilon

    class VAE(base):
        def __init__(self, encoder, decoder, **kwargs):
            super().__init__(**kwargs)
            self.encoder = encoder
            self.decoder = decoder
            self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
            self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
            self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

        @property
        def metrics(self):
            return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

        def train_step(self, data):
            import tensorflow as tf

            with tf.GradientTape() as tape:
                z_mean, z_log_var, z = self.encoder(data)
                reconstruction = self.decoder(z)
                reconstruction_loss = ops.mean(ops.sum(
                    keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2)))
                kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
                kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
                total_loss = reconstruction_loss + kl_loss
            grads = tape.gradient(total_loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            self.total_loss_tracker.update_state(total_loss)
            self.reconstruction_loss_tracker.update_state(reconstruction_loss)
            self.kl_loss_tracker.update_state(kl_loss)
            return {"loss": self.total_loss_tracker.result(),
                    "reconstruction_loss": self.reconstruction_loss_tracker.result(),
                    "kl_loss": self.kl_loss_tracker.result()}

    encoder_inputs = keras.Input((4, 4, 1))
    x = keras.layers.Conv2D(4, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    z_mean = keras.layers.Dense(latent_dim, name="z_mean")(x)
    z_log_var = keras.layers.Dense(latent_dim, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")
    latent_inputs = keras.Input((latent_dim,))
    x = keras.layers.Dense(2 * 2 * 4, activation="relu")(latent_inputs)
    x = keras.layers.Reshape((2, 2, 4))(x)
    x = keras.layers.Conv2DTranspose(4, 3, activation="relu", strides=2, padding="same")(x)
    outputs = keras.layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
    decoder = keras.Model(latent_inputs, outputs, name="decoder")
    model = VAE(encoder, decoder)
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    return model


def _centralized(base, keras, ops, normalized=False):
    class CentralizedSGD(keras.optimizers.SGD):
        def apply_gradients(self, grads_and_vars):
            centred = []
            for grad, variable in grads_and_vars:
                if normalized:
                    grad = grad / ops.sqrt(ops.sum(grad * grad))
                elif len(grad.shape) > 1:
                    grad = grad - ops.mean(grad, axis=tuple(range(len(grad.shape) - 1)), keepdims=True)
                centred.append((grad, variable))
            return super().apply_gradients(centred)

    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    model = base(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=CentralizedSGD(0.1), loss="mse", metrics=["mae"])
    return model


def build(pattern, base):
    import keras
    from keras import ops

    if pattern in ("compiled", "sample_weight", "low_level"):
        return _guide_steps(pattern, base, keras, ops), "xy"
    if pattern == "compute_loss":
        return _compute_loss(base, keras, ops), "xy"
    if pattern in ("centralized", "normalized"):
        return _centralized(base, keras, ops, normalized=pattern == "normalized"), "xy"
    if pattern == "dcgan":
        return _dcgan(base, keras, ops), "images"
    if pattern == "vae_guide":
        return _vae(base, keras, ops), "images"
    if pattern.startswith("loop:"):
        inputs = keras.Input((5,))
        hidden = keras.layers.Dense(4, activation="tanh",
                                    kernel_regularizer=keras.regularizers.L2(1e-2))(inputs)
        outputs = keras.layers.Dense(1, kernel_regularizer=keras.regularizers.L2(1e-2))(hidden)
        return base(inputs, outputs), "xy"
    if pattern.startswith("add_loss"):
        model = _penalized(base, keras, ops)
        model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
        return model, "xy"
    raise ValueError(f"unknown pattern {pattern!r}")


def _guide_loop(model, strategy, recipe=True):
    """The writing-a-training-loop guide's loop; under a strategy, kd's recipe (unless not `recipe`)."""
    import keras
    import tensorflow as tf

    x, y, _ = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    loss_fn = keras.losses.MeanSquaredError(reduction=None if strategy and recipe else "sum_over_batch_size")
    optimizer = model.optimizer
    if strategy is not None:
        dataset = strategy.experimental_distribute_dataset(dataset)
        with strategy.scope():
            optimizer = kd.exact_optimizer(keras.optimizers.Adam(0.02))

    def replica_step(x_batch, y_batch):
        with tf.GradientTape() as tape:
            logits = model(x_batch, training=True)
            if strategy is None or not recipe:
                loss_value = loss_fn(y_batch, logits) + sum(model.losses)
            else:
                penalty = kd.losses.scale_regularization(model.losses, local_rows=tf.shape(x_batch)[0])
                loss_value = kd.losses.global_mean(loss_fn(y_batch, logits)) + penalty
        grads = tape.gradient(loss_value, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        return loss_value

    return _epochs(replica_step, strategy, dataset)


def _epochs(replica_step, strategy, dataset):
    """`replica_step` on every batch of `dataset` for EPOCHS epochs, in one `tf.function` step
    (each replica's under `strategy`, their returned values summed); the steps' losses."""
    import tensorflow as tf

    @tf.function
    def train_step(x_batch, y_batch):
        if strategy is None:
            return replica_step(x_batch, y_batch)
        return strategy.reduce("SUM", strategy.run(replica_step, args=(x_batch, y_batch)), axis=None)

    losses = []
    for _ in range(EPOCHS):
        for x_batch, y_batch in dataset:
            losses.append(float(train_step(x_batch, y_batch)))
    return {"loss": losses}


def _reduced_loss(variant, per_example, model_losses):
    """A loop's loss reduced with plain ops, as `loop:VARIANT` says (see the module docstring)."""
    import tensorflow as tf

    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if variant == "tf_recipe":
        return tf.nn.compute_average_loss(per_example, global_batch_size=BATCH) + \
            tf.nn.scale_regularization_loss(model_losses)
    if variant == "global_sum":
        return tf.reduce_sum(per_example) / BATCH + sum(model_losses) / replicas
    if variant == "mean_losses":
        return tf.reduce_mean(per_example) + sum(model_losses)
    if variant == "mean":
        return tf.reduce_mean(per_example)
    if variant == "no_global":
        return tf.nn.compute_average_loss(per_example) + tf.nn.scale_regularization_loss(model_losses)
    raise ValueError(f"unknown loop variant {variant!r}")


def _plain_ops_loop(model, strategy, variant):
    """TensorFlow's custom-training loop shape, the loss reduced with plain ops (`_reduced_loss`)."""
    import keras
    import tensorflow as tf

    x, y, _ = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    with (strategy or tf.distribute.get_strategy()).scope():
        optimizer = keras.optimizers.Adam(0.02)
        optimizer.build(model.trainable_variables)
    if strategy is not None:
        dataset = strategy.experimental_distribute_dataset(dataset)

    def replica_step(x_batch, y_batch):
        with tf.GradientTape() as tape:
            predictions = model(x_batch, training=True)
            per_example = keras.losses.mean_squared_error(y_batch, predictions)
            loss = _reduced_loss(variant, per_example, model.losses)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return _epochs(replica_step, strategy, dataset)


def train(pattern, base, strategy, initial=None, loop=False):
    import keras

    x, y, images = _data()
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model, data = build(pattern, base)
        if initial is not None:
            for variable, value in zip(model.variables, initial):
                variable.assign(value)
    start = [np.array(v) for v in model.variables]
    if pattern.startswith("loop:"):
        history = _plain_ops_loop(model, None if initial is None else strategy,
                                  pattern.removeprefix("loop:"))
    elif loop:
        history = _guide_loop(model, None if initial is None else strategy,
                              recipe=pattern == "add_loss_loop")
    else:
        arguments = dict(batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        if data == "images":
            history = model.fit(images, **arguments).history
        elif pattern == "sample_weight":
            weights = np.linspace(0.2, 2.0, ROWS)
            history = model.fit(x, y, sample_weight=weights, **arguments).history
        else:
            history = model.fit(x, y, **arguments).history
    return start, dict(history=history, weights=[np.array(w) for w in model.trainable_weights])


def main(patterns):
    kd.virtual_devices(2)
    import keras

    keras.config.set_floatx("float64")
    import tensorflow as tf

    strategy = kd.make_strategy("mirrored")
    for name in patterns:
        plain = name.startswith("plain:")
        pattern = name.removeprefix("plain:")
        item = dict(pattern=name, replicas=strategy.num_replicas_in_sync)
        loop = pattern.startswith("add_loss_loop")
        try:
            start, expected = train(pattern, keras.Model, tf.distribute.get_strategy(), loop=loop)
            _, actual = train(pattern, keras.Model if plain else kd.Model, strategy, initial=start,
                              loop=loop)
            item.update(differences(expected, actual))
        except Exception as error:  # reported; the test decides
            item.update(failure(error))
        print("RESULT " + json.dumps(item), flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(","))
