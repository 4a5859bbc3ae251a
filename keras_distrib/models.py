"""`keras_distrib.models`: the public path of `kd.models`, kd's model classes (docs/API.md).

The code lives in `keras_distrib.training.models`; this module only re-exports its
names, so `keras_distrib.models` and imports from it keep working.
"""

from keras_distrib.training.models import global_moments
from keras_distrib.training.models import layer_state
from keras_distrib.training.models import random_states
from keras_distrib.training.models import unregistered_class_warning
from keras_distrib.training.models import unsupported_settings
from keras_distrib.training.models import DistributedModelMixin
from keras_distrib.training.models import FunctionalModel
from keras_distrib.training.models import Model
from keras_distrib.training.models import Sequential

__all__ = [
    "DistributedModelMixin",
    "FunctionalModel",
    "Model",
    "Sequential",
    "global_moments",
    "layer_state",
    "random_states",
    "unregistered_class_warning",
    "unsupported_settings",
]
