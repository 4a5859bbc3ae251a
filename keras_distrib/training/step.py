"""The step: replica steps under `strategy.run`, several per compiled call.

`Step` is the one place in keras_distrib that calls `strategy.run`. `fit`,
`evaluate` and `predict` of kd models, `kd.TrainLoop`, the functions a
parameter-server coordinator schedules on its workers and the coordinator's
own exact evaluation all call a `Step`, so they cannot drift apart.

A step function runs up to k replica steps in one `tf.function` (a
`tf.range` loop: the graph does not grow with k) and returns global
results: train and test logs as one device reports them (`logs`: read from
the metric states, which kd's own training step brings in its gradient
all-reduce), predictions concatenated in input order.
"""

import functools
import warnings

import keras
import tensorflow as tf
from keras import tree

from keras_distrib import _keras_compat
from keras_distrib.training import collectives
from keras_distrib.training import coupling
from keras_distrib.training import first_step
from keras_distrib.training import gradients
from keras_distrib.training import logs as logs_lib
from keras_distrib.training import replica
from keras_distrib.cluster import strategies
from keras_distrib import validation

__all__ = [
    "Step",
    "on_replica_device",
    "plan_for",
    "replica_function",
    "shard_evaluator",
    "whole_step_xla",
]

KINDS = ("train", "test", "predict")
# Traces of a step at most, each finding a new place where rows meet (coupling.RowsMeet).
_RETRACES = 8


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
def _next_batch(iterator, agrees):
    """The next batch as an optional; without the workers' agreement when `agrees` is False.

    A distributed iterator that does not agree (`loop.join_workers`: every
    worker holds the same known number of batches) fetches with `next`.
    """
    if agrees:
        return iterator.get_next_as_optional()
    return tf.experimental.Optional.from_value(next(iterator))


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


# TensorFlow's stateful random ops (`tf.random.normal`, `tf.random.Generator`,
# ...): each device keeps its own state, so replicas cannot draw what one
# device draws for the global batch. Keras draws statelessly (kd lays those
# draws out, see draws.global_batch_draw).
STATEFUL_DRAWS = frozenset({
    "RandomStandardNormal", "RandomUniform", "RandomUniformInt", "TruncatedNormal",
    "ParameterizedTruncatedNormal", "Multinomial", "RandomShuffle", "RandomGamma",
    "RandomPoisson", "RandomPoissonV2", "StatefulStandardNormalV2", "StatefulUniform",
    "StatefulUniformInt", "StatefulUniformFullInt", "StatefulTruncatedNormal",
    "StatefulRandomBinomial",
})


_CALLS = ("PartitionedCall", "StatefulPartitionedCall")
# Ops whose attributes name functions of the graph's library (calls, branches, loops).
_WITH_FUNCTIONS = frozenset(_CALLS + ("If", "StatelessIf", "While", "StatelessWhile", "Case",
                                      "StatelessCase"))


def _stateful_draws(operations):
    """The stateful random ops among `operations`, nested functions included.

    Each op is judged by its type; only ops that run functions are read as
    NodeDefs, with the graph's function library, and only when the step
    calls a function (a step without calls is one graph: nothing nested).
    """
    found = {f"{op.type} ({op.name!r})": None for op in operations if op.type in STATEFUL_DRAWS}
    if any(op.type in _CALLS for op in operations):
        library = operations[0].graph.as_graph_def().library
        nested = [op.node_def for op in operations if op.type in _WITH_FUNCTIONS]
        found.update({f"{node.op} ({node.name!r})": None
                      for node, _ in collectives.walk(nested, library)
                      if node.op in STATEFUL_DRAWS})
    return list(found)


def refuse_stateful_draws(operations, owner):
    """Refuses TensorFlow's stateful random ops in `owner`'s step on several replicas."""
    if replica.replicas_in_sync() == 1:
        return
    found = _stateful_draws(operations)
    if found:
        raise ValueError(
            f"{owner} draws random numbers with TensorFlow's stateful ops: {', '.join(found)}. "
            f"On {replica.replicas_in_sync()} replicas each device draws from its own state, "
            "not the numbers one device draws for the global batch, so training would differ "
            "from one device. Draw with Keras's random functions and a seed generator "
            "(keras.random.normal(shape, seed=self.seed_generator), the generator a "
            "keras.random.SeedGenerator made in __init__), which kd lays out over the global "
            "batch, or draw in the input pipeline."
        )


