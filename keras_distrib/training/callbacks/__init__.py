"""Callbacks whose files come from the chief only, written atomically (public path: `kd.callbacks`)."""

from keras_distrib.training.callbacks.backup_and_restore import BackupAndRestore
from keras_distrib.training.callbacks.model_checkpoint import ModelCheckpoint
from keras_distrib.training.callbacks.tensorboard import TensorBoard

__all__ = [
    "BackupAndRestore",
    "ModelCheckpoint",
    "TensorBoard",
]
