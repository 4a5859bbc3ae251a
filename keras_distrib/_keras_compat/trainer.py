"""Keras's model and trainer internals: functional construction, build, compile state.

Part of `keras_distrib._keras_compat`: only these modules touch `keras.src`,
`tensorflow.python` or private attributes of Keras/TensorFlow objects.
"""

import contextlib
import threading
import warnings

import keras
from keras.src.models import functional as keras_functional
from keras.src.models import model as keras_model
from keras.src.saving import saving_lib
from keras.src.saving import serialization_lib
from keras.src.trainers import compile_utils

from keras_distrib._keras_compat.versions import KERAS_VERSION

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
    "saved_config",
    "saving_hook_found",
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


# One transform at a time: `saved_config` replaces a module attribute of
# Keras's saving_lib, shared by every thread's save.
_SAVING = threading.RLock()


def saving_hook_found():
    """Whether Keras's saving_lib serializes the model through the function `saved_config` wraps.

    Keras's saving_lib (3.13 to 3.15) imports `serialize_keras_object` by
    name and calls it once per save, on the model, to write config.json.
    `tests/test_keras_compat.py` checks this on the installed Keras.
    """
    return getattr(saving_lib, "serialize_keras_object", None) is serialization_lib.serialize_keras_object


@contextlib.contextmanager
def saved_config(transform):
    """While open, the `.keras` file Keras writes holds `transform(config)` as its model config.

    Keras names a model's class in config.json by its Python module and
    name; kd's `Model.save` names its own functional and Sequential classes
    there as Keras's (keeping kd's registered name), so that plain Keras
    loads the file. The replacement of saving_lib's `serialize_keras_object`
    lasts for the save only (`replacements.REPLACEMENTS`, scope
    `WHILE_SAVING`) and changes nothing but what `transform` changes. On a
    Keras whose saving_lib no longer serializes through that name, the file
    is Keras's own and kd warns.

    Args:
        transform: Takes the model's serialized config (a dict) and returns
            the config to write.
    """
    with _SAVING:
        if getattr(saving_lib.serialize_keras_object, "kd_saved_config", False):
            yield  # a save within a save: the outer transform applies
            return
        if not saving_hook_found():
            warnings.warn(
                f"Keras {keras.__version__} writes .keras files in a way kd does not know: this file "
                "names kd's classes, so it loads only where keras_distrib is installed "
                "(kd.save_for_keras writes one that plain Keras loads).", stacklevel=4)
            yield
            return
        keras_serialize = saving_lib.serialize_keras_object

        def serialize(obj):
            return transform(keras_serialize(obj))

        serialize.kd_saved_config = True
        setattr(saving_lib, "serialize_keras_object", serialize)
        try:
            yield
        finally:
            setattr(saving_lib, "serialize_keras_object", keras_serialize)


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


# Keras 3.14 on lets a ValueError from the model's symbolic call through
# `_symbolic_build`; 3.13 wraps it in a RuntimeError.
_BUILD_WRAPS_VALUE_ERRORS = KERAS_VERSION < (3, 14)


def symbolic_build(model, data_batch):
    """Builds the model, its compiled losses and metrics from a batch or spec.

    Inputs the model refuses (a required input fed None) raise Keras's own
    ValueError, as Keras's `fit` does, on every Keras kd admits.
    """
    try:
        model._symbolic_build(data_batch=data_batch)
    except RuntimeError as error:
        if _BUILD_WRAPS_VALUE_ERRORS and isinstance(error.__context__, ValueError):
            raise error.__context__ from None
        raise


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
