"""The step: replica steps under `strategy.run`, several per compiled call.

`Step` is the one place in keras_distrib that calls `strategy.run`. `fit`,
`evaluate` and `predict` of kd models, `kd.TrainLoop`, the functions a
parameter-server coordinator schedules on its workers and the coordinator's
own exact evaluation all call a `Step`, so they cannot drift apart.

A step function runs up to k replica steps in one `tf.function` (a
`tf.range` loop: the graph does not grow with k) and returns global
results. Train and test logs are read from the metric variables in
cross-replica context, where SyncOnRead variables are summed over every
replica and worker: the true global values (Keras averages each replica's
local results, wrong whenever replicas hold different numbers of rows).
Predictions come back concatenated in input order.
"""

import warnings

import keras
import tensorflow as tf
from keras import tree

from keras_distrib import _keras_compat
from keras_distrib import replica
from keras_distrib import strategies
from keras_distrib import validation

__all__ = [
    "SparseGradientInLoop",
    "Step",
    "metric_names",
    "metric_results",
    "on_replica_device",
    "plan_for",
    "reduce_mean",
    "replica_function",
    "shard_evaluator",
    "step_logs",
    "whole_step_xla",
]

KINDS = ("train", "test", "predict")


class SparseGradientInLoop(Exception):
    """A sparse gradient met inside a compiled multi-step loop, where kd cannot gather it.

    TensorFlow fixes the shape of a collective at its first loop iteration,
    and gathering sparse (`tf.IndexedSlices`) gradients changes shape with
    the batch. With every replica in this process kd gathers them without a
    collective (see `gradients.all_reduce`); across worker processes, or in
    an XLA-compiled step, the step runs one step per compiled call instead.
    """


class _CompositeInLoop(Exception):
    """Ragged or sparse predictions, which a compiled loop cannot stack (one step per call then)."""


class _CarriedOutputs(Exception):
    """The step returns values the loop did not expect; traced again to carry them.

    Only a custom step that returns values other than metrics does this: the
    loop learns their specs from the first trace and carries them from then on.
    """


# The loop's assertion that it ran a step: no batch was left (StopIteration).
_NO_BATCH = "kd step: the iterator holds no batch"


@tf.autograph.experimental.do_not_convert
def _zeros_of(specs):
    if specs is None:
        return {}
    return tree.map_structure(
        lambda spec: tf.zeros([d or 0 for d in spec.shape] if spec.shape.rank is not None else [],
                              spec.dtype),
        specs,
    )


def _invariants(values, specs):
    if specs is None:
        return []
    return list(zip(tree.flatten(values), [spec.shape for spec in tree.flatten(specs)]))


def _same_specs(specs, carried):
    try:
        tree.assert_same_structure(specs, carried)
    except (TypeError, ValueError):
        return False
    return all(
        a.dtype == b.dtype and b.shape.is_compatible_with(a.shape)
        for a, b in zip(tree.flatten(specs), tree.flatten(carried))
    )


def metric_results(model):
    """Every model metric's value; global when read in cross-replica context.

    Under mirrored and multi-worker mirrored strategies, every metric
    variable is summed over the replicas in one batched all-reduce (one
    collective per read of the logs; reading them one by one would make one
    per variable, each a round trip across workers).
    """
    variables = list(model.metrics_variables)
    values = _global_values(model.distribute_strategy, variables)
    if values is None:
        return _read_results(model)
    with keras.StatelessScope(state_mapping=list(zip(variables, values))):
        return _read_results(model)


_BATCHED_READS = (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy)


def _global_values(strategy, variables):
    """The global values of `variables` (metric state), all-reduced together, or None.

    None outside cross-replica context, with one replica, or under a
    strategy whose metric variables are not per replica (those read as
    they are).
    """
    if tf.distribute.get_replica_context() is not None and tf.distribute.has_strategy():
        return None
    if not isinstance(strategy, _BATCHED_READS) or strategy.num_replicas_in_sync == 1:
        return None
    values = [None] * len(variables)
    groups = {}
    for index, variable in enumerate(variables):
        aggregation = _keras_compat.sync_on_read_aggregation(variable)
        if aggregation in (tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN):
            groups.setdefault(aggregation, []).append(index)
        else:
            values[index] = tf.convert_to_tensor(variable.value)
    with strategy.scope():
        destination = _keras_compat.default_reduce_destination(strategy)
        for aggregation, indices in groups.items():
            reduced = strategy.extended.batch_reduce_to(
                tf.distribute.ReduceOp.from_variable_aggregation(aggregation),
                [(_keras_compat.backend_variable(variables[i]), destination) for i in indices],
            )
            for index, value in zip(indices, reduced):
                values[index] = strategy.experimental_local_results(value)[0]
    return values


