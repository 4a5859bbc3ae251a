"""`assert_parity`: one device against each strategy, step by step, with a float64 re-check."""

import math
import os
import pickle
import shutil
import tempfile
import textwrap
import warnings

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from keras_distrib import report
from keras_distrib import validation
from keras_distrib.testing import diagnosis
from keras_distrib.testing import snapshots
from keras_distrib.testing.strategies import IN_CLUSTER
from keras_distrib.testing.strategies import STRATEGIES
from keras_distrib.testing.strategies import ClusterError
from keras_distrib.testing.strategies import cpu_devices
from keras_distrib.testing.strategies import task_entry
from keras_distrib.testing.strategies import local_strategy
from keras_distrib.testing.strategies import run_in_cluster
from keras_distrib.training import models

__all__ = ["assert_parity"]

_PATHS = ("fit", "loop")
_FLOAT32_TOLERANCE = 2e-5
_FLOAT16_TOLERANCE = 5e-3
# An exact model re-run in float64 matches one device to about 1e-12 (Adam
# can magnify the last bits of a near-zero gradient a few thousand times).
_FLOAT64_TOLERANCE = 1e-9


def _check_arguments(model_fn, data, strategies_, steps, path, batch_size, replicas):
    problems = []
    if not callable(model_fn):
        problems.append(f"`model_fn`={model_fn!r} is not callable: pass a function that builds "
                        "and compiles the model")
    if path not in _PATHS:
        problems.append(f"`path`={path!r}: expected one of {list(_PATHS)}")
    for kind in strategies_:
        if not isinstance(kind, tf.distribute.Strategy) and kind not in STRATEGIES:
            problems.append(f"`strategies` item {kind!r}: expected one of {list(STRATEGIES)} or a "
                            "tf.distribute.Strategy")
    if steps is not None and not validation.is_whole(steps, 1):
        problems.append(f"`steps`={steps!r}: expected a whole number >= 1, or None (one epoch)")
    if not validation.is_whole(batch_size, 1):
        problems.append(f"`batch_size`={batch_size!r}: expected a whole number >= 1 (the global batch)")
    if not validation.is_whole(replicas, 1):
        problems.append(f"`replicas`={replicas!r}: expected a whole number >= 1")
    if isinstance(data, tf.data.Dataset):
        cluster = [k for k in strategies_ if not isinstance(k, tf.distribute.Strategy) and k in IN_CLUSTER]
        if cluster:
            problems.append(f"`data` is a tf.data.Dataset, which cannot reach the processes of "
                            f"{cluster}: pass a `dataset_fn(input_context)` defined at module level "
                            "of a .py file instead")
    elif callable(data) and not isinstance(data, (tuple, list)):
        if "parameter_server" in strategies_:
            problems.append("`data` is a dataset_fn and `strategies` names 'parameter_server', "
                            "which compares on NumPy data only: pass (x, y) arrays for it")
    elif not isinstance(data, (tuple, list)) or len(data) not in (2, 3):
        problems.append(f"`data` is a {type(data).__name__}: expected (x, y) or (x, y, sample_weight) "
                        "as NumPy arrays (x and y may be dicts or lists of arrays), a batched "
                        "tf.data.Dataset, or a dataset_fn(input_context)")
    if problems:
        raise ValueError("kd.testing.assert_parity: invalid arguments:\n  - " + "\n  - ".join(problems))


def _label(kind, replicas, path):
    if isinstance(kind, tf.distribute.Strategy):
        return f"{type(kind).__name__} ({kind.num_replicas_in_sync} replicas, {path})"
    count = {"one_device": 1, "multi_worker": 2, "parameter_server": 1}.get(kind, replicas)
    where = {"multi_worker": "2 worker processes", "parameter_server": "1 worker, 1 ps"}.get(
        kind, f"{count} replica{'s' * (count != 1)}")
    return f"{kind} ({where}, {path})"


