"""`kd.callbacks.TensorBoard`: summaries from the chief only.

Non-chief workers still run the callback (so every worker does the same
work between collectives), but log into scratch space removed at the end.
"""

import shutil
import tempfile

import keras

from keras_distrib import cluster

__all__ = [
    "TensorBoard",
]


class TensorBoard(keras.callbacks.TensorBoard):
    """`keras.callbacks.TensorBoard` whose files come from the chief alone.

    Accepts the same arguments as `keras.callbacks.TensorBoard`.
    """

    def __init__(self, log_dir="logs", **kwargs):
        self._info = cluster.cluster_info()
        self._scratch = None
        if not self._info.is_chief:
            self._scratch = tempfile.mkdtemp(prefix=f"kd_tb_{self._info.task_type}{self._info.task_index}_")
            log_dir = self._scratch
        super().__init__(log_dir=log_dir, **kwargs)

    def on_train_end(self, logs=None):
        super().on_train_end(logs)
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
