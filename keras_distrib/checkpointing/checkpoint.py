"""`kd.CheckpointManager`: atomic, chief-only checkpoints that track progress.

Layout of `directory`:

    ckpt-<n>/            one complete checkpoint: TF files, progress.json, and
                         manifest.json (every file's size and SHA-256, written last)
    latest               the name of the newest checkpoint written (a hint)
    .kd-run.json         the run the checkpoints belong to (an id, its host and
                         start), written with the run's first checkpoint
    .kd-lock.json        the run that owns the directory (pid, host, start)
    .kd-created          present when kd created the directory (it holds the
                         directory's device and inode: a copy elsewhere is not
                         kd's mark): only then may `delete_all` remove it
                         (never a mount point or link)

A checkpoint is written into a hidden staging directory and renamed into
place, then `latest` is replaced (temp name, rename): a crash at any moment
leaves the previous checkpoints intact, never a half-written one under a
real name. Restoring does not trust `latest` (it takes the newest
checkpoint), nor the checkpoint's files: each one's digest is checked
against the manifest before anything is read. A changed, truncated or
missing file is refused, naming it and the newest older checkpoint that is
whole (with how to resume from it); nothing is restored past it silently.
Nor is a checkpoint of another run: each one records the run that wrote it
and the name it was written as (in progress.json, which the manifest
covers), and a resume refuses one that is not this directory's run's (copied
in, copied over, renamed) unless it is adopted on purpose (`adopt_checkpoint`).
Old checkpoints are removed only after a newer one is complete, so there is
always an intact one.

Every worker writes (saving may run collectives), but only the chief writes
into `directory`, and only the chief locks it; the others write into a
scratch directory that is removed.
"""

import contextlib
import datetime
import errno
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import socket
import uuid

import tensorflow as tf

from keras_distrib.cluster import info as cluster
from keras_distrib import files
from keras_distrib import validation

logger = logging.getLogger("keras_distrib")

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "DamagedCheckpointError",
    "ForeignCheckpointError",
    "checkpoint_number",
    "data_problems",
    "file_problems",
    "manifest_problems",
    "read_progress_file",
    "validate_directory",
    "write_manifest",
]

_LATEST = "latest"
# Left in a directory kd created, so that a later run (a restart) knows it may remove it.
CREATED_MARKER = ".kd-created"
_PROGRESS = "progress.json"
_STATE = "state"
_PREFIX = "ckpt"
_NAME = re.compile(rf"^{_PREFIX}-(\d+)$")
PROGRESS_FILE = _PROGRESS
# Written when training ends, for a SidecarEvaluator watching the directory.
FINISHED_FILE = "finished"
# Written last into each checkpoint: every other file's size and SHA-256.
MANIFEST_FILE = "manifest.json"
_MANIFEST_FORMAT = "kd-checkpoint-manifest-1"
# What a damaged checkpoint is moved to, to resume from the one before it.
DAMAGED_PREFIX = "damaged-"
# The run a directory's checkpoints belong to; each checkpoint's progress.json
# says which run wrote it, under which name (`WRITTEN_BY`).
RUN_FILE = ".kd-run.json"
_RUN_FORMAT = "kd-run-1"
WRITTEN_BY = "written_by"


class CheckpointError(ValueError):
    """A checkpoint directory or checkpoint cannot be used (nothing changed)."""


class ForeignCheckpointError(CheckpointError):
    """A checkpoint was not written by the run its directory belongs to (nothing restored).

    Attributes:
        path: The checkpoint.
        theirs: What the checkpoint records of the run that wrote it (or None).
        ours: The directory's run record (or None).
    """

    def __init__(self, message, path, theirs, ours):
        super().__init__(message)
        self.path, self.theirs, self.ours = path, theirs, ours


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's files differ from its manifest (nothing was restored or changed).

    Attributes:
        path: The damaged checkpoint.
        problems: One message per file, naming it.
        previous: The newest older checkpoint that is whole, or None.
    """

    def __init__(self, message, path, problems, previous):
        super().__init__(message)
        self.path, self.problems, self.previous = path, problems, previous


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


def _digest_file(path):
    """`(bytes, SHA-256 hex)` of the file at `path`, read in 4 MiB pieces."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            piece = f.read(1 << 22)
            if not piece:
                return size, digest.hexdigest()
            size += len(piece)
            digest.update(piece)


