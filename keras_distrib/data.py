"""`keras_distrib.data`: the public path of `kd.data`, the input pipeline (docs/API.md).

The code lives in `keras_distrib.training.data`; this module only re-exports its
names, so `keras_distrib.data` and imports from it keep working.
"""

from keras_distrib.training import data as _implementation
from keras_distrib.training.data import *  # noqa: F401,F403  (the names of its __all__)

__all__ = _implementation.__all__