def _read_results(model):
    results = {}
    for metric in model.metrics:
        value = metric.result()
        if isinstance(value, dict):
            results.update(value)
        else:
            results[metric.name] = value
    return results


def metric_names(model):
    """Log keys the model's metrics produce, without reading any variable.

    The keys are those of the metrics' results computed eagerly on zero
    state (Keras names compiled metrics when it reports them: `out0_mae`
    for a model with several outputs), so no read or collective enters a
    traced step.
    """
    names = set()
    for metric in model.metrics:
        names.update(_keras_compat.compile_metric_names(metric))
        names.add(metric.name)
    variables = list(model.metrics_variables)
    with tf.init_scope():
        zeros = [tf.zeros(v.shape, v.dtype) for v in variables]
        with keras.StatelessScope(state_mapping=list(zip(variables, zeros))):
            names.update(_read_results(model))
    return names


def reduce_mean(strategy, value):
    """Mean over replicas of a per-replica value (what Keras calls "auto")."""
    if isinstance(value, tf.distribute.DistributedValues) or strategies.traits(strategy).is_multi_worker:
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
    traits = strategies.traits(strategy)
    if traits.replicas == 1 or traits.is_tpu:
        return True
    devices = tuple(getattr(strategy.extended, "worker_devices", ()))
    return bool(devices) and all("GPU" in d.upper() for d in devices) and not traits.is_multi_worker


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


def plan_for(model, *, looped=False):
    """The `StepPlan` for `model` under its strategy (see replica.StepPlan)."""
    strategy = model.distribute_strategy
    replicas = strategy.num_replicas_in_sync
    jit = bool(model.jit_compile) and not model.run_eagerly
    return replica.StepPlan(
        pad_empty=replicas > 1 and not strategies.traits(strategy).is_tpu,
        xla_forward=jit and not whole_step_xla(strategy),
        looped=bool(looped),
    )


def _created_before_the_batch(next_creator, **kwargs):
    # A variable a step creates on its first trace (a model built by its
    # first call, a lazily built metric) must not wait for the step's batch:
    # tf.function then cannot lift its initializer out of the traced graph,
    # and XLA (`jit_compile=True`) refuses a function that initializes
    # variables in place.
    with tf.control_dependencies(None):
        return next_creator(**kwargs)


def replica_function(model, kind, *, looped=False):
    """One replica's step of `kind`, inside its `ReplicaBatch`.

    Keras's Optional inputs become None, and the replica's batch (row
    counts, the plan) is open around the model's step, so an overridden
    `train_step` gets kd's arithmetic too. With `jit_compile=True`, the
    whole step is compiled by XLA where the strategy allows it; otherwise
    (several CPU replicas) the forward and backward passes are
    (`StepPlan.xla_forward`), and the all-reduces run outside XLA.
    """
    step_fn = {"train": model.train_step, "test": model.test_step,
               "predict": model.predict_step}[kind]
    plan = plan_for(model, looped=looped)

    # Not converted by AutoGraph, as Keras 3 does not convert its steps: a
    # step holds no Python control flow on tensors, and converting it (and
    # every function it calls, again on each replica's thread) was most of
    # kd's extra time to the first step.
    @tf.autograph.experimental.do_not_convert
    def replica_step(data):
        data = _keras_compat.autoconvert_optionals(data)
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        # Nothing of the step runs before its batch arrives: a step whose
        # input ends (OutOfRangeError, the end of an epoch of unknown
        # length) would otherwise still count itself in
        # `optimizer.iterations`, which depends on no data.
        arrived = [t for t in tf.nest.flatten(data, expand_composites=True) if isinstance(t, tf.Tensor)]
        with tf.control_dependencies(arrived), replica.replica_batch(replica.batch_rows(x), plan), \
                tf.variable_creator_scope(_created_before_the_batch):
            return step_fn(data)

    if not model.jit_compile or model.run_eagerly or plan.xla_forward:
        return replica_step
    return on_replica_device(tf.function(replica_step, jit_compile=True, reduce_retracing=True))


