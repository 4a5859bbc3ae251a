"""`kd.callbacks.TensorBoard`: summaries from the chief only, and the model graph.

Non-chief workers still run the callback (so every worker does the same
work between collectives), but log into scratch space. That space is made
only when a model is set (the first moment Keras writes), removed at the end
of training and at interpreter exit, and a worker killed outright (SIGKILL,
out of memory) leaves nothing for long: making a new scratch directory
removes those of dead processes (`keras_distrib.files.make_scratch`).

With `write_graph=True` (the default) it writes the model's conceptual graph
(the `keras` tag) as Keras's callback does for Keras's own models; Keras
writes it only for classes named `Functional` or `Sequential`, so not for
kd's `FunctionalModel`.
"""

import os

import keras

from keras_distrib import _keras_compat
from keras_distrib import checkpoint
from keras_distrib import cluster
from keras_distrib import files

__all__ = [
    "TensorBoard",
]


class TensorBoard(keras.callbacks.TensorBoard):
    """`keras.callbacks.TensorBoard` whose files come from the chief alone.

    Accepts the same arguments as `keras.callbacks.TensorBoard`. With
    `write_graph=True` TensorBoard's Graphs tab shows a kd model as it shows
    Keras's: the conceptual graph of a functional or sequential model (tag
    `keras`), also for kd's functional class and functional subclasses.

    Raises:
        CheckpointError: `log_dir` is a file, lies under a file, or is not
            writable (checked on the chief, which writes there).

    Example:
        >>> import tempfile, keras_distrib as kd
        >>> callback = kd.callbacks.TensorBoard(tempfile.mkdtemp())
    """

    def __init__(self, log_dir="logs", **kwargs):
        self._info = cluster.cluster_info()
        if self._info.is_chief:
            log_dir = checkpoint.validate_directory(log_dir, "log_dir")
        self._real_log_dir = os.fspath(log_dir)
        self._scratch = None
        super().__init__(log_dir=log_dir, **kwargs)

    def set_model(self, model):
        """Sets the model; a non-chief worker makes its scratch space now."""
        if not self._info.is_chief and self._scratch is None:
            self._scratch = files.make_scratch(f"tb{self._info.task_type}{self._info.task_index}")
            self.log_dir = self._scratch
        super().set_model(model)
        if self.write_graph:
            _keras_compat.write_model_config(self, model)

    def on_train_end(self, logs=None):
        """Closes the writers; a non-chief worker removes its scratch space."""
        try:
            super().on_train_end(logs)
        finally:
            if self._scratch is not None:
                files.remove_scratch(self._scratch)
                self._scratch = None
                self.log_dir = self._real_log_dir
