"""What a kd model's own `save` writes: files plain Keras loads, naming kd's classes too.

A functional or Sequential kd model's `.keras` file names Keras's classes
with kd's registered name beside them, and keeps kd's own compile
arguments in an entry of their own (`OWN_COMPILE_ENTRY`); a legacy `.h5`
file names the model's class by its registered name. `saving` reads them
back (`kd.load_model`) and writes files without kd's names at all
(`save_for_keras`); both walk a serialized config with `config_dicts`.
"""

import functools
import json
import os
import warnings

import h5py
import keras

from keras_distrib import _keras_compat

__all__ = [
    "OWN_COMPILE_ENTRY",
    "config_dicts",
    "save",
    "unregistered_class_warning",
]

# A `.keras` file's config entry (beside "compile_config") that keeps kd's own
# compile arguments out of what plain Keras compiles with.
OWN_COMPILE_ENTRY = "keras_distrib_compile"


def config_dicts(config):
    """Every dict in a serialized Keras config (dicts and lists nested), each before its values.

    A caller may change a dict in place when it is yielded: its values are
    walked afterwards, as they are then (an entry added is walked too).
    """
    if isinstance(config, dict):
        yield config
        for value in list(config.values()):
            yield from config_dicts(value)
    elif isinstance(config, list):
        for value in config:
            yield from config_dicts(value)


def save(model, keras_save, filepath, *, keras_classes, own_compile_names, **kwargs):
    """`keras_save(filepath, **kwargs)` (Keras's `Model.save` of `model`), naming kd's classes as Keras's.

    `keras_classes`: {kd's registered class name: the Keras class a file
    names beside it}; `own_compile_names`: kd's own compile arguments, kept
    in `OWN_COMPILE_ENTRY`. Warns first where `load_model` will not find the
    model's class (`unregistered_class_warning`).
    """
    unregistered_class_warning(model)
    before = _file_stamp(filepath)
    as_keras = functools.partial(_as_keras_classes, keras_classes=keras_classes,
                                 own_compile_names=own_compile_names)
    with _keras_compat.saved_config(as_keras):
        result = keras_save(filepath, **kwargs)
    if str(filepath).endswith((".h5", ".hdf5")) and _file_stamp(filepath) != before:
        _record_registered_class(filepath, type(model))
    return result


def unregistered_class_warning(model):
    """Warns when `keras.saving.load_model` will not find `model`'s class.

    A `.keras` file names the model's class; a subclass such as
    `class MyTask(kd.DistributedModelMixin, keras_hub.models.BertTextClassifier)`
    reloads only if Keras can look its name up: registered with
    `@keras.saving.register_keras_serializable()`, or passed to
    `load_model(..., custom_objects={"MyTask": MyTask})`. Said when saving,
    while the class is at hand, rather than when loading fails.

    Returns:
        True if it warned.
    """
    cls = type(model)
    if keras.saving.get_registered_object(keras.saving.get_registered_name(cls)) is cls:
        return False
    warnings.warn(
        f"{cls.__name__} is not registered with Keras, so keras.saving.load_model will not "
        f"find it in this file (\"Could not locate class '{cls.__name__}'\"). Decorate the class "
        "with @keras.saving.register_keras_serializable(), or load with "
        f"keras.saving.load_model(path, custom_objects={{'{cls.__name__}': {cls.__name__}}}).",
        stacklevel=4,  # the caller of the model's `save`
    )
    return True


def _as_keras_classes(config, *, keras_classes, own_compile_names):
    """A serialized model config naming kd's functional and Sequential classes as Keras's.

    Each such node keeps kd's registered name (`keras_distrib>FunctionalModel`),
    which Keras looks up first: where kd's model classes are loaded it finds
    kd's class; where kd is not installed it falls back to the module and
    class, now Keras's `Functional` or `Sequential`, whose layers and
    weights are the same. kd's own compile arguments move out of
    "compile_config" (plain Keras's `compile` refuses them) to an entry of
    their own (`OWN_COMPILE_ENTRY`), which `kd.load_model` applies again.
    A subclass of the user's own keeps its class, as in plain Keras.
    """
    for node in config_dicts(config):
        keras_class = keras_classes.get(node.get("registered_name"))
        if keras_class is not None:
            node["module"], node["class_name"] = keras_class.__module__, keras_class.__name__
            compile_config = node.get("compile_config") or {}
            own = {name: compile_config.pop(name) for name in own_compile_names if name in compile_config}
            if own:
                node[OWN_COMPILE_ENTRY] = own
    return config


def _file_stamp(path):
    try:
        status = os.stat(path)
    except (OSError, TypeError, ValueError):
        return None
    return status.st_mtime_ns, status.st_size, status.st_ino


def _record_registered_class(path, cls):
    """Names `cls` by its registered name in a legacy `.h5` file's model config."""
    name = keras.saving.get_registered_name(cls)
    if name == cls.__name__:  # not registered: Keras's bare name is all there is
        return
    with h5py.File(path, "r+") as file:
        config = file.attrs.get("model_config")
        if config is None:
            return
        if isinstance(config, bytes):
            config = config.decode("utf-8")
        config = json.loads(config)
        if config.get("class_name") != cls.__name__:
            return
        config["class_name"] = name
        file.attrs["model_config"] = json.dumps(config).encode("utf-8")
