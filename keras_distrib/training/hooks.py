"""What kd installs on a model before its steps: on its layers, variables, optimizers, metrics.

A kd model's layers, optimizers and metrics stay Keras's objects; kd
installs its per-replica behaviour on them (each replacement is listed with
its scope in `_keras_compat.replacements`):

- `install_layer_hooks`: on every layer, what `forward`, `draws` and
  `batch_norm` do on several replicas (add_loss terms recorded per replica,
  BatchNormalization's global moments, random layers drawing for the
  global batch, layers where rows meet computed on the global batch, a
  padded row for a plain Keras sub-model), the sum over replicas of a
  layer's state updates, central storage's writes from one replica, and
  the seed states in the model's checkpoints;
- `install_step_hooks`: at the first step, the process-wide replacements,
  kd's gradient pipeline on every optimizer the model holds, one device's
  logs from every metric, and a `compute_loss` of the model's own run on
  the global batch where its rows meet.

At compile, a metric made outside the strategy's scope is made again in it
(`metric_in_scope`), so its states travel in the step's gradient all-reduce.

Every installer is idempotent: the model calls them at compile, at the
first step and when its layers are built.
"""

import inspect

import keras
import tensorflow as tf

from keras_distrib import _keras_compat
from keras_distrib.training import batch_norm
from keras_distrib.training import coupling
from keras_distrib.training import draws
from keras_distrib.training import forward
from keras_distrib.training import gradients
from keras_distrib.training import logs as logs_lib
from keras_distrib.training import losses as kd_losses
from keras_distrib.training import replica

__all__ = [
    "install_layer_hooks",
    "install_replica_writes",
    "install_step_hooks",
    "is_kd_model",
    "metric_in_scope",
]


def is_kd_model(layer):
    """Whether `layer` is a kd model (`models.DistributedModelMixin`): it installs its own hooks."""
    return isinstance(layer, _keras_compat.ModelHooks)


def install_layer_hooks(model, variables=True):
    """Installs kd's per-replica hooks on every layer and variable of `model` (idempotent).

    `variables`: also the model's, metrics' and optimizer's variables;
    not in `compile`, where a subclass's own `compile` creates metrics
    after calling `super().compile()` (SimCLR's order).
    """
    per_replica = getattr(model, "batch_norm", "global") == "per_replica"
    for layer in _keras_compat.flatten_layers(model):
        _keras_compat.record_add_loss(layer, forward.record_loss)
        if isinstance(layer, keras.layers.BatchNormalization):
            _keras_compat.replace_batch_norm_moments(layer, batch_norm.global_moments)
            if per_replica:
                batch_norm.PER_REPLICA_BATCH_NORM.add(layer)
            else:
                batch_norm.PER_REPLICA_BATCH_NORM.discard(layer)
        # Keras's layers by what they do with the rows (their class
        # exactly; a subclass may change that, and is read instead).
        if type(layer) in forward.GLOBAL_BATCH_RANDOM_LAYERS:
            _keras_compat.replace_call(layer, draws.global_batch_call)
        elif type(layer) in forward.ROWS_MEET_LAYERS:
            _keras_compat.replace_call(layer, forward.rows_meet_call)
        elif type(layer) in forward.ROW_WISE_LAYERS:
            _keras_compat.replace_call(layer, forward.row_wise_call)
        elif isinstance(layer, keras.Model) and layer is not model and not is_kd_model(layer):
            # A plain Keras model inside: padded for an empty replica, a
            # place where rows may meet, and its outputs where a custom
            # step's own computations start (coupling.anchor).
            _keras_compat.replace_call(layer, forward.sub_model_call)
        elif layer is not model and forward.may_meet(layer):
            _keras_compat.replace_call(layer, forward.layer_call)
    for layer, variable in forward.layer_state(model):
        _keras_compat.replace_variable_updates(variable, forward.replica_state_updates(layer, variable))
    install_replica_writes(model)
    _track_random_states(model)
    if variables:
        _keras_compat.fix_variables(_keras_compat.model_variables(model))


def _track_random_states(model):
    # Keras's seed generators (random layers, a `SeedGenerator` of the
    # model's own) are not checkpoint dependencies of the model: a
    # restored model would draw other masks than the run it continues.
    # A child holding their states puts them in every checkpoint of the
    # model (kd's backups and the user's tf.train.Checkpoint alike).
    states = draws.random_states(model)
    current = getattr(model, "_kd_random_states", None)
    if current is not None and current.keys == draws.state_keys(states):
        return
    model._kd_random_states = draws.RandomStates(states)