def manifest_entries(path):
    """`{name: {"bytes": n, "sha256": hex}}` of every file in `path` but the manifest (and kd's temporaries)."""
    entries = {}
    for name in sorted(os.listdir(path)):
        if (name != MANIFEST_FILE and not name.startswith(files.STAGING_PREFIX)
                and os.path.isfile(os.path.join(path, name))):
            size, digest = _digest_file(os.path.join(path, name))
            entries[name] = {"bytes": size, "sha256": digest}
    return entries


def write_manifest(path, entries=None):
    """Writes `path`/manifest.json (atomically): `entries`, else every file's size and SHA-256.

    Written last, once every other file is complete. An entry may carry a
    `previous` entry, also accepted (`relabel` replacing progress.json).
    """
    entries = manifest_entries(path) if entries is None else entries
    files.atomic_write_text(os.path.join(path, MANIFEST_FILE),
                            json.dumps({"format": _MANIFEST_FORMAT, "files": entries}, indent=1))
    return entries


def _read_manifest(path):
    """`(entries, problem)`: the manifest's file entries, or None and what is wrong with it."""
    file = os.path.join(path, MANIFEST_FILE)
    try:
        with open(file) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None, (f"{file!r} is missing: kd writes it last into every checkpoint, so this one "
                      "was written by a kd without manifests, or the manifest was deleted, and "
                      "its files cannot be checked")
    except (OSError, ValueError) as error:
        return None, f"{file!r} cannot be read ({error})"
    entries = manifest.get("files") if isinstance(manifest, dict) else None
    if (not isinstance(manifest, dict) or manifest.get("format") != _MANIFEST_FORMAT
            or not isinstance(entries, dict)
            or not all(isinstance(e, dict) and validation.is_whole(e.get("bytes"), 0)
                       and isinstance(e.get("sha256"), str) for e in entries.values())):
        return None, f"{file!r} is not a manifest kd wrote"
    return entries, None


def manifest_problems(path, *, digests=True):
    """What differs between checkpoint `path`'s files and its manifest, one message per file.

    A missing or unreadable manifest, a listed file that is missing, has
    another size (truncated or grown) or, with `digests`, another SHA-256
    (changed in place: a bit flip, a tensor rewritten to another valid
    value). Without `digests` only sizes are compared (cheap: no reading).

    Returns:
        A list of messages, each naming a file; empty if the files are the
        ones kd wrote.
    """
    entries, problem = _read_manifest(path)
    if problem:
        return [problem]
    problems = []
    for name, entry in sorted(entries.items()):
        file = os.path.join(path, name)
        try:
            size = os.path.getsize(file)
        except OSError:
            problems.append(f"{file!r} is missing (the manifest lists it)")
            continue
        accepted = [entry] + ([entry["previous"]] if isinstance(entry.get("previous"), dict) else [])
        if size not in [e.get("bytes") for e in accepted]:
            what = "truncated" if size < entry["bytes"] else "longer than written"
            problems.append(f"{file!r} is {what}: {size} bytes, the manifest says {entry['bytes']}")
        elif digests:
            try:
                _, digest = _digest_file(file)
            except OSError as error:
                problems.append(f"{file!r} cannot be read ({error.strerror})")
                continue
            if digest not in [e.get("sha256") for e in accepted]:
                problems.append(f"{file!r} has changed since kd wrote it (its SHA-256 is not the "
                                "manifest's)")
    return problems


def file_problems(path):
    """What makes checkpoint `path` incomplete, checked from its files alone.

    Cheap: reads the manifest and progress.json and compares sizes, without
    reading the data. Whether the files are the ones kd wrote is checked by
    `manifest_problems`, whether the tensor data reads back by `data_problems`.

    Returns:
        A list of messages, each naming a file; empty if complete.
    """
    if not os.path.isdir(path):
        return [f"{path!r} is not a directory"]
    problems = manifest_problems(path, digests=False)
    if not problems:
        try:
            read_progress_file(path)
        except CheckpointError as error:
            problems.append(str(error).rstrip("."))
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
    """`Type: first line` of `error`, whole, without TensorFlow's `{{function_node ...}}` and `[Op:...]`."""
    text = str(error).strip().splitlines()
    line = re.sub(r"^\{\{function_node [^}]*\}\}\s*|\s*\[Op:\w+\]$", "", text[0]) if text else ""
    return f"{type(error).__name__}: {line}"


