"""`keras_distrib.losses`: the public path of `kd.losses`, the loss arithmetic (docs/API.md).

The code lives in `keras_distrib.training.losses`; this module only re-exports its
names, so `keras_distrib.losses` and imports from it keep working.
"""

from keras_distrib.training.losses import global_mean
from keras_distrib.training.losses import global_share
from keras_distrib.training.losses import row_weighted
from keras_distrib.training.losses import scale_regularization

__all__ = [
    "global_mean",
    "global_share",
    "row_weighted",
    "scale_regularization",
]
