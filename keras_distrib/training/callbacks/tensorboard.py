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

A full disk (or a quota, or a log directory gone read-only) does not end the
training run: the first failed write logs a warning naming the log directory
and the fix, TensorBoard logging stops for the rest of the run, and training
goes on (the model, its checkpoints and its history are unaffected).
"""

import errno
import logging
import os

import keras
import tensorflow as tf

from keras_distrib import _keras_compat
from keras_distrib.checkpointing import checkpoint
from keras_distrib.cluster import info as cluster
from keras_distrib import files

__all__ = [
    "TensorBoard",
]

logger = logging.getLogger("keras_distrib")

_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM)


def _write_failure(error):
    """The reason, when `error` is a failed write of the logs (else None)."""
    if isinstance(error, OSError) and error.errno in _DISK_ERRNOS:
        return error.strerror or str(error)
    if isinstance(error, (tf.errors.ResourceExhaustedError, tf.errors.PermissionDeniedError,
                          tf.errors.FailedPreconditionError, tf.errors.UnavailableError,
                          tf.errors.DataLossError)):
        text = error.message or str(error)
        for reason in ("No space left on device", "Disk quota exceeded",
                       "Read-only file system", "Permission denied"):
            if reason in text:
                return reason
        if isinstance(error, tf.errors.ResourceExhaustedError) and "events" in text:
            return text.splitlines()[0]
    return None


class TensorBoard(keras.callbacks.TensorBoard):
    """`keras.callbacks.TensorBoard` whose files come from the chief alone.

    Accepts the same arguments as `keras.callbacks.TensorBoard`. With
    `write_graph=True` TensorBoard's Graphs tab shows a kd model as it shows
    Keras's: the conceptual graph of a functional or sequential model (tag
    `keras`), also for kd's functional class and functional subclasses.

    When a write fails for lack of space (or quota, or a read-only file
    system), a warning names the log directory and the fix, logging stops
    for the rest of the run and training goes on.

    Args:
        log_dir: Where the chief writes the logs (the other workers write
            to scratch space that is removed).
        **kwargs: `keras.callbacks.TensorBoard`'s other arguments
            (`histogram_freq`, `write_graph`, `update_freq`, ...).

    Raises:
        CheckpointError: `log_dir` is a file, lies under a file, or is not
            writable (checked on the chief, which writes there).

    Examples:
        >>> import tempfile, keras_distrib as kd
        >>> callback = kd.callbacks.TensorBoard(tempfile.mkdtemp())
    """

    def __init__(self, log_dir="logs", **kwargs):
        self._info = cluster.cluster_info()
        if self._info.is_chief:
            log_dir = checkpoint.validate_directory(log_dir, "log_dir")
        self._real_log_dir = os.fspath(log_dir)
        self._scratch = None
        self._stopped = None
        super().__init__(log_dir=log_dir, **kwargs)

    def _guarded(self, hook, *args):
        """Runs `hook`; a failed write of the logs stops logging, not training."""
        if self._stopped:
            return
        try:
            hook(*args)
        except (OSError, tf.errors.OpError) as error:
            reason = _write_failure(error)
            if reason is None:
                raise
            self._stop_logging(reason)

    def _stop_logging(self, reason):
        self._stopped = reason
        logger.warning(
            "TensorBoard: cannot write the logs in %s (%s). Training goes on without "
            "TensorBoard logs for the rest of this run; the logs written so far are kept. "
            "Free space there, or give `log_dir` on another disk, for the next run.",
            self.log_dir, reason,
        )
        # Leave no summary writer of ours installed as TensorBoard's default.
        _keras_compat.exit_summary_contexts(self, ignore=(OSError, tf.errors.OpError))
        for writer in getattr(self, "_writers", {}).values():
            try:
                writer.close()
            except (OSError, tf.errors.OpError):
                pass

    def set_model(self, model):
        """Sets the model; a non-chief worker makes its scratch space now."""
        if not self._info.is_chief and self._scratch is None:
            self._scratch = files.make_scratch(f"tb{self._info.task_type}{self._info.task_index}")
            self.log_dir = self._scratch
        self._guarded(super().set_model, model)
        if self.write_graph:
            self._guarded(_keras_compat.write_model_config, self, model)

    def on_train_begin(self, logs=None):
        self._guarded(super().on_train_begin, logs)

    def on_train_batch_begin(self, batch, logs=None):
        self._guarded(super().on_train_batch_begin, batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self._guarded(super().on_train_batch_end, batch, logs)

    def on_test_begin(self, logs=None):
        self._guarded(super().on_test_begin, logs)

    def on_test_batch_begin(self, batch, logs=None):
        self._guarded(super().on_test_batch_begin, batch, logs)

    def on_test_end(self, logs=None):
        self._guarded(super().on_test_end, logs)

    def on_epoch_begin(self, epoch, logs=None):
        self._guarded(super().on_epoch_begin, epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._guarded(super().on_epoch_end, epoch, logs)

    def on_train_end(self, logs=None):
        """Closes the writers; a non-chief worker removes its scratch space."""
        try:
            self._guarded(super().on_train_end, logs)
        finally:
            if self._scratch is not None:
                files.remove_scratch(self._scratch)
                self._scratch = None
                self.log_dir = self._real_log_dir
