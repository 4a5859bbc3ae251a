"""ParameterServerStrategy for Keras 3: a data source and a runner for kd's loop.

Keras 3 dropped parameter-server training. Here the process that calls
`fit` is the coordinator: it owns a `ClusterCoordinator`, gives every worker
its own dataset (repeated, so epochs are counted in steps), and kd's loop
(`keras_distrib.training.loop`: epochs, callbacks, progress, backup) schedules chunks
of training steps (`keras_distrib.training.step.Step.scheduled`) on the workers.
Workers update the variables on the parameter servers asynchronously;
keras_distrib makes those updates atomic, so the optimizer's step counter
and the metrics count every step.

Evaluation and prediction run on the coordinator itself, with the same loop
and steps as on one device, reading the variables from the parameter
servers: every example is counted exactly once (even when workers fail) and
predictions come back in input order.
"""

import collections
import collections.abc
import contextlib
import weakref

import keras
import tensorflow as tf
from keras import tree

from keras_distrib import _keras_compat
from keras_distrib.training import loop
from keras_distrib.training import logs as logs_lib
from keras_distrib.training import refusals
from keras_distrib.training import step as step_lib
from keras_distrib import validation

__all__ = [
    "ShardRunner",
    "WorkerEpochs",
    "WorkerRunner",
    "coordinator_for",
    "evaluate",
    "fit",
    "predict",
]

_COORDINATORS = weakref.WeakKeyDictionary()


def coordinator_for(strategy):
    """The `ClusterCoordinator` keras_distrib owns for `strategy` (one per strategy)."""
    if strategy not in _COORDINATORS:
        _COORDINATORS[strategy] = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    return _COORDINATORS[strategy]


def _check_shippable(dataset, argument="x"):
    """Refuses a dataset whose graph calls back into this Python process."""
    found = sorted(_keras_compat.PYTHON_OPS & _keras_compat.dataset_ops_used(dataset))
    if found:
        raise ValueError(
            f"`{argument}` is a tf.data.Dataset built with Python code ({', '.join(found)}: "
            "Dataset.from_generator, tf.py_function or tf.numpy_function). Parameter-server "
            "workers run their input pipelines themselves, in other processes, where that "
            "Python code does not exist. Build the dataset from tensors or files "
            "(Dataset.from_tensor_slices, TFRecordDataset), or pass NumPy arrays or a "
            "dataset_fn(input_context) that does."
        )


def _repeated(dataset):
    if dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
        return dataset
    return dataset.repeat()


def _input_context(strategy, index):
    return tf.distribute.InputContext(
        num_input_pipelines=_worker_count(strategy), input_pipeline_id=index,
        num_replicas_in_sync=strategy.num_replicas_in_sync,
    )


class WorkerData:
    """What each worker reads, and how to give every worker its iterator.

    Accepts what TensorFlow's guides and tf-keras accept:

    - a `tf.data.Dataset` instance (shuffle, repeat, map, batch...): shipped
      to every worker as is (its graph is serialized), repeated;
    - a `dataset_fn(input_context)`: called on each worker with that
      worker's own `InputContext` (pipeline id = worker index, pipeline
      count = workers), so it can shard with `dataset.shard(...)`;
    - NumPy arrays or dicts of them: each worker reads all rows, shuffled
      each pass when `shuffle`, batched by `batch_size`.
    """

    def __init__(self, strategy, x, y=None, sample_weight=None, batch_size=None, shuffle=True,
                 class_weight=None, argument="x"):
        self.strategy = strategy
        if isinstance(x, tf.data.Dataset):
            _check_shippable(x, argument)
            self._dataset = _repeated(x)
            self._for_worker = None
            self.element_spec = x.element_spec
            return
        if callable(x):
            def for_worker(index):
                dataset = x(_input_context(strategy, index))
                if not isinstance(dataset, tf.data.Dataset):
                    raise TypeError(
                        f"`{argument}` (a dataset_fn) returned a {type(dataset).__name__}; it "
                        "must return a tf.data.Dataset."
                    )
                return _repeated(dataset)

            self._dataset = None
            self._for_worker = for_worker
            self.element_spec = for_worker(0).element_spec
            return
        _check_arrays(x, argument)
        if batch_size is None:
            batch_size = 32
        if class_weight is not None:
            if sample_weight is not None:
                raise ValueError("Pass `class_weight` or `sample_weight`, not both.")
            sample_weight = _class_weight_to_sample_weights(y, class_weight)
        arrays = tuple(a for a in (x, y, sample_weight) if a is not None)
        rows = len(tree.flatten(x)[0])

        def from_arrays(index):
            dataset = tf.data.Dataset.from_tensor_slices(arrays)
            if shuffle:
                dataset = dataset.shuffle(rows, reshuffle_each_iteration=True)
            return dataset.repeat().batch(batch_size)

        self._dataset = None
        self._for_worker = from_arrays
        self.element_spec = from_arrays(0).element_spec

    def iterator(self, coordinator):
        """A per-worker iterator for `coordinator.schedule`."""
        if self._dataset is not None:
            return iter(coordinator.create_per_worker_dataset(self._dataset))
        return _keras_compat.per_worker_iterator(coordinator, self._for_worker)


