"""Checks on what users pass to `fit`, `evaluate` and `predict`, before any step runs.

Without them, a bad argument ends deep inside TensorFlow (a shape error in
a layer, a failed cast in a loss, a NaN loss epochs later), in a message
that does not name the argument. Each check here names the argument, says
what it received and what was expected, and how to fix it, and lists every
problem found, not the first (`keras_distrib.validation.InputError`).
"""

import collections.abc
import dataclasses
import math
import numbers
import warnings

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from keras_distrib.validation import InputError
from keras_distrib.validation import NonFiniteDataWarning
from keras_distrib.validation import is_whole

__all__ = [
    "FitRequest",
    "check_fit_arguments",
    "static_rows",
    "validate_fit",
    "validate_inputs",
]

_VERBOSE = ("auto", 0, 1, 2)


@dataclasses.dataclass(frozen=True)
class FitRequest:
    """What `fit` was asked to do: Keras's `fit` arguments, in one object.

    Built at the front doors (`kd.Model.fit`, `kd.TrainLoop.fit`) and handed
    down whole (`front.fit` checks it with `validate_fit`, then `loop.fit` or
    `parameter_server.fit` runs it), so the arguments are spelled out once.
    Each field is `keras.Model.fit`'s argument of that name, with its
    default.
    """

    x: object = None
    y: object = None
    batch_size: object = None
    epochs: object = 1
    verbose: object = "auto"
    callbacks: object = None
    validation_split: object = 0.0
    validation_data: object = None
    shuffle: object = True
    class_weight: object = None
    sample_weight: object = None
    initial_epoch: object = 0
    steps_per_epoch: object = None
    validation_steps: object = None
    validation_batch_size: object = None
    validation_freq: object = 1


def validate_fit(model, request):
    """`validate_inputs` for a `FitRequest`: raises `InputError` listing every problem."""
    validate_inputs(
        model, request.x, request.y, request.sample_weight, method="fit",
        validation_data=request.validation_data, epochs=request.epochs,
        batch_size=request.batch_size, initial_epoch=request.initial_epoch,
        steps_per_epoch=request.steps_per_epoch, validation_split=request.validation_split,
        validation_steps=request.validation_steps,
        validation_batch_size=request.validation_batch_size,
        validation_freq=request.validation_freq, verbose=request.verbose,
        shuffle=request.shuffle, class_weight=request.class_weight, callbacks=request.callbacks,
    )


def check_fit_arguments(*, epochs=1, batch_size=None, initial_epoch=0, steps_per_epoch=None,
                        validation_split=0.0, validation_steps=None, validation_batch_size=None,
                        validation_freq=1, verbose="auto", shuffle=True, class_weight=None,
                        callbacks=None):
    """The problems with `fit`'s scalar arguments, as a list of messages."""
    problems = []
    if not is_whole(epochs, 0):
        problems.append(f"`epochs`={epochs!r}: expected a whole number >= 0")
    if not is_whole(initial_epoch, 0):
        problems.append(f"`initial_epoch`={initial_epoch!r}: expected a whole number >= 0")
    elif is_whole(epochs, 0) and initial_epoch > epochs:
        problems.append(
            f"`initial_epoch`={initial_epoch!r} is past `epochs`={epochs!r} (the index of the "
            "last epoch, counted from 0, not a number of further epochs): nothing would train. "
            f"Pass `epochs` > {initial_epoch!r}, e.g. epochs={initial_epoch + epochs!r}"
        )
    for name, value in (("batch_size", batch_size), ("steps_per_epoch", steps_per_epoch),
                        ("validation_steps", validation_steps),
                        ("validation_batch_size", validation_batch_size)):
        if value is not None and not is_whole(value, 1):
            problems.append(f"`{name}`={value!r}: expected a whole number >= 1, or None")
    if (isinstance(validation_split, bool) or not isinstance(validation_split, numbers.Real)
            or not 0 <= validation_split < 1):  # NaN fails both comparisons
        problems.append(
            f"`validation_split`={validation_split!r}: expected a fraction in [0, 1), "
            "e.g. 0.2 to hold out the last 20% of the rows"
        )
    if isinstance(validation_freq, collections.abc.Container) and not isinstance(validation_freq, str):
        bad = [v for v in validation_freq if not is_whole(v, 1)]
        if bad or not len(validation_freq):
            problems.append(
                f"`validation_freq`={validation_freq!r}: expected epoch numbers >= 1 (e.g. [1, 5])"
            )
    elif not is_whole(validation_freq, 1):
        problems.append(
            f"`validation_freq`={validation_freq!r}: expected a whole number of epochs >= 1, "
            "or a list of epoch numbers"
        )
    if not isinstance(verbose, (bool, np.bool_)) and verbose not in _VERBOSE:
        problems.append(f"`verbose`={verbose!r}: expected one of {list(_VERBOSE)}")
    if not isinstance(shuffle, (bool, np.bool_)) and shuffle != "batch":
        problems.append(f"`shuffle`={shuffle!r}: expected True, False or 'batch'")
    if class_weight is not None:
        if not isinstance(class_weight, collections.abc.Mapping):
            problems.append(
                f"`class_weight`={class_weight!r}: expected a dict {{class index: weight}}"
            )
        else:
            bad = {k: v for k, v in class_weight.items()
                   if not is_whole(k, 0) or isinstance(v, bool) or not isinstance(v, numbers.Real)
                   or not math.isfinite(v) or v < 0}
            if bad:
                problems.append(
                    f"`class_weight` entries {bad!r}: expected whole class indices >= 0 mapped "
                    "to finite weights >= 0"
                )
    problems.extend(_callback_problems(callbacks))
    return problems


