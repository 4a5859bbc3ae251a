"""The training loop: epochs, callbacks, progress, validation, backup and resume.

`kd.Model.fit`/`evaluate`/`predict`, `kd.TrainLoop` and parameter-server
training all run the loops below. What differs is where batches come from
(a *source*: Keras's epoch iterator over local or distributed data, or
per-worker datasets under a parameter server) and how chunks of steps run
(a *runner*: a compiled `Step` in this process, or the same step scheduled
on the workers).

A source iterates `(begin, end, iterator)` chunks of an epoch, has
`num_batches` and `catch_stop_iteration()` (Keras's `EpochIterator`
protocol). A runner has `run(iterator, count) -> logs`,
`skip(iterator, count)`, `epoch_logs(logs) -> dict` and `wait()` (returns
once every step it started has finished). A callback with a
`set_runner(runner)` method gets the runner before training begins (e.g.
a backup waits for the steps in flight before it saves).

Resuming mid-epoch is explicit: a callback that restores a backup exposes
`restored_position`, a `DataPosition`; the loop starts at that epoch and
moves the data past the batches the backup already holds, without training
them.
"""

import collections.abc
import contextlib
import dataclasses

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from keras_distrib import _keras_compat
from keras_distrib.cluster import info as cluster
from keras_distrib.training import data as data_lib
from keras_distrib.training import served
from keras_distrib.training import gradients
from keras_distrib.training import hooks
from keras_distrib.training import logs as logs_lib
from keras_distrib.cluster import strategies
from keras_distrib.cluster import watchdog

__all__ = [
    "DataPosition",
    "EmptyDataError",
    "LocalRunner",
    "build",
    "build_model",
    "callback_list",
    "chunk_end_hooks",
    "epoch_interrupted",
    "epoch_source",
    "evaluate",
    "evaluate_pass",
    "fit",
    "fit_epochs",
    "owned_batches",
    "predict",
    "predict_pass",
    "resume_position",
    "skip_before_distribution",
]


class EmptyDataError(ValueError):
    """`fit` got no batch at all in an epoch (nothing was trained)."""


@dataclasses.dataclass(frozen=True)
class DataPosition:
    """Where training resumes: an epoch, and how many of its batches are done."""

    epoch: int
    batch: int = 0


class LocalRunner:
    """Runs chunks of steps in this process with a compiled `Step`."""

    def __init__(self, model, step):
        self.model = model
        self.step = step

    def run(self, iterator, count, *, logs=True):
        """Runs up to `count` steps; returns the global logs (or outputs).

        `logs=False` (evaluation): returns `{}` without reading the metrics;
        `read_logs` reads them afterwards.
        """
        return self.step(iterator, count, logs=logs)

    def read_logs(self):
        """The metrics' global values (one packed all-reduce)."""
        return self.step.read_logs()

    def skip(self, iterator, count):
        """Moves `iterator` past up to `count` batches without running them."""
        return self.step.skip(iterator, count)

    def epoch_logs(self, logs):
        """The epoch's logs: the last call's global logs (the metrics' values then).

        With no step run in this process (a resume from a backup taken at the
        epoch's last step), the metrics' values restored from the backup.
        """
        if not logs:
            return dict(self.model.get_metrics_result())
        # The last call's logs are already the metrics' global values at the
        # epoch's end; reading the metrics again (Keras's
        # `_get_metrics_result_or_logs`) would all-reduce each variable on its own.
        return dict(logs)

    def wait(self):
        """Nothing to wait for: a compiled call returns when its steps are done."""


def resume_position(callbacks):
    """The `DataPosition` a callback restored (e.g. BackupAndRestore), or None."""
    for callback in callbacks.callbacks:
        position = getattr(callback, "restored_position", None)
        if position is not None:
            return position
    return None


def epoch_interrupted(callbacks):
    """Whether a callback stopped the epoch part-way for a restart (a preemption's backup).

    Such an epoch did not finish: it is not ended (no `on_epoch_end`, so no
    checkpoint, log line or History entry counts it); the restarted run
    finishes it and ends it once.
    """
    return any(getattr(c, "epoch_interrupted", False) is True
               for c in getattr(callbacks, "callbacks", ()))


