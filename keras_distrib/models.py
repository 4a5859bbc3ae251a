"""`keras_distrib.models`: the public path of `kd.models`, kd's model classes (docs/API.md).

The code lives in `keras_distrib.training.models`; this module only re-exports its
names, so `keras_distrib.models` and imports from it keep working.
"""

from keras_distrib.training import models as _implementation
from keras_distrib.training.models import *  # noqa: F401,F403  (the names of its __all__)

__all__ = _implementation.__all__
