"""Callbacks whose files come from the chief only, written atomically."""

from keras_distrib.callbacks.backup_and_restore import BackupAndRestore
from keras_distrib.callbacks.model_checkpoint import ModelCheckpoint
from keras_distrib.callbacks.tensorboard import TensorBoard

__all__ = [
    "BackupAndRestore",
    "ModelCheckpoint",
    "TensorBoard",
]
