"""`keras_distrib.penalties`: the public path of how an `add_loss` term adds up over replicas (docs/API.md).

The code lives in `keras_distrib.training.penalties`; this module only re-exports its
names, so `keras_distrib.penalties` and imports from it keep working.
"""

from keras_distrib.training.penalties import FIXED
from keras_distrib.training.penalties import ROW_MEAN
from keras_distrib.training.penalties import ROW_SUM
from keras_distrib.training.penalties import kind_of
from keras_distrib.training.penalties import mark_global
from keras_distrib.training.penalties import mark_rows
from keras_distrib.training.penalties import row_mixing
from keras_distrib.training.penalties import Unknown

__all__ = [
    "FIXED",
    "ROW_MEAN",
    "ROW_SUM",
    "Unknown",
    "kind_of",
    "mark_global",
    "mark_rows",
    "row_mixing",
]