def _check_arrays(x, argument):
    if isinstance(x, (keras.utils.PyDataset, collections.abc.Iterator)):
        raise ValueError(
            f"`{argument}` is a {type(x).__name__} (Python code producing batches). "
            "Parameter-server workers build their input pipelines themselves, in other "
            "processes; pass NumPy arrays, a tf.data.Dataset built from tensors or files, "
            "or a dataset_fn(input_context)."
        )


def _check_steps(steps_per_epoch):
    if steps_per_epoch is None:
        raise ValueError(
            "`steps_per_epoch` is required under ParameterServerStrategy: each "
            "worker repeats its dataset and workers run at their own pace, so an "
            "epoch is a number of steps. Pass e.g. steps_per_epoch=len(x) // batch_size."
        )
    if not validation.is_whole(steps_per_epoch, 1):
        raise ValueError(f"`steps_per_epoch`={steps_per_epoch!r} must be a whole number >= 1.")


def _class_weight_to_sample_weights(y, class_weight):
    labels = tf.convert_to_tensor(y)
    if labels.shape.rank is not None and labels.shape.rank > 1 and labels.shape[-1] > 1:
        labels = tf.argmax(labels, axis=-1)
    labels = tf.cast(tf.reshape(labels, [-1]), tf.int64)
    table = tf.constant([class_weight.get(i, 1.0) for i in range(int(tf.reduce_max(labels)) + 1)])
    return tf.gather(table, labels).numpy()





class WorkerEpochs:
    """Epochs of `steps_per_epoch` steps over per-worker datasets (a loop source).

    The datasets repeat, so the data runs on across epochs (`continuous`):
    a resumed run moves past the epochs its backup holds as well.
    """

    continuous = True

    def __init__(self, coordinator, data, steps_per_epoch, steps_per_call):
        self.iterator = data.iterator(coordinator)
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
        self._skip = None

    def run(self, iterator, count):
        """Schedules `count` steps on a worker; returns logs a few chunks behind."""
        self.in_flight.append(
            self.coordinator.schedule(self.function, args=(iterator, tf.constant(count)))
        )
        while len(self.in_flight) > self.depth:
            self.latest = _keras_compat.pythonify_logs(self.in_flight.popleft().fetch())
        return dict(self.latest)

    def skip(self, iterator, count):
        """Moves a single worker's data past `count` batches (resuming a backup).

        With one worker the resumed run then reads exactly the batches the
        interrupted one would have. With several, which worker read which
        batch was never reproducible, so nothing is skipped: each worker's
        stream continues afresh.
        """
        if count <= 0 or _worker_count(self.model.distribute_strategy) != 1:
            return 0
        if self._skip is None:
            @tf.function
            def skip_on_worker(iterator, count):
                for _ in tf.range(count):
                    next(iterator)
                return count

            self._skip = skip_on_worker
        # One worker runs closures in the order they were scheduled.
        self.coordinator.schedule(self._skip, args=(iterator, tf.constant(count)))
        return count

    def wait(self):
        """Returns once every step scheduled on the workers has finished."""
        self.coordinator.join()

    def epoch_logs(self, logs):
        """Waits for every scheduled step; returns the metrics' global values."""
        self.wait()
        self.in_flight.clear()
        with self.model.distribute_strategy.scope():
            return _keras_compat.pythonify_logs(logs_lib.metric_results(self.model))


