"""`keras_distrib.penalties`: the public path of how an `add_loss` term adds up over replicas (docs/API.md).

The code lives in `keras_distrib.training.penalties`; this module only re-exports its
names, so `keras_distrib.penalties` and imports from it keep working.
"""

from keras_distrib.training import penalties as _implementation
from keras_distrib.training.penalties import *  # noqa: F401,F403  (the names of its __all__)

__all__ = _implementation.__all__
