"""`kd.callbacks`: the public path of kd's callbacks (docs/API.md).

The code lives in `keras_distrib.training.callbacks`; this package only
re-exports it, so `from keras_distrib.callbacks import BackupAndRestore`
keeps working.
"""

from keras_distrib.training import callbacks as _implementation
from keras_distrib.training.callbacks import *  # noqa: F401,F403  (the names of its __all__)

__all__ = _implementation.__all__