def _callback_problems(callbacks):
    if callbacks is None or isinstance(callbacks, keras.callbacks.CallbackList):
        return []
    if isinstance(callbacks, keras.callbacks.Callback):
        return [f"`callbacks`={type(callbacks).__name__}(...): expected a list; wrap it: [callback]"]
    if not isinstance(callbacks, (list, tuple)):
        return [f"`callbacks`={callbacks!r}: expected a list of keras.callbacks.Callback"]
    bad = [c for c in callbacks if not isinstance(c, keras.callbacks.Callback)]
    if bad:
        return [
            f"`callbacks` items {bad!r} are not keras.callbacks.Callback instances "
            "(a class instead of an instance? call it: MyCallback())"
        ]
    return []


# Data.


def _is_array(value):
    return isinstance(value, np.ndarray) or (tf.is_tensor(value) and hasattr(value, "numpy")) or (
        hasattr(value, "shape") and hasattr(value, "__array__") and not np.isscalar(value)
    )


def _as_numpy(value):
    if tf.is_tensor(value):
        return value.numpy()
    return np.asarray(value)


def _leaves(name, data):
    """`(label, array)` for every array in `data`, e.g. `("x['image']", ...)`."""
    if data is None:
        return []
    if _is_array(data):
        return [(name, data)]
    if isinstance(data, collections.abc.Mapping):
        found = []
        for key, value in data.items():
            found += _leaves(f"{name}[{key!r}]", value)
        return found
    if isinstance(data, (list, tuple)):
        found = []
        for index, value in enumerate(data):
            found += _leaves(f"{name}[{index}]", value)
        return found
    return []


def _rows(array):
    shape = getattr(array, "shape", None)
    if shape is None or len(shape) == 0:
        return None
    return None if shape[0] is None else int(shape[0])


def _holds_strings(array):
    kind = array.dtype.kind
    if kind in "US":
        return True
    if kind == "O":
        flat = array.reshape(-1)
        return flat.size > 0 and isinstance(flat[0], (str, bytes))
    return False


def _non_finite(label, array):
    if array.dtype.kind not in "fc":
        return None
    bad = ~np.isfinite(array)
    if not bad.any():
        return None
    rows = np.unique(np.nonzero(bad.reshape(bad.shape[0], -1) if bad.ndim > 1 else bad)[0])
    kinds = [k for k, present in (("NaN", np.isnan(array).any()), ("inf", np.isinf(array).any())) if present]
    return (
        f"`{label}` holds {' and '.join(kinds)} in {len(rows)} row(s) (first: "
        f"{rows[:5].tolist()}); training on them makes the loss and every weight NaN. Clean "
        f"the data (e.g. np.nan_to_num, or drop those rows) before fit"
    )


