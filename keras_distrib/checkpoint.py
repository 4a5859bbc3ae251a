"""`keras_distrib.checkpoint`: the public path of checkpoint files and `kd.CheckpointManager` (docs/API.md).

The code lives in `keras_distrib.checkpointing.checkpoint`; this module only re-exports its
names, so `keras_distrib.checkpoint` and imports from it keep working.
"""

from keras_distrib.checkpointing.checkpoint import checkpoint_number
from keras_distrib.checkpointing.checkpoint import data_problems
from keras_distrib.checkpointing.checkpoint import file_problems
from keras_distrib.checkpointing.checkpoint import read_progress_file
from keras_distrib.checkpointing.checkpoint import validate_directory
from keras_distrib.checkpointing.checkpoint import CheckpointError
from keras_distrib.checkpointing.checkpoint import CheckpointManager

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "checkpoint_number",
    "data_problems",
    "file_problems",
    "read_progress_file",
    "validate_directory",
]