def adoption_problem(adopt_checkpoint, where):
    """Why `adopt_checkpoint` is not the name of a checkpoint (in `where`, words), or None."""
    if adopt_checkpoint is None or (isinstance(adopt_checkpoint, str)
                                    and checkpoint_number(adopt_checkpoint) is not None):
        return None
    return (f"`adopt_checkpoint`={adopt_checkpoint!r}: expected the name of a checkpoint in {where}, "
            f"e.g. '{_PREFIX}-7' (or None)")


def _new_run():
    """A fresh run's identity: a random id, the host and the start (UTC)."""
    return {"id": uuid.uuid4().hex[:12], "host": socket.gethostname(),
            "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")}


def describe_run(run):
    """`run <id> (started <when> on <host>)` of a run identity, for messages."""
    if not isinstance(run, dict) or not isinstance(run.get("id"), str):
        return "a run kd cannot name"
    return f"run {run['id']} (started {run.get('started', '?')} on {run.get('host', '?')})"


def read_run_file(directory):
    """The run record of `directory` (`RUN_FILE`), or None when there is none.

    Raises:
        CheckpointError: the file is there but is not a run record kd wrote.
    """
    file = os.path.join(directory, RUN_FILE)
    try:
        with open(file) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        problem = f"cannot be read ({error})"
    else:
        if (isinstance(record, dict) and record.get("format") == _RUN_FORMAT
                and isinstance(record.get("run"), dict) and isinstance(record["run"].get("id"), str)):
            return record
        problem = "is not a run record kd wrote"
    raise CheckpointError(
        f"{file!r} {problem}; it records which run the checkpoints beside it belong to. Put it "
        "back from a copy, or give another directory to start from scratch.")


def _write_run_file(directory, record):
    files.atomic_write_text(os.path.join(directory, RUN_FILE),
                            json.dumps(dict(record, format=_RUN_FORMAT), indent=1))


def _progress_digest(path):
    """The manifest's SHA-256 of checkpoint `path`'s progress.json (what an adoption is bound to)."""
    entries, _ = _read_manifest(path)
    entry = (entries or {}).get(_PROGRESS)
    return entry.get("sha256") if isinstance(entry, dict) else None


