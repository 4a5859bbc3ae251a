"""Keras's compiled losses, trackers and metrics (the process-wide replacements: `replacements`).

Part of `keras_distrib._keras_compat`: only these modules touch `keras.src`,
`tensorflow.python` or private attributes of Keras/TensorFlow objects.
"""

import keras
from tensorflow.python.distribute import device_util
from tensorflow.python.distribute import values as tf_values
from keras.src.losses import loss as keras_loss
from keras.src.trainers import compile_utils
from keras.src.utils import tracking

__all__ = [
    "CompileLoss",
    "backend_variable",
    "compile_loss_arguments",
    "compiled_loss",
    "compiled_loss_tracker_names",
    "compiled_losses",
    "compute_loss",
    "default_reduce_destination",
    "exit_summary_contexts",
    "loss_tracker",
    "mean_variables",
    "replace_compile_losses",
    "replace_mean_update",
    "replace_metric_result",
    "replace_metric_update",
    "set_compiled_loss",
    "set_loss_tracker",
    "squeeze_or_expand_to_same_rank",
    "sync_on_read_aggregation",
    "unscale_for_tracker",
]


def squeeze_or_expand_to_same_rank(x1, x2):
    """Keras's rank alignment of losses and weights (as `Loss.__call__` does it)."""
    return keras_loss.squeeze_or_expand_to_same_rank(x1, x2)


CompileLoss = compile_utils.CompileLoss


def compiled_loss_tracker_names(compile_loss):
    """The names of a built `CompileLoss`'s per-output trackers (`<name>_loss`), in order."""
    return [metric.name for metric in compile_loss._metrics]


def replace_compile_losses(compile_loss, losses, trackers):
    """After `CompileLoss.build`: its losses and per-output trackers replaced.

    `losses`: one per output, in `compiled_losses`'s order; `trackers`: one
    per name of `compiled_loss_tracker_names`, in its order.
    """
    compile_loss._flat_losses = [
        entry._replace(loss=loss) for entry, loss in zip(compile_loss._flat_losses, losses, strict=True)
    ]
    trackers = list(trackers)
    compile_loss._metrics.clear()
    compile_loss._metrics.extend(trackers)


def sync_on_read_aggregation(variable):
    """The `tf.VariableAggregation` of a Keras variable stored on-read per replica, else None.

    Keras metric variables are (`synchronization=ON_READ`): each replica adds
    to its own copy, and a read in cross-replica context aggregates them.
    """
    inner = getattr(variable, "_value", None)
    if not isinstance(inner, tf_values.SyncOnReadVariable):
        return None
    return inner.aggregation


def backend_variable(variable):
    """The TensorFlow variable behind a Keras variable (distributed under a strategy)."""
    return variable._value


def default_reduce_destination(strategy):
    """Where `strategy.reduce` puts its result: the current device, else the default one."""
    return device_util.current() or strategy.extended._default_device or "/device:CPU:0"


def compiled_losses(compile_loss):
    """The loss objects of a built `CompileLoss`, one per output (None before it is built)."""
    if not compile_loss.built:
        return None
    return [entry.loss for entry in compile_loss._flat_losses]


def compiled_loss(model):
    """The model's `CompileLoss` (None before compile or without a loss)."""
    return getattr(model, "_compile_loss", None)


def compile_loss_arguments(compile_loss):
    """What `compile` gave a `CompileLoss`: (loss, loss_weights, output_names)."""
    return compile_loss._user_loss, compile_loss._user_loss_weights, compile_loss.output_names


@tracking.no_automatic_dependency_tracking
def set_compiled_loss(model, compile_loss):
    """Replaces the model's `CompileLoss`."""
    model._compile_loss = compile_loss


def loss_tracker(model):
    """The model's `loss` tracker (None before compile)."""
    return getattr(model, "_loss_tracker", None)


@tracking.no_automatic_dependency_tracking
def set_loss_tracker(model, tracker):
    """Replaces the model's loss tracker."""
    model._loss_tracker = tracker


def exit_summary_contexts(callback, ignore):
    """Exits every summary-writer context a Keras TensorBoard callback has entered.

    Keras's TensorBoard keeps them on a stack (`_prev_summary_state`) while
    it writes; errors of the types in `ignore` are passed over.
    """
    while getattr(callback, "_prev_summary_state", None):
        writer_context, step_context = callback._prev_summary_state.pop()
        for part in (step_context, writer_context):
            try:
                part.__exit__(None, None, None)
            except ignore:
                pass


def unscale_for_tracker(share):
    """The value Keras's trackers expect: the replica loss times R."""
    return keras_loss.unscale_loss_for_distribution(share)


def _replace_on_instance(owner, name, make):
    """Sets `owner.<name>` to `make(owner, owner.<name>)` on the instance, once."""
    if getattr(vars(owner).get(name), "replaced_by_kd", False):
        return
    replacement = make(owner, getattr(owner, name))
    replacement.replaced_by_kd = True
    object.__setattr__(owner, name, replacement)


def replace_metric_result(metric, record):
    """Makes `metric.result()` return `record(metric, value)` of Keras's result `value` (idempotent)."""
    _replace_on_instance(metric, "result", lambda owner, result: lambda: record(owner, result()))


def replace_mean_update(metric, make_update):
    """Makes a `keras.metrics.Mean`'s `update_state` call `make_update(metric, keras_update)`.

    Only metrics whose `update_state` is Mean's own (trackers fed values, not
    `MeanMetricWrapper`s fed `y_true, y_pred`). Idempotent.
    """
    if type(metric).update_state is keras.metrics.Mean.update_state:
        _replace_on_instance(metric, "update_state", make_update)


def replace_metric_update(metric, make_update):
    """Makes `metric.update_state` call `make_update(metric, keras_update)` (idempotent)."""
    _replace_on_instance(metric, "update_state", make_update)


def mean_variables(metric):
    """A `keras.metrics.Mean`'s (total, count) variables."""
    return metric.total, metric.count


def compute_loss(model, **kwargs):
    """Keras's `_compute_loss` (compute_loss with its backward-compatible arguments)."""
    return model._compute_loss(**kwargs)
