"""Handing a model on: `.keras` files plain Keras loads, and any `.keras` file into kd.

A functional or Sequential kd model saved with `model.save("m.keras")`
names Keras's classes (`Functional`, `Sequential`) with kd's registered
name beside them: plain Keras loads it where kd is not installed, and
where kd's model classes are loaded Keras finds kd's class by that name
(`model_files`). `save_for_keras` writes a file without kd's
names at all, which `keras.saving.load_model` loads as Keras's classes
even beside kd. (`model.export(path)` writes a SavedModel for serving; it
needs neither kd nor Keras to load.)

The way back: `load_model` loads any `.keras` file as a kd model, a plain
Keras model's included, compiled as it was saved and with its optimizer
state, to train on exactly where it stopped. What kd adds to `compile`
(`batch_norm`, `rows_meet`, `gradient_buckets`, `pss_evaluation_shards`) is not Keras's: `save_for_keras`
keeps it in an entry of its own in the file (`keras_distrib.json`, which
Keras does not read), `model.save` in an entry of the config beside
"compile_config" (`model_files.OWN_COMPILE_ENTRY`, which Keras ignores), and
`load_model` compiles with it again.
"""

import functools
import inspect
import json
import os
import shutil
import zipfile

import keras

from keras_distrib import _keras_compat
from keras_distrib import files
from keras_distrib.cluster import info as cluster_lib
from keras_distrib.training import model_files
from keras_distrib.training import models

__all__ = [
    "SETTINGS_ENTRY",
    "load_model",
    "save_for_keras",
]

# The file's entry for what kd adds (Keras reads config.json, metadata.json,
# model.weights.h5 and assets/ by name, and nothing else).
SETTINGS_ENTRY = "keras_distrib.json"
_CONFIG = "config.json"
_FORMAT = 1


def _triple(config):
    return config.get("module"), config.get("class_name"), config.get("registered_name")


@functools.lru_cache(maxsize=None)
def _keras_triples():
    """How Keras names its own Functional and Sequential classes in a file's config."""
    inputs = keras.Input((1,))
    functional = keras.Model(inputs, keras.layers.Identity()(inputs))
    sequential = keras.Sequential([keras.layers.Identity()])
    return {kind: _triple(keras.saving.serialize_keras_object(model))
            for kind, model in (("functional", functional), ("sequential", sequential))}


def _class_triple(cls):
    return cls.__module__, cls.__name__, keras.saving.get_registered_name(cls)


def _keras_kind(model):
    """"sequential" or "functional": the Keras class `model` is saved as; None if neither."""
    for kind, base in (("sequential", keras.Sequential), ("functional", _keras_compat.Functional)):
        if isinstance(model, base):
            # A class with its own get_config saves arguments the base cannot take.
            return kind if type(model).get_config is base.get_config else None
    return None


def _check_filepath(filepath, name="filepath"):
    if not isinstance(filepath, (str, os.PathLike)):
        raise ValueError(f"`{name}`={filepath!r} ({type(filepath).__name__}): expected a path "
                         "(str or os.PathLike) ending in .keras.")
    path = os.fspath(filepath)
    if "://" in path:
        raise ValueError(f"`{name}`={path!r} is a remote path; kd writes and reads .keras files "
                         "locally. Use a local path and copy the file.")
    if not path.endswith(".keras"):
        raise ValueError(f"`{name}`={path!r} does not end in .keras, Keras's model format. Name "
                         "the file `*.keras` (for serving, `model.export(path)` writes a SavedModel).")
    return path


def _plain_config(model):
    """`model`'s config with Keras's classes for kd's, and kd's own compile arguments apart."""
    renames, problems = {}, []
    for layer in _keras_compat.flatten_layers(model):
        if not isinstance(layer, models.DistributedModelMixin):
            continue
        kind = _keras_kind(layer)
        if kind is None:
            what = "the model" if layer is model else f"its layer {layer.name!r}"
            problems.append(
                f"{what} is a {type(layer).__name__}, a subclass plain Keras cannot rebuild "
                "without its code (not a functional or Sequential model, or with a get_config "
                "of its own)")
            continue
        renames[_class_triple(type(layer))] = _keras_triples()[kind]
    if _keras_compat.weight_partitions(model):
        problems.append(
            "its weights are partitioned over parameter servers (`variable_partitioner`): the "
            "optimizer keeps a slot per part, which plain Keras cannot load")
    if problems:
        raise ValueError(
            "`model` cannot be handed on to plain Keras:\n  - " + "\n  - ".join(problems) +
            "\nSave it with `model.save(...)` (kd loads it back) or serve it with "
            "`model.export(path)` (a SavedModel needs neither kd nor Keras).")
    config = keras.saving.serialize_keras_object(model)

    for node in model_files.config_dicts(config):
        triple = _triple(node)
        if triple in renames:
            node["module"], node["class_name"], node["registered_name"] = renames[triple]
    compile_config = config.get("compile_config") or {}
    keras_arguments = set(inspect.signature(keras.Model.compile).parameters)
    own = {name: value for name, value in compile_config.items() if name not in keras_arguments}
    for name in own:
        del compile_config[name]
    left = sorted(_kd_references(config))
    if left:
        raise ValueError("`model` cannot be handed on to plain Keras: its config still names kd's "
                         f"classes at {left}. Use Keras's own objects there.")
    return config, {"format": _FORMAT, "model_class": keras.saving.get_registered_name(type(model)),
                    "compile": own}


