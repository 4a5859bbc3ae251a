"""The one place where steps are wrapped in `strategy.run` and reduced.

`Model.fit`/`evaluate`/`predict` (through `DistributedModelMixin`) and
`kd.TrainLoop` both get their compiled functions from here, so the two paths
cannot drift apart.

Logs are read from the metric variables in cross-replica context, where
SyncOnRead variables are summed over every replica and worker: the true
global values. Keras instead averages each replica's local metric results,
which is wrong whenever replicas hold different numbers of rows.
"""

import warnings

import tensorflow as tf
from keras.src import tree
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_distrib import _keras_compat
from keras_distrib import gradients
from keras_distrib import losses as kd_losses


def metric_results(model):
    """Every model metric's value; global when read in cross-replica context."""
    results = {}
    for metric in model.metrics:
        value = metric.result()
        if isinstance(value, dict):
            results.update(value)
        else:
            results[metric.name] = value
    return results


def metric_names(model):
    """Log keys the model's metrics produce, without reading any variable."""
    from keras.src.trainers.compile_utils import CompileMetrics

    names = set()
    for metric in model.metrics:
        if isinstance(metric, CompileMetrics):
            names.update(sub.name for sub in metric.metrics)
        names.add(metric.name)
    return names


def _is_multi_worker(strategy):
    extended = strategy.extended
    return bool(getattr(extended, "_in_multi_worker_mode", lambda: False)())


def reduce_mean(strategy, value):
    """Mean over replicas of a per-replica value (what Keras calls "auto")."""
    if isinstance(value, tf.distribute.DistributedValues) or _is_multi_worker(strategy):
        return strategy.reduce(tf.distribute.ReduceOp.MEAN, value, axis=None)
    return value


def step_logs(model, strategy, outputs):
    """Global logs for the outputs of a replica step.

    Keys that name a model metric take the metric's global value; anything
    else a custom `train_step` returns is averaged over replicas.
    """
    if not isinstance(outputs, dict):
        return tree.map_structure(lambda v: reduce_mean(strategy, v), outputs)
    metric_values = metric_results(model)
    return {
        key: metric_values[key] if key in metric_values else reduce_mean(strategy, value)
        for key, value in outputs.items()
    }


def whole_step_xla(strategy):
    """Whether XLA may compile a whole replica step under `strategy`.

    A step all-reduces (row counts, gradients). TensorFlow only lowers that
    into XLA for one replica, TPUs, or mirrored replicas that are all GPUs;
    elsewhere a synchronization inside a compiled function fails.
    """
    if strategy.num_replicas_in_sync == 1 or isinstance(strategy, tf.distribute.TPUStrategy):
        return True
    devices = tuple(getattr(strategy.extended, "worker_devices", ()))
    return bool(devices) and all("GPU" in d.upper() for d in devices) and not _is_multi_worker(strategy)


def on_replica_device(function):
    """Calls `function` placed on the current replica's device."""

    def placed(*args, **kwargs):
        # XLA compiles for the device the call is placed on; without this,
        # every replica's cluster lands on the first device and cannot reach
        # the other replicas' variables.
        context = tf.distribute.get_replica_context()
        devices = tf.nest.flatten(getattr(context, "devices", None) or [None])
        with tf.device(devices[0]):
            return function(*args, **kwargs)

    return placed


def step_plan(model, *, looped=False):
    """The `StepPlan` for `model` under its strategy (see kd.losses.StepPlan)."""
    strategy = model.distribute_strategy
    replicas = strategy.num_replicas_in_sync
    jit = bool(model.jit_compile) and not model.run_eagerly
    return kd_losses.StepPlan(
        pad_empty=replicas > 1 and not isinstance(strategy, tf.distribute.TPUStrategy),
        xla_forward=jit and not whole_step_xla(strategy),
        looped=looped,
    )