def callback_list(callbacks, model, *, verbose, epochs, steps, history=False, **params):
    """A Keras `CallbackList`, with a progress bar on the chief only.

    `params` go to the callbacks' `params` too (e.g. `batch_size`, the
    global batch size, which a backup checks on resume).
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    verbose = cluster.chief_verbose(verbose)
    return keras.callbacks.CallbackList(
        callbacks, add_history=history, add_progbar=verbose != 0, verbose=verbose,
        epochs=epochs, steps=steps, model=model, **params,
    )


def _should_validate(epoch, validation_freq):
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return epoch + 1 in validation_freq


def chunk_end_hooks(callbacks):
    """The `on_train_chunk_end(batch, logs)` methods of kd's saving callbacks.

    Keras dispatches `on_train_batch_end` from a background thread only when
    no callback overrides it; otherwise every step waits for its logs to be
    copied to NumPy on the main thread. kd's callbacks need the main thread after a
    chunk (to save between steps) but not the logs' values, so the loop
    calls this hook instead, with the logs as they are (tensors).
    """
    return [c.on_train_chunk_end for c in getattr(callbacks, "callbacks", ())
            if callable(getattr(c, "on_train_chunk_end", None))]


@contextlib.contextmanager
def _one_pass(source):
    """The source's stop-of-data handling for one pass; the pass is ended on leaving.

    A pass left early (`stop_training`, an error) would otherwise keep its
    tf.data iterators alive until a full garbage collection (see
    `_keras_compat.end_pass`).
    """
    try:
        with source.catch_stop_iteration():
            yield
    finally:
        _keras_compat.end_pass(source)


@contextlib.contextmanager
def _lost_tasks_explained():
    """Puts kd's explanation first on an error that says the cluster lost a task.

    Every collective can be the one that finds a task gone: a step's, the
    epoch-end read of a metric, a callback's save, the validation pass. So
    the whole of a pass is covered, not only its steps.
    """
    try:
        yield
    except tf.errors.OpError as error:
        explained = watchdog.explain_lost_task(error, cluster.cluster_info().label)
        if explained is None:
            raise
        raise explained from error


def fit_epochs(model, source, runner, *, epochs, initial_epoch, callbacks, validate=None):
    """Trains `model` epoch by epoch; returns its `History`.

    Args:
        model: The model (its `stop_training` is honoured).
        source: The epochs' batches (see the module docstring).
        runner: Runs chunks of training steps.
        epochs: Index of the epoch to stop before.
        initial_epoch: Epoch to start at, unless a callback restores another
            (or Keras's `model._initial_epoch` is set, as its BackupAndRestore does).
        callbacks: A Keras `CallbackList` (with a History).
        validate: Optional `validate(epoch) -> dict or None` (validation logs).
    """
    watch = watchdog.from_environment(model.distribute_strategy)  # KD_WATCHDOG, checked first
    model.stop_training = False
    _keras_compat.set_initial_epoch(model, None)
    for callback in getattr(callbacks, "callbacks", ()):
        if callable(getattr(callback, "set_runner", None)):
            callback.set_runner(runner)
    try:
        return _fit_or_abort(model, source, runner, epochs, initial_epoch, callbacks, validate, watch)
    except BaseException:
        # Keras calls no `on_train_end` when training raises: kd's callbacks
        # that hold something for the run (a signal handler, a lock) let it go.
        for callback in getattr(callbacks, "callbacks", ()):
            if callable(getattr(callback, "on_train_abort", None)):
                callback.on_train_abort()
        raise


def _fit_or_abort(model, source, runner, epochs, initial_epoch, callbacks, validate, watch):
    with _lost_tasks_explained():
        callbacks.on_train_begin()
        restored = resume_position(callbacks)
        position = restored or DataPosition(_keras_compat.initial_epoch(model) or initial_epoch)
        if restored is not None and restored.batch:
            served_input = served.description_of(_keras_compat.epoch_distributed_dataset(source))
            if served_input is not None:
                served_input.resumed_at(restored.epoch, restored.batch)
        if restored is not None and getattr(source, "continuous", False):
            # The data runs on across epochs (a parameter server's repeated
            # per-worker datasets): move past the epochs the backup holds too.
            runner.skip(source.iterator, (restored.epoch - initial_epoch) * source.num_batches)
        elif restored is not None and restored.epoch > initial_epoch:
            # A dataset that reshuffles each epoch draws its orders from a seed
            # state of this process: move it to the resumed epoch's order.
            _replay_orders(source, restored.epoch - initial_epoch)
        chunk_hooks = chunk_end_hooks(callbacks)
        if watch is None:
            return _fit_epochs(model, source, runner, position, epochs, callbacks, validate, chunk_hooks, None)
        with watch:
            return _fit_epochs(model, source, runner, position, epochs, callbacks, validate, chunk_hooks, watch)


def _replay_orders(source, epochs):
    """Moves the source's data to the shuffle order of its epoch `epochs` (see `replay_epochs`).

    Raises:
        ValueError: the data reshuffles each epoch and its position in the
            orders cannot be told (`steps_per_epoch` with a dataset that
            reshuffles): the resumed run would train other batches.
    """
    distributed = _keras_compat.epoch_distributed_dataset(source)
    if distributed is None or _keras_compat.reshuffles_each_iteration(distributed) is False:
        return
    count = _keras_compat.iterators_before_epoch(source, epochs)
    if count is None:
        raise ValueError(
            f"Cannot resume at epoch {epochs + 1} exactly: `x` is a dataset that reshuffles each "
            "iteration (`shuffle(..., reshuffle_each_iteration=True)`) and `steps_per_epoch` is "
            "set, so which shuffle order the epoch trains on depends on where earlier epochs "
            "stopped in the data, which the backup does not hold. Shuffle with "
            "`reshuffle_each_iteration=False` (or a seed per epoch), or leave `steps_per_epoch` "
            "unset so that each epoch is one pass over the data."
        )
    data_lib.replay_epochs(distributed, count)


def skip_before_distribution(model, source, count):
    """Starts the source's next epoch `count` batches in, skipped before distribution.

    Resuming mid-epoch: `dataset.skip(count)` on the batched dataset, before
    it is split per replica, moves past the batches the backup holds without
    running the split (or, for arrays, the slicing) for each of them; moving
    the distributed iterator costs about a fifth of training those steps on
    a small model. The batches are the same: the skip wraps the very dataset
    the epoch would iterate (a reshuffling dataset draws this epoch's order
    as it would have), and later epochs iterate it unwrapped. Only where one
    process holds every replica: the data of several workers is sharded
    (by file, possibly) after this point, and a `dataset_fn`'s or a
    parameter server's per-worker datasets are not one dataset to wrap.
    Returns whether it did; if not, the loop moves the iterator instead.
    """
    traits = strategies.traits(model.distribute_strategy)
    if count <= 0 or traits.is_multi_worker or traits.is_parameter_server:
        return False
    distributed = _keras_compat.epoch_distributed_dataset(source)
    if distributed is None:
        return False
    skipped = _keras_compat.redistributed(distributed, lambda dataset: dataset.skip(count))
    return skipped is not None and _keras_compat.next_epoch_over(source, skipped)


def _fit_epochs(model, source, runner, position, epochs, callbacks, validate, chunk_hooks, watch):
    logs, epoch_logs = {}, None
    for epoch in range(position.epoch, epochs):
        model.reset_metrics()
        callbacks.on_epoch_begin(epoch)
        done = position.batch if epoch == position.epoch else 0
        pending = 0 if skip_before_distribution(model, source, done) else done
        ran = False  # a step ran, or the backup held the batches
        with _one_pass(source):
            for begin, end, iterator in source:
                if end < done:  # the backup holds this whole chunk
                    if pending:
                        runner.skip(iterator, end - begin + 1)
                    ran = True
                    continue
                if begin < done:
                    if pending:
                        runner.skip(iterator, done - begin)
                    begin = done
                callbacks.on_train_batch_begin(begin)
                if watch is not None:
                    if watch.steps_seen == 0 and hasattr(iterator, "element_spec"):
                        watch.check_batches(iterator.element_spec)
                    watch.entering()
                logs = runner.run(iterator, end - begin + 1)
                ran = True
                callbacks.on_train_batch_end(end, logs)
                for hook in chunk_hooks:
                    hook(end, logs)
                if watch is not None:
                    watch.step(epoch, end)
                if model.stop_training:
                    break
        if epoch_interrupted(callbacks):
            break
        if not ran:
            raise EmptyDataError(
                f"`x` gave no batch in epoch {epoch + 1}: the data is empty (e.g. a dataset "
                "filtered to nothing, or a generator that is exhausted). Nothing was trained. "
                "Pass data with at least one row (a generator must yield batches for every "
                "epoch, or set `steps_per_epoch`)."
            )
        epoch_logs = runner.epoch_logs(logs)
        if validate is not None:
            validation_logs = validate(epoch)
            if validation_logs:
                epoch_logs.update({f"val_{k}": v for k, v in validation_logs.items()})
        callbacks.on_epoch_end(epoch, epoch_logs)
        if model.stop_training:
            break
    if epochs > 0 and model.optimizer is not None and not epoch_interrupted(callbacks):
        model.optimizer.finalize_variable_values(model.trainable_weights)
    callbacks.on_train_end(logs=epoch_logs)
    return model.history


def _reads_test_batch_logs(callbacks):
    """Whether a callback overrides the hook that receives an evaluation batch's logs."""
    base = keras.callbacks.Callback.on_test_batch_end
    return any(type(callback).on_test_batch_end is not base
               for callback in getattr(callbacks, "callbacks", ()))


@_lost_tasks_explained()
def evaluate_pass(model, source, runner, *, callbacks, return_dict):
    """One pass of evaluation; returns the logs (a dict, or a list as Keras)."""
    model.stop_evaluating = False
    callbacks.on_test_begin()
    model.reset_metrics()
    logs = {}
    # Read once at the end when no callback looks at a batch's logs and the
    # step reports only its metrics: no collective per call for them.
    once = (not _reads_test_batch_logs(callbacks) and hasattr(runner, "read_logs")
            and logs_lib.reports_only_metrics(model, "test"))
    with _one_pass(source):
        for begin, end, iterator in source:
            callbacks.on_test_batch_begin(begin)
            logs = runner.run(iterator, end - begin + 1, logs=False) if once else \
                runner.run(iterator, end - begin + 1)
            callbacks.on_test_batch_end(end, logs)
            if model.stop_evaluating:
                break
    if once:
        logs = runner.read_logs()
    logs = _keras_compat.pythonify_logs(runner.epoch_logs(logs))
    callbacks.on_test_end(logs)
    if return_dict:
        return logs
    return _keras_compat.flatten_metrics_in_order(model, logs)


def predict_pass(model, source, runner, *, callbacks):
    """One pass of prediction; returns every row's outputs, in order, as NumPy.

    Ragged outputs (or outputs whose shapes vary by batch) come back as a
    RaggedTensor, as Keras returns them.
    """
    model.stop_predicting = False
    callbacks.on_predict_begin()
    outputs = []
    with _one_pass(source):
        for begin, end, iterator in source:
            callbacks.on_predict_batch_begin(begin)
            batch_outputs = runner.run(iterator, end - begin + 1)
            outputs.append(batch_outputs)
            callbacks.on_predict_batch_end(end, {"outputs": batch_outputs})
            if model.stop_predicting:
                break
    callbacks.on_predict_end()
    if not outputs:
        raise ValueError(
            "`predict` got no batch from `x`: it is empty, or `steps`=0. Pass data "
            "with at least one row."
        )
    return _keras_compat.concat_predictions(outputs)


# Front ends over local or distributed data (everything but parameter servers).


def _copy_batch(batch):
    """A batch whose arrays are new NumPy arrays that nothing else holds."""
    return tree.map_structure(
        lambda v: np.array(v, copy=True) if isinstance(v, np.ndarray) else v, batch
    )


class _CopiedBatches(keras.utils.PyDataset):
    """A PyDataset that hands out copies of another's batches (see `owned_batches`)."""

    def __init__(self, inner):
        super().__init__(workers=inner.workers, use_multiprocessing=inner.use_multiprocessing,
                         max_queue_size=inner.max_queue_size)
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    @property
    def num_batches(self):
        return self.inner.num_batches

    def __getitem__(self, index):
        return _copy_batch(self.inner[index])

    def on_epoch_begin(self):
        self.inner.on_epoch_begin()

    def on_epoch_end(self):
        self.inner.on_epoch_end()


def _copy_element(*element):
    def copy(value):
        return tf.raw_ops.DeepCopy(x=value) if isinstance(value, tf.Tensor) else value

    return tree.map_structure(copy, element if len(element) > 1 else element[0])


def owned_batches(x):
    """`x`, with every batch a Python side hands to TensorFlow copied first.

    `Dataset.from_generator` (and so Keras's PyDataset and generator
    adapters) gives TensorFlow the generator's NumPy arrays without a copy;
    TensorFlow then treats their memory as its own and may write a step's
    intermediate result into it (an op reusing its input's buffer). The
    user's arrays change: under MirroredStrategy the labels were rewritten
    in place during epoch 1, so epoch 2 trained on different labels, in
    some runs (it depends on TensorFlow's scheduling). Copying each batch
    first leaves the user's arrays alone; one device gives the same values
    either way.
    """
    if isinstance(x, keras.utils.PyDataset):
        return _CopiedBatches(x)
    if isinstance(x, tf.data.Dataset):
        if _keras_compat.dataset_calls_python(x, _keras_compat.PYTHON_OPS):
            return x.map(_copy_element)
        return x
    if isinstance(x, collections.abc.Iterator) and not hasattr(x, "shape"):
        return (_copy_batch(batch) for batch in x)
    return x


def epoch_source(model, *, x, y=None, sample_weight=None, batch_size=None, steps=None,
                 shuffle=False, class_weight=None, steps_per_call=1, strategy=None):
    """Keras's epoch iterator over `x` for `model`'s strategy (or `strategy`).

    Batches from Python (PyDataset, generators, `from_generator`) are
    copied before TensorFlow sees them (`owned_batches`). Workers whose
    datasets hold different numbers of batches all take every step
    (`join_workers`).
    """
    strategy = strategy or model.distribute_strategy
    source = _keras_compat.epoch_iterator(
        x=owned_batches(x), y=y, sample_weight=sample_weight, batch_size=batch_size,
        steps_per_epoch=steps, shuffle=shuffle, class_weight=class_weight,
        distribute_strategy=strategy,
        steps_per_execution=steps_per_call,
    )
    if steps is None and strategies.traits(strategy).is_multi_worker:
        if isinstance(x, tf.distribute.DistributedDataset):
            join_workers(source, strategy)
        elif _keras_compat.batches_from_arrays(source):
            # Every worker holds the global batch count, one batch per replica
            # and step (an empty one where a last batch has too few rows): no
            # worker runs out first, so the steps need not agree on it.
            _keras_compat.skip_batch_agreement(source)
    return source


def worker_batch_counts(strategy, local_count):
    """Every worker's batch count per epoch (-1: unknown), by worker index."""
    replicas = strategy.num_replicas_in_sync
    workers = max(cluster.cluster_info().num_workers, 1)
    local = replicas // workers
    index = cluster.cluster_info().task_index if workers > 1 else 0

    def own_count():
        context = tf.distribute.get_replica_context()
        first = tf.equal(context.replica_id_in_sync_group % local, 0)
        counts = tf.one_hot(index, workers, dtype=tf.int64) * tf.constant(local_count + 1, tf.int64)
        return tf.where(first, counts, tf.zeros_like(counts))

    total = strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(own_count), axis=None)
    return [int(count) - 1 for count in np.asarray(total)]


