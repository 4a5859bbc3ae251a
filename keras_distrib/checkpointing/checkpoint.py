"""`kd.CheckpointManager`: atomic, chief-only checkpoints that track progress.

Layout of `directory`:

    ckpt-<n>/            one complete checkpoint: TF files + progress.json
    latest               the name of the newest checkpoint written (a hint)
    .kd-lock.json        the run that owns the directory (pid, host, start)
    .kd-created          present when kd created the directory: only then may
                         `delete_all` remove it (never a mount point or link)

A checkpoint is written into a hidden staging directory and renamed into
place, then `latest` is replaced (temp name, rename): a crash at any moment
leaves the previous checkpoints intact, never a half-written one under a
real name. Restoring does not trust `latest`: it takes the newest
checkpoint that is complete and readable, falls back to older ones past a
damaged one, and says what it skipped. Old checkpoints are removed only
after a newer one is complete, so there is always an intact one.

Every worker writes (saving may run collectives), but only the chief writes
into `directory`, and only the chief locks it; the others write into a
scratch directory that is removed.
"""

import json
import logging
import os
import re
import shutil

import tensorflow as tf

from keras_distrib.cluster import info as cluster
from keras_distrib import files
from keras_distrib import validation

logger = logging.getLogger("keras_distrib")

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "checkpoint_number",
    "data_problems",
    "file_problems",
    "read_progress_file",
    "validate_directory",
]

_LATEST = "latest"
# Left in a directory kd created, so that a later run (a restart) knows it may remove it.
CREATED_MARKER = ".kd-created"
_PROGRESS = "progress.json"
_STATE = "state"
_PREFIX = "ckpt"
_NAME = re.compile(rf"^{_PREFIX}-(\d+)$")
_DATA_SHARD = re.compile(rf"^{_STATE}\.data-(\d+)-of-(\d+)$")
PROGRESS_FILE = _PROGRESS
# Written when training ends, for a SidecarEvaluator watching the directory.
FINISHED_FILE = "finished"


class CheckpointError(ValueError):
    """A checkpoint directory or checkpoint cannot be used (nothing changed)."""