def assert_parity(model_fn, data, *, strategies=None, steps=None, path="fit", batch_size=32,
                  replicas=2, tolerance=None, seed=0, timeout=300):
    """Asserts that `model_fn`'s model trains under each strategy as on one device.

    Trains on one CPU device (the reference) and under each strategy, from
    the same initial weights and on the same global batches in the same
    order, and compares every weight (BatchNormalization's moving statistics
    and the state layers keep, such as counters, included) after every step,
    then the loss and metrics `fit` reports. A mismatch in layer state names
    the layer and the variable.
    Give it data whose row count is not a multiple of `batch_size`: the
    uneven last batch (some replicas get few rows, or none) is where
    per-replica arithmetic shows.

    Args:
        model_fn: A function without arguments that builds, compiles and
            returns a `keras.Model`. It is called inside each strategy's
            scope (after `keras.utils.set_random_seed(seed)`). For
            `"multi_worker"` and `"parameter_server"` it must be importable:
            a function at module level of a .py file.
        data: `(x, y)` or `(x, y, sample_weight)`: NumPy arrays (x and y may
            be dicts or lists of arrays), fed in order (no shuffling) in
            batches of `batch_size`; or a finite `tf.data.Dataset` of global
            batches (in this process only); or a `dataset_fn(input_context)`,
            called for one input pipeline in every run, so every run trains
            on the same global batches (module level of a .py file for
            `"multi_worker"`; not for `"parameter_server"`).
        strategies: Names from `STRATEGIES` (`"one_device"`, `"mirrored"`,
            `"central_storage"`, `"multi_worker"`, `"parameter_server"`) or
            `tf.distribute.Strategy` objects of this process; `["mirrored"]`
            when `None`.
        steps: Training steps to compare; one epoch when `None`. More than
            one epoch's steps train several epochs.
        path: `"fit"` (`model.fit`) or `"loop"` (`kd.TrainLoop(model).fit`;
            kd models only). The reference always uses one-device `fit`.
        batch_size: The global batch size.
        replicas: Replicas of `"mirrored"` and `"central_storage"`.
        tolerance: Largest allowed max |a - b| / (1 + |a|); 2e-5 (float32
            round-off), or 5e-3 for a mixed-precision model, when `None`.
            A float32 difference above it is checked again in float64
            (both runs, from the same initial weights): if float64 matches
            to 1e-9, the difference was round-off
            (an optimizer such as Adam magnifies the last bits of a
            near-zero gradient), and the strategy passes with a warning.
        seed: Passed to `keras.utils.set_random_seed` before each build.
        timeout: Seconds for each strategy that runs in other processes.

    Returns:
        A dict: for each strategy's label, the largest difference found
        (in float64 where the float64 re-check decided).

    Raises:
        AssertionError: a strategy trains differently. The message names
            the first step and the first variable that differ, the size of
            the difference, the likely cause and what the float64 re-check
            found; also when training fails under a strategy but not on one
            device (with the whole error, TensorFlow's included).
        ValueError: invalid arguments (each one listed).
        RuntimeError: a strategy needs more logical CPU devices than this
            process can still have (the message says how to split them).

    Examples:
        >>> import keras, numpy as np, keras_distrib as kd
        >>> def model_fn():
        ...     inputs = keras.Input((4,))
        ...     model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
        ...     model.compile(optimizer=keras.optimizers.SGD(0.1, clipnorm=0.5), loss="mse")
        ...     return model
        >>> x = np.random.default_rng(0).normal(size=(33, 4)).astype("float32")
        >>> kd.testing.assert_parity(model_fn, (x, x[:, :1]), batch_size=16, strategies=["one_device"])
        {'one_device (1 replica, fit)': ...}

        The default, `strategies=["mirrored"]`, needs 2 logical CPU devices
        (see the module docstring); `"multi_worker"` needs `model_fn` in a
        .py file.
    """
    if strategies is None:
        strategies_ = ["mirrored"]
    elif isinstance(strategies, (str, tf.distribute.Strategy)):
        strategies_ = [strategies]
    else:
        strategies_ = list(strategies)
    _check_arguments(model_fn, data, strategies_, steps, path, batch_size, replicas)
    if snapshots.is_dataset_source(data):
        arrays = data
        x = snapshots.dataset_of(data)
        rows, steps_per_epoch = None, snapshots.dataset_steps(x)
    else:
        x, y, sample_weight = (tuple(data) + (None,))[:3]
        rows = len(snapshots.first_input(x))
        steps_per_epoch = math.ceil(rows / batch_size)
        arrays = (x, y, sample_weight)
    steps = steps or steps_per_epoch

    if any(not isinstance(k, tf.distribute.Strategy) and k in ("mirrored", "central_storage")
           for k in strategies_):
        cpu_devices(replicas)  # before the reference touches TensorFlow's devices
    with tf.device("/CPU:0"):
        reference_model = snapshots.make_model(model_fn, seed, x)
        if path == "loop" and not isinstance(reference_model, models.DistributedModelMixin):
            raise ValueError(
                f"`path`='loop' trains with kd.TrainLoop, which takes kd models only, and "
                f"`model_fn` returned a plain {type(reference_model).__name__}. Build a kd.Model "
                "/ kd.Sequential, or use path='fit'."
            )
        initial = [np.array(w) for w in reference_model.get_weights()]
        reference = snapshots.train(reference_model, arrays, batch_size=batch_size, steps=steps,
                           path="fit", per_epoch=False)
    names = [getattr(v, "path", v.name) for v in reference_model.weights]
    shapes = [tuple(w.shape) for w in initial]
    if tolerance is None:
        policy = getattr(getattr(reference_model, "dtype_policy", None), "name", "")
        tolerance = _FLOAT16_TOLERANCE if "16" in policy else _FLOAT32_TOLERANCE

    def train_under(kind, arrays, initial, floatx="float32"):
        label = _label(kind, replicas, path)
        try:
            if not isinstance(kind, tf.distribute.Strategy) and kind in IN_CLUSTER:
                shipped = arrays
                if callable(arrays) and not isinstance(arrays, tuple):
                    shipped = (task_entry().function_spec(arrays),)
                return _train_in_cluster(kind, model_fn, shipped, initial, batch_size=batch_size,
                                         steps=steps, path=path, seed=seed, timeout=timeout,
                                         floatx=floatx)
            strategy = kind if isinstance(kind, tf.distribute.Strategy) else local_strategy(
                kind, replicas=replicas)
            build_from = snapshots.dataset_of(arrays) if snapshots.is_dataset_source(arrays) else arrays[0]
            with strategy.scope():
                model = snapshots.make_model(model_fn, seed, build_from, initial)
            return snapshots.train(model, arrays, batch_size=batch_size, steps=steps, path=path,
                          per_epoch=False)
        except ClusterError as error:
            raise AssertionError(
                f"kd.testing.assert_parity: training under {label} failed (on one device it "
                f"runs): {error.summary}\n  the whole error:\n{textwrap.indent(str(error), '    ')}"
            ) from error
        except AssertionError:
            raise
        except Exception as error:
            raise AssertionError(
                f"kd.testing.assert_parity: training under {label} failed (on one device it "
                f"runs): {report.error_line(error)}\n  the whole error:\n"
                + textwrap.indent(report.error_text(error), "    ")
            ) from error

    def compare(kind, reference, candidate, tolerance):
        count = (kind.num_replicas_in_sync if isinstance(kind, tf.distribute.Strategy)
                 else {"one_device": 1, "multi_worker": 2, "parameter_server": 1}.get(kind, replicas))
        return diagnosis.compare(
            _label(kind, replicas, path), reference, candidate, names=names, shapes=shapes,
            tolerance=tolerance, model=reference_model, replicas=count,
            steps_per_epoch=steps_per_epoch, rows=rows, batch_size=batch_size,
            compare_history=kind != "parameter_server",
        )

    results = {}
    for kind in strategies_:
        candidate = train_under(kind, arrays, initial)
        try:
            results[_label(kind, replicas, path)] = compare(kind, reference, candidate, tolerance)
        except diagnosis.Mismatch as mismatch:
            if tolerance >= _FLOAT16_TOLERANCE or snapshots.is_dataset_source(arrays):
                # Mixed precision: float64 would be another model. A dataset
                # holds its own dtypes: only NumPy data is re-run in float64.
                raise
            results[_label(kind, replicas, path)] = _recheck_in_float64(
                mismatch, kind, model_fn, arrays, initial, seed=seed, batch_size=batch_size,
                steps=steps, tolerance=tolerance, train_under=train_under, compare=compare,
            )
    return results


