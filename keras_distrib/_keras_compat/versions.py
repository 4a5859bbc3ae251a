"""The installed Keras and TensorFlow versions, as (major, minor), for version checks.

Part of `keras_distrib._keras_compat`; the package's `check_versions` and
every version-dependent workaround read them here.
"""

import keras
import tensorflow as tf

__all__ = [
    "KERAS_VERSION",
    "TENSORFLOW_VERSION",
    "version_tuple",
]


def version_tuple(version):
    """`(major, minor)` of a version string; a suffix (`rc1`, `dev2025`) is dropped.

    Examples:
        >>> from keras_distrib._keras_compat import versions
        >>> versions.version_tuple("3.14.0rc1")
        (3, 14)
    """
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


KERAS_VERSION = version_tuple(keras.__version__)
TENSORFLOW_VERSION = version_tuple(tf.__version__)
