"""`kd.TrainLoop`: a custom training loop that matches `Model.fit` exactly.

The loop runs the model's own `train_step`/`test_step` through the compiled
functions of `keras_distrib.execution`, the very ones `kd.Model.fit` uses, so
the two paths cannot drift. What it adds over `fit` is access: a compiled
`train_step(iterator)` for hand-written loops, `steps_per_loop` steps per
call, and an explicit, readable epoch loop.
"""

import keras
import numpy as np
import tensorflow as tf
from keras.src import callbacks as callbacks_module
from keras.src import tree
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.utils.python_utils import pythonify_logs

from keras_distrib import _keras_compat
from keras_distrib import cluster
from keras_distrib import execution
from keras_distrib import parameter_server


def _check_steps_per_loop(steps_per_loop):
    if isinstance(steps_per_loop, bool) or not isinstance(steps_per_loop, int) or steps_per_loop < 1:
        raise ValueError(
            f"`steps_per_loop`={steps_per_loop!r} must be a whole number >= 1 "
            "(the number of steps run inside one compiled call)."
        )


def _first_replica_spec(spec):
    """A TensorSpec per input from a (possibly per-replica) element spec."""
    values = getattr(spec, "_value_specs", None)
    return values[0] if values else spec


class TrainLoop:
    """Runs a compiled model's steps under a strategy, as `fit` does.

    Args:
        model: A compiled `keras.Model` (a `kd.Model` for exact global-batch
            arithmetic), created in `strategy.scope()`.
        strategy: The strategy; the model's when `None`.
        steps_per_loop: Steps run inside one compiled function. Larger values
            remove per-step Python dispatch, the main cost on small models.

    Raises:
        ValueError: the model is not compiled, was created (or its optimizer
            was) outside `strategy.scope()`, or `steps_per_loop` < 1.

    Example:
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
        optimizer_strategy = getattr(model.optimizer, "_distribution_strategy", strategy)
        if optimizer_strategy is not strategy:
            raise ValueError(
                f"The optimizer was created under {type(optimizer_strategy).__name__}, "
                f"not {type(strategy).__name__}. Create the optimizer inside "
                "`with strategy.scope():` (e.g. pass it to compile there)."
            )
        self.model = model
        self.strategy = strategy
        self.steps_per_loop = steps_per_loop
        self._functions = {}

    # Compiled steps for hand-written loops.

    def distribute(self, dataset):
        """`strategy.experimental_distribute_dataset(dataset)`."""
        return self.strategy.experimental_distribute_dataset(dataset)

    def build(self, data_batch):
        """Creates the model, metric and optimizer variables in the scope.

        Variables created inside a compiled step fail under several replicas
        (e.g. Adam's slots), so this runs before the first step. `data_batch`
        may be a batch, or an element spec.
        """
        data_batch = tree.map_structure(_first_replica_spec, data_batch)
        with self.strategy.scope():
            self.model._symbolic_build(data_batch=data_batch)
            if self.model.optimizer is not None and not self.model.optimizer.built:
                self.model.optimizer.build(self.model.trainable_variables)

    def _check_iterator(self, iterator):
        distributed = isinstance(iterator, tf.distribute.DistributedIterator)
        if not distributed and self.strategy.num_replicas_in_sync > 1:
            raise ValueError(
                f"`iterator` is a {type(iterator).__name__}, not a distributed "
                f"iterator, but the strategy has {self.strategy.num_replicas_in_sync} "
                "replicas. Use `iter(loop.distribute(dataset))`."
            )
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            if not self.model.optimizer.built or not self.model.built:
                self.build(iterator.element_spec)

    def _compiled(self, kind):
        """The compiled distributed function for `kind` ("train" or "test")."""
        functions = self._functions
        if kind not in functions:
            step = self.model.train_step if kind == "train" else self.model.test_step
            functions[kind] = execution.make_step_function(
                self.model, step, steps_per_execution=self.steps_per_loop
            )
        return functions[kind]

    def train_step(self, iterator):
        """Runs up to `steps_per_loop` training steps; returns global logs."""
        self._check_iterator(iterator)
        return self._compiled("train")(iterator)

    def test_step(self, iterator):
        """Runs up to `steps_per_loop` evaluation steps; returns global logs."""
        self._check_iterator(iterator)
        return self._compiled("test")(iterator)

    def train_epoch(self, distributed_dataset):
        """Trains on a whole distributed dataset inside one `tf.function`."""
        if not isinstance(distributed_dataset, tf.distribute.DistributedDataset):
            if self.strategy.num_replicas_in_sync > 1:
                raise ValueError(
                    "`distributed_dataset` is not distributed. Use loop.distribute(dataset)."
                )
        self.build(distributed_dataset.element_spec)
        if "epoch" not in self._functions:
            self._functions["epoch"] = execution.make_epoch_function(self.model, self.model.train_step)
        function = self._functions["epoch"]
        return function(distributed_dataset)

    # Model.fit-like entry points.

    def _epoch_iterator(self, **kwargs):
        return tf_trainer.TFEpochIterator(
            distribute_strategy=self.strategy, steps_per_execution=self.steps_per_loop, **kwargs
        )

    def _prepare(self, epoch_iterator):
        # From the element spec: opening an iterator would consume the data
        # (and reorder a reshuffling dataset).
        self.build(_keras_compat.dataset_element_spec(epoch_iterator))

    def fit(self, x=None, y=None, *, batch_size=None, epochs=1, verbose="auto",
            callbacks=None, validation_data=None, shuffle=True, class_weight=None,
            sample_weight=None, initial_epoch=0, steps_per_epoch=None,
            validation_steps=None, validation_batch_size=None, validation_freq=1,
            backup_dir=None, backup_freq="epoch"):
        """Trains like `Model.fit` and returns its `keras.callbacks.History`.

        With `backup_dir`, a `kd.callbacks.BackupAndRestore(backup_dir,
        save_freq=backup_freq)` is added: a restarted run resumes at the
        saved epoch and step.
        """
        model = self.model
        verbose = cluster.chief_verbose(verbose)
        if parameter_server.is_parameter_server(self.strategy):
            # Steps are scheduled on the workers by the coordinator.
            return parameter_server.fit(
                model, x, y, batch_size=batch_size, epochs=epochs, verbose=verbose,
                callbacks=callbacks, validation_data=validation_data, shuffle=shuffle,
                class_weight=class_weight, sample_weight=sample_weight,
                initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch,
                validation_steps=validation_steps, validation_batch_size=validation_batch_size,
                validation_freq=validation_freq, steps_per_execution=self.steps_per_loop,
                evaluate=lambda **kw: parameter_server.evaluate(model, return_dict=True, **kw),
            )
        if backup_dir is not None:
            from keras_distrib.callbacks import BackupAndRestore

            callbacks = list(callbacks or []) + [BackupAndRestore(backup_dir, save_freq=backup_freq)]
        epoch_iterator = self._epoch_iterator(
            x=x, y=y, sample_weight=sample_weight, batch_size=batch_size,
            steps_per_epoch=steps_per_epoch, shuffle=shuffle, class_weight=class_weight,
        )
        self._prepare(epoch_iterator)
        epoch_iterator.reset()
        if not isinstance(callbacks, callbacks_module.CallbackList):
            callbacks = callbacks_module.CallbackList(
                callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose,
                epochs=epochs, steps=epoch_iterator.num_batches, model=model,
            )
        model.stop_training = False
        model._initial_epoch = None
        callbacks.on_train_begin()
        # A BackupAndRestore callback may have moved the start (as in fit).
        initial_epoch = model._initial_epoch or initial_epoch
        epoch_logs, logs = None, {}
        for epoch in range(initial_epoch, epochs):
            model.reset_metrics()
            callbacks.on_epoch_begin(epoch)
            with epoch_iterator.catch_stop_iteration():
                for begin_step, end_step, iterator in epoch_iterator:
                    callbacks.on_train_batch_begin(begin_step)
                    logs = self.train_step(iterator)
                    callbacks.on_train_batch_end(end_step, logs)
                    if model.stop_training:
                        break
            epoch_logs = dict(model._get_metrics_result_or_logs(logs))
            if validation_data is not None and (epoch + 1) % validation_freq == 0:
                val_x, val_y, val_weight = keras.utils.unpack_x_y_sample_weight(validation_data)
                val_logs = self.evaluate(
                    val_x, val_y, sample_weight=val_weight, steps=validation_steps,
                    batch_size=validation_batch_size or batch_size, callbacks=callbacks,
                )
                epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
            callbacks.on_epoch_end(epoch, epoch_logs)
            if model.stop_training:
                break
        if epochs > 0 and model.optimizer is not None:
            model.optimizer.finalize_variable_values(model.trainable_weights)
        callbacks.on_train_end(logs=epoch_logs)
        return model.history

    def evaluate(self, x=None, y=None, *, batch_size=None, verbose="auto",
                 sample_weight=None, steps=None, callbacks=None):
        """Evaluates like `Model.evaluate(return_dict=True)`."""
        model = self.model
        verbose = cluster.chief_verbose(verbose)
        if parameter_server.is_parameter_server(self.strategy):
            return parameter_server.evaluate(
                model, x, y, batch_size=batch_size, verbose=verbose,
                sample_weight=sample_weight, steps=steps, callbacks=callbacks, return_dict=True,
            )
        epoch_iterator = self._epoch_iterator(
            x=x, y=y, sample_weight=sample_weight, batch_size=batch_size,
            steps_per_epoch=steps, shuffle=False,
        )
        self._prepare(epoch_iterator)
        epoch_iterator.reset()
        if not isinstance(callbacks, callbacks_module.CallbackList):
            callbacks = callbacks_module.CallbackList(
                callbacks, add_progbar=verbose != 0, verbose=verbose, epochs=1,
                steps=epoch_iterator.num_batches, model=model,
            )
        model.stop_evaluating = False
        callbacks.on_test_begin()
        model.reset_metrics()
        logs = {}
        with epoch_iterator.catch_stop_iteration():
            for begin_step, end_step, iterator in epoch_iterator:
                callbacks.on_test_batch_begin(begin_step)
                logs = self.test_step(iterator)
                callbacks.on_test_batch_end(end_step, logs)
                if model.stop_evaluating:
                    break
        logs = pythonify_logs(model._get_metrics_result_or_logs(logs))
        callbacks.on_test_end(logs)
        return logs

    def predict(self, x, *, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """Predicts like `Model.predict`: every row once, in input order."""
        outputs = self.model.predict(
            x, batch_size=batch_size, verbose=verbose, steps=steps, callbacks=callbacks
        )
        return tree.map_structure(np.asarray, outputs)
