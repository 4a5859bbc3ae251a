"""The argument checks every part of kd shares, and the errors a bad argument raises.

A whole number >= k and a number of seconds are checked in one place
(`is_whole`, `is_seconds`). What `fit`, `evaluate` and `predict` are given
is checked against the model in `keras_distrib.training.inputs`, which
raises `InputError` from here.

The floor of the layout, and free of TensorFlow and Keras: the launcher and
the command line check their arguments without loading either.
"""

import math
import numbers

import numpy as np

__all__ = [
    "InputError",
    "NonFiniteDataWarning",
    "is_seconds",
    "is_whole",
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
