"""`keras_distrib.loop`: the public path of `kd.loop`, the outer training loop (docs/API.md).

The code lives in `keras_distrib.training.loop`; this module only re-exports its
names, so `keras_distrib.loop` and imports from it keep working.
"""

from keras_distrib.training import loop as _implementation
from keras_distrib.training.loop import *  # noqa: F401,F403  (the names of its __all__)

__all__ = _implementation.__all__