def _in_float64(arrays):
    """`arrays` with every floating NumPy array as float64."""
    def cast(value):
        value = np.asarray(value) if value is not None else None
        if value is not None and np.issubdtype(value.dtype, np.floating):
            return value.astype("float64")
        return value
    return tuple(tree.map_structure(cast, part) if part is not None else None for part in arrays)


def _recheck_in_float64(mismatch, kind, model_fn, arrays, initial, *, seed, batch_size, steps,
                        tolerance, train_under, compare):
    """Tells float32 round-off from a real difference: both runs again in float64.

    An exact model matches one device to about 1e-12 in float64, while a
    real difference (a per-replica mean, unsynchronized statistics) stays
    the size it was. Returns the float64 difference when it is round-off
    (and warns with the float32 one); raises the float32 report, with what
    float64 showed, when it is not.
    """
    previous = keras.config.floatx(), keras.config.dtype_policy()
    # Keras fixes its global dtype policy at first use: set_floatx alone
    # would leave new layers in float32.
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        wide = _in_float64(arrays)
        initial64 = [np.asarray(w, dtype="float64") if np.issubdtype(np.asarray(w).dtype, np.floating)
                     else w for w in initial]
        with tf.device("/CPU:0"):
            reference_model = snapshots.make_model(model_fn, seed, wide[0], initial64)
            narrow = sorted({v.path for v in reference_model.weights
                             if np.issubdtype(np.dtype(v.dtype), np.floating) and v.dtype != "float64"})
            if narrow:
                raise TypeError(f"variables stay in lower precision: {narrow[:3]} (a layer's "
                                "`dtype` or a dtype policy fixes them)")
            reference = snapshots.train(reference_model, wide, batch_size=batch_size, steps=steps,
                               path="fit", per_epoch=False)
        candidate = train_under(kind, wide, initial64, floatx="float64")
        gap64 = compare(kind, reference, candidate, min(tolerance, _FLOAT64_TOLERANCE))
    except diagnosis.Mismatch as real:
        raise AssertionError(
            f"{mismatch}\n  float64 re-check: the same training in float64 still differs by "
            f"{real.gap:.3g} (an exact model matches to about 1e-12): a real difference, not "
            "round-off."
        ) from None
    except Exception as error:  # the model cannot run in float64: keep the float32 verdict
        raise AssertionError(
            f"{mismatch}\n  float64 re-check: not possible ({report.error_line(error)}), so "
            "this may still be float32 round-off."
        ) from None
    finally:
        keras.config.set_floatx(previous[0])
        keras.config.set_dtype_policy(previous[1])
    warnings.warn(
        f"kd.testing.assert_parity: {_label_of(mismatch)}: float32 differs from one device by "
        f"{mismatch.gap:.3g} (tolerance {tolerance:g}), and the same training in float64 "
        f"matches to {gap64:.3g}: float32 round-off (magnified by the optimizer, e.g. Adam on "
        "near-zero gradients), not a difference in the arithmetic.",
        stacklevel=3,
    )
    return gap64


def _label_of(mismatch):
    first = str(mismatch).splitlines()[0]
    return first.removeprefix("kd.testing.assert_parity: ").split(" does not train")[0].split(
        " trains the same")[0]


def _train_in_cluster(kind, model_fn, arrays, initial, *, batch_size, steps, path, seed, timeout,
                      floatx="float32"):
    """Trains under `kind` in other processes; returns the chief's snapshots."""
    spec = task_entry().function_spec(model_fn)
    folder = tempfile.mkdtemp(prefix="kd_parity_")
    try:
        payload_path = os.path.join(folder, "payload.pkl")
        with open(payload_path, "wb") as f:
            pickle.dump({
                "model_fn": spec, "arrays": arrays, "initial_weights": initial, "seed": seed,
                "batch_size": batch_size, "steps": steps, "path": path,
                "per_epoch": kind == "parameter_server", "floatx": floatx,
            }, f)
        # One worker under a parameter server: several would each read their
        # own copy of the data, at their own pace (not one device's order).
        values = run_in_cluster(snapshots.parity_task, payload_path, kind=kind,
                                workers=2 if kind == "multi_worker" else 1, timeout=timeout)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return values["worker 0"] if kind == "multi_worker" else values
