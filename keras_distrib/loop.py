"""`keras_distrib.loop`: the public path of `kd.loop`, the outer training loop (docs/API.md).

The code lives in `keras_distrib.training.loop`; this module only re-exports its
names, so `keras_distrib.loop` and imports from it keep working.
"""

from keras_distrib.training.loop import build
from keras_distrib.training.loop import build_model
from keras_distrib.training.loop import callback_list
from keras_distrib.training.loop import chunk_end_hooks
from keras_distrib.training.loop import epoch_interrupted
from keras_distrib.training.loop import epoch_source
from keras_distrib.training.loop import evaluate
from keras_distrib.training.loop import evaluate_pass
from keras_distrib.training.loop import fit
from keras_distrib.training.loop import fit_epochs
from keras_distrib.training.loop import owned_batches
from keras_distrib.training.loop import predict
from keras_distrib.training.loop import predict_pass
from keras_distrib.training.loop import resume_position
from keras_distrib.training.loop import skip_before_distribution
from keras_distrib.training.loop import DataPosition
from keras_distrib.training.loop import EmptyDataError
from keras_distrib.training.loop import LocalRunner

__all__ = [
    "DataPosition",
    "EmptyDataError",
    "LocalRunner",
    "build",
    "build_model",
    "callback_list",
    "chunk_end_hooks",
    "epoch_interrupted",
    "epoch_source",
    "evaluate",
    "evaluate_pass",
    "fit",
    "fit_epochs",
    "owned_batches",
    "predict",
    "predict_pass",
    "resume_position",
    "skip_before_distribution",
]
