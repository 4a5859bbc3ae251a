"""`kd.TrainLoop`: a kd model's compiled steps, for `fit`-like calls and hand-written loops.

It sits above the loop engine (`keras_distrib.training.loop`), the front door
(`keras_distrib.training.front`) and the models: it runs the same compiled `Step`s
and the same outer loop as `Model.fit`, so the two cannot drift.
"""

import keras
import tensorflow as tf

from keras_distrib import _keras_compat
from keras_distrib.training import callbacks as callbacks_lib
from keras_distrib.training import front
from keras_distrib.training import hooks
from keras_distrib.training import inputs
from keras_distrib.training import loop
from keras_distrib.training import models
from keras_distrib.training import refusals
from keras_distrib.training import logs as logs_lib
from keras_distrib.training import step as step_lib
from keras_distrib import validation

__all__ = [
    "TrainLoop",
]


def _check_steps_per_loop(steps_per_loop):
    if not validation.is_whole(steps_per_loop, 1):
        raise ValueError(
            f"`steps_per_loop`={steps_per_loop!r} must be a whole number >= 1 "
            "(the number of steps run inside one compiled call)."
        )


class TrainLoop:
    """Runs a compiled kd model's steps under a strategy, as `fit` does.

    `fit`, `evaluate` and `predict` run the same loop and compiled steps as
    the model's own; what the loop adds is access: `train_step(iterator)`
    for hand-written loops, `steps_per_loop` steps per compiled call, and
    `train_epoch` (a whole epoch in one compiled call).

    Args:
        model: A compiled `kd.Model` (or a model with `kd.DistributedModelMixin`),
            created in `strategy.scope()`.
        strategy: The strategy; the model's when `None`.
        steps_per_loop: Steps run inside one compiled function. Larger values
            remove per-step Python dispatch, the main cost on small models.

    Raises:
        ValueError: the model is not a kd model, not compiled, was created
            (or its optimizer was) outside `strategy.scope()`, or
            `steps_per_loop` < 1.

    Examples:
        >>> import keras, numpy as np, keras_distrib as kd
        >>> inputs = keras.Input((2,))
        >>> model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> loop = kd.TrainLoop(model, steps_per_loop=4)
        >>> history = loop.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=4, verbose=0)
        >>> len(history.history["loss"])
        1
    """

    def __init__(self, model, *, strategy=None, steps_per_loop=1):
        if not isinstance(model, keras.Model):
            raise ValueError(f"`model` must be a keras.Model, got {type(model).__name__}.")
        if not isinstance(model, models.DistributedModelMixin):
            raise ValueError(
                f"`model` is a plain {type(model).__name__}, not a kd model: its steps divide "
                "each replica's loss by the replica's own rows, so an uneven last batch gives "
                "wrong gradients. Build it as kd.Model(inputs, outputs) or kd.Sequential, or "
                "subclass kd.Model / put kd.DistributedModelMixin first in your model's bases."
            )
        if not getattr(model, "compiled", False):
            raise ValueError(
                "`model` is not compiled. Call `model.compile(optimizer=..., loss=...)` "
                "inside the strategy scope before creating the TrainLoop."
            )
        _check_steps_per_loop(steps_per_loop)
        strategy = strategy or model.distribute_strategy
        model_strategy = model.distribute_strategy
        if model_strategy is not strategy:
            raise ValueError(
                f"`model` was created under {type(model_strategy).__name__}, not the "
                f"given {type(strategy).__name__}. Create and compile the model inside "
                "`with strategy.scope():`."
            )
        optimizer_strategy = _keras_compat.optimizer_strategy(model.optimizer, strategy)
        if optimizer_strategy is not strategy:
            raise ValueError(
                f"The optimizer was created under {type(optimizer_strategy).__name__}, "
                f"not {type(strategy).__name__}. Create the optimizer inside "
                "`with strategy.scope():` (e.g. pass it to compile there)."
            )
        self.model = model
        self.strategy = strategy
        self.steps_per_loop = steps_per_loop
        self._steps = {}

    def _step(self, kind):
        """The compiled `Step` of `kind`, `steps_per_loop` steps per call."""
        if kind not in self._steps:
            refusals.check_exactness(self.model, training=kind == "train")
            # As the model's own steps: a custom step's metrics, loss objects
            # and trackers give one device's logs.
            hooks.install_step_hooks(self.model, kd_compute_loss=models.DistributedModelMixin.compute_loss)
            self._steps[kind] = step_lib.Step(self.model, kind, steps=self.steps_per_loop)
        return self._steps[kind]

    # Compiled steps for hand-written loops.

    def distribute(self, dataset):
        """`strategy.experimental_distribute_dataset(dataset)`, Python-fed batches copied first.

        A `Dataset.from_generator` (or `py_function`) pipeline gets a copy of
        each batch, so training cannot write into the generator's arrays.

        Args:
            dataset: A batched `tf.data.Dataset` (global batches).

        Returns:
            A `tf.distribute.DistributedDataset` for `train_step`,
            `test_step` and `train_epoch`.
        """
        return self.strategy.experimental_distribute_dataset(loop.owned_batches(dataset))

    def build(self, data_batch):
        """Creates the model, metric and optimizer variables in the scope.

        Variables created inside a compiled step fail under several replicas
        (e.g. Adam's slots), so this runs before the first step.

        Args:
            data_batch: A batch, or a dataset's element spec.
        """
        loop.build_model(self.model, data_batch)

    def _check_iterator(self, iterator):
        distributed = isinstance(iterator, tf.distribute.DistributedIterator)
        if not distributed and self.strategy.num_replicas_in_sync > 1:
            raise ValueError(
                f"`iterator` is a {type(iterator).__name__}, not a distributed "
                f"iterator, but the strategy has {self.strategy.num_replicas_in_sync} "
                "replicas. Use `iter(loop.distribute(dataset))`."
            )
        if not isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            raise ValueError(
                f"`iterator` is a {type(iterator).__name__}; expected an iterator over a "
                "(distributed) tf.data dataset: `iter(loop.distribute(dataset))`."
            )
        if not self.model.optimizer.built or not self.model.built:
            self.build(iterator.element_spec)

    def train_step(self, iterator):
        """Runs up to `steps_per_loop` training steps in one compiled call; returns global logs.

        For hand-written loops: create the iterator in Python
        (`iter(loop.distribute(dataset))`) and pass it in, once per call.

        Args:
            iterator: An iterator over a distributed dataset.

        Returns:
            A dict of the global logs after the last step (loss, metrics).
        """
        self._check_iterator(iterator)
        return self._step("train")(iterator)

    def test_step(self, iterator):
        """Runs up to `steps_per_loop` evaluation steps in one compiled call; returns global logs.

        Args:
            iterator: An iterator over a distributed dataset.

        Returns:
            A dict of the global logs (loss, metrics).
        """
        self._check_iterator(iterator)
        return self._step("test")(iterator)

    def train_epoch(self, distributed_dataset):
        """Trains on a whole distributed dataset in one compiled call; returns global logs.

        Args:
            distributed_dataset: A `tf.distribute.DistributedDataset`
                (`loop.distribute(dataset)`).

        Returns:
            A dict of the global logs at the end of the epoch.
        """
        if not isinstance(distributed_dataset, tf.distribute.DistributedDataset):
            if self.strategy.num_replicas_in_sync > 1:
                raise ValueError(
                    "`distributed_dataset` is not distributed. Use loop.distribute(dataset)."
                )
        self.build(distributed_dataset.element_spec)
        try:
            return self._step("train")(iter(distributed_dataset), count=2**31 - 1)
        except StopIteration:
            with self.strategy.scope():
                return logs_lib.metric_results(self.model)

    # Model.fit-like entry points.

    def fit(self, x=None, y=None, *, batch_size=None, epochs=1, verbose="auto",
            callbacks=None, validation_split=0.0, validation_data=None, shuffle=True,
            class_weight=None, sample_weight=None, initial_epoch=0, steps_per_epoch=None,
            validation_steps=None, validation_batch_size=None, validation_freq=1,
            backup_dir=None, backup_freq="epoch", declared_changes=(), adopt_checkpoint=None):
        """Trains like `Model.fit` and returns its `keras.callbacks.History`.

        The same front door as `Model.fit`: Keras's `fit` arguments (keyword
        only after `x` and `y`), the same checks and errors, the same loop
        and compiled steps, `steps_per_loop` steps per call.

        Args:
            x: As `keras.Model.fit`.
            y: As `keras.Model.fit`.
            batch_size: As `keras.Model.fit`.
            epochs: As `keras.Model.fit`.
            verbose: As `keras.Model.fit` (progress bars on the chief only).
            callbacks: As `keras.Model.fit`.
            validation_split: As `keras.Model.fit`.
            validation_data: As `keras.Model.fit`.
            shuffle: As `keras.Model.fit`.
            class_weight: As `keras.Model.fit`.
            sample_weight: As `keras.Model.fit`.
            initial_epoch: As `keras.Model.fit`.
            steps_per_epoch: As `keras.Model.fit`.
            validation_steps: As `keras.Model.fit`.
            validation_batch_size: As `keras.Model.fit`.
            validation_freq: As `keras.Model.fit`.
            backup_dir: Resume an interrupted run exactly: adds
                `kd.callbacks.BackupAndRestore(backup_dir,
                save_freq=backup_freq, declared_changes=declared_changes)`.
            backup_freq: `"epoch"` or a number of steps between backups.
            declared_changes: The settings this run changed on purpose
                since the backup was written (e.g.
                `["optimizer.learning_rate"]`), accepted at the resume and
                recorded in the run record (see `BackupAndRestore`).
            adopt_checkpoint: The name (`"ckpt-7"`) of a backup in
                `backup_dir` that another run wrote, to resume from it on
                purpose (see `BackupAndRestore`).

        Returns:
            A `keras.callbacks.History`.
        """
        for name, value in (("declared_changes", declared_changes), ("adopt_checkpoint", adopt_checkpoint)):
            if value and backup_dir is None:
                raise ValueError(f"`{name}`={value!r} without `backup_dir`: it describes a resume "
                                 "from a backup; give `backup_dir` too, or drop it")
        if backup_dir is not None:
            if callbacks is None or isinstance(callbacks, (list, tuple)):
                callbacks = list(callbacks or []) + [callbacks_lib.BackupAndRestore(
                    backup_dir, save_freq=backup_freq, declared_changes=declared_changes,
                    adopt_checkpoint=adopt_checkpoint)]
        return front.fit(self.model, self._step, inputs.FitRequest(
            x=x, y=y, batch_size=batch_size, epochs=epochs, verbose=verbose, callbacks=callbacks,
            validation_split=validation_split, validation_data=validation_data, shuffle=shuffle,
            class_weight=class_weight, sample_weight=sample_weight, initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
            validation_batch_size=validation_batch_size, validation_freq=validation_freq,
        ))

    def evaluate(self, x=None, y=None, *, batch_size=None, verbose="auto",
                 sample_weight=None, steps=None, callbacks=None, shards=None):
        """Evaluates like `Model.evaluate(return_dict=True)` (the same front door).

        Args:
            x: As `keras.Model.evaluate`.
            y: As `keras.Model.evaluate`.
            batch_size: As `keras.Model.evaluate`.
            verbose: As `keras.Model.evaluate`.
            sample_weight: As `keras.Model.evaluate`.
            steps: As `keras.Model.evaluate`.
            callbacks: As `keras.Model.evaluate`.
            shards: Parameter-server training only: evaluate on the workers
                in this many shards (as `compile(pss_evaluation_shards=...)`).

        Returns:
            A dict of the global logs.
        """
        return front.evaluate(
            self.model, self._step, x, y, batch_size=batch_size, verbose=verbose,
            sample_weight=sample_weight, steps=steps, callbacks=callbacks, return_dict=True,
            shards=shards,
        )

    def predict(self, x, *, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """Predicts like `Model.predict`: every row once, in input order (the same front door).

        Args:
            x: As `keras.Model.predict`.
            batch_size: As `keras.Model.predict`.
            verbose: As `keras.Model.predict`.
            steps: As `keras.Model.predict`.
            callbacks: As `keras.Model.predict`.

        Returns:
            The predictions, as `keras.Model.predict` returns them.
        """
        return front.predict(self.model, self._step, x, batch_size=batch_size, verbose=verbose,
                             steps=steps, callbacks=callbacks)