def _model_input_specs(model):
    """The structure of a model's symbolic inputs (functional, built Sequential), or None."""
    try:
        return model.input
    except (AttributeError, ValueError):  # A subclassed or unbuilt model.
        return None


def _shape_text(shape):
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _shape_problem(label, shape, expected, *, batched):
    """A message if `shape` (of one array or batch) does not fit `expected` (with batch dim)."""
    expected = tuple(expected)
    shape = tuple(shape)
    # Keras's functional models adjust a rank off by one through a trailing
    # dimension of 1 (squeezed or added); so do we.
    if len(shape) == len(expected) + 1 and shape[-1] == 1:
        shape = shape[:-1]
    elif len(shape) == len(expected) - 1 and expected[-1] == 1:
        expected = expected[:-1]
    if len(shape) == len(expected) + 1 and batched:
        return (
            f"`{label}` yields batches of shape {_shape_text(shape)} but the model takes "
            f"{_shape_text(expected)}: one dimension too many. Is the dataset batched twice? "
            "Call .batch() once"
        )
    if len(shape) == len(expected) - 1 and batched:
        return (
            f"`{label}` yields elements of shape {_shape_text(shape)} but the model takes "
            f"batches {_shape_text(expected)}: the dataset is not batched. Call "
            ".batch(batch_size) on it"
        )
    if len(shape) != len(expected):
        return (
            f"`{label}` has shape {_shape_text(shape)} ({len(shape)} dimensions) but the model "
            f"takes {_shape_text(expected)} ({len(expected)} dimensions). Reshape the data or "
            "the model's Input"
        )
    wrong = [i for i, (a, b) in enumerate(zip(shape[1:], expected[1:]), 1)
             if a is not None and b is not None and a != b]
    if wrong:
        return (
            f"`{label}` has shape {_shape_text(shape)} but the model takes "
            f"{_shape_text(expected)} (dimension {wrong[0]} differs). Pass data of the model's "
            "input shape, or change the model's Input"
        )
    return None


def _pair_inputs(model, x, label):
    """`(label, data, expected shape)` for each of the model's inputs found in `x`."""
    structure = _model_input_specs(model)
    if structure is None:
        return []
    if isinstance(structure, collections.abc.Mapping):
        if not isinstance(x, collections.abc.Mapping):
            return []
        return [(f"{label}[{k!r}]", x[k], structure[k].shape) for k in structure if k in x]
    if isinstance(structure, (list, tuple)):
        if isinstance(x, (list, tuple)) and len(x) == len(structure) and len(structure) > 1:
            return [(f"{label}[{i}]", v, s.shape) for i, (v, s) in enumerate(zip(x, structure))]
        if len(structure) == 1:
            structure = structure[0]
        else:
            return []
    if hasattr(structure, "shape"):
        return [(label, x, structure.shape)]
    return []


def _dataset_problems(model, dataset, y, label):
    problems = []
    if y is not None:
        problems.append(
            f"`y` was given with `{label}` a tf.data.Dataset; the dataset yields (x, y) (or "
            "(x, y, sample_weight)) itself. Drop `y`, or pass arrays"
        )
    spec = dataset.element_spec
    if isinstance(spec, tuple) and spec:
        x_spec = spec[0]
        y_spec = spec[1] if len(spec) > 1 else None
    else:
        x_spec, y_spec = spec, None
    for y_leaf in tree.flatten(y_spec) if y_spec is not None else []:
        if isinstance(y_leaf, tf.TensorSpec) and y_leaf.dtype == tf.string:
            problems.append(
                f"`{label}` yields string labels; losses need numbers. Map the labels to "
                "integer class indices (e.g. with keras.layers.StringLookup) in the dataset"
            )
            break
    for sub_label, sub_spec, expected in _pair_inputs(model, x_spec, label):
        if isinstance(sub_spec, tf.TensorSpec) and sub_spec.shape.rank is not None:
            problem = _shape_problem(sub_label, sub_spec.shape.as_list(), expected, batched=True)
            if problem:
                problems.append(problem)
    return problems


