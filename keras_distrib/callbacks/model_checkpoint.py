"""`kd.callbacks.ModelCheckpoint`: Keras's checkpoint callback, chief-only and atomic.

Every worker saves (saving reads distributed variables, which may run
collectives); the chief writes the real file, the others write into scratch
space that is removed. Each file is written under a temporary name in its
destination folder and renamed, so a crash never leaves a half-written file
where a good one was.
"""

import os
import tempfile
import warnings

import keras
import numpy as np

from keras_distrib import cluster
from keras_distrib.callbacks import _schedule

__all__ = [
    "ModelCheckpoint",
]

_MODES = ("auto", "min", "max")


class ModelCheckpoint(keras.callbacks.Callback):
    """Saves the model or its weights, like `keras.callbacks.ModelCheckpoint`.

    Args:
        filepath: Path ending in `.keras` (whole model) or `.weights.h5`
            (weights only); may hold `{epoch}`, `{batch}` and log keys, e.g.
            `"ckpt/model-{epoch:02d}-{val_loss:.2f}.keras"`.
        monitor: Log key compared when `save_best_only`.
        verbose: 1 prints a line per save (chief only).
        save_best_only: Save only when `monitor` improves.
        save_weights_only: Save weights only (filepath must end `.weights.h5`).
        mode: `"auto"`, `"min"` or `"max"` for `monitor`.
        save_freq: `"epoch"` or a number of batches.
        initial_value_threshold: Best value to beat at the start.

    Raises:
        ValueError: listing every invalid argument.
    """

    def __init__(self, filepath, monitor="val_loss", verbose=0, save_best_only=False,
                 save_weights_only=False, mode="auto", save_freq="epoch",
                 initial_value_threshold=None):
        super().__init__()
        problems = []
        filepath = os.fspath(filepath)
        ending = ".weights.h5" if save_weights_only else ".keras"
        if not filepath.endswith(ending):
            problems.append(
                f"`filepath`={filepath!r} must end with {ending!r} when "
                f"`save_weights_only`={save_weights_only}"
            )
        if os.path.isdir(filepath):
            problems.append(f"`filepath`={filepath!r} is a directory; give a file path")
        if mode not in _MODES:
            problems.append(f"`mode`={mode!r} must be one of {list(_MODES)}")
        try:
            self.schedule = _schedule.SaveSchedule(save_freq)
        except ValueError as error:
            problems.append(str(error))
        if problems:
            raise ValueError("Invalid ModelCheckpoint arguments:\n  - " + "\n  - ".join(problems))
        self.filepath = filepath
        self.monitor = monitor
        self.verbose = verbose
        self.save_best_only = save_best_only
        self.save_weights_only = save_weights_only
        if mode == "auto":
            mode = "max" if "acc" in monitor or monitor.startswith("fmeasure") else "min"
        self.mode = mode
        self.best = initial_value_threshold
        if self.best is None:
            self.best = np.inf if mode == "min" else -np.inf
        self._epoch = 0

    def _improved(self, value):
        return value < self.best if self.mode == "min" else value > self.best

    def _save(self, epoch, batch, logs):
        logs = dict(logs or {})
        if self.save_best_only:
            current = logs.get(self.monitor)
            if current is None:
                warnings.warn(
                    f"ModelCheckpoint: `monitor`={self.monitor!r} is not in the logs "
                    f"({sorted(logs)}); nothing saved.", stacklevel=2,
                )
                return
            if not self._improved(current):
                return
            self.best = current
        name = self.filepath.format(epoch=epoch + 1, batch=batch, **logs)
        folder, base = os.path.split(os.path.abspath(name))
        with cluster.writer_directory(folder) as directory:
            handle, temp = tempfile.mkstemp(prefix=".tmp-", suffix=base, dir=directory)
            os.close(handle)
            try:
                if self.save_weights_only:
                    self.model.save_weights(temp, overwrite=True)
                else:
                    self.model.save(temp, overwrite=True)
                os.replace(temp, os.path.join(directory, base))
            finally:
                if os.path.exists(temp):
                    os.remove(temp)
        if self.verbose and cluster.is_chief():
            print(f"\nEpoch {epoch + 1}: saved {'weights' if self.save_weights_only else 'model'} to {name}")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self.schedule.new_epoch()

    def on_train_batch_end(self, batch, logs=None):
        if self.schedule.batch_done(batch):
            self._save(self._epoch, batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if self.schedule.per_epoch:
            self._save(epoch, None, logs)
