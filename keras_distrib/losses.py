"""`keras_distrib.losses`: the public path of `kd.losses`, the loss arithmetic (docs/API.md).

The code lives in `keras_distrib.training.losses`; this module only re-exports its
names, so `keras_distrib.losses` and imports from it keep working.
"""

from keras_distrib.training import losses as _implementation
from keras_distrib.training.losses import *  # noqa: F401,F403  (the names of its __all__)

__all__ = [name for name in _implementation.__all__ if name != "replica_part"]