def join_workers(source, strategy):
    """Runs every worker's epoch for as many steps as the longest worker's.

    Workers whose datasets (a `dataset_fn`'s shards) hold different numbers
    of batches would stop at different steps, and the collectives of the
    next step would pair with something else. TensorFlow hands a worker
    that has run out empty batches while any worker still has data; kd
    steps on them (an empty replica adds nothing), so every worker takes
    every step: what one device computes on the same global data. So when
    the counts differ, every worker runs until the data ends everywhere
    (TensorFlow ends it on every worker at the same step).
    """
    local = source.num_batches
    counts = worker_batch_counts(strategy, -1 if local is None else int(local))
    if len(set(counts)) == 1:
        # The same known count everywhere, one replica per worker: no worker
        # runs out first, so the steps need not agree at every batch whether
        # any worker has one left (TensorFlow's all-reduce per fetch).
        if counts[0] >= 0 and strategy.num_replicas_in_sync == len(counts):
            _keras_compat.skip_batch_agreement(source)
        return
    _keras_compat.set_epoch_batches(source, None)


def build(model, source):
    """Creates the model's, metrics' and optimizer's variables in the scope.

    From the source's element spec: opening an iterator would consume the
    user's data (and reorder a reshuffling dataset). Variables created
    inside a compiled step fail under several replicas (e.g. Adam's slots).
    """
    build_model(model, _keras_compat.dataset_element_spec(source))