class Step:
    """Runs `model`'s `kind` steps under its strategy, up to `steps` per call.

    Args:
        model: A compiled Keras model created in its strategy's scope.
        kind: `"train"`, `"test"` or `"predict"`.
        steps: Steps per compiled call (`steps_per_execution`,
            `steps_per_loop`).

    Calling `step(iterator)` runs up to `steps` steps (`count` if given),
    fewer when the iterator runs out, and returns the global logs (train,
    test) or the predictions of every row in order (predict). It raises
    `StopIteration` when the iterator holds no batch at all.
    """

    def __init__(self, model, kind, *, steps=1):
        if kind not in KINDS:
            raise ValueError(f"`kind`={kind!r}: expected one of {list(KINDS)}.")
        if not validation.is_whole(steps, 1):
            raise ValueError(f"`steps`={steps!r}: expected a whole number >= 1.")
        self.model = model
        self.kind = kind
        self.steps = steps
        self.strategy = model.distribute_strategy
        strategies.check_collective_keys(self.strategy)
        self._single = replica_function(model, kind)
        self._looped = replica_function(model, kind, looped=True)
        # Collectives inside a compiled loop keep their first iteration's
        # shape; gathering predictions across workers (or sparse gradients,
        # see SparseGradientInLoop) changes shape with the batch.
        self._looping = not (kind == "predict" and strategies.traits(self.strategy).is_multi_worker)
        # What the looped step returns besides metrics, learnt while tracing.
        self._carried_specs = None
        self._carried_keys = frozenset()
        self._output_keys = None
        self._compile()

    # Compiled functions.

    @tf.autograph.experimental.do_not_convert
    def _run(self, data, looped=False):
        return self.strategy.run(self._looped if looped else self._single, args=(data,))

    @tf.autograph.experimental.do_not_convert
    def _finish(self, outputs, extras):
        if self.kind == "predict":
            return _keras_compat.concat_replicas(outputs, self.strategy)
        logs = step_logs(self.model, self.strategy, outputs)
        if isinstance(logs, dict):
            logs.update(extras)
        return logs

    @tf.autograph.experimental.do_not_convert
    def _extras(self, outputs):
        # Values a custom step returns that are not metrics (usually none).
        if self.kind == "predict" or not isinstance(outputs, dict):
            return {}
        names = metric_names(self.model) - self._carried_keys
        return {k: reduce_mean(self.strategy, v) for k, v in outputs.items() if k not in names}

    def _one(self, iterator):
        outputs = self._run(next(iterator))
        return self._finish(outputs, self._extras(outputs))

    def _many(self, iterator, count):
        if self.kind == "predict":
            first = self._finish(self._run(next(iterator)), {})
            return self._many_predictions(iterator, count, first)
        # Every step runs inside the loop, so the replica step is traced once
        # (per replica thread). The logs are read from the metrics after the
        # loop; what else the step returns (reduced) is carried out of it,
        # in the shapes the previous trace recorded (see _CarriedOutputs).
        # Each iteration fetches its batch first. (Fetching the next batch at
        # the end of an iteration, under `if steps < count`, keeps the step
        # out of a `tf.cond` and traces faster, ResNet spe=10 6.4 -> 5.7 CPU s
        # to the first step, but the fetch inside a `tf.cond` made every
        # looped step as slow as a call of one step: MLP spe=50 1.00x of
        # spe=1, against 1.71x this way.)
        carried = self._carried_specs
        last = _zeros_of(carried)
        steps = tf.constant(0)
        for _ in tf.range(count):
            tf.autograph.experimental.set_loop_options(shape_invariants=_invariants(last, carried))
            optional = iterator.get_next_as_optional()
            if not optional.has_value():
                break
            outputs = self._run(optional.get_value(), looped=True)
            last = self._carry(outputs, carried)
            steps += 1
        tf.debugging.assert_positive(steps, message=_NO_BATCH)
        return self._loop_logs(last)

    @tf.autograph.experimental.do_not_convert
    def _carry(self, outputs, carried):
        """The outputs to carry out of the loop; records their specs while tracing."""
        if isinstance(outputs, dict):
            self._output_keys = list(outputs)
            values = self._extras(outputs)
        else:
            self._output_keys = None
            values = tree.map_structure(lambda v: reduce_mean(self.strategy, v), outputs)
        if tf.executing_eagerly():  # run_eagerly: nothing is traced
            return values
        specs = tree.map_structure(tf.type_spec_from_value, values)
        if carried is None and isinstance(values, dict) and not values:
            self._carried_specs = specs  # nothing to carry, as the loop assumed
        elif carried is None or not _same_specs(specs, carried):
            self._carried_specs = specs
            raise _CarriedOutputs()
        return values

    @tf.autograph.experimental.do_not_convert
    def _loop_logs(self, last):
        if self._output_keys is None:
            return last
        metric_values = metric_results(self.model)
        missing = [k for k in self._output_keys if k not in last and k not in metric_values]
        if missing:
            # A key named like a metric that no metric reports: carry it too.
            self._carried_keys = self._carried_keys | set(missing)
            raise _CarriedOutputs()
        return {k: last[k] if k in last else metric_values[k] for k in self._output_keys}

    def _many_predictions(self, iterator, count, first):
        flat = tree.flatten(first)
        if not all(isinstance(t, tf.Tensor) for t in flat):
            raise _CompositeInLoop()
        arrays = [
            tf.TensorArray(t.dtype, size=0, dynamic_size=True, infer_shape=False).write(0, t)
            for t in flat
        ]
        index = tf.constant(1)
        for _ in tf.range(count - 1):
            optional = iterator.get_next_as_optional()
            if not optional.has_value():
                break
            outputs = tree.flatten(self._finish(self._run(optional.get_value(), looped=True), {}))
            arrays = [a.write(index, t) for a, t in zip(arrays, outputs)]
            index += 1
        return tree.pack_sequence_as(first, [a.concat() for a in arrays])

    def _skip(self, iterator, count):
        skipped = tf.constant(0)
        for _ in tf.range(count):
            optional = iterator.get_next_as_optional()
            if not optional.has_value():
                break
            skipped += 1
        return skipped

    def _compile(self):
        self._functions = {k: self._compiled(f)
                           for k, f in {"one": self._one, "many": self._many, "skip": self._skip}.items()}

    def _compiled(self, function):
        if self.model.run_eagerly:
            return function
        return tf.function(function, reduce_retracing=True)

    # Calling.

    def __call__(self, iterator, count=None):
        count = self.steps if count is None else int(count)
        functions = self._functions
        try:
            # With more than one step per call, every call (a last, shorter
            # one too) runs the looped function: one trace, not two.
            if count == 1 and self.steps == 1:
                return functions["one"](iterator)
            if self._looping:
                try:
                    return self._call_many(iterator, count)
                except SparseGradientInLoop:
                    self._looping = False
                    _warn_stepwise(self.model, count)
                except _CompositeInLoop:  # ragged or sparse predictions
                    self._looping = False
            return self._stepwise(iterator, count)
        except tf.errors.OutOfRangeError:
            raise StopIteration from None

    def _call_many(self, iterator, count):
        for attempt in range(3):
            try:
                return self._functions["many"](iterator, tf.constant(count))
            except _CarriedOutputs:
                if attempt == 2:
                    raise
                # A new function: one whose first trace failed may keep
                # what that trace left behind instead of tracing again.
                self._functions["many"] = self._compiled(self._many)
            except tf.errors.InvalidArgumentError as error:
                if _NO_BATCH in str(error.message):
                    raise StopIteration from None
                raise

    def _stepwise(self, iterator, count):
        results = []
        for _ in range(count):
            try:
                results.append(self._functions["one"](iterator))
            except tf.errors.OutOfRangeError:
                break
        if not results:
            raise StopIteration
        if self.kind != "predict":
            return results[-1]
        return tree.map_structure(lambda *parts: tf.concat(parts, axis=0), *results)

    def skip(self, iterator, count):
        """Moves `iterator` past up to `count` batches without running them.

        Resuming mid-epoch: the batches the backup already holds. Returns
        the number of batches skipped.
        """
        if count <= 0:
            return 0
        return int(self._functions["skip"](iterator, tf.constant(int(count))))

    def scheduled(self):
        """A function for a parameter-server coordinator to schedule.

        `function(iterator, count)` runs `count` steps on the worker that
        runs it, each on the next batch of that worker's iterator, and
        returns the global logs (read from the parameter servers).
        """
        strategy = self.strategy
        model = self.model
        single = self._single

        @tf.function
        def run_on_worker(iterator, count):
            for _ in tf.range(count):
                strategy.run(single, args=(next(iterator),))
            return metric_results(model)

        return run_on_worker