def _worker_count(strategy):
    return max(1, _keras_compat.parameter_server_workers(strategy))


def fit(model, request, *, steps_per_call=1):
    """`Model.fit` under ParameterServerStrategy, as `request` (an `inputs.FitRequest`) asks.

    See the module docstring.
    """
    strategy = model.distribute_strategy
    _check_steps(request.steps_per_epoch)
    if request.validation_split:
        raise ValueError(
            f"`validation_split`={request.validation_split!r} is not supported under "
            "ParameterServerStrategy (workers read repeated per-worker datasets); pass "
            "`validation_data`."
        )
    refusals.check_exactness(model, training=True)
    coordinator = coordinator_for(strategy)
    data = WorkerData(strategy, request.x, request.y, request.sample_weight, request.batch_size,
                      request.shuffle, request.class_weight)
    loop.build_model(model, data.element_spec)
    source = WorkerEpochs(coordinator, data, request.steps_per_epoch, steps_per_call)
    runner = WorkerRunner(
        model, coordinator, step_lib.Step(model, "train", steps=steps_per_call),
        depth=_worker_count(strategy),
    )
    callbacks = loop.callback_list(
        request.callbacks, model, verbose=request.verbose, epochs=request.epochs,
        steps=request.steps_per_epoch, history=True
    )
    validate = None
    if request.validation_data is not None:
        val_x, val_y, val_weight = keras.utils.unpack_x_y_sample_weight(request.validation_data)

        def validate(epoch):
            if not loop._should_validate(epoch, request.validation_freq):
                return None
            return evaluate(
                model, val_x, val_y, sample_weight=val_weight, steps=request.validation_steps,
                batch_size=request.validation_batch_size or request.batch_size,
                callbacks=callbacks, return_dict=True,
            )

    return loop.fit_epochs(
        model, source, runner, epochs=request.epochs, initial_epoch=request.initial_epoch,
        callbacks=callbacks, validate=validate,
    )


def evaluation_shards(model, shards=None):
    """How many shards `evaluate` splits its data into over the workers.

    `shards` (an argument of evaluate), else the model's
    `pss_evaluation_shards` (a compile option). 0: the coordinator evaluates
    alone. "auto": 4 per worker.
    """
    if shards is None:
        shards = getattr(model, "pss_evaluation_shards", 0) or 0
    if shards == "auto":
        return 4 * _worker_count(model.distribute_strategy)
    if not validation.is_whole(shards, 0):
        raise ValueError(
            f"`pss_evaluation_shards`={shards!r}: expected a whole number >= 0 (0: the "
            "coordinator evaluates alone) or 'auto' (4 shards per worker)."
        )
    return shards


def evaluate(model, x=None, y=None, *, batch_size=None, verbose="auto", sample_weight=None,
             steps=None, callbacks=None, return_dict=False, shards=None):
    """`Model.evaluate` under ParameterServerStrategy: exact either way.

    By default the coordinator evaluates, reading the variables from the
    parameter servers. With `shards` > 0 (or the model compiled with
    `pss_evaluation_shards`), the data is split into that many shards,
    each evaluated by one scheduled closure on a worker from fresh metric
    state; the coordinator adds up the shards' metric states. Every example
    counts exactly once even when a worker fails (a failed shard is redone
    elsewhere, from scratch). Exact for metrics whose state adds up over
    examples: every built-in Keras metric (means, sums, confusion counts,
    AUC).
    """
    shards = evaluation_shards(model, shards)
    if shards:
        return _evaluate_sharded(
            model, x, y, sample_weight=sample_weight, batch_size=batch_size, steps=steps,
            shards=shards, callbacks=callbacks, verbose=verbose, return_dict=return_dict,
        )
    return loop.evaluate(
        model, model.make_test_function(), x, y, batch_size=batch_size, verbose=verbose,
        sample_weight=sample_weight, batches=steps, callbacks=callbacks,
        return_dict=return_dict, strategy=_keras_compat.default_strategy(),
    )