def build_model(model, data_batch):
    """Builds `model` from a batch or element spec, then its optimizer.

    The optimizer is built on the variables it updates: under a parameter
    server with a partitioner, one per shard (Keras would build it on the
    whole weights, which it then cannot update).
    """
    data_batch = tree.map_structure(_first_replica_spec, data_batch)
    # No `call` of its own (a GAN or SimCLR whose train_step calls its
    # sub-models): nothing for Keras to trace, as on one device, where Keras
    # builds lazily; a sub-model not built yet (an augmentation pipeline
    # without an Input) builds at the first trace.
    call_less = type(model).call is keras.Model.call
    if call_less:
        model.built = True
    optimizer = model.optimizer
    hold = optimizer is not None and not optimizer.built
    with model.distribute_strategy.scope():
        if hold:
            optimizer.built = True  # Keras's build would use the whole weights
        try:
            if not call_less:
                _keras_compat.symbolic_build(model, data_batch)
        finally:
            if hold:
                optimizer.built = False
        if optimizer is not None and not optimizer.built:
            optimizer.build(_keras_compat.optimizer_variables(model))
    # Per-replica bookkeeping on the layers and variables just created.
    hooks.install_layer_hooks(model)


def _first_replica_spec(spec):
    """A TensorSpec from a (possibly per-replica) element spec.

    An absent optional input (`keras.Input(optional=True)` fed None) is
    None, as Keras builds it.
    """
    values = _keras_compat.per_replica_specs(spec)
    spec = values[0] if values else spec
    if _keras_compat.is_absent_input_spec(spec):
        return None
    return spec


