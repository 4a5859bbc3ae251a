"""Metric states and the step's logs: one device's values, read with as few collectives as can be.

Train and test logs are read from the metric variables in cross-replica
context, where SyncOnRead variables are summed over every replica and
worker: the true global values (Keras averages each replica's local
results, wrong whenever replicas hold different numbers of rows),
all-reduced together in one flat buffer per dtype (`metric_results`). kd's
own training step brings them instead: its metric states travel in the
gradient all-reduce (`sum_with_metric_states`, called by
`gradients.all_reduce`), so its logs cost no collective of their own.
What a custom step returns besides metric results is reduced as one
device's value (`replica_logs`, `step_logs`).
"""

import keras
import tensorflow as tf
from keras import tree

from keras_distrib import _keras_compat
from keras_distrib.training import losses as kd_losses
from keras_distrib.training import replica
from keras_distrib.cluster import strategies

__all__ = [
    "global_states_of",
    "metric_names",
    "metric_results",
    "metrics_only",
    "packs_metric_states",
    "path_key",
    "reduce_mean",
    "replica_logs",
    "reports_only_metrics",
    "result_leaves",
    "step_logs",
    "sum_with_metric_states",
]


def metric_results(model, states=None):
    """Every model metric's value; global when read in cross-replica context.

    Under mirrored and multi-worker mirrored strategies, every metric
    variable is summed over the replicas in one packed all-reduce (one
    collective per read of the logs and dtype; reading them one by one would
    make one per variable, each a round trip across workers). `states`: the
    global values of `model.metrics_variables`, when the step's gradient
    all-reduce brought them (see `sum_with_metric_states`); no collective then.
    """
    variables = list(model.metrics_variables)
    values = states if states is not None else _global_values(model.distribute_strategy, variables)
    if values is None:
        return _read_results(model)
    with keras.StatelessScope(state_mapping=list(zip(variables, values))):
        return _read_results(model)


_BATCHED_READS = (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy)
_SUMMED = (tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN)


def packs_metric_states(variables):
    """Whether every one of `variables` is stored per replica, summed or averaged on read."""
    return all(_keras_compat.sync_on_read_aggregation(v) in _SUMMED for v in variables)


def sum_with_metric_states(context, tensors, variables):
    """Sums `tensors` and the local states of metric `variables` over the replicas, packed.

    One all-reduce per dtype (`replica.sum_packed`), in replica context.
    Returns the summed `tensors` and each variable's global value: its sum
    over the replicas, divided by the replicas in sync for a MEAN variable,
    as a read in cross-replica context gives it. Every variable must pass
    `packs_metric_states`.
    """
    tensors = list(tensors)
    states = [tf.convert_to_tensor(v.value, v.dtype) for v in variables]
    summed = replica.sum_packed(context, tensors + states)
    replicas = replica.replicas_in_sync()
    values = [
        value / tf.cast(replicas, value.dtype)
        if _keras_compat.sync_on_read_aggregation(variable) == tf.VariableAggregation.MEAN
        else value
        for variable, value in zip(variables, summed[len(tensors):])
    ]
    return summed[:len(tensors)], values


def _global_values(strategy, variables):
    """The global values of `variables` (metric state), all-reduced together, or None.

    One packed all-reduce per dtype of every per-replica variable (TensorFlow's
    `batch_reduce_to` on SyncOnRead variables falls back to one collective
    per variable). None outside cross-replica context, with one replica, or
    under a strategy whose metric variables are not per replica (those read
    as they are).
    """
    if tf.distribute.get_replica_context() is not None and tf.distribute.has_strategy():
        return None
    if not isinstance(strategy, _BATCHED_READS) or strategy.num_replicas_in_sync == 1:
        return None
    packed = [i for i, v in enumerate(variables) if packs_metric_states([v])]
    values = [None if i in packed else tf.convert_to_tensor(v.value)
              for i, v in enumerate(variables)]
    if not packed:
        return values

    def replica_read():
        context = tf.distribute.get_replica_context()
        return sum_with_metric_states(context, [], [variables[i] for i in packed])[1]

    with strategy.scope():
        reduced = strategy.run(replica_read)
    for index, value in zip(packed, reduced):
        values[index] = strategy.experimental_local_results(value)[0]
    return values


