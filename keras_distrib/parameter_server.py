"""ParameterServerStrategy for Keras 3: `fit`, `evaluate`, `predict`, `TrainLoop`.

Keras 3 dropped parameter-server training. Here the process that calls
`fit` is the coordinator: it owns a `ClusterCoordinator`, gives every worker
its own dataset (repeated, so epochs are counted in steps), schedules
`steps_per_execution` training steps per remote call, and runs the callbacks
locally. Workers update the variables on the parameter servers
asynchronously; keras_distrib makes those updates atomic, so the optimizer's
step counter and the metrics count every step.

Evaluation and prediction run on the coordinator itself, reading the
variables from the parameter servers: every example is counted exactly once
(even when workers fail) and predictions come back in input order.
"""

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import distribute_lib
from keras.src import callbacks as callbacks_module
from keras.src import tree
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.trainers.data_adapters import data_adapter_utils
from keras.src.utils.python_utils import pythonify_logs

from keras_distrib import _keras_compat
from keras_distrib import execution


def is_parameter_server(strategy):
    return isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)


def coordinator_for(strategy):
    """The `ClusterCoordinator` keras_distrib owns for `strategy` (one per strategy)."""
    coordinator = getattr(strategy, "_kd_coordinator", None)
    if coordinator is None:
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        strategy._kd_coordinator = coordinator
    return coordinator


def _dataset_fn(x, y, sample_weight, batch_size, shuffle, class_weight):
    """A per-worker dataset function (no arguments) that repeats forever.

    A user `dataset_fn(input_context)` gets a default context: each worker
    reads (and shuffles) the whole data, as in TensorFlow's guide.
    """
    if callable(x) and not isinstance(x, tf.data.Dataset):
        def from_fn():
            dataset = x(tf.distribute.InputContext())
            if not isinstance(dataset, tf.data.Dataset):
                raise TypeError(
                    f"`dataset_fn` returned a {type(dataset).__name__}, not a tf.data.Dataset."
                )
            return dataset.repeat()

        return from_fn
    if isinstance(x, tf.data.Dataset):
        return lambda: x.repeat()
    if batch_size is None:
        batch_size = 32
    if class_weight is not None:
        if sample_weight is not None:
            raise ValueError("Pass `class_weight` or `sample_weight`, not both.")
        sample_weight = data_adapter_utils.class_weight_to_sample_weights(
            tf.convert_to_tensor(y), class_weight
        ).numpy()
    arrays = tuple(a for a in (x, y, sample_weight) if a is not None)
    rows = len(tree.flatten(x)[0])

    def from_arrays():
        dataset = tf.data.Dataset.from_tensor_slices(arrays)
        if shuffle:
            dataset = dataset.shuffle(rows, reshuffle_each_iteration=True)
        return dataset.repeat().batch(batch_size)

    return from_arrays


def _check_steps(steps_per_epoch):
    if steps_per_epoch is None:
        raise ValueError(
            "`steps_per_epoch` is required under ParameterServerStrategy: each "
            "worker repeats its dataset and workers run at their own pace, so an "
            "epoch is a number of steps. Pass e.g. steps_per_epoch=len(x) // batch_size."
        )
    if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) or steps_per_epoch < 1:
        raise ValueError(f"`steps_per_epoch`={steps_per_epoch!r} must be a whole number >= 1.")


def _build(model, strategy, dataset_fn):
    """Creates model, metric and optimizer variables (on the ps) before scheduling."""
    sample = dataset_fn().element_spec
    with strategy.scope():
        if model.built and model.optimizer is not None and not model.optimizer.built:
            # Per shard when a partitioner split the weights (slots on each shard's ps).
            model.optimizer.build(_keras_compat.optimizer_variables(model))
        model._symbolic_build(data_batch=sample)


