"""How many collectives a model's compiled steps make, counted in what TensorFlow traced.

Each collective is a barrier across replicas and, between workers, a network
round trip, so their number per step is what a cluster's latency multiplies.
`count` runs a `fit`, `evaluate` and `predict` epoch of a compiled kd model and
counts the collective ops (`CollectiveReduceV2`, `CollectiveGatherV2`,
NCCL's) in the graphs TensorFlow traced for its step functions, the functions
they call included: what runs, not what kd requested.

Evaluation logs: with `verbose=0` and no callback that overrides
`on_test_batch_end`, a kd model's own `test_step` reports no logs per call
(`on_test_batch_end` gets `{}`), and the logs are read once at the end (one
packed all-reduce). A `test_step` of your own keeps its logs per call.
"""

from keras_distrib.training.collectives import count
from keras_distrib.training.collectives import graph_collectives
from keras_distrib.training.collectives import traced

__all__ = [
    "count",
    "graph_collectives",
    "traced",
]
