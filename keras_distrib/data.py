"""The input pipeline: every example exactly once per epoch, split as one device would take it.

`kd.distribute_dataset` turns NumPy arrays, a `tf.data.Dataset` or a
`dataset_fn(input_context)` into a distributed dataset, sharded over the
workers and batched per replica; `kd.describe_input` explains the split before
you train. The rest of this module answers the questions a hand-written
pipeline asks: which files this worker reads, how a batch splits over the
replicas, how to replay a reshuffling dataset's order on resume.
"""

from keras_distrib.training.data import describe_input
from keras_distrib.training.data import distribute_dataset
from keras_distrib.training.data import file_count
from keras_distrib.training.data import replay_epochs
from keras_distrib.training.data import replica_split
from keras_distrib.training.data import shard_files
from keras_distrib.training.served import serve

__all__ = [
    "describe_input",
    "distribute_dataset",
    "file_count",
    "replay_epochs",
    "replica_split",
    "serve",
    "shard_files",
]