def _warn_stepwise(model, count):
    warnings.warn(
        f"{model.name}: {count} steps per call run as {count} calls of one step: the "
        "model has sparse gradients (e.g. from an Embedding), which cannot be all-gathered "
        "inside a compiled loop. The results are exact either way.",
        stacklevel=3,
    )


def shard_evaluator(model):
    """What a worker runs over one shard of evaluation data: the metric state it adds up to.

    Parameter-server evaluation sharded over the workers
    (`pss_evaluation_shards`): the coordinator schedules it on each shard and
    sums the states.

    The metrics update inside a `keras.StatelessScope` that starts from their
    reset values, so each shard's result is its own, whatever else ran.
    """
    strategy = model.distribute_strategy
    replica_step = replica_function(model, "test")
    variables = list(model.metrics_variables)

    def current(scope):
        return [tf.convert_to_tensor(scope.get_current_value(v), v.dtype) for v in variables]

    def replica_update(data, state):
        # The scope is entered on the replica's own thread (the strategy
        # runs replica functions on threads of their own).
        with keras.StatelessScope(state_mapping=list(zip(variables, state))) as scope:
            replica_step(data)
        return current(scope)

    @tf.function
    def evaluate_shard(iterator):
        with keras.StatelessScope() as scope:
            for metric in model.metrics:
                metric.reset_state()
        state = current(scope)
        optional = iterator.get_next_as_optional()
        while optional.has_value():
            state = strategy.run(replica_update, args=(optional.get_value(), state))
            optional = iterator.get_next_as_optional()
        return state

    return evaluate_shard