def _array_problems(model, x, y, sample_weight, labels=("x", "y", "sample_weight"), *,
                    check_finite, method="fit"):
    problems = []
    label = labels[0]
    leaves = {"x": _leaves(labels[0], x), "y": _leaves(labels[1], y),
              "sample_weight": _leaves(labels[2], sample_weight)}
    lengths = [(name, _rows(array)) for group in leaves.values() for name, array in group]
    lengths = [(name, rows) for name, rows in lengths if rows is not None]
    if len({rows for _, rows in lengths}) > 1:
        listed = ", ".join(f"`{name}` {rows}" for name, rows in lengths)
        problems.append(
            f"the data's row counts differ ({listed}); every array needs one row per example. "
            "Pass x, y and sample_weight with the same first dimension"
        )
    for name, array in leaves["y"]:
        if _is_array(array) and _holds_strings(_as_numpy(array)):
            sample = _as_numpy(array).reshape(-1)[:1].tolist()
            problems.append(
                f"`{name}` holds strings (e.g. {sample}); losses need numbers. Map the labels "
                "to integer class indices (e.g. np.unique(y, return_inverse=True), or "
                "keras.layers.StringLookup)"
            )
    problems.extend(_sample_weight_problems(labels[2], sample_weight, leaves["y"]))
    for group in leaves.values():
        for name, array in group:
            if _rows(array) == 0:
                problems.append(
                    f"`{name}` has 0 rows; `{method}` needs at least one example. Pass data "
                    "with rows (an empty array usually means a filter or split removed everything)"
                )
                break
    if check_finite:
        for group in leaves.values():
            for name, array in group:
                if _is_array(array):
                    problem = _non_finite(name, _as_numpy(array))
                    if problem:
                        warnings.warn(problem + ".", NonFiniteDataWarning, stacklevel=4)
    for sub_label, data, expected in _pair_inputs(model, x, label):
        if _is_array(data):
            problem = _shape_problem(sub_label, tuple(data.shape), expected, batched=False)
            if problem:
                problems.append(problem)
    return problems


def _sample_weight_problems(label, sample_weight, y_leaves):
    """A weight that is not numbers, or whose shape cannot weigh `y`'s rows."""
    if sample_weight is None or isinstance(sample_weight, (collections.abc.Mapping, list, tuple)):
        return []
    if not _is_array(sample_weight):
        return [f"`{label}`={sample_weight!r}: expected an array of weights, one per row (shape "
                "(rows,)), or None"]
    weights = _as_numpy(sample_weight)
    if weights.dtype.kind not in "biuf":
        return [f"`{label}` holds {weights.dtype} values; expected numbers (one weight per row)"]
    if len(y_leaves) != 1 or not _is_array(y_leaves[0][1]) or weights.ndim < 2:
        return []
    y_shape = tuple(y_leaves[0][1].shape)
    fits = weights.ndim <= len(y_shape) and all(
        w in (1, t) for w, t in zip(weights.shape[1:], y_shape[1:]))
    if fits:
        return []
    return [
        f"`{label}` has shape {weights.shape}, which cannot weigh `{y_leaves[0][0]}` of shape "
        f"{y_shape}; expected one weight per row, shape ({weights.shape[0]},) (or a shape "
        "matching y's, for per-element weights)"
    ]


def _data_problems(model, x, y, sample_weight, *, check_finite, method):
    if isinstance(x, tf.data.Dataset):
        return _dataset_problems(model, x, y, "x")
    return _array_problems(model, x, y, sample_weight, check_finite=check_finite, method=method)


def _absent_inputs(name, data):
    """Labels of the None entries inside a list, tuple or dict of inputs."""
    if isinstance(data, collections.abc.Mapping):
        items = [(f"{name}[{k!r}]", v) for k, v in data.items()]
    elif isinstance(data, (list, tuple)):
        items = [(f"{name}[{i}]", v) for i, v in enumerate(data)]
    else:
        return []
    found = []
    for label, value in items:
        found += [label] if value is None else _absent_inputs(label, value)
    return found


def _absent_input_problems(model, x):
    replicas = model.distribute_strategy.num_replicas_in_sync
    absent = _absent_inputs("x", x) if replicas > 1 else []
    if not absent:
        return []
    return [
        f"{', '.join(f'`{label}`' for label in absent)} is None (an optional input left out), under "
        f"{type(model.distribute_strategy).__name__} with {replicas} replicas: TensorFlow's "
        "distributed input cannot split a missing input over replicas (plain Keras fails there "
        "too). Pass the input (e.g. zeros the model ignores), or run on one device"
    ]


