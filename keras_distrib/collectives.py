"""`keras_distrib.collectives`: the public path of how many collectives a model's steps make (docs/API.md).

The code lives in `keras_distrib.training.collectives`; this module only re-exports its
names, so `keras_distrib.collectives` and imports from it keep working.
"""

from keras_distrib.training.collectives import count
from keras_distrib.training.collectives import graph_collectives
from keras_distrib.training.collectives import traced

__all__ = [
    "count",
    "graph_collectives",
    "traced",
]
