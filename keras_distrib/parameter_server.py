"""ParameterServerStrategy for Keras 3: a data source and a runner for kd's loop.

Keras 3 dropped parameter-server training. Here the process that calls
`fit` is the coordinator: it owns a `ClusterCoordinator`, gives every worker
its own dataset (repeated, so epochs are counted in steps), and kd's loop
(`keras_distrib.loop`: epochs, callbacks, progress, backup) schedules chunks
of training steps (`keras_distrib.step.Step.scheduled`) on the workers.
Workers update the variables on the parameter servers asynchronously;
keras_distrib makes those updates atomic, so the optimizer's step counter
and the metrics count every step.

Evaluation and prediction run on the coordinator itself, with the same loop
and steps as on one device, reading the variables from the parameter
servers: every example is counted exactly once (even when workers fail) and
predictions come back in input order.
"""

import collections
import contextlib
import weakref

import keras
import tensorflow as tf
from keras import tree

from keras_distrib import _keras_compat
from keras_distrib import loop
from keras_distrib import step as step_lib

__all__ = [
    "WorkerEpochs",
    "WorkerRunner",
    "coordinator_for",
    "evaluate",
    "fit",
    "is_parameter_server",
    "predict",
]

_COORDINATORS = weakref.WeakKeyDictionary()


def is_parameter_server(strategy):
    """Whether `strategy` is a (TF2) ParameterServerStrategy."""
    return isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)


def coordinator_for(strategy):
    """The `ClusterCoordinator` keras_distrib owns for `strategy` (one per strategy)."""
    if strategy not in _COORDINATORS:
        _COORDINATORS[strategy] = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    return _COORDINATORS[strategy]


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
        sample_weight = _class_weight_to_sample_weights(y, class_weight)
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


def _class_weight_to_sample_weights(y, class_weight):
    labels = tf.convert_to_tensor(y)
    if labels.shape.rank is not None and labels.shape.rank > 1 and labels.shape[-1] > 1:
        labels = tf.argmax(labels, axis=-1)
    labels = tf.cast(tf.reshape(labels, [-1]), tf.int64)
    table = tf.constant([class_weight.get(i, 1.0) for i in range(int(tf.reduce_max(labels)) + 1)])
    return tf.gather(table, labels).numpy()


def _build(model, strategy, dataset_fn):
    """Creates model, metric and optimizer variables (on the ps) before scheduling."""
    loop.build_model(model, dataset_fn().element_spec)


class WorkerEpochs:
    """Epochs of `steps_per_epoch` steps over per-worker datasets (a loop source)."""

    def __init__(self, coordinator, dataset_fn, steps_per_epoch, steps_per_call):
        self.iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        self.num_batches = steps_per_epoch
        self.steps_per_call = steps_per_call

    def __iter__(self):
        for begin in range(0, self.num_batches, self.steps_per_call):
            yield begin, min(begin + self.steps_per_call, self.num_batches) - 1, self.iterator

    def catch_stop_iteration(self):
        """A no-op context: per-worker datasets never run out."""
        return contextlib.nullcontext()  # per-worker datasets repeat forever


class WorkerRunner:
    """Schedules chunks of steps on the workers (a loop runner).

    Each chunk returns the global logs read at its end. To keep every worker
    busy, the loop is handed the logs of a chunk scheduled `depth` chunks
    earlier (one per worker): real values, a few chunks behind.
    """

    def __init__(self, model, coordinator, step, depth):
        self.model = model
        self.coordinator = coordinator
        self.function = step.scheduled()
        self.depth = max(1, depth)
        self.in_flight = collections.deque()
        self.latest = {}

    def run(self, iterator, count):
        """Schedules `count` steps on a worker; returns logs a few chunks behind."""
        self.in_flight.append(
            self.coordinator.schedule(self.function, args=(iterator, tf.constant(count)))
        )
        while len(self.in_flight) > self.depth:
            self.latest = _keras_compat.pythonify_logs(self.in_flight.popleft().fetch())
        return dict(self.latest)

    def skip(self, iterator, count):
        """Nothing to skip: repeated per-worker datasets have no epoch position."""
        # Per-worker datasets repeat; resuming continues with the remaining steps.
        return 0

    def epoch_logs(self, logs):
        """Waits for every scheduled step; returns the metrics' global values."""
        self.coordinator.join()
        self.in_flight.clear()
        with self.model.distribute_strategy.scope():
            return _keras_compat.pythonify_logs(step_lib.metric_results(self.model))


def _worker_count(strategy):
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    return max(1, resolver.cluster_spec().num_tasks("worker"))


def fit(model, x=None, y=None, *, steps_per_call=1, batch_size=None, epochs=1, verbose="auto",
        callbacks=None, validation_split=0.0, validation_data=None, shuffle=True,
        class_weight=None, sample_weight=None, initial_epoch=0, steps_per_epoch=None,
        validation_steps=None, validation_batch_size=None, validation_freq=1):
    """`Model.fit` under ParameterServerStrategy (see the module docstring)."""
    strategy = model.distribute_strategy
    _check_steps(steps_per_epoch)
    if validation_split:
        raise ValueError(
            f"`validation_split`={validation_split!r} is not supported under "
            "ParameterServerStrategy (workers read repeated per-worker datasets); pass "
            "`validation_data`."
        )
    model._check_exactness(training=True)
    coordinator = coordinator_for(strategy)
    dataset_fn = _dataset_fn(x, y, sample_weight, batch_size, shuffle, class_weight)
    _build(model, strategy, dataset_fn)
    source = WorkerEpochs(coordinator, dataset_fn, steps_per_epoch, steps_per_call)
    runner = WorkerRunner(
        model, coordinator, step_lib.Step(model, "train", steps=steps_per_call),
        depth=_worker_count(strategy),
    )
    callbacks = loop.callback_list(
        callbacks, model, verbose=verbose, epochs=epochs, steps=steps_per_epoch, history=True
    )
    validate = None
    if validation_data is not None:
        val_x, val_y, val_weight = keras.utils.unpack_x_y_sample_weight(validation_data)

        def validate(epoch):
            if not loop._should_validate(epoch, validation_freq):
                return None
            return evaluate(
                model, val_x, val_y, sample_weight=val_weight, steps=validation_steps,
                batch_size=validation_batch_size or batch_size, callbacks=callbacks,
                return_dict=True,
            )

    return loop.fit_epochs(
        model, source, runner, epochs=epochs, initial_epoch=initial_epoch,
        callbacks=callbacks, validate=validate,
    )


def evaluate(model, x=None, y=None, *, batch_size=None, verbose="auto", sample_weight=None,
             steps=None, callbacks=None, return_dict=False):
    """`Model.evaluate` under ParameterServerStrategy: exact, on the coordinator."""
    return loop.evaluate(
        model, model.make_test_function(), x, y, batch_size=batch_size, verbose=verbose,
        sample_weight=sample_weight, steps_count=steps, callbacks=callbacks,
        return_dict=return_dict, strategy=_keras_compat.default_strategy(),
    )


def predict(model, x, *, batch_size=None, verbose="auto", steps=None, callbacks=None):
    """`Model.predict` under ParameterServerStrategy: every row once, in order."""
    return loop.predict(
        model, model.make_predict_function(), x, batch_size=batch_size, verbose=verbose,
        steps_count=steps, callbacks=callbacks, strategy=_keras_compat.default_strategy(),
    )


