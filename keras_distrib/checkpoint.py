"""`keras_distrib.checkpoint`: the public path of checkpoint files and `kd.CheckpointManager` (docs/API.md).

The code lives in `keras_distrib.checkpointing.checkpoint`; this module only re-exports its
names, so `keras_distrib.checkpoint` and imports from it keep working.
"""

from keras_distrib.checkpointing import checkpoint as _implementation
from keras_distrib.checkpointing.checkpoint import *  # noqa: F401,F403  (the names of its __all__)

__all__ = _implementation.__all__
