"""The gradient pipeline: one all-reduce, then the optimizer's own steps on the global gradient.

Keras applies clipping, accumulation and loss-scale unscaling to each
replica's partial gradient; kd's pipeline sums the replicas' gradients first,
then unscales, accumulates, clips, decays and applies them as one device does.
`fit` and `kd.TrainLoop` install it themselves; a hand-written loop gives its
optimizer the pipeline with `exact_optimizer`.
"""

from keras_distrib.training.gradients import all_reduce
from keras_distrib.training.gradients import exact_optimizer
from keras_distrib.training.gradients import install

__all__ = [
    "all_reduce",
    "exact_optimizer",
    "install",
]
