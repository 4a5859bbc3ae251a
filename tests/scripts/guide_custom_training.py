"""TensorFlow's "Custom training with tf.distribute.Strategy" guide, TF2 code, with kd.

The guide's MirroredStrategy custom loop over (Fashion-MNIST-shaped) images:
a CNN, per-example losses averaged over the global batch, train and test
steps, accuracy metrics, a checkpoint restored without the strategy, and
the loop inside one tf.function. Changes: the model class (kd.Sequential),
Keras 3 renames, and building the optimizer in the scope (Keras 3). Runs on
2 virtual devices and, as the reference, on one device. Prints RESULT.
"""

import json
import os
import tempfile

import keras_distrib as kd

kd.virtual_devices(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

rng = np.random.default_rng(0)
train_images = rng.uniform(size=(200, 28, 28)).astype("float32")[..., None]
train_labels = rng.integers(0, 10, size=(200,)).astype("int64")
test_images, test_labels = train_images[:70], train_labels[:70]
BATCH_SIZE_PER_REPLICA = 16
GLOBAL_BATCH_SIZE = 32  # the same global batch on one device and on 2 replicas
EPOCHS = 2


def run(strategy):
    keras.utils.set_random_seed(0)
    train_dataset = tf.data.Dataset.from_tensor_slices((train_images, train_labels)).batch(GLOBAL_BATCH_SIZE)
    test_dataset = tf.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)
    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    def create_model():
        regularizer = keras.regularizers.L2(1e-5)
        return kd.Sequential([
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(8, 3, activation="relu", kernel_regularizer=regularizer),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu", kernel_regularizer=regularizer),
            keras.layers.Dense(10, kernel_regularizer=regularizer),
        ])

    checkpoint_dir = tempfile.mkdtemp()
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")
    with strategy.scope():
        # Keras 3: reduction=None instead of tf.keras.losses.Reduction.NONE.
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

        def compute_loss(labels, predictions, model_losses):
            per_example_loss = loss_object(labels, predictions)
            loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)
            if model_losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
            return loss

        test_loss = keras.metrics.Mean(name="test_loss")
        train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_accuracy = keras.metrics.SparseCategoricalAccuracy(name="test_accuracy")
        model = create_model()
        optimizer = keras.optimizers.Adam(learning_rate=0.001)
        optimizer.build(model.trainable_variables)  # Keras 3: build the optimizer in the scope
        checkpoint = tf.train.Checkpoint(optimizer=optimizer, model=model)

    def train_step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions, model.losses)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        train_accuracy.update_state(labels, predictions)
        return loss

    def test_step(inputs):
        images, labels = inputs
        predictions = model(images, training=False)
        t_loss = loss_object(labels, predictions)
        test_loss.update_state(t_loss)
        test_accuracy.update_state(labels, predictions)

    @tf.function
    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    @tf.function
    def distributed_test_step(dataset_inputs):
        return strategy.run(test_step, args=(dataset_inputs,))

    history = []
    for epoch in range(EPOCHS):
        total_loss, num_batches = 0.0, 0
        for x in train_dist_dataset:
            total_loss += distributed_train_step(x)
            num_batches += 1
        for x in test_dist_dataset:
            distributed_test_step(x)
        checkpoint.save(checkpoint_prefix)
        history.append([float(total_loss / num_batches), float(test_loss.result()),
                        float(train_accuracy.result()), float(test_accuracy.result())])
        test_loss.reset_state()
        train_accuracy.reset_state()
        test_accuracy.reset_state()

    # Restore the latest checkpoint without the strategy, evaluate on one device.
    eval_model = create_model()
    eval_accuracy = keras.metrics.SparseCategoricalAccuracy(name="eval_accuracy")
    tf.train.Checkpoint(model=eval_model).restore(tf.train.latest_checkpoint(checkpoint_dir)).expect_partial()
    eval_accuracy.update_state(test_labels, eval_model(test_images, training=False))

    # Iterating inside a tf.function, as the guide's last section does.
    @tf.function
    def train_epoch(dataset):
        total = tf.constant(0.0)
        for x in dataset:
            total += distributed_train_step(x)
        return total

    history.append([float(train_epoch(train_dist_dataset)), 0.0, 0.0, float(eval_accuracy.result())])
    return model.get_weights(), history


kd_weights, kd_history = run(tf.distribute.MirroredStrategy())
weights, history = run(tf.distribute.get_strategy())
print("RESULT " + json.dumps({
    "weights": max(float(np.max(np.abs(a - b))) for a, b in zip(kd_weights, weights)),
    "history": float(np.max(np.abs(np.array(kd_history) - np.array(history)))),
    "history_kd": kd_history,
}), flush=True)