def fit(model, train_function, request, *, test_function=None):
    """`Model.fit` over the loop, as `request` (an `inputs.FitRequest`) asks.

    `train_function` (a train `Step`) runs the chunks of steps,
    `test_function` (a test `Step`) the validation.
    """
    x, y, sample_weight = request.x, request.y, request.sample_weight
    epochs, validation_data = request.epochs, request.validation_data
    max_epochs = _keras_compat.max_epochs()
    if max_epochs and max_epochs < epochs:
        epochs = max_epochs
    if request.validation_split and validation_data is None:
        (x, y, sample_weight), validation_data = _keras_compat.train_validation_split(
            (x, y, sample_weight), request.validation_split
        )
    source = epoch_source(
        model, x=x, y=y, sample_weight=sample_weight, batch_size=request.batch_size,
        steps=request.steps_per_epoch, shuffle=request.shuffle, class_weight=request.class_weight,
        steps_per_call=train_function.steps_per_call,
    )
    build(model, source)
    source.reset()
    gradients.report_bucket_plan(model)
    callbacks = callback_list(
        request.callbacks, model, verbose=request.verbose, epochs=epochs,
        steps=source.num_batches, history=True,
        batch_size=_keras_compat.data_batch_size(source),
    )
    validate = None
    if validation_data is not None:
        val_x, val_y, val_weight = keras.utils.unpack_x_y_sample_weight(validation_data)
        cached = []

        def validate(epoch):
            if not _should_validate(epoch, request.validation_freq):
                return None
            if not cached:
                cached.append(epoch_source(
                    model, x=val_x, y=val_y, sample_weight=val_weight,
                    batch_size=request.validation_batch_size or request.batch_size,
                    steps=request.validation_steps, steps_per_call=test_function.steps_per_call,
                ))
            cached[0].reset()
            return evaluate_pass(
                model, cached[0], LocalRunner(model, test_function),
                callbacks=callbacks, return_dict=True,
            )

    return fit_epochs(
        model, source, LocalRunner(model, train_function), epochs=epochs,
        initial_epoch=request.initial_epoch, callbacks=callbacks, validate=validate,
    )


