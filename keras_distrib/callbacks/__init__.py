"""Keras's checkpoint and log callbacks, made safe for many workers: only the chief's files persist.

Every worker takes part in each save (a save may need collectives), but only
the chief's files are kept; the others write to scratch space that is removed
afterwards. Files are written under a temporary name and renamed into place,
so a reader sees the old file or the new one, never half of one.
"""

from keras_distrib.training.callbacks import BackupAndRestore
from keras_distrib.training.callbacks import ModelCheckpoint
from keras_distrib.training.callbacks import TensorBoard

__all__ = [
    "BackupAndRestore",
    "ModelCheckpoint",
    "TensorBoard",
]