def fit(model, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
        validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
        sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
        validation_batch_size=None, validation_freq=1, *, steps_per_execution=None,
        evaluate=None):
    """`Model.fit` under ParameterServerStrategy (see the module docstring)."""
    strategy = model.distribute_strategy
    _check_steps(steps_per_epoch)
    if validation_split:
        raise ValueError(
            "`validation_split` is not supported under ParameterServerStrategy; "
            "pass `validation_data`."
        )
    coordinator = coordinator_for(strategy)
    dataset_fn = _dataset_fn(x, y, sample_weight, batch_size, shuffle, class_weight)
    _build(model, strategy, dataset_fn)
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    train_steps = execution.make_scheduled_function(model, model.train_step)
    per_call = int(steps_per_execution or model.steps_per_execution or 1)
    if not isinstance(callbacks, callbacks_module.CallbackList):
        callbacks = callbacks_module.CallbackList(
            callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose,
            epochs=epochs, steps=steps_per_epoch, model=model,
        )
    evaluate = evaluate or (lambda **kwargs: model.evaluate(return_dict=True, **kwargs))
    model.stop_training = False
    model._initial_epoch = None
    callbacks.on_train_begin()
    initial_epoch = model._initial_epoch or initial_epoch
    epoch_logs = None
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        callbacks.on_epoch_begin(epoch)
        for begin in range(0, steps_per_epoch, per_call):
            count = min(per_call, steps_per_epoch - begin)
            callbacks.on_train_batch_begin(begin)
            coordinator.schedule(train_steps, args=(iterator, tf.constant(count)))
            callbacks.on_train_batch_end(begin + count - 1, {})
            if model.stop_training:
                break
        coordinator.join()
        with strategy.scope():
            epoch_logs = pythonify_logs(execution.metric_results(model))
        if validation_data is not None and (epoch + 1) % validation_freq == 0:
            val_x, val_y, val_weight = data_adapter_utils.unpack_x_y_sample_weight(validation_data)
            val_logs = evaluate(
                x=val_x, y=val_y, sample_weight=val_weight, steps=validation_steps,
                batch_size=validation_batch_size or batch_size, verbose=0,
            )
            epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
        callbacks.on_epoch_end(epoch, epoch_logs)
        if model.stop_training:
            break
    callbacks.on_train_end(logs=epoch_logs)
    return model.history


def _local_batches(x, y, sample_weight, batch_size, steps):
    """Batches read on the coordinator itself, not distributed to workers."""
    return tf_trainer.TFEpochIterator(
        x=x, y=y, sample_weight=sample_weight, batch_size=batch_size,
        steps_per_epoch=steps, shuffle=False,
        distribute_strategy=distribute_lib._get_default_strategy(),
    )


def _one_pass_callbacks(callbacks, verbose, epoch_iterator, model):
    if isinstance(callbacks, callbacks_module.CallbackList):
        return callbacks
    return callbacks_module.CallbackList(
        callbacks, add_progbar=verbose != 0, verbose=verbose, epochs=1,
        steps=epoch_iterator.num_batches, model=model,
    )


def evaluate(model, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
             steps=None, callbacks=None, return_dict=False, **kwargs):
    """`Model.evaluate` under ParameterServerStrategy: exact, on the coordinator."""
    kwargs.pop("_use_cached_eval_dataset", None)
    strategy = model.distribute_strategy
    epoch_iterator = _local_batches(x, y, sample_weight, batch_size, steps)
    test_step = execution.make_batch_function(model, model.test_step)
    callbacks = _one_pass_callbacks(callbacks, verbose, epoch_iterator, model)
    callbacks.on_test_begin()
    with strategy.scope():
        model.reset_metrics()
        with epoch_iterator.catch_stop_iteration():
            for begin, end, iterator in epoch_iterator:
                callbacks.on_test_batch_begin(begin)
                test_step(next(iterator))
                callbacks.on_test_batch_end(end, {})
        logs = pythonify_logs(execution.metric_results(model))
    callbacks.on_test_end(logs)
    if return_dict:
        return logs
    return model._flatten_metrics_in_order(logs)


def predict(model, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
    """`Model.predict` under ParameterServerStrategy: every row once, in order."""
    strategy = model.distribute_strategy
    epoch_iterator = _local_batches(x, None, None, batch_size, steps)
    predict_step = execution.make_batch_function(model, model.predict_step)
    callbacks = _one_pass_callbacks(callbacks, verbose, epoch_iterator, model)
    outputs = []
    callbacks.on_predict_begin()
    with strategy.scope():
        with epoch_iterator.catch_stop_iteration():
            for begin, end, iterator in epoch_iterator:
                callbacks.on_predict_batch_begin(begin)
                batch_outputs = predict_step(next(iterator))
                outputs.append(tree.map_structure(np.asarray, batch_outputs))
                callbacks.on_predict_batch_end(end, {"outputs": batch_outputs})
    callbacks.on_predict_end()
    return tree.map_structure(lambda *parts: np.concatenate(parts, axis=0), *outputs)
