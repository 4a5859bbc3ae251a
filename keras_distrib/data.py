"""`keras_distrib.data`: the public path of `kd.data`, the input pipeline (docs/API.md).

The code lives in `keras_distrib.training.data`; this module only re-exports its
names, so `keras_distrib.data` and imports from it keep working.
"""

from keras_distrib.training.data import describe_input
from keras_distrib.training.data import distribute_dataset
from keras_distrib.training.data import file_count
from keras_distrib.training.data import replay_epochs
from keras_distrib.training.data import replica_split
from keras_distrib.training.data import shard_files

__all__ = [
    "describe_input",
    "distribute_dataset",
    "file_count",
    "replay_epochs",
    "replica_split",
    "shard_files",
]
