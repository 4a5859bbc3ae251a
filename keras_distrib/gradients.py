"""`keras_distrib.gradients`: the public path of `kd.gradients`, the gradient pipeline (docs/API.md).

The code lives in `keras_distrib.training.gradients`; this module only re-exports its
names, so `keras_distrib.gradients` and imports from it keep working.
"""

from keras_distrib.training import gradients as _implementation
from keras_distrib.training.gradients import *  # noqa: F401,F403  (the names of its __all__)

__all__ = _implementation.__all__
