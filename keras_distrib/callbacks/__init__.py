"""`kd.callbacks`: the public path of kd's callbacks (docs/API.md).

The code lives in `keras_distrib.training.callbacks`; this package only
re-exports it, so `from keras_distrib.callbacks import BackupAndRestore`
keeps working.
"""

from keras_distrib.training.callbacks import BackupAndRestore
from keras_distrib.training.callbacks import ModelCheckpoint
from keras_distrib.training.callbacks import TensorBoard

__all__ = [
    "BackupAndRestore",
    "ModelCheckpoint",
    "TensorBoard",
]