def evaluate(model, test_function, x=None, y=None, *, batch_size=None, verbose="auto",
             sample_weight=None, batches=None, callbacks=None, return_dict=False,
             strategy=None):
    """`Model.evaluate` over the loop (`test_function`: a test `Step`; `batches`: Keras's `steps`)."""
    source = epoch_source(
        model, x=x, y=y, sample_weight=sample_weight, batch_size=batch_size,
        steps=batches, steps_per_call=test_function.steps_per_call, strategy=strategy,
    )
    build(model, source)
    source.reset()
    callbacks = callback_list(callbacks, model, verbose=verbose, epochs=1, steps=source.num_batches)
    return evaluate_pass(
        model, source, LocalRunner(model, test_function), callbacks=callbacks, return_dict=return_dict
    )


def predict(model, predict_function, x, *, batch_size=None, verbose="auto", batches=None,
            callbacks=None, strategy=None):
    """`Model.predict` over the loop (`predict_function`: a predict `Step`; `batches`: Keras's `steps`)."""
    source = epoch_source(
        model, x=x, batch_size=batch_size, steps=batches, steps_per_call=predict_function.steps_per_call,
        strategy=strategy,
    )
    callbacks = callback_list(callbacks, model, verbose=verbose, epochs=1, steps=source.num_batches)
    return predict_pass(model, source, LocalRunner(model, predict_function), callbacks=callbacks)
