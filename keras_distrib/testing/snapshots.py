"""Training with a snapshot of the weights after every step (what `assert_parity` compares)."""

import math
import pickle

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from keras_distrib.testing.strategies import task_entry

__all__ = [
    "dataset_of",
    "dataset_steps",
    "first_input",
    "is_dataset_source",
    "make_model",
    "parity_task",
    "train",
]


class _Recorder(keras.callbacks.Callback):
    """Keeps the model's weights after every step (or every epoch) up to `steps`."""

    def __init__(self, steps_per_epoch, steps, per_epoch=False):
        super().__init__()
        self.steps_per_epoch = steps_per_epoch
        self.steps = steps
        self.per_epoch = per_epoch
        self.weights = {}
        self.epoch = 0

    def _keep(self, step):
        if step <= self.steps:
            self.weights[step] = [np.array(w) for w in self.model.get_weights()]
        if step >= self.steps:
            self.model.stop_training = True

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if not self.per_epoch:
            self._keep(self.epoch * self.steps_per_epoch + batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        if self.per_epoch:  # parameter server: one step per epoch, joined at its end
            self._keep(epoch + 1)


def first_input(x):
    """The first input array (or tensor) of `x`, a structure of them."""
    return tree.flatten(x)[0]


def _one_pipeline_dataset(dataset_fn):
    """`dataset_fn`'s dataset for one input pipeline and one replica: the global batches."""
    context = tf.distribute.InputContext(
        num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1)
    return dataset_fn(context)


def is_dataset_source(data):
    """Whether `data` is a dataset or a `dataset_fn` (else NumPy arrays)."""
    return isinstance(data, tf.data.Dataset) or (callable(data) and not isinstance(data, (tuple, list)))


def dataset_of(arrays):
    """The dataset `arrays` stands for: a `dataset_fn`'s, for one input pipeline."""
    return _one_pipeline_dataset(arrays) if callable(arrays) else arrays


def _build(model, x):
    """Creates the model's variables (a subclassed model may have none yet).

    `x` is a batch of NumPy inputs, or a dataset's element spec (zeros of
    its shape: reading a batch would move a reshuffling dataset on).
    """
    if model.built and model.weights:
        return
    if isinstance(x, tf.data.Dataset):
        inputs = keras.utils.unpack_x_y_sample_weight(x.element_spec)[0]
        sample = tree.map_structure(
            lambda spec: tf.zeros([1] + [d or 1 for d in spec.shape[1:]], spec.dtype), inputs)
    else:
        sample = tree.map_structure(lambda a: a[:1], x)
    model(sample, training=False)


def make_model(model_fn, seed, x, initial_weights=None):
    """`model_fn()`'s model, seeded, built on `x` (arrays' inputs, or a dataset), from `initial_weights`."""
    keras.utils.set_random_seed(seed)  # the same dropout seeds in every run
    model = model_fn()
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`model_fn` returned a {type(model).__name__}; it must build, compile and "
            "return a keras.Model (assert_parity calls it inside each strategy's scope)."
        )
    if getattr(model, "optimizer", None) is None:
        raise ValueError(
            "`model_fn` returned a model that is not compiled. Call "
            "`model.compile(optimizer=..., loss=...)` inside `model_fn`."
        )
    _build(model, x)
    if initial_weights is not None:
        model.set_weights(initial_weights)
    return model


def train(model, arrays, *, batch_size, steps, path, per_epoch):
    """Trains `model` for `steps` steps; returns its weights after each step, and history.

    `arrays` is (x, y, sample_weight), a batched `tf.data.Dataset` or a
    `dataset_fn` (called for one input pipeline).
    """
    if is_dataset_source(arrays):
        dataset = dataset_of(arrays)
        steps_per_epoch = dataset_steps(dataset)
        recorder = _Recorder(steps_per_epoch, steps)
        kwargs = dict(x=dataset, epochs=math.ceil(steps / steps_per_epoch), shuffle=False)
    else:
        x, y, sample_weight = arrays
        steps_per_epoch = math.ceil(len(first_input(x)) / batch_size)
        recorder = _Recorder(steps_per_epoch, steps, per_epoch=per_epoch)
        if per_epoch:
            # Parameter server: each worker repeats its dataset, so epochs are
            # counted in steps. One step per epoch (joined at its end) keeps the
            # global batches of one device's epochs, the uneven one included.
            sliced = tuple(a for a in (x, y, sample_weight) if a is not None)
            kwargs = dict(
                x=lambda context: tf.data.Dataset.from_tensor_slices(sliced).batch(batch_size),
                epochs=steps, steps_per_epoch=1)
        else:
            kwargs = dict(x=x, y=y, sample_weight=sample_weight, batch_size=batch_size,
                          epochs=math.ceil(steps / steps_per_epoch), shuffle=False)
    fit = model.fit
    if path == "loop":
        from keras_distrib.training import train_loop

        fit = train_loop.TrainLoop(model).fit
    history = fit(**kwargs, verbose=0, callbacks=[recorder])
    return {"weights": recorder.weights, "history": dict(history.history)}


def parity_task(strategy, payload_path):
    """In a launched process: train the payload's model under `strategy`."""
    with open(payload_path, "rb") as f:
        payload = pickle.load(f)
    model_fn = task_entry()._resolve(payload["model_fn"])
    arrays = payload["arrays"]
    keras.config.set_floatx(payload.get("floatx", "float32"))
    keras.config.set_dtype_policy(keras.config.floatx())
    if isinstance(arrays, tuple) and isinstance(arrays[0], str):  # a dataset_fn's spec
        arrays = task_entry()._resolve(arrays[0])
    build_from = dataset_of(arrays) if is_dataset_source(arrays) else arrays[0]
    with strategy.scope():
        model = make_model(model_fn, payload["seed"], build_from, payload["initial_weights"])
    return train(model, arrays, batch_size=payload["batch_size"], steps=payload["steps"],
                  path=payload["path"], per_epoch=payload["per_epoch"])


def dataset_steps(dataset):
    """Batches in one pass of `dataset`; a clear error when it is unknown or endless."""
    if not isinstance(dataset, tf.data.Dataset):
        raise ValueError(
            f"`data`: the dataset_fn returned a {type(dataset).__name__}; expected a batched "
            "tf.data.Dataset (the global batches, for one input pipeline)."
        )
    count = int(dataset.cardinality())
    if count < 0:
        count = sum(1 for _ in dataset)  # unknown cardinality (e.g. filter): count once
    if count == 0 or dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            f"`data`: the dataset has {'no' if count == 0 else 'endless'} batches; expected a "
            "finite, batched tf.data.Dataset (use .take(n) on a repeated one)."
        )
    return count
