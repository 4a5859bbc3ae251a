"""The loss arithmetic of a replica: its exact share of the global mean.

Each replica returns its share, and the shares add up to the one-device
value. These functions return true shares, so each all-reduces its
denominator before the gradient (a hand-written loop calling them makes that
collective besides the gradients'); kd's own step, which `fit` and
`kd.TrainLoop` run, defers the scale instead and makes one collective per
step. Every function returns its inputs' floating dtype
(`keras.config.floatx()` for integers or an empty list), so a float64 model's
loop adds them without a cast.

These functions record their results as shares of the current kd step
(`compute_loss` and Keras loss objects called in a kd step do too):
trackers, logs and the gradient all-reduce tell them from values kd did not
compute.
"""

from keras_distrib.training.losses import global_batch
from keras_distrib.training.losses import global_mean
from keras_distrib.training.losses import global_share
from keras_distrib.training.losses import row_weighted
from keras_distrib.training.losses import scale_regularization

__all__ = [
    "global_batch",
    "global_mean",
    "global_share",
    "row_weighted",
    "scale_regularization",
]