def global_states_of(strategy, states):
    """The global metric states a replica step returned (identical on every replica), or None."""
    if states is None:
        return None
    return [strategy.experimental_local_results(value)[0] for value in states]


def result_leaves(name, value):
    """`[(log key, tensor)]` of a metric's `result()`, keyed as Keras's logs key them.

    A dict result is keyed by its own keys, a nested dict's (Keras's
    `compile_metrics` holding a metric whose result is a dict) by the inner
    keys, as Keras's `pythonify_logs` flattens them; anything else by
    `name`, the metric's.
    """
    if not isinstance(value, dict):
        return [(name, value)]
    return [pair for key, leaf in value.items() for pair in result_leaves(key, leaf)]


def _read_results(model):
    return dict(pair for metric in model.metrics for pair in result_leaves(metric.name, metric.result()))


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


def path_key(path):
    """The log key of an output's path in a step's nested outputs (`a/0/b`)."""
    return "/".join(map(str, path))


def replica_logs(outputs, sources):
    """What a replica step returns, ready to be reduced over the replicas (replica context).

    A custom step may return anything; one device's value of each entry is
    what kd's logs report:

    - a metric's `result()` (also inside Keras's nested `compile_metrics`):
      recorded in `sources` (path -> log key), read later as the metric's
      global value;
    - a loss share kd computed (`compute_loss`, a Keras loss object,
      `kd.losses`): its sum over replicas, so times R before the mean;
    - any other scalar: taken as a mean over the replica's rows (or a value
      every replica shares), weighted by n_r / N (`kd.losses.row_weighted`),
      times R before the mean;
    - anything else: Keras's mean over replicas.
    """
    batch = replica.current_batch()
    if batch is None:
        return outputs
    replicas = replica.replicas_in_sync()
    leaves = []
    for path, value in tree.flatten_with_path(outputs):
        record = batch.metrics.results.get(id(value))
        if record is not None and record[0] is value:
            sources[path] = record[1]
        elif replicas > 1 and tf.is_tensor(value) and value.dtype.is_floating \
                and value.shape.rank == 0:
            value = kd_losses.replica_part(value, what=f"the step's log {path_key(path)!r}") \
                * tf.cast(replicas, value.dtype)
        leaves.append(value)
    return tree.pack_sequence_as(outputs, leaves)


def step_logs(model, strategy, outputs, sources=None, extras=None, states=None, by_name=False):
    """Global logs for the outputs of a replica step (see `replica_logs`).

    Entries recorded in `sources` take their metric's global value; the
    others are averaged over replicas (`extras`, by path, when already
    reduced). Nested dicts (Keras's `compile_metrics`) keep their nesting.
    `states`: the global metric states the step's gradient all-reduce
    brought, if any (no collective then; see `sum_with_metric_states`).
    `by_name`: the step is kd's own (its outputs are its metrics' results),
    so a top-level key naming a metric takes that metric's global value
    even where its result was not recorded (a multi-output model's
    per-output loss trackers, which Keras reads inside its compiled loss).
    """
    sources = sources or {}
    metric_values = metric_results(model, states) if sources or by_name else {}
    leaves = []
    for path, value in tree.flatten_with_path(outputs):
        key = sources.get(path)
        if key is None and by_name and len(path) == 1:
            key = path[0]
        if key is not None and key in metric_values:
            leaves.append(metric_values[key])
        elif extras is not None and path_key(path) in extras:
            leaves.append(extras[path_key(path)])
        else:
            leaves.append(reduce_mean(strategy, value))
    return tree.pack_sequence_as(outputs, leaves)


def metrics_only(step_method):
    """Marks a kd `train_step`/`test_step` whose outputs are its metrics' results.

    Such a step's logs can be read from the metrics alone, so a loop may read
    them once instead of after every call (`reports_only_metrics`).
    """
    step_method.kd_metrics_only = True
    return step_method


def reports_only_metrics(model, kind):
    """Whether `model`'s `kind` step is kd's own (its logs are its metrics' results)."""
    return getattr(getattr(type(model), f"{kind}_step", None), "kd_metrics_only", False) is True
