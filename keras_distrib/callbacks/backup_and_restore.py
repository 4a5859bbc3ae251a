"""`kd.callbacks.BackupAndRestore`: resume an interrupted `fit` at the exact step.

Saves the model, the optimizer (with its step counter), the metric state and
the position in the epoch. On restart, the callback exposes that position
(`restored_position`, a `DataPosition`); kd's loop begins at the saved epoch
and moves the data past the batches already trained, without training them,
so the run continues with exactly the batch it would have trained next
(exact for input pipelines whose order does not depend on the run's history:
`shuffle=False`, or a dataset shuffled from a fixed seed per epoch).
On SIGTERM (preemption, or the launcher stopping a cluster) the workers save
together at the next batch and exit.
"""

import signal

import keras
import numpy as np
import tensorflow as tf

from keras_distrib import _keras_compat
from keras_distrib import checkpoint as checkpoint_lib
from keras_distrib.loop import DataPosition
from keras_distrib.callbacks import _schedule

__all__ = [
    "BackupAndRestore",
    "metric_state",
    "set_metric_state",
]


def metric_state(model):
    """Global values of every metric variable (summed over replicas)."""
    return [np.asarray(v.numpy()).tolist() for m in model.metrics for v in m.variables]


def set_metric_state(model, values, source="The backup"):
    """Restores metric variables saved by `metric_state` (the same model's)."""
    variables = [v for m in model.metrics for v in m.variables]
    if not isinstance(values, list):
        raise checkpoint_lib.CheckpointError(
            f"{source} holds no metric state (`metrics`={values!r}); it was not written by "
            "kd.callbacks.BackupAndRestore. Point `backup_dir` to a directory of its own."
        )
    if len(values) != len(variables):
        raise checkpoint_lib.CheckpointError(
            f"The backup holds {len(values)} metric values but the model has "
            f"{len(variables)} metric variables; it was written by another model."
        )
    with model.distribute_strategy.scope():
        for variable, value in zip(variables, values):
            variable.assign(np.asarray(value, dtype=variable.dtype))


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up training state so an interrupted `fit` resumes exactly.

    Args:
        backup_dir: Directory for the backup (the chief's is kept; other
            workers write to scratch space that is removed).
        save_freq: `"epoch"`, or a number of batches between backups.
        delete_checkpoint: Remove the backup after training completes.
        save_on_preemption: On SIGTERM, back up at the next batch (all
            workers together) and stop training with exit code 143.

    Only the chief writes (and locks) `backup_dir`: a second live run on
    the same directory is refused at the start of training, before it
    restores or writes anything; the lock of a run that died is taken over.

    Raises:
        CheckpointError: `backup_dir` is a file or not writable; at the
            start of training, the directory is in use by another live run,
            or holds only damaged backups.
        ValueError: invalid `save_freq`, or the model is not a kd model
            (when the callback is given to `fit`).
    """

    def __init__(self, backup_dir, *, save_freq="epoch", delete_checkpoint=True,
                 save_on_preemption=True):
        super().__init__()
        self.backup_dir = checkpoint_lib.validate_directory(backup_dir, "backup_dir")
        self.schedule = _schedule.SaveSchedule(save_freq)
        self.delete_checkpoint = delete_checkpoint
        self.save_on_preemption = save_on_preemption
        self._manager = None
        self._epoch = 0
        self._resume = None
        self.restored_position = None
        self._preempted = False
        self._previous_handler = None

    def set_model(self, model):
        """Sets the model; refuses a plain `keras.Model` (see below) before anything is written."""
        # A plain keras.Model divides each replica's loss by its own rows and
        # does not follow kd's resume position (it would train batches twice):
        # refuse it when the model becomes known, before anything is written.
        from keras_distrib import models

        if not isinstance(model, models.DistributedModelMixin):
            raise ValueError(
                f"`model` is a plain {type(model).__name__}, and kd.callbacks.BackupAndRestore "
                "needs a kd model: a plain model's steps and resume position are not kd's, so a "
                "resumed run would retrain batches and drift from one device. Build the model as "
                "kd.Model(inputs, outputs) or kd.Sequential, or put kd.DistributedModelMixin "
                "first in your model class's bases; or use keras.callbacks.BackupAndRestore "
                "with a plain Keras model."
            )
        super().set_model(model)

    def _checkpoint(self):
        model = self.model
        items = {"model": model}
        if model.optimizer is not None:
            items["optimizer"] = model.optimizer
        return tf.train.Checkpoint(**items)

    def on_train_begin(self, logs=None):
        model = self.model
        if model.optimizer is not None and not model.optimizer.built:
            with model.distribute_strategy.scope():
                model.optimizer.build(model.trainable_variables)
        self._manager = checkpoint_lib.CheckpointManager(self._checkpoint(), self.backup_dir)
        progress = self._manager.restore_or_initialize()
        self.restored_position = None
        if progress is not None:
            if "metrics" not in progress:
                raise checkpoint_lib.CheckpointError(
                    f"The checkpoint {self._manager.restored_path!r} in `backup_dir` has no "
                    "metric state: it was not written by kd.callbacks.BackupAndRestore (a "
                    "kd.CheckpointManager's, perhaps). Give the callback a directory of its own."
                )
            self.restored_position = DataPosition(progress["epoch"], progress["step"])
            if progress["step"] > 0:
                self._resume = progress
        if self.save_on_preemption:
            try:
                self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
            except ValueError:  # Not the main thread: preemption is not watched.
                self._previous_handler = None

    def _on_sigterm(self, signum, frame):
        self._preempted = True

    def _preemption_agreed(self):
        """Whether any worker was preempted (all workers must agree to save)."""
        flag = tf.constant(1.0 if self._preempted else 0.0)
        strategy = self.model.distribute_strategy
        if _keras_compat.is_multi_worker(strategy):
            per_replica = strategy.experimental_distribute_values_from_function(lambda _: flag)
            flag = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
        return bool(flag.numpy() > 0)

    def _save(self, epoch, step):
        self._manager.save(epoch=epoch, step=step, metrics=metric_state(self.model))

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self.schedule.new_epoch()
        resume = self._resume
        if resume is not None and resume["epoch"] == epoch:
            # The loop skips the batches the backup holds; their metric
            # state comes from the backup.
            set_metric_state(self.model, resume["metrics"], f"The backup in {self.backup_dir!r}")
            self.schedule.batch_done(resume["step"] - 1)
        self._resume = None

    def on_train_batch_end(self, batch, logs=None):
        due = self.schedule.batch_done(batch)
        step = batch + 1
        if self.save_on_preemption and self._preemption_agreed():
            self._save(self._epoch, step)
            self.model.stop_training = True
            self._stop_for_preemption = True
            return
        if due:
            self._save(self._epoch, step)

    def on_epoch_end(self, epoch, logs=None):
        if self.schedule.per_epoch and not self._preempted:
            self._save(epoch + 1, 0)

    def on_train_end(self, logs=None):
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None
        if getattr(self, "_stop_for_preemption", False):
            raise SystemExit(143)
        if self.delete_checkpoint:
            self._manager.delete_all()
        else:
            self._manager.mark_finished()
        self._manager.close()
