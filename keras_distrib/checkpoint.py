"""`kd.CheckpointManager`: atomic, chief-only checkpoints that track progress.

Layout of `directory`:

    ckpt-<n>/            one complete checkpoint: TF files + progress.json
    latest               the name of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory and renamed into
place, then `latest` is replaced (temp name, rename): a crash at any moment
leaves the previous checkpoint as the latest, never a half-written one.
Every worker writes (saving may run collectives), but only the chief writes
into `directory`; the others write into a scratch directory that is removed.
"""

import json
import os
import shutil
import tempfile

import tensorflow as tf

from keras_distrib import cluster

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "validate_directory",
]

_LATEST = "latest"
_PROGRESS = "progress.json"
_PREFIX = "ckpt"
PROGRESS_FILE = _PROGRESS
# Written when training ends, for a SidecarEvaluator watching the directory.
FINISHED_FILE = "finished"


class CheckpointError(ValueError):
    """A checkpoint directory or checkpoint cannot be used (nothing changed)."""


def validate_directory(directory, argument="directory"):
    """Raises `CheckpointError` unless `directory` can hold checkpoints."""
    if not isinstance(directory, (str, os.PathLike)) or not str(directory):
        raise CheckpointError(f"`{argument}`={directory!r} must be a directory path.")
    directory = os.fspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(
            f"`{argument}`={directory!r} is a file, not a directory. Pass a "
            "directory path (it is created if missing)."
        )
    parent = directory
    while not os.path.exists(parent):
        parent = os.path.dirname(parent) or "."
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(
            f"`{argument}`={directory!r} is not writable ({parent!r} denies "
            "writing). Choose a directory this process can write."
        )
    return directory


def _atomic_write_text(path, text):
    folder = os.path.dirname(path)
    handle, temp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    with os.fdopen(handle, "w") as f:
        f.write(text)
    os.replace(temp, path)


class CheckpointManager:
    """Saves and restores a `tf.train.Checkpoint` with epoch/step progress.

    Args:
        checkpoint: A `tf.train.Checkpoint` (e.g. of a model and optimizer).
        directory: Where checkpoints live; created if missing.
        max_to_keep: Complete checkpoints kept (older ones are removed after
            a newer one is in place).

    Raises:
        CheckpointError: `directory` is a file or not writable, or
            `max_to_keep` < 1.

    Example:
        >>> import tempfile, tensorflow as tf, keras_distrib as kd
        >>> step = tf.Variable(3)
        >>> manager = kd.CheckpointManager(tf.train.Checkpoint(step=step), tempfile.mkdtemp())
        >>> path = manager.save(epoch=1, step=0)
        >>> _ = step.assign(0)
        >>> manager.restore_or_initialize()["epoch"], int(step.numpy())
        (1, 3)
    """

    def __init__(self, checkpoint, directory, *, max_to_keep=1):
        if not isinstance(checkpoint, tf.train.Checkpoint):
            raise CheckpointError(
                f"`checkpoint` must be a tf.train.Checkpoint, got {type(checkpoint).__name__}."
            )
        if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise CheckpointError(f"`max_to_keep`={max_to_keep!r} must be a whole number >= 1.")
        self.checkpoint = checkpoint
        self.directory = validate_directory(directory)
        self.max_to_keep = max_to_keep
        self.progress = None

    # Reading.

    def _names(self, directory=None):
        directory = directory or self.directory
        if not os.path.isdir(directory):
            return []
        names = [n for n in os.listdir(directory) if n.startswith(_PREFIX + "-")]
        return sorted(names, key=lambda n: int(n.split("-")[1]))

    @property
    def latest(self):
        """Path of the newest complete checkpoint, or None."""
        pointer = os.path.join(self.directory, _LATEST)
        if not os.path.exists(pointer):
            return None
        with open(pointer) as f:
            name = f.read().strip()
        path = os.path.join(self.directory, name)
        return path if os.path.isdir(path) else None

    def read_progress(self, path=None):
        """The progress dict (epoch, step, extras) of `path` (the latest by default)."""
        path = path or self.latest
        if path is None:
            return None
        with open(os.path.join(path, _PROGRESS)) as f:
            return json.load(f)

    def restore(self, path=None):
        """Restores `path` (the latest by default); returns its progress dict."""
        path = path or self.latest
        if path is None:
            raise CheckpointError(f"No checkpoint in {self.directory!r} to restore.")
        try:
            status = self.checkpoint.read(os.path.join(path, "state"))
            status.assert_existing_objects_matched()
        except (AssertionError, ValueError, tf.errors.OpError) as error:
            raise CheckpointError(
                f"The checkpoint {path!r} does not fit this model/optimizer "
                f"({type(error).__name__}: {str(error).splitlines()[0][:300]}). It was "
                "left untouched. Restore into the model it was written from, or "
                "point to another directory."
            ) from error
        self.progress = self.read_progress(path)
        return self.progress

    def restore_or_initialize(self):
        """Restores the latest checkpoint if there is one; returns its progress.

        Returns None (and changes nothing) when the directory holds none.
        """
        if self.latest is None:
            self.progress = None
            return None
        return self.restore()

    # Writing.

    def save(self, *, epoch, step=0, **extra):
        """Writes a new checkpoint with its progress; returns its path.

        Every worker must call this together; only the chief's copy persists.
        """
        info = cluster.cluster_info()
        with cluster.writer_directory(self.directory, info) as directory:
            names = self._names(directory)
            number = int(names[-1].split("-")[1]) + 1 if names else 1
            name = f"{_PREFIX}-{number}"
            staging = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=directory)
            try:
                self.checkpoint.write(os.path.join(staging, "state"))
                progress = {"epoch": int(epoch), "step": int(step), **extra}
                with open(os.path.join(staging, _PROGRESS), "w") as f:
                    json.dump(progress, f)
                final = os.path.join(directory, name)
                os.replace(staging, final)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            _atomic_write_text(os.path.join(directory, _LATEST), name)
            for old in self._names(directory)[: -self.max_to_keep]:
                shutil.rmtree(os.path.join(directory, old), ignore_errors=True)
            self._remove_stale_staging(directory)
        self.progress = progress
        return os.path.join(self.directory, name)

    @staticmethod
    def _remove_stale_staging(directory):
        for name in os.listdir(directory):
            if name.startswith(".tmp-"):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)

    def mark_finished(self):
        """Records that training ended (chief only): a SidecarEvaluator stops."""
        if cluster.is_chief():
            os.makedirs(self.directory, exist_ok=True)
            _atomic_write_text(os.path.join(self.directory, FINISHED_FILE), "finished\n")

    def delete_all(self):
        """Removes the directory's checkpoints (chief only), e.g. after success."""
        if cluster.is_chief() and os.path.isdir(self.directory):
            for name in self._names() + [_LATEST]:
                path = os.path.join(self.directory, name)
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                elif os.path.exists(path):
                    os.remove(path)
            self._remove_stale_staging(self.directory)
            if not os.listdir(self.directory):
                os.rmdir(self.directory)