def disk_full_advice(error, path, safe, what="", where=None):
    """kd's sentence for a failed write to `path`: what happened, what is safe, what to do.

    Args:
        error: The OSError (or a TensorFlow error, whose first line is kept).
        path: What kd was writing.
        safe: What is left intact, as a clause ("the older checkpoints were kept").
        what: Words before the path ("the checkpoint ").
        where: The directory to free space in (`path`'s by default).
    """
    if isinstance(error, OSError) and error.strerror:
        reason = error.strerror
        if error.filename and os.fspath(error.filename) != os.fspath(path):
            reason += f" at {os.fspath(error.filename)!r}"
        full = error.errno in (errno.ENOSPC, errno.EDQUOT)
    else:
        reason = _first_line(error)
        full = "No space left" in str(error) or "quota" in str(error).lower()
    where = where or os.path.dirname(os.fspath(path)) or "."
    fix = (f"Free space in {where!r} (or raise the quota), or give another directory" if full else
           f"Free space in (or fix the permissions of) {where!r}, or give another directory")
    return (f"Could not write {what}{os.fspath(path)!r} ({reason}); {safe}. {fix}; then run the "
            "same command again: it resumes from what was kept.")


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
        adopt_checkpoint: The name (`"ckpt-7"`) of a checkpoint in
            `directory` that another run wrote, to continue from on purpose.
            Each checkpoint records the run that wrote it (`.kd-run.json`
            names the directory's run); a resume refuses another run's
            (copied in, copied over, renamed) unless it is adopted here. The
            adoption is recorded in `.kd-run.json`, bound to that
            checkpoint's files, so later resumes accept it without the setting.

    Raises:
        CheckpointError: `checkpoint` is not a `tf.train.Checkpoint`,
            `directory` is a file or not writable, `max_to_keep` is not a
            whole number >= 1, or `adopt_checkpoint` is not a checkpoint name.

    Examples:
        >>> import tempfile, tensorflow as tf, keras_distrib as kd
        >>> step = tf.Variable(3)
        >>> manager = kd.CheckpointManager(tf.train.Checkpoint(step=step), tempfile.mkdtemp())
        >>> path = manager.save(epoch=1, step=0)
        >>> _ = step.assign(0)
        >>> manager.restore_or_initialize()["epoch"], int(step.numpy())
        (1, 3)
        >>> manager.close()
    """

    def __init__(self, checkpoint, directory, *, max_to_keep=1, adopt_checkpoint=None):
        problems = []
        adoption = adoption_problem(adopt_checkpoint, "the directory")
        if adoption:
            problems.append(adoption)
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
        self._verified = None  # (path, _stamp(path)) of the checkpoint last verified whole
        self.adopt_checkpoint = adopt_checkpoint
        self.run = None  # this run's identity (`.kd-run.json`'s `run`), once known
        self._run_written = False
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
            if self._created:
                # The directory was made for this lock: take it back, so that
                # "nothing was written" holds (and a later run creates it, marked, anew).
                with contextlib.suppress(OSError):
                    if os.path.getsize(self._lock.path) == 0:
                        os.remove(self._lock.path)
                with contextlib.suppress(OSError):
                    os.rmdir(self.directory)
            raise CheckpointError(disk_full_advice(
                error, self._lock.path, "nothing was restored or written", what="the lock file ",
                where=self.directory)) from None
        if self._created:
            marker = os.path.join(self.directory, CREATED_MARKER)
            if not os.path.lexists(marker):
                try:
                    files.atomic_write_text(marker, _directory_identity(self.directory))
                except OSError as error:
                    raise CheckpointError(disk_full_advice(
                        error, marker, "nothing was restored or written")) from None

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

        Returns None when there is no complete checkpoint. Reads progress.json
        as it is; `verify` checks it against the manifest first.

        Raises:
            CheckpointError: `path`'s progress.json is missing or corrupt.
        """
        path = path or self.latest
        if path is None:
            return None
        return read_progress_file(os.fspath(path))

    @property
    def newest(self):
        """Path of the newest checkpoint, whole or not, or None: what a resume restores."""
        names = self._names()
        return os.path.join(self.directory, names[-1]) if names else None

    def verify(self, path):
        """Checks every file of checkpoint `path` against its manifest (sizes and SHA-256).

        A checkpoint verified once is not read again while its files keep
        their sizes and modification times.

        Raises:
            DamagedCheckpointError: a file is missing, truncated or changed, or
                the manifest is; the message names each file, and the newest
                older checkpoint that is whole, with how to resume from it.
        """
        path = os.fspath(path)
        stamp = _stamp(path)
        if self._verified == (path, stamp):
            return
        problems = manifest_problems(path)
        if not problems:
            try:
                read_progress_file(path)
            except CheckpointError as error:
                problems.append(str(error).rstrip("."))
        if problems:
            raise self._damaged(path, problems)
        self._verified = (path, stamp)

    # Which run a checkpoint belongs to.

    def _directory_run(self):
        """This directory's run record (`RUN_FILE`) or None; sets `run` from it."""
        record = read_run_file(self.directory)
        if record is not None and self.run is None:
            self.run = dict(record["run"])
        return record

    def _identity_problem(self, path):
        """Why checkpoint `path` is not this directory's run's, as `(reason, theirs, ours)`, or None."""
        try:
            progress = read_progress_file(path)
        except CheckpointError:
            return None  # `verify` names what is wrong with the files
        record = self._directory_run()
        ours = record["run"] if record else None
        theirs = progress.get(WRITTEN_BY)
        name = os.path.basename(path)
        adopted = (record or {}).get("adopted") or []
        if {"checkpoint": name, "progress_sha256": _progress_digest(path)} in [
                {k: a.get(k) for k in ("checkpoint", "progress_sha256")} for a in adopted
                if isinstance(a, dict)]:
            return None
        if theirs is None:
            if record is None:
                return None  # a directory written before kd recorded runs: nothing to compare
            return (f"it records no run, so kd did not write it into this directory (this "
                    f"directory's checkpoints all record {describe_run(ours)}): it was copied "
                    "in from elsewhere", None, ours)
        if not isinstance(theirs, dict) or not isinstance(theirs.get("id"), str):
            return f"its record of the run that wrote it is not kd's (`{WRITTEN_BY}`={theirs!r})", theirs, ours
        if record is None:
            return (f"it was written by {describe_run(theirs)}, and this directory holds no record "
                    f"of a run ({RUN_FILE}, which kd writes with a run's first checkpoint): it was "
                    "copied in from that run's directory", theirs, ours)
        if theirs["id"] != ours["id"]:
            return (f"it was written by {describe_run(theirs)}"
                    + (f" as {theirs.get('as')!r}" if theirs.get("as") not in (None, name) else "")
                    + f", and this directory belongs to {describe_run(ours)}: it was copied in "
                    "from the other run's directory", theirs, ours)
        if theirs.get("as") != name:
            return (f"this run wrote it as {theirs.get('as')!r}, and it was renamed since, so its "
                    "place among this run's checkpoints is not the one it was written in", theirs, ours)
        return None

    def check_identity(self, path):
        """Refuses checkpoint `path` unless this directory's run wrote it under its name.

        A checkpoint adopted on purpose (`adopt_checkpoint`, recorded in
        `.kd-run.json`) is accepted, and so are the checkpoints of a
        directory written before kd recorded runs.

        Raises:
            ForeignCheckpointError: another run wrote it (copied in, copied
                over one of this run's), or it was renamed; the message names
                the checkpoint, both runs and the ways out. Nothing is changed.
        """
        path = os.fspath(path)
        problem = self._identity_problem(path)
        if problem is None:
            return
        reason, theirs, ours = problem
        name = os.path.basename(path)
        if self.adopt_checkpoint == name:
            self._adopt(path, theirs)
            return
        aside = os.path.join(os.path.dirname(path), "foreign-" + name)
        raise ForeignCheckpointError(
            f"The checkpoint {path!r} does not belong to this directory's run: {reason}. Nothing "
            "was restored or changed; resuming from it would continue another run's training "
            f"here. To start fresh, give another directory (or move it away: "
            f"`mv {shlex.quote(path)} {shlex.quote(aside)}`). To continue from it on purpose, "
            f"adopt it: `adopt_checkpoint={name!r}` (of kd.callbacks.BackupAndRestore or "
            "kd.CheckpointManager); the adoption is recorded.", path, theirs, ours)

    def _adopt(self, path, theirs):
        """Records that checkpoint `path` (another run's) was adopted on purpose (chief only)."""
        record = self._directory_run() or {"run": self.run or _new_run()}
        self.run = dict(record["run"])
        entry = {"checkpoint": os.path.basename(path), "progress_sha256": _progress_digest(path),
                 "run": theirs}
        logger.warning("Adopted the checkpoint %s of %s on purpose (`adopt_checkpoint`); this "
                       "directory's %s goes on from it.", path, describe_run(theirs),
                       describe_run(self.run))
        if cluster.is_chief():
            self._own()
            record = dict(record, adopted=[*(record.get("adopted") or []), entry])
            try:
                _write_run_file(self.directory, record)
            except OSError as error:
                raise CheckpointError(disk_full_advice(
                    error, os.path.join(self.directory, RUN_FILE),
                    "nothing was restored, the checkpoints are intact")) from None
            self._run_written = True

    def _this_run(self):
        """This run's identity: the directory's, or a new one (a fresh run)."""
        if self.run is None:
            self._directory_run()
        if self.run is None:
            self.run = _new_run()
        return self.run

    def _damaged(self, path, problems):
        """The DamagedCheckpointError for `path`: its problems, and the checkpoint before it."""
        number = checkpoint_number(os.path.basename(path))
        previous = None
        if os.path.dirname(os.path.abspath(path)) == os.path.abspath(self.directory) and number:
            for name in reversed(self._names()):
                candidate = os.path.join(self.directory, name)
                if (checkpoint_number(name) < number and not manifest_problems(candidate)
                        and not self._identity_problem(candidate)):
                    try:
                        previous = (candidate, read_progress_file(candidate))
                    except CheckpointError:
                        continue
                    break
        aside = os.path.join(os.path.dirname(path), DAMAGED_PREFIX + os.path.basename(path))
        move = f"`mv {shlex.quote(path)} {shlex.quote(aside)}`"
        if previous is not None:
            where, progress = previous
            offer = (f"The checkpoint before it, {where!r} (epoch {progress['epoch']}, step "
                     f"{progress['step']}), is whole. To resume from it, move the damaged one "
                     f"away: {move}, and run again (or restore it by path: "
                     f"`manager.restore({where!r})`).")
        else:
            offer = (f"No older checkpoint there is whole. Put the file(s) back from a copy, or "
                     f"move the checkpoint away ({move}) to start from scratch. (Keep more "
                     "checkpoints with `max_to_keep`.)")
        message = (f"The checkpoint {path!r} fails its manifest check, so nothing was restored "
                   "or changed:\n  - " + "\n  - ".join(problems) + f"\n{offer}")
        return DamagedCheckpointError(message, path, problems, previous and previous[0])

    def restore(self, path=None):
        """Restores a checkpoint; returns its progress dict.

        The checkpoint's files are checked against its manifest first
        (`verify`): nothing is read from a changed, truncated or missing file.

        Args:
            path: A checkpoint directory; the newest checkpoint when `None`
                (`latest` is not trusted; an older one is never taken in its
                place: the error names it).

        Raises:
            DamagedCheckpointError: the checkpoint fails its manifest check
                (or its data does not read back), naming each file and the
                checkpoint before it that is whole.
            ForeignCheckpointError: a checkpoint of the directory was written
                by another run, or renamed (see `check_identity`).
            CheckpointError: no checkpoint to restore, or a whole checkpoint
                does not fit the model.
        """
        self.skipped = []
        if path is None:
            path = self.newest
            if path is None:
                raise CheckpointError(f"No checkpoint in {self.directory!r} to restore.")
        path = os.fspath(path)
        self.verify(path)
        if os.path.dirname(os.path.abspath(path)) == os.path.abspath(self.directory):
            self.check_identity(path)
        try:
            status = self.checkpoint.read(os.path.join(path, _STATE))
            status.assert_existing_objects_matched()
        except Exception as error:  # noqa: BLE001 - corruption escapes as IndexError etc.
            damage = data_problems(path)
            if damage:
                raise self._damaged(path, damage) from None
            raise CheckpointError(
                f"The checkpoint {path!r} is intact (every file reads back) but does not fit "
                f"this model/optimizer ({_first_line(error)}). It was left untouched. Restore "
                "into the model it was written from, or point to another directory."
            ) from error
        self.progress = read_progress_file(path)
        self.restored_path = path
        self._log_restored(path)
        return self.progress

    def _log_restored(self, path):
        marker = self._marker()
        note = ""
        if marker != os.path.basename(path) and os.path.dirname(path) == self.directory:
            named = os.path.join(self.directory, marker) if marker else None
            if marker is None:
                note = " (the `latest` marker is missing; restored the newest one)"
            elif not os.path.isdir(named):
                note = (f" (the `latest` marker names {marker!r}, which is not there; restored "
                        "the newest one)")
            elif file_problems(named):
                note = (f" (the `latest` marker names {marker!r}, which is not a complete "
                        "checkpoint; restored the newest one)")
            else:
                note = (f" (the `latest` marker names {marker!r}, an older complete checkpoint: "
                        "kd moves the marker just after a checkpoint is in place, so the run "
                        "that wrote this one stopped in between; restored the newest one)")
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
        """Restores the newest checkpoint if there is one; returns its progress.

        Returns None (and changes nothing) when the directory holds no
        checkpoint. A newest checkpoint that fails its manifest check raises
        (`DamagedCheckpointError`, naming the one before it) rather than go
        back or start over silently (see `restore`). This is how a run
        resumes, so the chief locks the directory first: a second live run
        is refused before it can resume from the first one's checkpoint.
        (`restore` alone does not lock: reading is safe beside a writer.)
        """
        self._own()
        self._refuse_left()
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
            if self.max_to_keep > 1:
                # Room for the new one first: the disk never holds more than `max_to_keep`.
                self._prune(directory, keep=self.max_to_keep - 1)
            names = self._names(directory)
            number = checkpoint_number(names[-1]) + 1 if names else 1
            name = f"{_PREFIX}-{number}"
            staging = files.staging_directory(directory, name)
            final = os.path.join(directory, name)
            progress = {"epoch": int(epoch), "step": int(step), **extra,
                        WRITTEN_BY: dict(self._this_run(), **{"as": name})}
            if info.is_chief and not self._run_written:
                self._record_run(directory, staging, final)
            try:
                self.checkpoint.write(os.path.join(staging, _STATE))
                with open(os.path.join(staging, _PROGRESS), "w") as f:
                    json.dump(progress, f)
                write_manifest(staging)  # last: it vouches for every file above
                files.publish(staging, final)
            except (OSError, tf.errors.OpError) as error:
                shutil.rmtree(staging, ignore_errors=True)
                raise CheckpointError(disk_full_advice(
                    error, final, "nothing was replaced, the older checkpoints were kept",
                    what="the checkpoint ", where=directory)) from error
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            problems = file_problems(final)
            if problems:
                raise CheckpointError(
                    f"The new checkpoint {final!r} came out incomplete ({'; '.join(problems)}); "
                    "the older checkpoints were kept. Check the disk (space, quota)."
                )
            try:
                files.atomic_write_text(os.path.join(directory, _LATEST), name)
            except OSError as error:
                raise CheckpointError(disk_full_advice(
                    error, os.path.join(directory, _LATEST),
                    f"the checkpoint {final!r} is complete (a resume takes the newest complete "
                    "checkpoint, whatever `latest` says)")) from None
            # A resumed or resubmitted run is not finished (a SidecarEvaluator
            # watching the directory would otherwise stop).
            if os.path.exists(os.path.join(directory, FINISHED_FILE)):
                os.remove(os.path.join(directory, FINISHED_FILE))
            self._prune(directory)
            files.remove_dead_staging(directory)
        self.progress = progress
        return os.path.join(self.directory, name)

    def _record_run(self, directory, staging, final):
        """Writes `.kd-run.json` (this run's identity) before the run's first checkpoint."""
        record = read_run_file(directory)
        if record is None or record["run"].get("id") != self.run["id"]:
            try:
                _write_run_file(directory, {"run": self.run})
            except OSError as error:
                shutil.rmtree(staging, ignore_errors=True)
                raise CheckpointError(disk_full_advice(
                    error, os.path.join(directory, RUN_FILE),
                    f"{final!r} was not written and the older checkpoints were kept")) from None
        self._run_written = True

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
        entries, problem = _read_manifest(latest)
        if problem:
            raise self._damaged(latest, [problem])
        # Two files cannot be replaced at once: the manifest first accepts the
        # old progress.json and the new one, then only the new one.
        old_entry = entries[_PROGRESS]
        try:
            temp = files.staging_file(latest)
            try:
                with open(temp, "w") as f:
                    f.write(json.dumps(progress))
                size, digest = _digest_file(temp)
                entries[_PROGRESS] = {"bytes": size, "sha256": digest, "previous": old_entry}
                write_manifest(latest, entries)
                files.publish(temp, os.path.join(latest, _PROGRESS))
            finally:
                if os.path.exists(temp):
                    os.remove(temp)
            del entries[_PROGRESS]["previous"]
            write_manifest(latest, entries)
        except OSError as error:
            # Each step leaves a manifest that accepts the progress.json in place.
            was = self.progress or {}
            raise CheckpointError(disk_full_advice(
                error, os.path.join(latest, _PROGRESS),
                f"the checkpoint {latest!r} is whole and resumes exactly (it still says epoch "
                f"{was.get('epoch', '?')}, step {was.get('step', '?')}: the end of that epoch, "
                "which a resume ends once more without training a batch)",
                where=self.directory)) from None
        self.progress = progress

    def _prune(self, directory, keep=None):
        """Keeps the newest `keep` (`max_to_keep`) complete checkpoints (the new one among them).

        Runs only after the new checkpoint is complete (or, to make room,
        keeping `max_to_keep` - 1 before it). Incomplete ones older than the
        newest complete one are removed too: they could never be restored.
        """
        keep = self.max_to_keep if keep is None else keep
        names = self._names(directory)
        complete = [n for n in names if not file_problems(os.path.join(directory, n))]
        kept = set(complete[-keep:])
        for name in names:
            if complete and name not in kept and (
                    name in complete or checkpoint_number(name) < checkpoint_number(complete[-1])):
                if name not in complete:
                    logger.warning("Removed the incomplete checkpoint %s (a newer complete one exists).",
                                   os.path.join(directory, name))
                _remove_whole(os.path.join(directory, name))

    def _record_left(self, left):
        """Reports checkpoints the clean-up could not remove, and records them for the next run."""
        record = read_run_file(self.directory) or {"run": self._this_run()}
        names = [os.path.basename(path) for path, _ in left]
        listing = "; ".join(f"{path} ({reason})" for path, reason in left)
        removal = " ".join(shlex.quote(path) for path, _ in left)
        logger.warning(
            "Training finished, but the clean-up could not remove %s. A later run in %s refuses "
            "to resume from it (this run finished); remove it by hand: `chmod -R u+w %s && rm -rf "
            "%s` (or `chattr -R -i` first for an immutable one).", listing, self.directory,
            removal, removal)
        try:
            _write_run_file(self.directory, dict(record, finished=True, left=names))
        except OSError as error:
            logger.warning("%s", disk_full_advice(
                error, os.path.join(self.directory, RUN_FILE),
                "training finished and nothing else changed"))

    def _refuse_left(self):
        """Refuses checkpoints a finished run's clean-up could not remove (they are not a resume)."""
        record = read_run_file(self.directory)
        if not record or not record.get("finished"):
            return
        left = [os.path.join(self.directory, name) for name in record.get("left") or []
                if isinstance(name, str) and os.path.lexists(os.path.join(self.directory, name))]
        if not left:
            self.run = _new_run()  # what was left is gone: a new run begins
            return
        removal = " ".join(shlex.quote(path) for path in left)
        raise CheckpointError(
            f"{', '.join(repr(p) for p in left)} {'is' if len(left) == 1 else 'are'} left over "
            f"from {describe_run(record['run'])}, which finished; its clean-up could not remove "
            f"{'it' if len(left) == 1 else 'them'} (see {os.path.join(self.directory, RUN_FILE)!r}), "
            "so this is not a resume and nothing was restored. Remove it: `chmod -R u+w "
            f"{removal} && rm -rf {removal}`, then also the record `rm "
            f"{shlex.quote(os.path.join(self.directory, RUN_FILE))}`; or give another directory.")

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
            left = []
            for name in [_LATEST] + self._names() + [FINISHED_FILE]:
                path = os.path.join(self.directory, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    left += _remove_whole(path)
                elif os.path.lexists(path):
                    os.remove(path)
            files.remove_dead_staging(self.directory)
            if left:
                self._record_left(left)
            elif os.path.lexists(os.path.join(self.directory, RUN_FILE)):
                # Last: while a checkpoint is there, so is the record of its run.
                os.remove(os.path.join(self.directory, RUN_FILE))
            self.close()
            marker = os.path.join(self.directory, CREATED_MARKER)
            created = _marks_this_directory(marker, self.directory)
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


def _remove_whole(path):
    """Removes checkpoint `path` so that no part of it stays under its name, even if killed.

    It is renamed to a staging name first (`files.remove_dead_staging` ends
    what a killed process left), then removed.

    Returns:
        `(path, reason)` of what could not be removed (a read-only or
        immutable checkpoint, a busy mount): empty when all of it went.
    """
    directory, name = os.path.split(path)
    trash = files.staging_directory(directory, f"removed-{name}")
    errors = []
    try:
        os.replace(path, trash)  # onto the new, empty directory
    except OSError:
        os.rmdir(trash)
        trash = path
    shutil.rmtree(trash, onerror=lambda function, where, info: errors.append(info[1]))
    if not os.path.lexists(trash):
        return []
    reason = next((e.strerror for e in errors if isinstance(e, OSError) and e.strerror), "unknown")
    return [(trash, reason)]


def _directory_identity(directory):
    """What `CREATED_MARKER` holds: the device and inode of the directory kd created."""
    info = os.stat(directory)
    return json.dumps({"device": info.st_dev, "inode": info.st_ino})


def _marks_this_directory(marker, directory):
    """Whether `marker` is kd's mark of this very directory (not one copied in from another)."""
    if not os.path.isfile(marker) or os.path.islink(marker):
        return False
    try:
        with open(marker) as f:
            return f.read() == _directory_identity(directory)
    except (OSError, UnicodeDecodeError):
        return False


def _stamp(path):
    """The sizes and modification times of `path`'s files: what `verify` remembers."""
    try:
        return tuple(sorted((entry.name, entry.stat().st_size, entry.stat().st_mtime_ns)
                            for entry in os.scandir(path) if entry.is_file()))
    except OSError:
        return None