def _kd_references(node, where="config"):
    """Where `node` (a serialized config) names a class of keras_distrib."""
    if isinstance(node, dict):
        if str(node.get("module") or "").startswith("keras_distrib") or \
                str(node.get("registered_name") or "").startswith("keras_distrib>"):
            yield where
        for key, value in node.items():
            yield from _kd_references(value, f"{where}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _kd_references(value, f"{where}[{index}]")


def _rewrite(source, target, config, entry):
    """Copies the .keras file `source` to `target` with `config` and kd's `entry`."""
    with zipfile.ZipFile(source, "r") as zin, zipfile.ZipFile(target, "w") as zout:
        for info in zin.infolist():
            if info.filename in (_CONFIG, SETTINGS_ENTRY):
                continue
            with zin.open(info) as reading, zout.open(info, "w") as writing:
                shutil.copyfileobj(reading, writing, 1 << 20)
        zout.writestr(_CONFIG, json.dumps(config))
        if entry is not None:
            zout.writestr(SETTINGS_ENTRY, json.dumps(entry))


def save_for_keras(model, filepath, *, overwrite=True):
    """Saves `model` as a `.keras` file that plain Keras loads, where kd is not installed.

    The file is what `model.save` writes, with Keras's own classes
    (`Functional`, `Sequential`) in place of kd's: `keras.saving.load_model`
    gives the same weights, predictions and optimizer state without kd.
    kd's own compile arguments (`batch_norm`, ...) are kept in an entry
    Keras does not read, so `kd.load_model` compiles with them again. Only
    the chief writes (other workers write nothing), and the file appears
    whole or not at all.

    Args:
        model: A kd model (`kd.Model`, `kd.Sequential`, or a functional or
            Sequential subclass without a get_config of its own); nested kd
            models are handed on too.
        filepath: Where to write, a local path ending in `.keras`.
        overwrite: Replace an existing file (default); `False` refuses.

    Returns:
        `filepath` as a string.

    Raises:
        ValueError: `model` is not one plain Keras can rebuild (a
            subclassed model, weights partitioned over parameter servers),
            or `filepath` / `overwrite` is invalid; nothing is written.

    Examples:
        >>> import os, tempfile, keras, keras_distrib as kd
        >>> inputs = keras.Input((3,))
        >>> model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="adam", loss="mse", batch_norm="per_replica")
        >>> path = kd.save_for_keras(model, os.path.join(tempfile.mkdtemp(), "m.keras"))
        >>> type(keras.saving.load_model(path)).__name__  # Keras's own class
        'Functional'
        >>> kd.load_model(path).batch_norm  # and back to kd, as compiled
        'per_replica'
    """
    if not isinstance(model, keras.Model):
        raise ValueError(f"`model` is a {type(model).__name__}; expected a keras.Model (a kd model).")
    path = _check_filepath(filepath)
    if not isinstance(overwrite, bool):
        raise ValueError(f"`overwrite`={overwrite!r}: expected True or False.")
    if os.path.isdir(path):
        raise ValueError(f"`filepath`={path!r} is a directory; give a file name ending in .keras.")
    if os.path.exists(path) and not overwrite:
        raise ValueError(f"`filepath`={path!r} exists and `overwrite`=False; nothing was written. "
                         "Pass overwrite=True to replace it, or another path.")
    config, entry = _plain_config(model)
    folder, base = os.path.split(os.path.abspath(path))
    with cluster_lib.writer_directory(folder) as directory:
        saved = files.staging_file(directory, suffix=".keras")
        handed = files.staging_file(directory, suffix=".keras")
        try:
            keras.saving.save_model(model, saved)
            _rewrite(saved, handed, config, entry)
            files.publish(handed, os.path.join(directory, base))
        finally:
            for temporary in (saved, handed):
                if os.path.exists(temporary):
                    os.remove(temporary)
    return path


def _kd_config(config, entry, custom_objects):
    """The file's config with the top-level model as a kd class; raises ValueError if it cannot be."""
    triples = _keras_triples()
    triple = _triple(config)
    wanted = entry.get("model_class") if entry else None
    if wanted is not None and wanted != keras.saving.get_registered_name(models.FunctionalModel) \
            and wanted != keras.saving.get_registered_name(models.Sequential):
        cls = keras.saving.get_registered_object(wanted, custom_objects=custom_objects)
        if cls is None:
            raise ValueError(
                f"`filepath` holds a model saved from class {wanted!r}, which is not registered "
                "here: loading it as a kd.Model would drop that class's own steps. Import the module "
                "that defines it (registered with @keras.saving.register_keras_serializable()), or "
                f"pass `custom_objects`={{{wanted.split('>')[-1]!r}: TheClass}}.")
        return dict(config, **dict(zip(("module", "class_name", "registered_name"), _class_triple(cls))))
    if triple == triples["functional"]:
        target = models.FunctionalModel
    elif triple == triples["sequential"]:
        target = models.Sequential
    else:
        cls = keras.saving.get_registered_object(triple[2] or triple[1], custom_objects=custom_objects)
        if isinstance(cls, type) and issubclass(cls, models.DistributedModelMixin):
            return config  # a kd model already
        raise ValueError(
            f"`filepath` holds a {triple[1]} model, neither functional nor Sequential, so kd "
            "cannot make it a kd model. Add kd.DistributedModelMixin to that class's bases "
            "(`class MyModel(kd.DistributedModelMixin, keras.Model)`) and load it with "
            "keras.saving.load_model.")
    return dict(config, **dict(zip(("module", "class_name", "registered_name"), _class_triple(target))))


def load_model(filepath, *, custom_objects=None, compile=True, safe_mode=True):
    """Loads any `.keras` file as a kd model: plain Keras's, kd's, `save_for_keras`'s.

    A functional or Sequential model becomes a `kd.Model` / `kd.Sequential`
    with the same weights; compiled as saved, with its optimizer's state
    (step count, slots), so training goes on exactly where it stopped.
    kd's own compile arguments that `save_for_keras` kept (`batch_norm`,
    ...) are applied again. Call it inside `strategy.scope()` to train
    under a strategy, as `keras.saving.load_model`.

    Args:
        filepath: A local `.keras` file.
        custom_objects: As `keras.saving.load_model`'s.
        compile: Compile the model as it was saved (default).
        safe_mode: As `keras.saving.load_model`'s (no lambda deserialization).

    Returns:
        A kd model.

    Raises:
        ValueError: `filepath` is not a `.keras` file, or holds a model kd
            cannot make a kd model (a subclassed plain Keras model, a class
            that is not registered here).

    Examples:
        >>> import os, tempfile, keras, keras_distrib as kd
        >>> plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> plain.compile(optimizer="adam", loss="mse")
        >>> path = os.path.join(tempfile.mkdtemp(), "plain.keras")
        >>> plain.save(path)
        >>> type(kd.load_model(path)).__name__
        'Sequential'
        >>> isinstance(kd.load_model(path), kd.DistributedModelMixin)
        True
    """
    path = _check_filepath(filepath)
    if not os.path.isfile(path) or not zipfile.is_zipfile(path):
        what = "does not exist" if not os.path.exists(path) else "is not a .keras (zip) file"
        raise ValueError(f"`filepath`={path!r} {what}; expected a file written by Keras's "
                         "`model.save` or kd.save_for_keras.")
    with zipfile.ZipFile(path) as archive:
        names = set(archive.namelist())
        if _CONFIG not in names:
            raise ValueError(f"`filepath`={path!r} has no {_CONFIG}; it is not a .keras model file.")
        config = json.loads(archive.read(_CONFIG))
        entry = json.loads(archive.read(SETTINGS_ENTRY)) if SETTINGS_ENTRY in names else None
    kd_config = _kd_config(config, entry, custom_objects)
    # kd's own compile arguments: save_for_keras keeps them in an entry of
    # the file, model.save in one of the config.
    own = {**(entry or {}).get("compile", {}), **config.get(model_files.OWN_COMPILE_ENTRY, {})}
    if compile and own and kd_config.get("compile_config"):
        kd_config = dict(kd_config, compile_config={**kd_config["compile_config"], **own})
    if kd_config == config:
        return keras.saving.load_model(path, custom_objects=custom_objects, compile=compile,
                                       safe_mode=safe_mode)
    scratch = files.make_scratch("load")
    try:
        copy = os.path.join(scratch, os.path.basename(path))
        _rewrite(path, copy, kd_config, None)
        return keras.saving.load_model(copy, custom_objects=custom_objects, compile=compile,
                                       safe_mode=safe_mode)
    finally:
        files.remove_scratch(scratch)
