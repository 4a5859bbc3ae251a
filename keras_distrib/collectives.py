"""`keras_distrib.collectives`: the public path of how many collectives a model's steps make (docs/API.md).

The code lives in `keras_distrib.training.collectives`; this module only re-exports its
names, so `keras_distrib.collectives` and imports from it keep working.
"""

from keras_distrib.training import collectives as _implementation
from keras_distrib.training.collectives import *  # noqa: F401,F403  (the names of its __all__)

__all__ = _implementation.__all__
