"""The argument checks every part of kd shares, and the errors a bad argument raises.

A whole number >= k, a number of seconds and a path a command will write
are checked in one place (`is_whole`, `is_seconds`, `output_path_problem`). What `fit`, `evaluate` and `predict` are given
is checked against the model in `keras_distrib.training.inputs`, which
raises `InputError` from here.

The floor of the layout, and free of TensorFlow and Keras: the launcher and
the command line check their arguments without loading either.
"""

import math
import numbers
import os

import numpy as np

__all__ = [
    "InputError",
    "NonFiniteDataWarning",
    "is_seconds",
    "is_whole",
    "output_path_problem",
]


class InputError(ValueError):
    """An argument to `fit`, `evaluate` or `predict` is invalid (nothing ran)."""


class NonFiniteDataWarning(UserWarning):
    """The data holds NaN or inf (Keras trains on it, as does kd; `TerminateOnNaN` stops it)."""


def is_whole(value, minimum=0):
    """Whether `value` is a whole number (not a bool) >= `minimum`; NumPy integers count."""
    return (not isinstance(value, (bool, np.bool_)) and isinstance(value, numbers.Integral)
            and value >= minimum)


def is_seconds(value, *, zero=False):
    """Whether `value` is a finite real number of seconds, > 0 (or >= 0 with `zero`)."""
    return (not isinstance(value, (bool, np.bool_)) and isinstance(value, numbers.Real)
            and math.isfinite(value) and (value >= 0 if zero else value > 0))


def output_path_problem(name, path, *, directory=False):
    """Why `path`, given as `name`, cannot be written (a file, or a folder with `directory`), or None.

    Checked before a command runs, so that a benchmark of minutes does not
    end on a missing folder. A folder may be created (its nearest existing
    parent must be writable); a file's folder must exist.
    """
    path = os.path.abspath(os.fspath(path))
    kind = "a directory" if directory else "a file"
    if os.path.exists(path) and os.path.isdir(path) != directory:
        return f"`{name}`={path!r} exists and is not {kind}: give the path of {kind}"
    folder = path if directory else os.path.dirname(path)
    if not directory and not os.path.isdir(folder):
        return f"`{name}`={path!r}: its folder {folder!r} does not exist: create it, or give another path"
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"`{name}`={path!r}: {folder!r} is a file, not a folder: give another path"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"`{name}`={path!r}: {folder!r} is not writable here: give a path this user can write"
    return None