def replica_function(model, kind, *, looped=False, sources=None, capture=None, one_device=False):
    """One replica's step of `kind`, inside its `ReplicaBatch`.

    Returns `(outputs, states)`: the step's outputs, and the global metric
    states its gradient all-reduce brought (kd's own `train_step`; see
    `sum_with_metric_states`), else None.

    With `capture` (a dict), a third value: `{"data": the replica's batch,
    "gradients": [the global gradients of each optimizer update]}`, what the
    first-step check compares; the variables of each update go in
    `capture["variables"]` when traced. With `one_device`, the step is one
    device's, run eagerly on a global batch (the check's reference): it
    returns `(outputs, states, [(variables, gradients) of each update])`.

    Keras's Optional inputs become None, and the replica's batch (row
    counts, the plan) is open around the model's step, so an overridden
    `train_step` gets kd's arithmetic too. With `jit_compile=True`, the
    whole step is compiled by XLA where the strategy allows it; otherwise
    (several CPU replicas) the forward and backward passes are
    (`StepPlan.xla_forward`), and the all-reduces run outside XLA.
    """
    step_fn = {"train": model.train_step, "test": model.test_step,
               "predict": model.predict_step}[kind]
    plan = replica.StepPlan() if one_device else plan_for(model, looped=looped)
    sources = {} if sources is None else sources
    records = capture is not None or one_device

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
        with tf.control_dependencies(arrived), \
                replica.replica_batch(replica.batch_rows(x), plan) as batch, \
                tf.variable_creator_scope(_created_before_the_batch):
            batch.step = replica.StepIdentity(model=model, kind=kind, retraceable=True,
                                              rows_meet=getattr(model, "rows_meet", "global"))
            # The data's leaves, the batch's first (kd lays out rows of each, coupling.row_layout).
            leaves = [t for t in tree.flatten(x) + tree.flatten(data)
                      if isinstance(t, tf.Tensor) and t.shape.rank]
            batch.rows.leaves = list({t.ref(): t for t in leaves}.values())
            if records:
                batch.reduced.recorded_gradients = []
            graph = tf.compat.v1.get_default_graph()
            first = len(graph.get_operations()) if not tf.executing_eagerly() else None
            # Leaves of the data a previous trace found rows meeting in are
            # gathered (a custom step's labels against gathered embeddings).
            outputs = step_fn(coupling.planned_data(data, batch))
            if first is not None:
                refuse_stateful_draws(graph.get_operations()[first:],
                                      f"{type(model).__name__}.{kind}_step")
            outputs = outputs if kind == "predict" else logs_lib.replica_logs(outputs, sources)
            if one_device:
                return outputs, batch.reduced.global_metric_states, batch.reduced.recorded_gradients
            if capture is not None:
                capture["variables"] = [variables for variables, _ in batch.reduced.recorded_gradients]
                return outputs, batch.reduced.global_metric_states, {
                    "data": data, "gradients": [values for _, values in batch.reduced.recorded_gradients]}
            return outputs, batch.reduced.global_metric_states

    if one_device or not model.jit_compile or model.run_eagerly or plan.xla_forward:
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
    `StopIteration` when the iterator holds no batch at all. An evaluation
    step called with `logs=False` returns `{}` and reads no metric (no
    collective): `read_logs()` reads them once, at the end.

    A training step function's first call, on several replicas, checks its
    first step against one device's and refuses a difference
    (`keras_distrib.training.first_step`); so does the first call after the
    step is traced anew where rows met.
    """

    def __init__(self, model, kind, *, steps=1):
        if kind not in KINDS:
            raise ValueError(f"`kind`={kind!r}: expected one of {list(KINDS)}.")
        if not validation.is_whole(steps, 1):
            raise ValueError(f"`steps`={steps!r}: expected a whole number >= 1.")
        self.model = model
        self.kind = kind
        self.steps_per_call = steps
        self.strategy = model.distribute_strategy
        strategies.check_collective_keys(self.strategy)
        # Which of a step's outputs are metric results (path -> log key), learnt while tracing.
        self._sources = {}
        # The first-step check (first_step.py): the call of one step also
        # returns its batch and global gradients, compared with one device's
        # at the first call of each traced function.
        self._checks = kind == "train" and first_step.applies(model, self.strategy)
        self._captured = None
        self._capture = {} if self._checks else None
        self._single = replica_function(model, kind, sources=self._sources, capture=self._capture)
        self._looped = replica_function(model, kind, looped=True, sources=self._sources)
        # Collectives inside a compiled loop keep their first iteration's
        # shape; gathering predictions across workers (or sparse gradients,
        # see gradients.SparseGradientInLoop) changes shape with the batch.
        self._looping = not (kind == "predict" and strategies.traits(self.strategy).is_multi_worker)
        # What the looped step returns besides metrics, learnt while tracing.
        self._carried_specs = None
        self._outputs = None  # the structure the looped step returns
        self._states_carried = False
        self._compile()

    # Compiled functions.

    @tf.autograph.experimental.do_not_convert
    def _run(self, data, looped=False):
        return self.strategy.run(self._looped if looped else self._single, args=(data,))

    @tf.autograph.experimental.do_not_convert
    def _finish(self, outputs, extras, states=None):
        if self.kind == "predict":
            return _keras_compat.concat_replicas(outputs, self.strategy)
        return logs_lib.step_logs(self.model, self.strategy, outputs, self._sources, extras,
                                  logs_lib.global_states_of(self.strategy, states),
                                  by_name=logs_lib.reports_only_metrics(self.model, self.kind))

    @tf.autograph.experimental.do_not_convert
    def _extras(self, outputs):
        # Outputs of a custom step that are not metric results (usually none), by path.
        if self.kind == "predict":
            return {}
        return {logs_lib.path_key(path): logs_lib.reduce_mean(self.strategy, value)
                for path, value in tree.flatten_with_path(outputs) if path not in self._sources}

    # As written, as Keras's own step function runs: nothing here needs
    # AutoGraph (no tensor-dependent Python control flow), and converting it
    # costs CPU before every first step.
    @tf.autograph.experimental.do_not_convert
    def _one(self, iterator, logs=True):
        outputs, states, *captured = self._run(next(iterator))
        result = self._finish(outputs, self._extras(outputs), states) if logs else {}
        return (result, captured[0]) if captured else result

    def _logs_of(self, result):
        # The call of one step returns what the first-step check compares
        # too (with the check on); kept for it only while it is due.
        if not self._checks:
            return result
        logs, captured = result
        self._captured = captured if self._check_due else None
        return logs

    def _many(self, iterator, count, logs=True):
        if self.kind == "predict":
            first = self._finish(self._run(next(iterator))[0], {})
            return self._many_predictions(iterator, count, first)
        # Every step runs inside the loop, so the replica step is traced once
        # (per replica thread). The logs are read from the metrics after the
        # loop; what else the step returns (reduced) is carried out of it,
        # in the shapes the previous trace recorded (see _CarriedOutputs).
        # Each iteration fetches its batch first: a fetch at the end of an
        # iteration would sit inside a `tf.cond` (`if steps < count`), which
        # makes every looped step as slow as a call of one step
        # (docs/benchmarks/2026-11-24-first-step.md).
        # The global metric states, when the step's gradient all-reduce
        # brings them (see sum_with_metric_states), are carried out too: the
        # logs then cost no collective.
        carried = self._carried_specs
        last = _zeros_of(carried)
        states = self._no_states()
        agrees = _keras_compat.agrees_on_batches(iterator)
        steps = tf.constant(0)
        for _ in tf.range(count):
            tf.autograph.experimental.set_loop_options(shape_invariants=_invariants(last, carried))
            optional = _next_batch(iterator, agrees)
            if not optional.has_value():
                break
            outputs, step_states = self._run(optional.get_value(), looped=True)
            last = self._carry(outputs, carried)
            states = self._carry_states(step_states, states)
            steps += 1
        tf.debugging.assert_positive(steps, message=_NO_BATCH)
        if not logs:
            return {}
        return self._loop_logs(last, states if self._states_carried else None)

    @tf.autograph.experimental.do_not_convert
    def _no_states(self):
        self._states_carried = False
        return [tf.zeros(v.shape, v.dtype) for v in self.model.metrics_variables]

    @tf.autograph.experimental.do_not_convert
    def _carry_states(self, step_states, states):
        if step_states is None:
            return states
        self._states_carried = True
        return logs_lib.global_states_of(self.strategy, step_states)

    @tf.autograph.experimental.do_not_convert
    def _carry(self, outputs, carried):
        """The outputs to carry out of the loop; records their specs while tracing."""
        self._outputs = outputs
        values = self._extras(outputs)
        if tf.executing_eagerly():  # run_eagerly: nothing is traced
            return values
        specs = tree.map_structure(tf.type_spec_from_value, values)
        if carried is None and not values:
            self._carried_specs = specs  # nothing to carry, as the loop assumed
        elif carried is None or not _same_specs(specs, carried):
            self._carried_specs = specs
            raise _CarriedOutputs()
        return values

    @tf.autograph.experimental.do_not_convert
    def _loop_logs(self, last, states):
        return logs_lib.step_logs(self.model, self.strategy, self._outputs, self._sources, last,
                                  states, by_name=logs_lib.reports_only_metrics(self.model, self.kind))

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
            outputs = tree.flatten(self._finish(self._run(optional.get_value(), looped=True)[0], {}))
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
        functions = {"one": self._one, "many": self._many, "skip": self._skip,
                     "quiet_one": functools.partial(self._one, logs=False),
                     "quiet_many": functools.partial(self._many, logs=False)}
        self._functions = {k: self._compiled(f) for k, f in functions.items()}
        self._read_function = None
        self._check_due = self._checks

    @tf.autograph.experimental.do_not_convert
    def _read(self):
        return logs_lib.metric_results(self.model)

    def read_logs(self):
        """The metrics' global values, read once: one packed all-reduce per dtype.

        What a loop calls once at the end of an evaluation whose steps ran
        with `logs=False`.
        """
        if self._read_function is None:
            self._read_function = self._compiled(self._read)
        with _keras_compat.released_custom_gradients():
            return self._read_function()

    def _compiled(self, function):
        if self.model.run_eagerly:
            return function
        return tf.function(function, reduce_retracing=True)

    # Calling.

    def __call__(self, iterator, count=None, *, logs=True):
        # Where a trace finds the rows of the batch meeting at a place kd had
        # not looked (coupling.RowsMeet), kd has recorded what to gather: the
        # step is traced again, from new functions. A trace raises before any
        # batch is read, so no data is lost.
        for _ in range(_RETRACES):
            try:
                if self._check_due:
                    return self._checked_call(iterator, count, logs)
                return self._call(iterator, count, logs)
            except coupling.RowsMeet as meeting:
                where = str(meeting)
                self._compile()
                self._sources.clear()
                self._carried_specs = None
        raise ValueError(
            f"{type(self.model).__name__}'s {self.kind} step: the rows of the batch still meet "
            f"after {_RETRACES} traces on the global batch ({where}). Compile the model with "
            "rows_meet=\"per_replica\" to leave each replica its own rows, or gather them yourself "
            "with kd.losses.global_batch(tensor)."
        )

    def _checked_call(self, iterator, count, logs):
        """A call whose first step is checked against one device (first_step.check).

        The first step runs alone (the call of one step), compared with one
        device's before the call goes on; a difference raises with every
        variable put back as it was before the step.
        """
        with self.strategy.scope(), _keras_compat.eager_ops_as_kernels():
            snapshot = first_step.Snapshot(self.model)
        result = self._call(iterator, 1, logs, alone=True)
        captured, self._captured = self._captured, None
        with self.strategy.scope(), _keras_compat.eager_ops_as_kernels():
            first_step.check(self.model, self.strategy, self._single_one_device(), result,
                             {**captured, "variables": self._capture["variables"]}, snapshot,
                             rerun=lambda batches: self._rerun(batches, logs))
        self._check_due = False
        count = self.steps_per_call if count is None else int(count)
        if count <= 1:
            return result
        try:
            return self._call(iterator, count - 1, logs)
        except StopIteration:
            return result

    def _rerun(self, iterator, logs):
        """The first step again on `iterator`'s batch (the check's sub-batch): its logs and capture."""
        result = self._call(iterator, 1, logs, alone=True)
        captured, self._captured = self._captured, None
        return result, {**captured, "variables": self._capture["variables"]}

    def _single_one_device(self):
        return replica_function(self.model, self.kind, one_device=True)

    def _call(self, iterator, count, logs, alone=False):
        # A call that traces drops what its trace registered in TensorFlow's
        # gradient registry for all-reduces (released_custom_gradients):
        # else every step function traced stays alive with its graph.
        with _keras_compat.released_custom_gradients():
            count = self.steps_per_call if count is None else int(count)
            functions = self._functions
            # Without logs (evaluation whose logs are read once, at its end:
            # `read_logs`) a call reads no metric and makes no collective for it.
            quiet = "" if logs or self.kind != "test" else "quiet_"
            try:
                # With more than one step per call, every call (a last, shorter
                # one too) runs the looped function: one trace, not two.
                if alone or (count == 1 and self.steps_per_call == 1):
                    return self._logs_of(functions[quiet + "one"](iterator))
                if self._looping:
                    try:
                        return self._call_many(iterator, count, quiet)
                    except (gradients.SparseGradientInLoop, coupling.GatherInLoop) as why:
                        self._looping = False
                        _warn_stepwise(self.model, count, why)
                    except _CompositeInLoop:  # ragged or sparse predictions
                        self._looping = False
                return self._stepwise(iterator, count, quiet)
            except tf.errors.OutOfRangeError:
                raise StopIteration from None
            except tf.errors.InvalidArgumentError as error:
                message = str(error.message)
                if replica.DRAW_REFUSAL in message:
                    raise ValueError(replica.DRAW_REFUSAL) from None
                if coupling.ROWS_REFUSAL in message:
                    raise ValueError(message[message.index(coupling.ROWS_REFUSAL):].split("\n")[0]) from None
                raise

    def _call_many(self, iterator, count, quiet=""):
        for attempt in range(3):
            try:
                return self._functions[quiet + "many"](iterator, tf.constant(count))
            except _CarriedOutputs:
                if attempt == 2:
                    raise
                # A new function: one whose first trace failed may keep
                # what that trace left behind instead of tracing again.
                self._functions[quiet + "many"] = self._compiled(
                    functools.partial(self._many, logs=not quiet))
            except tf.errors.InvalidArgumentError as error:
                if _NO_BATCH in str(error.message):
                    raise StopIteration from None
                raise

    def _stepwise(self, iterator, count, quiet=""):
        results = []
        for _ in range(count):
            try:
                results.append(self._logs_of(self._functions[quiet + "one"](iterator)))
            except tf.errors.OutOfRangeError:
                break
        if not results:
            raise StopIteration
        if self.kind != "predict":
            return results[-1]
        return tree.map_structure(lambda *parts: tf.concat(parts, axis=0), *results)

    def compiled_functions(self):
        """The graphs TensorFlow traced for this step, by function.

        `{"one": [...], "many": [...], "quiet_one": [...], "quiet_many": [...],
        "read": [...]}`: the `ConcreteFunction`s of the call of one step, of
        the looped call of several, the same without logs (`logs=False`), and
        of the separate read of the logs (`read_logs`); empty lists when not
        traced (or with `run_eagerly`). What `keras_distrib.training.collectives`
        counts.
        """
        functions = {**self._functions, "read": self._read_function}
        return {name: [] if self.model.run_eagerly or function is None
                else _keras_compat.concrete_functions(function)
                for name, function in functions.items() if name != "skip"}

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
            return logs_lib.metric_results(model)

        return run_on_worker


def _warn_stepwise(model, count, why):
    what = ("the model has sparse gradients (e.g. from an Embedding), which cannot be "
            "all-gathered inside a compiled loop" if isinstance(why, gradients.SparseGradientInLoop) else
            "the rows of its batch meet, and kd gathers the global batch there, which a "
            "compiled loop cannot hold (its shape changes with an uneven last batch)")
    warnings.warn(
        f"{model.name}: {count} steps per call run as {count} calls of one step: {what}. "
        "The results are exact either way.",
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