def _shard_datasets(strategy, x, y, sample_weight, batch_size, steps, shards):
    """`shards` datasets that together hold every evaluation batch once."""
    if isinstance(x, tf.data.Dataset):
        _check_shippable(x)
        dataset = x.take(steps) if steps else x
        return [dataset.shard(shards, i) for i in range(shards)]
    if callable(x):
        contexts = [tf.distribute.InputContext(shards, i, strategy.num_replicas_in_sync) for i in range(shards)]
        datasets = [x(context) for context in contexts]
        for dataset in datasets:
            _check_shippable(dataset)
        return [d.take(steps) if steps else d for d in datasets]
    _check_arrays(x, "x")
    arrays = tuple(a for a in (x, y, sample_weight) if a is not None)
    dataset = tf.data.Dataset.from_tensor_slices(arrays).batch(batch_size or 32)
    if steps:
        dataset = dataset.take(steps)
    return [dataset.shard(shards, i) for i in range(shards)]


class _Shards:
    """Each evaluation shard as one step of an evaluation pass (a loop source)."""

    def __init__(self, iterators):
        self.iterators = iterators
        self.num_batches = len(iterators)

    def __iter__(self):
        return ((index, index, iterator) for index, iterator in enumerate(self.iterators))

    def catch_stop_iteration(self):
        return contextlib.nullcontext()


class ShardRunner:
    """Evaluates whole shards on the workers (a loop runner).

    Each `run` schedules one shard, evaluated on a worker from fresh metric
    state; `epoch_logs` waits for them all and sets the model's metric
    variables to the sum of the shards' states.
    """

    def __init__(self, model, coordinator):
        self.model = model
        self.coordinator = coordinator
        self.function = step_lib.shard_evaluator(model)
        self.states = []

    def run(self, iterator, count):
        """Schedules the shard `iterator` reads; its logs come with the pass's end."""
        self.states.append(self.coordinator.schedule(self.function, args=(iterator,)))
        return {}

    def skip(self, iterator, count):
        """Evaluation never resumes part-way: nothing to skip."""
        return 0

    def wait(self):
        """Returns once every scheduled shard has been evaluated."""
        self.coordinator.join()

    def epoch_logs(self, logs):
        """The metrics' global values: the sum of every shard's metric state."""
        self.wait()
        totals = [sum(values) for values in zip(*(state.fetch() for state in self.states))]
        with self.model.distribute_strategy.scope():
            for variable, total in zip(self.model.metrics_variables, totals):
                variable.assign(total)
            return logs_lib.metric_results(self.model)


def _evaluate_sharded(model, x, y, *, sample_weight, batch_size, steps, shards, callbacks,
                      verbose, return_dict):
    strategy = model.distribute_strategy
    coordinator = coordinator_for(strategy)
    datasets = _shard_datasets(strategy, x, y, sample_weight, batch_size, steps, shards)
    loop.build_model(model, datasets[0].element_spec)
    iterators = [iter(coordinator.create_per_worker_dataset(d)) for d in datasets]
    callbacks = loop.callback_list(callbacks, model, verbose=verbose, epochs=1, steps=shards)
    return loop.evaluate_pass(model, _Shards(iterators), ShardRunner(model, coordinator),
                              callbacks=callbacks, return_dict=return_dict)


def predict(model, x, *, batch_size=None, verbose="auto", steps=None, callbacks=None):
    """`Model.predict` under ParameterServerStrategy: every row once, in order."""
    return loop.predict(
        model, model.make_predict_function(), x, batch_size=batch_size, verbose=verbose,
        batches=steps, callbacks=callbacks, strategy=_keras_compat.default_strategy(),
    )