def validate_inputs(model, x, y=None, sample_weight=None, *, method="fit", validation_data=None,
                    **arguments):
    """Raises `InputError` listing every problem with `method`'s arguments.

    Checks what can be checked before a step runs: scalar arguments (types,
    ranges, NaN), arrays with different or zero row counts, string labels,
    data whose shape does not fit the
    model's inputs, and a dataset batched twice (or not at all). Inputs it
    cannot inspect (generators, `PyDataset`s, a subclassed model's inputs)
    are passed through to Keras. NaN or inf in the data (fit and evaluate)
    is warned about (`NonFiniteDataWarning`), not refused: Keras trains on
    it (its `TerminateOnNaN` callback is for that case), and so does kd.

    Args:
        model: The kd model.
        x, y, sample_weight: The data, as given to `method`.
        method: `"fit"`, `"evaluate"` or `"predict"`.
        validation_data: `fit`'s validation data, checked like `x`/`y`.
        **arguments: `fit`'s other arguments (see `check_fit_arguments`).

    Raises:
        InputError: naming each bad argument, what it holds and the fix.

    Examples:
        >>> import keras, numpy as np, keras_distrib as kd
        >>> from keras_distrib.training import inputs as training_inputs
        >>> inputs = keras.Input((3,))
        >>> model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
        >>> training_inputs.validate_inputs(model, np.ones((4, 3)), np.ones((5, 1)))
        Traceback (most recent call last):
        ...
        keras_distrib.validation.InputError: Invalid `fit` arguments:
          - the data's row counts differ (`x` 4, `y` 5); every array needs one row per example. Pass x, y and sample_weight with the same first dimension
    """
    problems = []
    if method == "fit":
        problems.extend(check_fit_arguments(**arguments))
    else:
        for name in ("batch_size", "steps"):
            value = arguments.get(name)
            if value is not None and not is_whole(value, 1):
                problems.append(f"`{name}`={value!r}: expected a whole number >= 1, or None")
        verbose = arguments.get("verbose", "auto")
        if not isinstance(verbose, (bool, np.bool_)) and verbose not in _VERBOSE:
            problems.append(f"`verbose`={verbose!r}: expected one of {list(_VERBOSE)}")
        problems.extend(_callback_problems(arguments.get("callbacks")))
        return_dict = arguments.get("return_dict", False)
        if not isinstance(return_dict, (bool, np.bool_)):
            problems.append(f"`return_dict`={return_dict!r}: expected True (a dict of results "
                            "by name) or False (a list, or one scalar)")
    if x is None:
        problems.append(
            f"`x` is None; `{method}` needs data: arrays, a dict of arrays, or a tf.data.Dataset"
        )
    else:
        problems.extend(_absent_input_problems(model, x))
        check_finite = method != "predict"
        problems.extend(_data_problems(model, x, y, sample_weight, check_finite=check_finite,
                                       method=method))
    if validation_data is not None:
        if isinstance(validation_data, tf.data.Dataset):
            problems.extend(_dataset_problems(model, validation_data, None, "validation_data"))
        elif isinstance(validation_data, (list, tuple)) and len(validation_data) in (2, 3):
            val_x, val_y, val_weight = keras.utils.unpack_x_y_sample_weight(tuple(validation_data))
            labels = tuple(f"validation_data[{i}]" for i in range(3))
            problems.extend(_array_problems(model, val_x, val_y, val_weight, labels,
                                            check_finite=True, method="fit"))
        elif not hasattr(validation_data, "__iter__"):
            problems.append(
                f"`validation_data`={type(validation_data).__name__}: expected (x_val, y_val), "
                "(x_val, y_val, sample_weight_val) or a tf.data.Dataset"
            )
    if problems:
        raise InputError(f"Invalid `{method}` arguments:\n  - " + "\n  - ".join(problems))


def static_rows(x):
    """Rows in a batch of arrays or eager tensors (its first input's), or None."""
    for value in tree.flatten(x):
        if value is None:
            continue
        if isinstance(value, tf.RaggedTensor):
            return int(value.nrows())
        shape = getattr(value, "shape", None)
        if shape is None or len(shape) == 0 or shape[0] is None:
            return None
        return int(shape[0])
    return None
