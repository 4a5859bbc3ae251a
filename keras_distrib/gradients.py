"""`keras_distrib.gradients`: the public path of `kd.gradients`, the gradient pipeline (docs/API.md).

The code lives in `keras_distrib.training.gradients`; this module only re-exports its
names, so `keras_distrib.gradients` and imports from it keep working.
"""

from keras_distrib.training.gradients import all_reduce
from keras_distrib.training.gradients import exact_optimizer
from keras_distrib.training.gradients import install

__all__ = [
    "all_reduce",
    "exact_optimizer",
    "install",
]
