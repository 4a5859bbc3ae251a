"""Keras's model and trainer internals: functional construction, build, compile state.

Part of `keras_distrib._keras_compat`: only these modules touch `keras.src`,
`tensorflow.python` or private attributes of Keras/TensorFlow objects.
"""

import keras
from keras.src.models import functional as keras_functional
from keras.src.models import model as keras_model
from keras.src.trainers import compile_utils

__all__ = [
    "Functional",
    "ModelHooks",
    "assert_compiled",
    "call_has_training_arg",
    "compile_metric_log_keys",
    "compile_metric_names",
    "created_strategy",
    "flatten_metrics_in_order",
    "functional_init",
    "functional_init_arguments",
    "has_own_operations",
    "initial_epoch",
    "make_functional",
    "set_initial_epoch",
    "symbolic_build",
]


Functional = keras_functional.Functional


def has_own_operations(model):
    """Whether a functional model holds operations that are not layers (`keras.ops` on its tensors)."""
    return any(not isinstance(op, keras.layers.Layer) for op in getattr(model, "_operations", ()))


def functional_init_arguments(args, kwargs):
    """Whether `Model(*args, **kwargs)` is the functional construction."""
    return keras_model.functional_init_arguments(args, kwargs)


def make_functional(cls, kd_model, kd_functional):
    """Makes the user's class `cls` functional, as `keras.Model.__init__` does.

    Keras's "subclass a functional model" pattern
    (`super().__init__(inputs=..., outputs=...)` in a subclass's `__init__`)
    rewrites the bases of every class between `cls` and `keras.Model`,
    putting `Functional` in place of `keras.Model`. Done on a kd model, that
    rewrite would reach `kd.Model` itself, and every later `kd.Model`
    subclass would become functional. Here the rewrite stops at kd's class:
    `kd_model` is replaced by `kd_functional` (its fixed functional
    subclass) in the user's classes, and kd's classes are left untouched.
    """

    def inject(klass):
        if klass is kd_model:
            return kd_functional
        if klass is keras.Model:
            return keras_functional.Functional
        if (klass is object or not issubclass(klass, keras.Model)
                or issubclass(klass, keras_functional.Functional)
                or klass.__module__.startswith("keras_distrib.")):
            return klass
        bases = tuple(inject(base) for base in klass.__bases__)
        if bases != klass.__bases__:
            klass.__bases__ = bases
        return klass

    inject(cls)


def functional_init(model, args, kwargs):
    """`keras.Model.__init__` for functional arguments, on an already functional class."""
    keras_functional.Functional.__init__(model, *args, **kwargs)


class ModelHooks:
    """The private Keras methods kd models override, forwarding to kd's own.

    `keras_distrib.training.models.DistributedModelMixin` inherits this, so the
    overrides of private names live here.
    """

    def _aggregate_additional_loss(self, loss):
        return self.additional_loss_share(loss)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        return self.build_from_data(iterator=iterator, data_batch=data_batch)


def symbolic_build(model, data_batch):
    """Builds the model, its compiled losses and metrics from a batch or spec."""
    model._symbolic_build(data_batch=data_batch)


def assert_compiled(model, method):
    """Keras's error for `method` called on a model that was not compiled."""
    model._assert_compile_called(method)


def created_strategy(model):
    """The strategy `model` was created under, or None (the default one)."""
    return model._distribute_strategy


def call_has_training_arg(model):
    """Whether the model's `call` takes a `training` argument."""
    return model._call_has_training_arg


def initial_epoch(model):
    """The epoch Keras's own BackupAndRestore restored (`model._initial_epoch`)."""
    return getattr(model, "_initial_epoch", None)


def set_initial_epoch(model, epoch):
    """Sets the epoch Keras's `fit` starts from (its `_initial_epoch`)."""
    model._initial_epoch = epoch


def flatten_metrics_in_order(model, logs):
    """The logs in the order of the model's metrics, as Keras's `fit` reports them."""
    return model._flatten_metrics_in_order(logs)


def compile_metric_names(metric):
    """Log keys a compiled-metrics container produces (its metrics' names)."""
    if isinstance(metric, compile_utils.CompileMetrics):
        return {sub.name for sub in metric.metrics}
    return set()


def compile_metric_log_keys(metric):
    """The log keys a built compiled-metrics container reports (e.g. `out_mae`), or None.

    Keras names them when it reports them (output prefixes, de-duplication),
    so they are read from a result of the container's current state.
    """
    if isinstance(metric, compile_utils.CompileMetrics) and metric.built:
        return set(metric.result())
    return None
