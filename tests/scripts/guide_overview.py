"""TensorFlow's "Distributed training with TensorFlow" guide, TF2 code, with kd.

The guide's MirroredStrategy sections (Keras fit and a custom loop), changed
only where Keras 3 renamed things and where the model class is kd's. Each
section runs under the strategy (2 virtual devices) and, as the reference,
under the default strategy on one device. Prints one RESULT line.
"""

import json

import keras_distrib as kd

kd.virtual_devices(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

result = {}
# The guide repeats one example; rows of the same shape with distinct values
# make a wrong reduction visible.
rng = np.random.default_rng(0)
features = rng.normal(size=(105, 1)).astype("float32")
labels = (2.0 * features + 0.5).astype("float32")


def fit_section(strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        # Keras 3: an Input instead of `input_shape=(1,)` on the layer.
        model = kd.Sequential([keras.Input((1,)),
                               keras.layers.Dense(1, kernel_regularizer=keras.regularizers.L2(1e-4))])
        model.compile(loss="mse", optimizer="sgd")
    dataset = tf.data.Dataset.from_tensor_slices((features, labels)).batch(10)  # last batch: 5 rows
    history = model.fit(dataset, epochs=2, verbose=0)
    return model.get_weights(), history.history["loss"], model.evaluate(dataset, verbose=0)


def loop_section(strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = kd.Sequential([keras.Input((1,)),
                               keras.layers.Dense(1, kernel_regularizer=keras.regularizers.L2(1e-4))])
        optimizer = keras.optimizers.SGD()
        optimizer.build(model.trainable_variables)  # Keras 3: build the optimizer in the scope
    global_batch_size = 32  # the same global batch on one device and on 2 replicas
    dataset = tf.data.Dataset.from_tensor_slices((features, labels)).batch(global_batch_size)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)

    @tf.function
    def train_step(dist_inputs):
        def step_fn(inputs):
            features, labels = inputs
            with tf.GradientTape() as tape:
                logits = model(features, training=True)
                per_example_loss = keras.losses.mean_squared_error(labels, logits)
                loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=global_batch_size)
                model_losses = model.losses
                if model_losses:
                    loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            return loss

        per_replica_losses = strategy.run(step_fn, args=(dist_inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    losses = [float(train_step(batch)) for batch in dist_dataset]
    return model.get_weights(), losses


mirrored = tf.distribute.MirroredStrategy()
default = tf.distribute.get_strategy()
for name, section in (("fit", fit_section), ("loop", loop_section)):
    kd_run, reference = section(mirrored), section(default)
    result[name] = {
        "weights": max(float(np.max(np.abs(a - b))) for a, b in zip(kd_run[0], reference[0])),
        "losses": max(abs(a - b) for a, b in zip(kd_run[1], reference[1])),
        "replicas": mirrored.num_replicas_in_sync,
    }
    if name == "fit":
        result[name]["evaluate"] = abs(kd_run[2] - reference[2])
print("RESULT " + json.dumps(result), flush=True)
