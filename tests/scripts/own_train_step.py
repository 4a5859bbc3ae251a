"""Your own train_step/test_step, as Keras's guides teach them, against one device.

Usage: own_train_step.py CONFIG PATTERN[,PATTERN...] [float64]

Each pattern is a small model subclass written the way Keras's guide
"Customizing what happens in fit()" (and its GAN and VAE examples) writes
one, here in our own words: the same class body on the base `keras.Model`
trained on one device (the reference) and on the base `kd.Model` under
CONFIG's strategy, from the same initial weights, on 225 rows in global
batches of 32 (the last batch holds 1 row: a replica without rows).
CONFIG "plain-..." trains the `keras.Model` class under the strategy (the
contrast). Prints one 'RESULT {json}' line per pattern: the largest
relative difference of the weights and of every logged value.
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras_distrib as kd
from features import differences
from features import failure

CONFIGS = {
    "mirrored2": (2, "mirrored"),
    "central_storage2": (2, "central_storage"),
    "multi_worker": (1, "multi_worker"),
    "plain-mirrored2": (2, "mirrored"),
}
ROWS, BATCH, EPOCHS = 225, 32, 2


def _data(float_type):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(ROWS, 6)).astype(float_type)
    y = (x @ rng.normal(size=(6, 1)) + 0.3 * np.sin(x[:, :1])).astype(float_type)
    weights = rng.uniform(0.2, 2.0, size=(ROWS,)).astype(float_type)
    images = rng.uniform(size=(ROWS, 4, 4, 1)).astype(float_type)
    return x, y, weights, images


def _regressor(base, keras):
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(5, activation="tanh")(inputs)
    return base, inputs, keras.layers.Dense(1)(hidden)


def build(pattern, base):
    """(model, how to train it) for `pattern`, its classes derived from `base`."""
    import keras
    import tensorflow as tf
    from keras import ops

    if pattern in ("trackers", "sample_weight"):
        class Stepper(base):
            def train_step(self, data):
                x, y, weight = keras.utils.unpack_x_y_sample_weight(data)
                with tf.GradientTape() as tape:
                    prediction = self(x, training=True)
                    loss = self.compute_loss(y=y, y_pred=prediction, sample_weight=weight)
                variables = self.trainable_variables
                self.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
                for metric in self.metrics:
                    if metric.name == "loss":
                        metric.update_state(loss)
                    else:
                        metric.update_state(y, prediction, sample_weight=weight)
                return {metric.name: metric.result() for metric in self.metrics}

        _, inputs, outputs = _regressor(base, keras)
        model = Stepper(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        return model, "fit"

    if pattern == "own_loss":
        class OwnLoss(base):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.error = keras.losses.MeanSquaredError()
                self.tracked_loss = keras.metrics.Mean(name="loss")
                self.tracked_mae = keras.metrics.MeanAbsoluteError(name="mae")

            @property
            def metrics(self):
                return [self.tracked_loss, self.tracked_mae]

            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    prediction = self(x, training=True)
                    loss = self.error(y, prediction)
                grads = tape.gradient(loss, self.trainable_weights)
                self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
                self.tracked_loss.update_state(loss)
                self.tracked_mae.update_state(y, prediction)
                return {"loss": self.tracked_loss.result(), "mae": self.tracked_mae.result()}

        _, inputs, outputs = _regressor(base, keras)
        model = OwnLoss(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.05))
        return model, "fit"

    if pattern == "test_step":
        class Evaluated(base):
            def test_step(self, data):
                x, y = data
                prediction = self(x, training=False)
                loss = self.compute_loss(y=y, y_pred=prediction)
                for metric in self.metrics:
                    if metric.name == "loss":
                        metric.update_state(loss)
                    else:
                        metric.update_state(y, prediction)
                return {metric.name: metric.result() for metric in self.metrics}

        _, inputs, outputs = _regressor(base, keras)
        model = Evaluated(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        return model, "fit_evaluate"

    if pattern == "tensor_logs":
        class Tensors(base):
            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    prediction = self(x, training=True)
                    loss = self.compute_loss(y=y, y_pred=prediction)
                grads = tape.gradient(loss, self.trainable_weights)
                self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
                # Values the step computed, returned as they are.
                return {"loss": loss, "mean_error": ops.mean(ops.abs(y - prediction))}

        _, inputs, outputs = _regressor(base, keras)
        model = Tensors(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model, "fit"

    if pattern == "odd_draw":
        class OddDraw(base):
            def train_step(self, data):
                x, y = data
                # One more row than the batch: no layout over the global batch gives one
                # device's draws (kd refuses it).
                noise = keras.random.normal((tf.shape(x)[0] + 1, 1), seed=7, dtype=x.dtype)
                with tf.GradientTape() as tape:
                    prediction = self(x, training=True) + noise[1:]
                    loss = self.compute_loss(y=y, y_pred=prediction)
                grads = tape.gradient(loss, self.trainable_weights)
                self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
                return {"loss": loss}

        _, inputs, outputs = _regressor(base, keras)
        model = OddDraw(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model, "fit"

    if pattern == "tf_random":
        class StatefulNoise(base):
            def train_step(self, data):
                x, y = data
                # TensorFlow's stateful draw: each device keeps its own state (kd refuses it).
                noisy = x + tf.random.normal(tf.shape(x), stddev=0.1, dtype=x.dtype)
                return super().train_step((noisy, y))

        _, inputs, outputs = _regressor(base, keras)
        model = StatefulNoise(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model, "fit"

    if pattern == "gan":
        return _gan(base, keras, tf), "fit_images"
    if pattern == "vae":
        return _vae(base, keras, tf, ops), "fit_images"
    raise ValueError(f"unknown pattern {pattern!r}")


def _gan(base, keras, tf):
    latent = 3

    class Adversarial(base):
        def __init__(self, critic, maker):
            super().__init__()
            self.critic = critic
            self.maker = maker
            self.seeds = keras.random.SeedGenerator(11)
            self.critic_loss = keras.metrics.Mean(name="d_loss")
            self.maker_loss = keras.metrics.Mean(name="g_loss")

        @property
        def metrics(self):
            return [self.critic_loss, self.maker_loss]

        def compile(self, critic_optimizer, maker_optimizer, loss_fn):
            super().compile()
            self.critic_optimizer = critic_optimizer
            self.maker_optimizer = maker_optimizer
            self.loss_fn = loss_fn

        def train_step(self, images):
            rows = tf.shape(images)[0]
            z = keras.random.normal((rows, latent), seed=self.seeds)
            made = self.maker(z)
            both = tf.concat([made, images], axis=0)
            labels = tf.concat([tf.ones((rows, 1), images.dtype), tf.zeros((rows, 1), images.dtype)], 0)
            labels += 0.05 * keras.random.uniform(tf.shape(labels), dtype=images.dtype, seed=self.seeds)
            with tf.GradientTape() as tape:
                critic_loss = self.loss_fn(labels, self.critic(both))
            grads = tape.gradient(critic_loss, self.critic.trainable_weights)
            self.critic_optimizer.apply_gradients(zip(grads, self.critic.trainable_weights))
            z = keras.random.normal((rows, latent), seed=self.seeds)
            fooled = tf.zeros((rows, 1), images.dtype)
            with tf.GradientTape() as tape:
                maker_loss = self.loss_fn(fooled, self.critic(self.maker(z)))
            grads = tape.gradient(maker_loss, self.maker.trainable_weights)
            self.maker_optimizer.apply_gradients(zip(grads, self.maker.trainable_weights))
            self.critic_loss.update_state(critic_loss)
            self.maker_loss.update_state(maker_loss)
            return {"d_loss": self.critic_loss.result(), "g_loss": self.maker_loss.result()}

    critic = keras.Sequential([
        keras.Input((4, 4, 1)), keras.layers.Conv2D(3, 3, padding="same"),
        keras.layers.LeakyReLU(0.2), keras.layers.GlobalMaxPooling2D(), keras.layers.Dense(1),
    ], name="critic")
    maker = keras.Sequential([
        keras.Input((latent,)), keras.layers.Dense(16), keras.layers.LeakyReLU(0.2),
        keras.layers.Reshape((4, 4, 1)), keras.layers.Conv2D(1, 3, padding="same", activation="sigmoid"),
    ], name="maker")
    model = Adversarial(critic, maker)
    model.compile(keras.optimizers.Adam(0.003), keras.optimizers.Adam(0.003),
                  keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def _vae(base, keras, tf, ops):
    latent = 2

    class Sampling(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.seeds = keras.random.SeedGenerator(5)

        def call(self, inputs):
            mean, log_var = inputs
            noise = keras.random.normal(ops.shape(mean), dtype=mean.dtype, seed=self.seeds)
            return mean + ops.exp(0.5 * log_var) * noise

    class Autoencoder(base):
        def __init__(self, encoder, decoder, **kwargs):
            super().__init__(**kwargs)
            self.encoder = encoder
            self.decoder = decoder
            self.total = keras.metrics.Mean(name="total_loss")
            self.rebuilt = keras.metrics.Mean(name="reconstruction_loss")
            self.divergence = keras.metrics.Mean(name="kl_loss")

        def call(self, x):
            return self.decoder(self.encoder(x)[2])

        @property
        def metrics(self):
            return [self.total, self.rebuilt, self.divergence]

        def train_step(self, images):
            with tf.GradientTape() as tape:
                mean, log_var, z = self.encoder(images)
                rebuilt = self.decoder(z)
                rebuild_loss = ops.mean(ops.sum(
                    keras.losses.binary_crossentropy(images, rebuilt), axis=(1, 2)))
                divergence = -0.5 * (1 + log_var - ops.square(mean) - ops.exp(log_var))
                divergence = ops.mean(ops.sum(divergence, axis=1))
                total = rebuild_loss + divergence
            grads = tape.gradient(total, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            self.total.update_state(total)
            self.rebuilt.update_state(rebuild_loss)
            self.divergence.update_state(divergence)
            return {"loss": self.total.result(), "reconstruction_loss": self.rebuilt.result(),
                    "kl_loss": self.divergence.result()}

    images = keras.Input((4, 4, 1))
    x = keras.layers.Conv2D(2, 3, padding="same", activation="relu")(images)
    x = keras.layers.Flatten()(x)
    mean = keras.layers.Dense(latent)(x)
    log_var = keras.layers.Dense(latent)(x)
    encoder = keras.Model(images, [mean, log_var, Sampling()([mean, log_var])], name="encoder")
    codes = keras.Input((latent,))
    y = keras.layers.Dense(16, activation="relu")(codes)
    y = keras.layers.Reshape((4, 4, 1))(y)
    decoder = keras.Model(codes, keras.layers.Conv2D(1, 3, padding="same", activation="sigmoid")(y),
                          name="decoder")
    model = Autoencoder(encoder, decoder)
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    return model


def train(pattern, base, strategy, initial=None):
    import keras

    float_type = keras.config.floatx()
    x, y, weights, images = _data(float_type)
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model, how = build(pattern, base)
        if pattern == "vae":
            model(images[:2])
        if initial is not None:
            for variable, value in zip(model.variables, initial):
                variable.assign(value)
    start = [np.array(v) for v in model.variables]
    arguments = dict(batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    if how == "fit_images":
        history = model.fit(images, **arguments).history
    elif pattern == "sample_weight":
        history = model.fit(x, y, sample_weight=weights, **arguments).history
    else:
        # The default progress bar (verbose=1) once: it read PerReplica logs before.
        history = model.fit(x, y, **{**arguments, "verbose": 1 if pattern == "trackers" else 0}).history
    result = dict(history=history, weights=[np.array(w) for w in model.trainable_weights])
    if how == "fit_evaluate":
        result["evaluate"] = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    return start, result


def main(config, patterns, float64):
    devices, kind = CONFIGS[config]
    if devices > 1:
        kd.virtual_devices(devices)
    import keras

    if float64:
        keras.config.set_floatx("float64")
    import tensorflow as tf

    strategy = kd.make_strategy(kind)
    base = keras.Model if config.startswith("plain-") else kd.Model
    for pattern in patterns:
        item = dict(pattern=pattern, config=config, float64=float64,
                    replicas=strategy.num_replicas_in_sync, task=kd.cluster_info().label)
        try:
            start, expected = train(pattern, keras.Model, tf.distribute.get_strategy())
            _, actual = train(pattern, base, strategy, initial=start)
            item.update(differences(expected, actual))
            item["keys"] = sorted(actual["history"])
        except Exception as error:  # reported; the test decides
            item.update(failure(error))
        print("RESULT " + json.dumps(item), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","), len(sys.argv) > 3 and sys.argv[3] == "float64")
