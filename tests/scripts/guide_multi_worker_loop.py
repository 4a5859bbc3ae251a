"""TensorFlow's "Multi-worker training with a custom training loop" guide, with kd.

Launched on 2 workers (TF_CONFIG from kd.launch). The guide's code: a CNN
built in MultiWorkerMirroredStrategy's scope, a dataset_fn that shards by
input pipeline and batches per replica, a step with per-example losses
averaged over the global batch, an epoch counter and a checkpoint manager
whose files only the chief keeps. Changes: the model class (kd.Sequential),
Keras 3 renames, the optimizer built in the scope (Keras 3), and a seeded
shuffle so the reference can see the same batches. Each worker then runs the
same loop on one device over the same global batches (the reference) and
prints one RESULT line.
"""

import json
import os
import sys
import tempfile

import keras_distrib as kd

checkpoint_root = sys.argv[1]
strategy = kd.make_strategy("multi_worker")  # tf.distribute.MultiWorkerMirroredStrategy()
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

keras.utils.set_random_seed(0)  # datasets below shuffle with the same seeds
rng = np.random.default_rng(0)
x_train = rng.uniform(size=(256, 28, 28)).astype("float32")
y_train = rng.integers(0, 10, size=(256,)).astype("int64")
per_worker_batch_size = 16
num_workers = kd.cluster_info().num_workers
global_batch_size = per_worker_batch_size * num_workers
num_epochs, num_steps_per_epoch = 2, 6


def mnist_dataset():
    # Seeded (graph and op seed) so that every worker, and the one-device
    # reference, shuffle the same way.
    tf.random.set_seed(0)
    return tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(256, seed=3)


def dataset_fn(global_batch_size, input_context):
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    dataset = mnist_dataset()
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return dataset.batch(batch_size)


def build_cnn_model():
    keras.utils.set_random_seed(0)
    return kd.Sequential([
        keras.Input(shape=(28, 28)),
        keras.layers.Reshape(target_shape=(28, 28, 1)),
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10),
    ])


def train(strategy, dataset, checkpoint_dir, chief):
    with strategy.scope():
        model = build_cnn_model()
        optimizer = keras.optimizers.RMSprop(learning_rate=0.001)
        optimizer.build(model.trainable_variables)  # Keras 3: build the optimizer in the scope
        train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        epoch = tf.Variable(initial_value=tf.constant(0, dtype=tf.dtypes.int64), name="epoch")
        step_in_epoch = tf.Variable(initial_value=tf.constant(0, dtype=tf.dtypes.int64), name="step_in_epoch")

    @tf.function
    def train_step(iterator):
        def step_fn(inputs):
            x, y = inputs
            with tf.GradientTape() as tape:
                predictions = model(x, training=True)
                per_batch_loss = keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True, reduction=None)(y, predictions)
                loss = tf.nn.compute_average_loss(per_batch_loss, global_batch_size=global_batch_size)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            train_accuracy.update_state(y, predictions)
            return loss

        per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    # Only the chief's checkpoints persist; other workers write to a temp dir.
    write_dir = checkpoint_dir if chief else tempfile.mkdtemp()
    checkpoint = tf.train.Checkpoint(model=model, epoch=epoch, step_in_epoch=step_in_epoch)
    manager = tf.train.CheckpointManager(checkpoint, directory=write_dir, max_to_keep=1)
    losses = []
    while epoch.numpy() < num_epochs:
        iterator = iter(dataset)
        total_loss, num_batches = 0.0, 0
        while step_in_epoch.numpy() < num_steps_per_epoch:
            total_loss += train_step(iterator)
            num_batches += 1
            step_in_epoch.assign_add(1)
        losses.append(float(total_loss / num_batches))
        train_accuracy.reset_state()
        manager.save()
        epoch.assign_add(1)
        step_in_epoch.assign(0)
    return model.get_weights(), losses


info = kd.cluster_info()
multi_worker_dataset = strategy.distribute_datasets_from_function(
    lambda input_context: dataset_fn(global_batch_size, input_context)
)
kd_weights, kd_losses = train(strategy, multi_worker_dataset, os.path.join(checkpoint_root, "multi"), info.is_chief)
# The reference: one device, the same global batches (shuffled the same way).
one_device = tf.distribute.get_strategy()
reference_dataset = mnist_dataset().batch(global_batch_size)
weights, losses = train(one_device, reference_dataset, tempfile.mkdtemp(), True)
print("RESULT " + json.dumps({
    "task": info.label,
    "replicas": strategy.num_replicas_in_sync,
    "weights": max(float(np.max(np.abs(a - b))) for a, b in zip(kd_weights, weights)),
    "losses": max(abs(a - b) for a, b in zip(kd_losses, losses)),
    "kd_losses": kd_losses, "reference_losses": losses,
}), flush=True)