def install_replica_writes(model):
    """Installs which replica writes BatchNormalization's statistics and the seed states.

    Under central storage, BatchNormalization's moving statistics are
    written by replica 0 (see `_keras_compat.write_from_first_replica`).
    Random layers' seed states are written by the last replica, after
    every replica has read them. Sets the model's `_kd_replica_writes`
    once its layers are built.
    """
    for layer in _keras_compat.flatten_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization):
            _keras_compat.write_from_first_replica(layer.non_trainable_variables)
        for generator in _keras_compat.owned_seed_generators(layer):
            _keras_compat.write_seed_state_from_last_replica(generator)
            _keras_compat.replace_seed_next(generator, draws.counted_draws)
    object.__setattr__(model, "_kd_replica_writes", model.built)


def install_step_hooks(model, *, kd_compute_loss):
    """Installs what a step needs: the process-wide replacements, kd's gradient pipeline on
    every optimizer, one device's logs from every metric (idempotent).

    The replaced `tf.GradientTape.gradient` (it reads what the target is to
    the rows first: `gradients.classify_gradient_target`) and each
    optimizer's `apply` (which all-reduces the gradients before Keras's
    update: `gradients.exact_optimizer`) are what keep a user's own
    `train_step` exact. kd's own `train_step` takes its gradient through
    the first, and all-reduces and applies at calls of its own
    (`gradients.all_reduce`, `gradients.apply_reduced`).

    `kd_compute_loss`: kd's own `compute_loss` (`DistributedModelMixin`'s);
    a model's `compute_loss` of its own runs on the global batch where its
    rows meet (`_compute_loss_on_global_batch`).
    """
    # For the whole process, at the first step (not on import); each is
    # Keras's or TensorFlow's own outside a kd replica step
    # (_keras_compat.replacements lists every replacement and its scope).
    _keras_compat.install_for_process(
        loss_call=kd_losses.loss_object_call, before_gradient=gradients.classify_gradient_target,
        random_draw=draws.global_batch_draw)
    for optimizer in gradients.optimizers_of(model):
        gradients.install(optimizer)
    _compute_loss_on_global_batch(model, kd_compute_loss)
    metrics = list(model.metrics)
    kd_losses.exact_trackers(metrics)
    kd_losses.exact_metric_updates(metrics)
    for metric in metrics:
        _keras_compat.replace_metric_result(metric, _record_result)


def _record_result(metric, value):
    """Tells kd's step which logs are `metric`'s result `value` (see step.py); returns `value`."""
    batch = replica.current_batch()
    if batch is not None:
        for key, leaf in logs_lib.result_leaves(metric.name, value):
            batch.metrics.results[id(leaf)] = (leaf, key)
    return value


def _compute_loss_on_global_batch(model, kd_compute_loss):
    """A `compute_loss` of the model's own runs on the global batch where its rows meet.

    (An in-batch contrastive loss: `coupling.call_on_global_batch`.) Its
    scalar result is then this replica's share, as kd's own `compute_loss`
    returns; a per-row result is the global batch's (GLOBAL).
    """
    if type(model).compute_loss is kd_compute_loss or "compute_loss" in vars(model):
        return
    own = type(model).compute_loss.__get__(model)

    def compute_loss(*args, **kwargs):
        result, _ = coupling.call_on_global_batch(
            model, lambda a, k: own(*a, **k), (args, kwargs), share_scalars=True)
        return result

    compute_loss.__signature__ = inspect.signature(own)  # Keras reads its arguments
    compute_loss.__doc__ = own.__doc__
    object.__setattr__(model, "compute_loss", compute_loss)


def metric_in_scope(metric):
    """`metric`, made again in the current strategy's scope if it was made outside it.

    A metric object made before the scope holds plain variables: each
    replica updates the one copy, and its state cannot travel in the step's
    gradient all-reduce with the other metrics' (it cost a collective of its
    own per step). Its config makes the same metric, with per-replica states.
    """
    if not isinstance(metric, keras.metrics.Metric) or \
            tf.distribute.get_strategy().num_replicas_in_sync == 1 or \
            all(_keras_compat.sync_on_read_aggregation(v) is not None for v in metric.variables):
        return metric
    try:
        return type(metric).from_config(metric.get_config())
    except (TypeError, ValueError, NotImplementedError):
        return metric  # a metric of one's own that cannot be made again: as it is