def replica_function(model, step_fn, *, looped=False):
    """The per-replica step: one replica's batch, inside its `ReplicaBatch`.

    Keras's Optional inputs become None, and the replica's batch context
    (row counts, the step plan) is open around `step_fn`, so an overridden
    `train_step` gets kd's arithmetic too. With `jit_compile=True`, the
    whole step is compiled by XLA where the strategy allows it; otherwise
    (e.g. several CPU replicas) the model's forward and backward passes are
    (`StepPlan.xla_forward`), and the all-reduces run outside XLA.
    """
    plan = step_plan(model, looped=looped)

    def replica_step(data):
        data = _keras_compat.autoconvert_optionals(data)
        x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(data)
        with kd_losses.replica_batch(kd_losses.batch_rows(x), plan):
            return step_fn(data)

    if not model.jit_compile or model.run_eagerly or plan.xla_forward:
        return replica_step
    compiled = tf.function(replica_step, jit_compile=True, reduce_retracing=True)
    return on_replica_device(compiled)


def make_step_function(model, step_fn, *, steps_per_execution=None):
    """Compiles `step_fn` (a train or test step) into a distributed function.

    The returned `function(iterator)` runs up to `steps_per_execution` steps
    inside one `tf.function` (a `tf.range` loop, so the graph does not grow
    with k), and returns the global logs after the last step. It raises
    `StopIteration` when the iterator is exhausted before the first step.

    Args:
        model: The Keras model (its strategy, jit and eager settings apply).
        step_fn: A per-replica step taking one batch, returning a dict.
        steps_per_execution: Steps per call; `model.steps_per_execution` when
            `None`.

    Returns:
        The callable Keras stores as `train_function` / `test_function`.
    """
    strategy = model.distribute_strategy
    steps = int(steps_per_execution or model.steps_per_execution or 1)
    replica_step = replica_function(model, step_fn)
    looped_step = replica_function(model, step_fn, looped=True)

    def run(data, step=replica_step):
        return strategy.run(step, args=(data,))

    def extras_of(outputs):
        # Values a custom step returns that are not metrics (usually none).
        if not isinstance(outputs, dict):
            return {}
        names = metric_names(model)
        return {k: reduce_mean(strategy, v) for k, v in outputs.items() if k not in names}

    def finish(outputs, extras):
        logs = step_logs(model, strategy, outputs)
        if isinstance(logs, dict):
            logs.update(extras)
        return logs

    def multi_step(iterator):
        outputs = run(next(iterator))
        extras = extras_of(outputs)
        for _ in tf.range(steps - 1):
            optional = iterator.get_next_as_optional()
            if not optional.has_value():
                break
            step_outputs = run(optional.get_value(), looped_step)
            if extras:
                extras = extras_of(step_outputs)
        return finish(outputs, extras)

    def one_step(iterator):
        outputs = run(next(iterator))
        return finish(outputs, extras_of(outputs))

    def one_batch(data):
        outputs = run(data)
        return finish(outputs, extras_of(outputs))

    if not model.run_eagerly:
        multi_step = tf.function(multi_step, reduce_retracing=True)
        one_step = tf.function(one_step, reduce_retracing=True)
        one_batch = tf.function(one_batch, reduce_retracing=True)
    looping = [steps > 1]

    def stepwise(iterator):
        logs = None
        for _ in range(steps):
            try:
                logs = one_step(iterator)
            except tf.errors.OutOfRangeError:
                break
        if logs is None:
            raise StopIteration
        return logs

    def function(iterator):
        if getattr(model, "_kd_skip_steps", 0):
            return fast_forward(model, iterator, steps)
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            if not looping[0]:
                return stepwise(iterator)
            try:
                return multi_step(iterator)
            except tf.errors.OutOfRangeError:
                raise StopIteration from None
            except gradients.SparseGradientInLoop:
                looping[0] = False
                _warn_stepwise(model, steps)
                return stepwise(iterator)
        logs = None
        for _, data in zip(range(steps), iterator):
            logs = one_batch(data)
        if logs is None:
            raise StopIteration
        return logs

    return function


