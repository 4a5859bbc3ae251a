"""The optimizer's gradient pipeline: Keras's all-reduce skipped, its conditionals in cross-replica context.

Part of `keras_distrib._keras_compat`: only these modules touch `keras.src`,
`tensorflow.python` or private attributes of Keras/TensorFlow objects.
"""

import weakref

import tensorflow as tf
from tensorflow.python.distribute import ps_values

__all__ = [
    "apply_reduced",
    "base_optimizer",
    "has_gradient_pipeline",
    "install_gradient_pipeline",
    "replace_reduced_apply",
    "updated_variables",
]


#
# Keras's TF optimizer all-reduces inside `_backend_update_step`, after it
# has unscaled, accumulated and clipped each replica's partial gradient.
# kd all-reduces first (in `apply`), so these hooks make the optimizer skip
# its own reduction, and run the conditionals of `_backend_apply_gradients`
# (accumulation, EMA overwrite) in cross-replica context, where TensorFlow
# allows a `merge_call` inside a branch. Both are set on the optimizer
# instance only: other optimizers keep Keras's behaviour.

# Each pipeline optimizer's own `apply` (Keras's), which applies gradients
# already summed over the replicas: its function, called with the optimizer
# (a bound method would keep the optimizer alive).
_KERAS_APPLY = weakref.WeakKeyDictionary()
_REPLICA_THREAD_STRATEGIES = (
    tf.distribute.MirroredStrategy,
    tf.distribute.MultiWorkerMirroredStrategy,
    tf.distribute.experimental.CentralStorageStrategy,
)


def base_optimizer(optimizer):
    """The optimizer that applies updates (a LossScaleOptimizer's inner one)."""
    return getattr(optimizer, "inner_optimizer", None) or optimizer


def has_gradient_pipeline(optimizer):
    """Whether kd's gradient pipeline is installed on `optimizer`."""
    return optimizer in _KERAS_APPLY


def apply_reduced(optimizer, grads, trainable_variables):
    """Keras's `optimizer.apply` on gradients already summed over the replicas.

    For a step that all-reduces at its own call (kd's `train_step`): the
    optimizer, which has kd's pipeline, updates as on one device, with no
    reduction of its own and no second one of kd's.
    """
    return _KERAS_APPLY[optimizer](optimizer, grads, trainable_variables)


def replace_reduced_apply(optimizer, apply):
    """Makes `apply_reduced` on `optimizer` call `apply(optimizer, grads, trainable_variables)`.

    Returns the function it replaces, to put back the same way (kd's
    first-step check records the update instead of writing it).
    """
    kept = _KERAS_APPLY[optimizer]
    _KERAS_APPLY[optimizer] = apply
    return kept


def updated_variables(optimizer, trainable_variables=None):
    """The variables `optimizer.apply(grads, trainable_variables)` updates, as a list."""
    if trainable_variables is None:
        return list(optimizer._trainable_variables or ())
    return list(trainable_variables)


def install_gradient_pipeline(optimizer, aggregate, before_apply):
    """Makes `optimizer.apply` call `aggregate(grads, variables)` before anything else.

    `before_apply(optimizer, trainable_variables)` runs first (kd builds an
    unbuilt optimizer there); `aggregate` all-reduces the replicas'
    gradients; after it every replica holds the global gradient, and the
    optimizer's own reduction is skipped. The replaced `apply` is for a
    user's own step (`optimizer.apply_gradients(...)`); a step that
    all-reduces at its own call applies through `apply_reduced`.
    """
    if optimizer in _KERAS_APPLY:
        return
    outer_apply = optimizer.apply

    def apply(grads, trainable_variables=None):
        before_apply(optimizer, trainable_variables)
        variables = updated_variables(optimizer, trainable_variables)
        return outer_apply(aggregate(list(grads), variables), trainable_variables)

    object.__setattr__(optimizer, "apply", apply)
    base = base_optimizer(optimizer)
    object.__setattr__(base, "_all_reduce_sum_gradients", lambda grads_and_vars: list(grads_and_vars))
    backend_apply = base._backend_apply_gradients

    def backend_apply_gradients(grads, trainable_variables):
        if not _needs_cross_replica_conditionals(base):
            return backend_apply(grads, trainable_variables)
        context = tf.distribute.get_replica_context()
        context.merge_call(
            lambda distribution, grads: _apply_in_cross_replica(
                base, distribution, grads, trainable_variables
            ),
            args=(grads,),
        )

    object.__setattr__(base, "_backend_apply_gradients", backend_apply_gradients)
    object.__setattr__(base, "assign", _first_replica_optimizer_assign(base.assign))
    if getattr(outer_apply, "__self__", None) is optimizer:
        _KERAS_APPLY[optimizer] = outer_apply.__func__
    else:  # an `apply` set on the instance before kd's
        _KERAS_APPLY[optimizer] = lambda _, *args: outer_apply(*args)