def validate_directory(directory, argument="directory"):
    """Raises `CheckpointError` unless `directory` can hold checkpoints."""
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise CheckpointError(
            f"`{argument}`={directory!r} must be a directory path (a non-empty str or "
            "os.PathLike)."
        )
    directory = os.fspath(directory)
    if isinstance(directory, bytes):
        directory = os.fsdecode(directory)
    try:
        directory.encode("utf-8")
    except UnicodeEncodeError:
        # TensorFlow's file functions take UTF-8 paths only: it would fail at the first save.
        raise CheckpointError(
            f"`{argument}`={directory!r} is not valid UTF-8 (its bytes "
            f"{os.fsencode(directory)!r}), and TensorFlow reads and writes UTF-8 paths only. "
            "Rename the directory (or choose another) to a UTF-8 name."
        ) from None
    if os.path.islink(directory) and not os.path.exists(directory):
        try:
            target = os.readlink(directory)
        except OSError:
            target = "?"
        raise CheckpointError(
            f"`{argument}`={directory!r} is a symbolic link to {target!r}, which does not exist "
            "or loops back on itself. Create the target directory, or pass a real directory path."
        )
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(
            f"`{argument}`={directory!r} is a file, not a directory. Pass a "
            "directory path (it is created if missing)."
        )
    parent = directory
    while not os.path.exists(parent):
        parent = os.path.dirname(parent) or "."
    if not os.path.isdir(parent):
        raise CheckpointError(
            f"`{argument}`={directory!r} is under {parent!r}, which is a file, so the "
            "directory cannot be created. Choose a path under a directory."
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(
            f"`{argument}`={directory!r} is not writable ({parent!r} denies "
            "writing). Choose a directory this process can write."
        )
    return directory


def checkpoint_number(name):
    """`n` for a checkpoint directory name `ckpt-<n>`, else None."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def read_progress_file(path):
    """The progress dict of checkpoint `path`.

    Raises:
        CheckpointError: progress.json is missing, unreadable, not JSON, or
            lacks a whole-number `epoch` and `step` (naming the file).
    """
    file = os.path.join(path, _PROGRESS)
    try:
        with open(file) as f:
            text = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{file!r} is missing: the checkpoint is incomplete.") from None
    except OSError as error:
        raise CheckpointError(f"{file!r} cannot be read ({error.strerror}).") from None
    try:
        progress = json.loads(text)
    except ValueError as error:
        raise CheckpointError(
            f"{file!r} is corrupt: not valid JSON ({error}; {len(text)} bytes)."
        ) from None
    problems = []
    if not isinstance(progress, dict):
        raise CheckpointError(f"{file!r} is corrupt: holds a {type(progress).__name__}, not an object.")
    for key in ("epoch", "step"):
        value = progress.get(key)
        if not validation.is_whole(value, 0):
            problems.append(f"`{key}`={value!r} is not a whole number >= 0")
    if problems:
        raise CheckpointError(f"{file!r} is corrupt: " + "; ".join(problems) + ".")
    return progress


def file_problems(path):
    """What makes checkpoint `path` incomplete, checked from its files alone.

    Cheap: reads progress.json and lists the directory. Whether the tensor
    data reads back is checked by `data_problems`.

    Returns:
        A list of messages, each naming a file; empty if complete.
    """
    if not os.path.isdir(path):
        return [f"{path!r} is not a directory"]
    problems = []
    try:
        read_progress_file(path)
    except CheckpointError as error:
        problems.append(str(error).rstrip("."))
    names = set(os.listdir(path))
    if f"{_STATE}.index" not in names:
        problems.append(f"{os.path.join(path, _STATE + '.index')!r} is missing")
    shards = [_DATA_SHARD.match(n) for n in names]
    shards = [m for m in shards if m]
    if not shards:
        problems.append(f"{os.path.join(path, _STATE + '.data-*')!r}: no data file")
    else:
        total = int(shards[0].group(2))
        missing = [f"{_STATE}.data-{i:05d}-of-{total:05d}" for i in range(total)
                   if f"{_STATE}.data-{i:05d}-of-{total:05d}" not in names]
        if missing:
            problems.append(f"data file(s) {missing} missing in {path!r}")
    return problems


def data_problems(path):
    """Reads every tensor of checkpoint `path` back; lists what fails (checksums, truncation)."""
    prefix = os.path.join(path, _STATE)
    try:
        reader = tf.train.load_checkpoint(prefix)
        keys = sorted(reader.get_variable_to_shape_map())
    except Exception as error:  # noqa: BLE001 - TF raises many types for bad files
        return [f"{prefix + '.index'!r} cannot be read ({_first_line(error)})"]
    problems = []
    for key in keys:
        try:
            reader.get_tensor(key)
        except Exception as error:  # noqa: BLE001 - e.g. IndexError on a truncated file
            problems.append(f"the data files of {prefix!r} are damaged: tensor {key!r} "
                            f"does not read back ({_first_line(error)})")
            break
    return problems


def _first_line(error):
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"


class CheckpointManager:
    """Saves and restores a `tf.train.Checkpoint` with epoch/step progress.

    Restoring takes the newest checkpoint that is complete and readable,
    whatever `latest` says, and logs (logger `"keras_distrib"`) which one it
    restored and why it skipped any newer one. Saving never leaves fewer
    intact checkpoints: older ones are removed only after the new one is
    complete. The chief locks the directory (`.kd-lock.json`) on its first
    `save` or `restore_or_initialize`, until `close()` or exit: a second live run
    on the same directory is refused; a lock left by a dead run is taken
    over. `restore` alone (e.g. an evaluator reading) takes no lock.
    Only the chief's checkpoints persist; the other workers take part in each
    save (it may need collectives) and write to scratch space. A damaged or
    unreadable checkpoint raises `kd.CheckpointError`, naming the files.

    A checkpoint restores with or without a strategy and into another
    replica count. A kd model's checkpoint dependencies include the states
    of its seed generators (one entry per generator, named by its holder's
    position among the model's layers), so any `tf.train.Checkpoint` of it
    restores the draws of Dropout, random augmentation and the model's own
    `SeedGenerator` with the weights.

    Args:
        checkpoint: A `tf.train.Checkpoint` (e.g. of a model and optimizer).
        directory: Where checkpoints live; created if missing.
        max_to_keep: Complete checkpoints kept (older ones are removed after
            a newer one is in place).

    Raises:
        CheckpointError: `checkpoint` is not a `tf.train.Checkpoint`,
            `directory` is a file or not writable, or `max_to_keep` is not a
            whole number >= 1.

    Example:
        >>> import tempfile, tensorflow as tf, keras_distrib as kd
        >>> step = tf.Variable(3)
        >>> manager = kd.CheckpointManager(tf.train.Checkpoint(step=step), tempfile.mkdtemp())
        >>> path = manager.save(epoch=1, step=0)
        >>> _ = step.assign(0)
        >>> manager.restore_or_initialize()["epoch"], int(step.numpy())
        (1, 3)
        >>> manager.close()
    """

    def __init__(self, checkpoint, directory, *, max_to_keep=1):
        problems = []
        if not isinstance(checkpoint, tf.train.Checkpoint):
            problems.append(
                f"`checkpoint` must be a tf.train.Checkpoint, got {type(checkpoint).__name__}; "
                "wrap what you save: tf.train.Checkpoint(model=model, optimizer=model.optimizer)"
            )
        if not validation.is_whole(max_to_keep, 1):
            problems.append(f"`max_to_keep`={max_to_keep!r} must be a whole number >= 1")
        try:
            directory = validate_directory(directory)
        except CheckpointError as error:
            problems.append(str(error).rstrip("."))
        if problems:
            raise CheckpointError("Invalid CheckpointManager arguments:\n  - " + "\n  - ".join(problems))
        self.checkpoint = checkpoint
        self.directory = directory
        self.max_to_keep = max_to_keep
        self.progress = None
        self.skipped = []  # (path, reason) of checkpoints the last restore passed over
        self.restored_path = None
        # Only a directory kd created (marked CREATED_MARKER) is ever removed
        # (`delete_all`): never a mount point, a symbolic link or the user's.
        self._created = not os.path.lexists(directory)
        self._lock = files.DirectoryLock(directory, "checkpoint")

    # Ownership.

    def _own(self):
        """Locks the directory (chief only; other workers never write there)."""
        if not cluster.cluster_info().is_chief or self._lock.held:
            return
        try:
            self._lock.acquire()
        except (files.DirectoryInUseError, files.UnsafeLockError) as error:
            raise CheckpointError(str(error)) from None
        except OSError as error:
            raise CheckpointError(
                f"Could not write the lock file {self._lock.path!r} ({error.strerror}); nothing "
                f"was restored or written. Free space in (or fix the permissions of) "
                f"{self.directory!r}, or give another directory."
            ) from None
        if self._created:
            marker = os.path.join(self.directory, CREATED_MARKER)
            if not os.path.lexists(marker):
                files.atomic_write_text(marker, "")

    def close(self):
        """Releases the directory's lock (if this manager took it)."""
        self._lock.release()

    # Reading.

    def _names(self, directory=None):
        directory = directory or self.directory
        if not os.path.isdir(directory):
            return []
        names = [n for n in os.listdir(directory) if checkpoint_number(n) is not None]
        return sorted(names, key=checkpoint_number)

    @property
    def checkpoints(self):
        """Paths of the complete checkpoints, oldest first (files checked, not data)."""
        paths = [os.path.join(self.directory, n) for n in self._names()]
        return [p for p in paths if not file_problems(p)]

    @property
    def latest(self):
        """Path of the newest complete checkpoint, or None (`latest` is not trusted)."""
        paths = self.checkpoints
        return paths[-1] if paths else None

    def read_progress(self, path=None):
        """The progress dict of `path` (the newest complete checkpoint by default).

        Returns None when there is no complete checkpoint.

        Raises:
            CheckpointError: `path`'s progress.json is missing or corrupt.
        """
        path = path or self.latest
        if path is None:
            return None
        return read_progress_file(os.fspath(path))

    def _restore_one(self, path):
        """Restores `path` or raises CheckpointError; says whether it is damaged."""
        problems = file_problems(path)
        if problems:
            raise _Damaged(problems)
        try:
            status = self.checkpoint.read(os.path.join(path, _STATE))
            status.assert_existing_objects_matched()
        except Exception as error:  # noqa: BLE001 - corruption escapes as IndexError etc.
            damage = data_problems(path)
            if damage:
                raise _Damaged(damage) from None
            raise CheckpointError(
                f"The checkpoint {path!r} is intact (every file reads back) but does not fit "
                f"this model/optimizer ({_first_line(error)}). It was left untouched. Restore "
                "into the model it was written from, or point to another directory."
            ) from error
        return read_progress_file(path)

    def restore(self, path=None):
        """Restores a checkpoint; returns its progress dict.

        Args:
            path: A checkpoint directory. When `None`, the newest complete,
                readable checkpoint: damaged ones are skipped (and logged).

        Raises:
            CheckpointError: no checkpoint to restore; every checkpoint (or
                `path`) is damaged, naming each file and what is wrong; or
                an intact checkpoint does not fit the model.
        """
        self.skipped = []
        if path is not None:
            path = os.fspath(path)
            try:
                self.progress = self._restore_one(path)
                self.restored_path = path
            except _Damaged as damage:
                raise CheckpointError(
                    f"The checkpoint {path!r} is damaged: {'; '.join(damage.problems)}. Nothing "
                    "was changed. Restore another checkpoint (or move this one away)."
                ) from None
            return self.progress
        names = self._names()
        if not names:
            raise CheckpointError(f"No checkpoint in {self.directory!r} to restore.")
        for name in reversed(names):
            candidate = os.path.join(self.directory, name)
            try:
                self.progress = self._restore_one(candidate)
            except _Damaged as damage:
                reason = "; ".join(damage.problems)
                self.skipped.append((candidate, reason))
                logger.warning("Skipped checkpoint %s: %s.", candidate, reason)
                continue
            self.restored_path = candidate
            self._log_restored(candidate)
            return self.progress
        details = "\n  - ".join(f"{p}: {r}" for p, r in self.skipped)
        raise CheckpointError(
            f"Every checkpoint in {self.directory!r} is damaged, so none was restored and "
            f"none was deleted:\n  - {details}\nMove the damaged checkpoints away (or point "
            "to another directory) to start from scratch."
        )

    def _log_restored(self, path):
        marker = self._marker()
        note = ""
        if self.skipped:
            note = f" (newer checkpoint(s) skipped as damaged: {[p for p, _ in self.skipped]})"
        elif marker != os.path.basename(path):
            note = (f" (the `latest` marker names {marker!r}, which is not a complete "
                    "checkpoint; restored the newest complete one)" if marker else
                    " (the `latest` marker is missing; restored the newest complete one)")
        log = logger.warning if note else logger.info
        log("Restored checkpoint %s (epoch %s, step %s)%s.", path, self.progress["epoch"],
            self.progress["step"], note)

    def _marker(self):
        try:
            with open(os.path.join(self.directory, _LATEST)) as f:
                return f.read().strip() or None
        except (OSError, UnicodeDecodeError):
            return None

    def restore_or_initialize(self):
        """Restores the newest intact checkpoint if there is one; returns its progress.

        Returns None (and changes nothing) when the directory holds no
        checkpoint. A directory holding only damaged checkpoints raises
        rather than start over silently (see `restore`). This is how a run
        resumes, so the chief locks the directory first: a second live run
        is refused before it can resume from the first one's checkpoint.
        (`restore` alone does not lock: reading is safe beside a writer.)
        """
        self._own()
        if not self._names():
            marker = self._marker()
            if marker is not None:
                raise CheckpointError(
                    f"{os.path.join(self.directory, _LATEST)!r} names the checkpoint {marker!r}, "
                    f"but {os.path.join(self.directory, marker)!r} is missing and no other "
                    "checkpoint is there: it was deleted or moved, so training would start "
                    "from scratch. Put the checkpoint back, or delete the `latest` file to start "
                    "from scratch on purpose."
                )
            self.progress = None
            self.skipped = []
            return None
        return self.restore()

    # Writing.

    def save(self, *, epoch, step=0, **extra):
        """Writes a new checkpoint with its progress; returns its path.

        Every worker must call this together; only the chief's copy persists.

        Raises:
            CheckpointError: `epoch`/`step` are not whole numbers >= 0, the
                directory is in use by another live run, or the new
                checkpoint did not come out complete (then nothing older
                was removed).
        """
        problems = [
            f"`{key}`={value!r} must be a whole number >= 0"
            for key, value in (("epoch", epoch), ("step", step))
            if not validation.is_whole(value, 0)
        ]
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as error:
            problems.append(f"extra progress {sorted(extra)} must be JSON-serializable ({error})")
        if problems:
            raise CheckpointError("Invalid save arguments:\n  - " + "\n  - ".join(problems))
        info = cluster.cluster_info()
        if info.is_chief:
            self._own()
        with cluster.writer_directory(self.directory, info) as directory:
            names = self._names(directory)
            number = checkpoint_number(names[-1]) + 1 if names else 1
            name = f"{_PREFIX}-{number}"
            staging = files.staging_directory(directory, name)
            final = os.path.join(directory, name)
            progress = {"epoch": int(epoch), "step": int(step), **extra}
            try:
                self.checkpoint.write(os.path.join(staging, _STATE))
                with open(os.path.join(staging, _PROGRESS), "w") as f:
                    json.dump(progress, f)
                files.publish(staging, final)
            except (OSError, tf.errors.OpError) as error:
                shutil.rmtree(staging, ignore_errors=True)
                raise CheckpointError(
                    f"Could not write the checkpoint {final!r} ({_first_line(error)}); nothing "
                    f"was replaced, the older checkpoints were kept. Free space in (or fix the "
                    f"permissions of) {directory!r}, or give another directory."
                ) from error
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            problems = file_problems(final)
            if problems:
                raise CheckpointError(
                    f"The new checkpoint {final!r} came out incomplete ({'; '.join(problems)}); "
                    "the older checkpoints were kept. Check the disk (space, quota)."
                )
            files.atomic_write_text(os.path.join(directory, _LATEST), name)
            # A resumed or resubmitted run is not finished (a SidecarEvaluator
            # watching the directory would otherwise stop).
            if os.path.exists(os.path.join(directory, FINISHED_FILE)):
                os.remove(os.path.join(directory, FINISHED_FILE))
            self._prune(directory)
            files.remove_dead_staging(directory)
        self.progress = progress
        return os.path.join(self.directory, name)

    def relabel(self, *, epoch, step=0):
        """Moves the newest checkpoint's position to (`epoch`, `step`), its state unchanged.

        For a checkpoint whose state the new position describes as well: one
        taken at an epoch's last step becomes the next epoch's start once that
        epoch has ended, so a resume does not end it a second time. The new
        progress.json replaces the old one atomically (chief only).
        """
        if not cluster.is_chief() or self.progress is None:
            return
        self._own()
        latest = self.latest
        if latest is None:
            return
        progress = dict(read_progress_file(latest), epoch=int(epoch), step=int(step))
        files.atomic_write_text(os.path.join(latest, _PROGRESS), json.dumps(progress))
        self.progress = progress

    def _prune(self, directory):
        """Keeps the newest `max_to_keep` complete checkpoints (the new one among them).

        Runs only after the new checkpoint is complete. Incomplete ones older
        than it are removed too: they could never be restored.
        """
        names = self._names(directory)
        complete = [n for n in names if not file_problems(os.path.join(directory, n))]
        keep = set(complete[-self.max_to_keep:])
        for name in names:
            if name not in keep:
                if name not in complete:
                    logger.warning("Removed the incomplete checkpoint %s (a newer complete one exists).",
                                   os.path.join(directory, name))
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)

    def mark_finished(self):
        """Records that training ended (chief only): a SidecarEvaluator stops."""
        if cluster.is_chief():
            self._own()
            os.makedirs(self.directory, exist_ok=True)
            files.atomic_write_text(os.path.join(self.directory, FINISHED_FILE), "finished\n")

    def delete_all(self):
        """Removes the directory's checkpoints and lock (chief only), e.g. after success.

        The directory itself is removed only if kd created it and it is then
        empty; never a symbolic link or a mount point (e.g. a Kubernetes volume).
        """
        if cluster.is_chief() and os.path.isdir(self.directory):
            self._own()
            # `latest` first: a crash half-way leaves checkpoints without a
            # marker (restorable), never a marker naming deleted ones.
            for name in [_LATEST] + self._names() + [FINISHED_FILE]:
                path = os.path.join(self.directory, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                elif os.path.lexists(path):
                    os.remove(path)
            files.remove_dead_staging(self.directory)
            self.close()
            marker = os.path.join(self.directory, CREATED_MARKER)
            created = os.path.isfile(marker) and not os.path.islink(marker)
            if created:
                os.remove(marker)
            removable = (created and not os.path.islink(self.directory)
                         and not os.path.ismount(self.directory))
            if removable and not os.listdir(self.directory):
                try:
                    os.rmdir(self.directory)
                except OSError as error:
                    logger.warning("Could not remove the empty directory %s (%s); left in place.",
                                   self.directory, error.strerror)


class _Damaged(Exception):
    """A checkpoint's files are incomplete or do not read back."""

    def __init__(self, problems):
        super().__init__("; ".join(problems))
        self.problems = problems