def _warn_stepwise(model, steps):
    warnings.warn(
        f"{model.name}: {steps} steps per call run as {steps} calls of one step: the "
        "model has sparse gradients (e.g. from an Embedding), which cannot be all-gathered "
        "inside a compiled loop. The results are exact either way.",
        stacklevel=3,
    )


def make_epoch_function(model, step_fn):
    """One `tf.function` that runs `step_fn` on every batch of a distributed
    dataset (a whole epoch per call) and returns the global metric values.
    A model with sparse gradients runs one compiled step per batch instead."""
    strategy = model.distribute_strategy
    looped_step = replica_function(model, step_fn, looped=True)
    one_step = make_step_function(model, step_fn, steps_per_execution=1)
    looping = [True]

    @tf.function
    def epoch(dataset):
        for data in dataset:
            strategy.run(looped_step, args=(data,))
        return metric_results(model)

    def run_epoch(dataset):
        if looping[0]:
            try:
                return epoch(dataset)
            except gradients.SparseGradientInLoop:
                looping[0] = False
                _warn_stepwise(model, "all")
        iterator = iter(dataset)
        while True:
            try:
                one_step(iterator)
            except StopIteration:
                break
        with strategy.scope():
            return metric_results(model)

    return run_epoch


def make_scheduled_function(model, step_fn):
    """For a parameter-server coordinator to schedule: `count` steps on the
    worker that runs it, each on the next batch of that worker's iterator."""
    strategy = model.distribute_strategy
    replica_step = replica_function(model, step_fn)

    @tf.function
    def steps(iterator, count):
        for _ in tf.range(count):
            strategy.run(replica_step, args=(next(iterator),))
        return count

    return steps


def make_batch_function(model, step_fn):
    """One step on a given (local, undistributed) batch; for a coordinator
    that evaluates or predicts itself, reading the parameter servers."""
    strategy = model.distribute_strategy
    replica_step = replica_function(model, step_fn)

    @tf.function
    def batch_step(batch):
        return strategy.run(replica_step, args=(batch,))

    return batch_step


def fast_forward(model, iterator, steps):
    """Consumes up to `steps` batches without training (resuming mid-epoch).

    BackupAndRestore sets `model._kd_skip_steps` to the number of batches of
    the resumed epoch that the backup already holds; the train function then
    moves the input past them, one call (chunk) at a time, so Keras's step
    counting and callbacks see the same chunks as in the original run.
    """
    count = min(steps, model._kd_skip_steps)
    for _ in range(count):
        try:
            next(iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            model._kd_skip_steps = 0
            raise StopIteration from None
    model._kd_skip_steps -= count
    with model.distribute_strategy.scope():
        return metric_results(model)


def make_predict_function(model, *, steps_per_execution=None):
    """Compiles `model.predict_step` into a distributed function.

    The function takes a list of batches (Keras's predict loop hands over
    `steps_per_execution` at a time) and returns the outputs of every row,
    in input order, concatenated across replicas and workers.
    """
    from keras.src.backend.tensorflow import trainer as tf_trainer

    strategy = model.distribute_strategy
    replica_step = replica_function(model, model.predict_step)

    def predict_batches(batches):
        outputs = None
        for batch in batches:
            per_replica = strategy.run(replica_step, args=(batch,))
            step_outputs = tf_trainer.reduce_per_replica(
                per_replica, strategy, reduction="concat"
            )
            if outputs is None:
                outputs = step_outputs
            else:
                outputs = tree.map_structure(
                    lambda a, b: tf_trainer.concat([a, b]), outputs, step_outputs
                )
        return outputs

    if not model.run_eagerly:
        predict_batches = tf.function(predict_batches, reduce_retracing=True)
    return predict_batches