def _first_replica_optimizer_assign(optimizer_assign):
    """`optimizer.assign` that writes central-storage state from replica 0.

    Keras's optimizer assigns some state in each replica (Nadam's
    momentum-cache product, before its cross-replica update), to a variable
    without an aggregation: under CentralStorageStrategy TensorFlow refuses
    that ("You must specify an aggregation method"). Every replica computes
    the same value from the same all-reduced state, so replica 0 writes it,
    as `write_from_first_replica` does for BatchNormalization.
    """

    def assign(variable, value):
        inner = getattr(variable, "_value", None)
        context = tf.distribute.get_replica_context()
        if (
            not isinstance(inner, ps_values.AggregatingVariable)
            or inner.aggregation != tf.VariableAggregation.NONE
            or context is None
            or context.num_replicas_in_sync == 1
        ):
            return optimizer_assign(variable, value)
        stored = inner.get()
        value = tf.cast(value, stored.dtype)
        first = tf.equal(context.replica_id_in_sync_group, 0)
        tf.cond(first, lambda: stored.assign(value).op, tf.no_op)

    assign.__name__ = "assign"
    return assign


def _needs_cross_replica_conditionals(optimizer):
    if tf.distribute.get_replica_context() is None or not tf.distribute.has_strategy():
        return False
    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        return False
    if not isinstance(tf.distribute.get_strategy(), _REPLICA_THREAD_STRATEGIES):
        return False
    return bool(optimizer.gradient_accumulation_steps) or bool(
        optimizer.use_ema and optimizer.ema_overwrite_frequency
    )


def _apply_in_cross_replica(optimizer, distribution, grads, variables):
    """Keras's `_backend_apply_gradients`, its `cond`s in cross-replica context.

    Every replica holds the same (all-reduced) gradient, so each branch runs
    the same replica function on every replica, as one device would run it.

    Keras's own method cannot serve here. In a replica, its `ops.cond`
    (accumulation, EMA overwrite) holds the update, whose `merge_call`
    (`_backend_update_step`, `_apply_weight_decay`) TensorFlow refuses in a
    branch ("`merge_call` called while defining a new graph or a
    tf.function"); in cross-replica context its arithmetic on the gradients
    (`(g + acc_g) / steps`, clipping) refuses the per-replica values
    `merge_call` hands over ("using a PerReplica object while not inside a
    replica context"). No smaller method holds the conditionals. The pieces
    called here are Keras's own; `tests/test_keras_compat.py` checks that
    Keras's method still holds each of them.
    """

    def on_replicas(function):
        return lambda: distribution.extended.call_for_each_replica(function, args=(grads,))

    def update(step_grads):
        step_grads = optimizer._clip_gradients(step_grads)
        optimizer._apply_weight_decay(variables)
        optimizer._backend_update_step(step_grads, variables, optimizer.learning_rate)

    steps = optimizer.gradient_accumulation_steps
    if steps:
        accumulators = [
            optimizer._accumulated_gradients[optimizer._get_variable_index(v)] for v in variables
        ]

        def update_with_accumulated(step_grads):
            update([(g + a) / steps for g, a in zip(step_grads, accumulators)])
            optimizer._backend_reset_gradient_accumulators()

        def accumulate(step_grads):
            optimizer._backend_increment_gradient_accumulators(step_grads, accumulators)

        is_update_step = tf.equal((optimizer._iterations + 1) % steps, 0)
        tf.cond(is_update_step, on_replicas(update_with_accumulated), on_replicas(accumulate))
    else:
        on_replicas(update)()
    if optimizer.use_ema:
        trainable = optimizer._trainable_variables
        on_replicas(lambda _: optimizer._update_model_variables_moving_average(trainable))()
        if optimizer.ema_overwrite_frequency:
            overwrite = tf.equal((optimizer.iterations + 1) % optimizer.ema_overwrite_frequency, 0)
            tf.cond(
                overwrite,
                on_replicas(lambda _: optimizer._overwrite_model_variables_with_average_value(trainable)),
                lambda: None,
            )
