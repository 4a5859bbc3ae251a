"""`kd.callbacks.ModelCheckpoint`: Keras's checkpoint callback, chief-only and atomic.

Every worker saves (saving reads distributed variables, which may run
collectives); the chief writes the real file, the others write into scratch
space that is removed. Each file is written under a temporary name in its
destination folder and renamed, so a crash never leaves a half-written file
where a good one was.

Every argument is checked when the callback is made, so a bad one fails
before training, not at the first save an epoch later. `{placeholders}` in
`filepath` are checked in three steps, as far as what is known allows:

1. At construction: the template parses; every placeholder is a plain name
   (`{epoch}`, `{batch}`, or a log key; not `{}`, `{0}`, `{a.b}`, `{a[0]}`);
   its format spec works for its value (trial-formatted: `epoch` and
   `batch` are whole numbers, log values are floats, so `{epoch:02d}` and
   `{val_loss:.2f}` pass and `{loss:d}` fails); `{batch}` needs a batch
   `save_freq`; a name one typo away from a known key (`epoch`, `batch`,
   `loss`, `val_loss`, `monitor`) is refused with the likely intent:
   `{epch}` -> `{epoch}`.
2. When training begins, the compiled model tells which log keys it will
   produce (`loss`, its metrics, their `val_` forms): a placeholder one typo
   away from one of those is refused; one that is merely unknown only warns,
   since another callback may add it to the logs.
3. At a save, a placeholder absent from the logs raises an error that names
   it and lists the logs' keys.
"""

import difflib
import math
import numbers
import os
import re
import string
import warnings

import keras
import numpy as np

from keras_distrib import _keras_compat
from keras_distrib.checkpointing import checkpoint as checkpoint_lib
from keras_distrib.cluster import info as cluster
from keras_distrib import files
from keras_distrib import validation
from keras_distrib.training.callbacks import _schedule

__all__ = [
    "ModelCheckpoint",
]

_MODES = ("auto", "min", "max")


class ModelCheckpoint(keras.callbacks.Callback):
    """Saves the model or its weights, like `keras.callbacks.ModelCheckpoint`.

    Every worker takes part in each save; only the chief's file persists,
    written under a temporary name and renamed into place. Every argument is
    checked when the callback is made, so a bad one fails before training:
    `{placeholders}` in `filepath` must parse, be plain names and have a
    format spec that works for their value (`{epoch:02d}`, `{val_loss:.2f}`;
    not `{loss:d}`), `{batch}` needs a batch `save_freq`, and a name one typo
    away from a known key (`{epch}`) is refused with the likely intent. When
    training begins, a placeholder one typo away from one of the compiled
    model's log keys is refused (one merely unknown only warns: another
    callback may add it); at a save, one absent from the logs raises an error
    listing the logs' keys.

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
        ValueError: listing every invalid argument: types, a file path that
            is a directory or lies under a file, a folder this process cannot
            write, and malformed or mistyped `{placeholders}`.

    Examples:
        >>> import os, tempfile, keras_distrib as kd
        >>> path = os.path.join(tempfile.mkdtemp(), "model-{epoch:02d}-{val_loss:.3f}.keras")
        >>> callback = kd.callbacks.ModelCheckpoint(path, save_best_only=True)
    """

    def __init__(self, filepath, monitor="val_loss", verbose=0, save_best_only=False,
                 save_weights_only=False, mode="auto", save_freq="epoch",
                 initial_value_threshold=None):
        super().__init__()
        problems = []
        if not isinstance(filepath, (str, os.PathLike)) or not os.fspath(filepath):
            problems.append(f"`filepath`={filepath!r} must be a file path (str or os.PathLike)")
            filepath = None
        else:
            filepath = os.fsdecode(os.fspath(filepath))
        for name, value in (("save_best_only", save_best_only),
                            ("save_weights_only", save_weights_only)):
            if not isinstance(value, (bool, np.bool_)):
                problems.append(f"`{name}`={value!r} must be True or False")
        if not isinstance(monitor, str) or not monitor:
            problems.append(
                f"`monitor`={monitor!r} must be the name of a log key (a str such as "
                "'val_loss' or 'accuracy')"
            )
        if not validation.is_whole(verbose, 0):
            problems.append(f"`verbose`={verbose!r} must be 0 (silent) or 1 (a line per save)")
        if not isinstance(mode, str) or mode not in _MODES:
            problems.append(f"`mode`={mode!r} must be one of {list(_MODES)}")
        if initial_value_threshold is not None and (
            isinstance(initial_value_threshold, bool)
            or not isinstance(initial_value_threshold, numbers.Real)
            or not math.isfinite(initial_value_threshold)
        ):
            problems.append(
                f"`initial_value_threshold`={initial_value_threshold!r} must be a finite "
                "number, or None"
            )
        try:
            self.schedule = _schedule.SaveSchedule(save_freq)
        except ValueError as error:
            problems.append(str(error).rstrip("."))
            self.schedule = None
        if filepath is not None:
            ending = ".weights.h5" if save_weights_only else ".keras"
            if not filepath.endswith(ending):
                problems.append(
                    f"`filepath`={filepath!r} must end with {ending!r} when "
                    f"`save_weights_only`={save_weights_only}"
                )
            batch_freq = self.schedule is not None and not self.schedule.per_epoch
            known = {"loss", "val_loss"} | ({monitor} if isinstance(monitor, str) and monitor else set())
            problems.extend(placeholder_problems(filepath, batch_freq=batch_freq, known=known))
            problems.extend(_location_problems(filepath))
        if problems:
            raise ValueError("Invalid ModelCheckpoint arguments:\n  - " + "\n  - ".join(problems))
        self.filepath = filepath
        self.monitor = monitor
        self.verbose = verbose
        self.save_best_only = bool(save_best_only)
        self.save_weights_only = bool(save_weights_only)
        if mode == "auto":
            mode = "max" if "acc" in monitor or monitor.startswith("fmeasure") else "min"
        self.mode = mode
        self.best = initial_value_threshold
        if self.best is None:
            self.best = np.inf if mode == "min" else -np.inf
        self._epoch = 0

    def on_train_begin(self, logs=None):
        """Checks `filepath`'s log keys against the compiled model's, before training."""
        expected = expected_log_keys(self.model)
        if not expected:
            return
        typos, unknown = [], []
        for name in _log_placeholders(self.filepath):
            if name in expected:
                continue
            close = difflib.get_close_matches(name, sorted(expected), n=1, cutoff=_TYPO_CUTOFF)
            (typos if close else unknown).append((name, close))
        if typos:
            listed = ", ".join(f"{{{n}}} (did you mean {{{c[0]}}}?)" for n, c in typos)
            raise ValueError(
                f"`filepath`={self.filepath!r} names log keys the model does not produce: "
                f"{listed}. The model's log keys: {sorted(expected)}. Fix the placeholder "
                "names in `filepath`."
            )
        if unknown:
            warnings.warn(
                f"ModelCheckpoint: `filepath`={self.filepath!r} names "
                f"{['{' + n + '}' for n, _ in unknown]}, which the compiled model does not "
                f"log ({sorted(expected)}); saving will fail unless another callback adds "
                "them to the logs.", stacklevel=2,
            )

    def _improved(self, value):
        return value < self.best if self.mode == "min" else value > self.best

    def _file_name(self, epoch, batch, logs):
        # As Keras: `{epoch}` and `{batch}` count from 1.
        values = {**logs, "epoch": epoch + 1, "batch": None if batch is None else batch + 1}
        try:
            return self.filepath.format(**values)
        except KeyError as error:
            raise ValueError(
                f"`filepath`={self.filepath!r} names {{{error.args[0]}}}, which is not in "
                f"the logs at this save (keys: {sorted(values)}). Use one of those keys."
            ) from None

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
        name = self._file_name(epoch, batch, logs)
        folder, base = os.path.split(os.path.abspath(name))
        with cluster.writer_directory(folder) as directory:
            temp = files.staging_file(directory, suffix=base)
            try:
                if self.save_weights_only:
                    self.model.save_weights(temp, overwrite=True)
                else:
                    self.model.save(temp, overwrite=True)
                files.publish(temp, os.path.join(directory, base))
            except OSError as error:
                raise checkpoint_lib.CheckpointError(
                    f"ModelCheckpoint could not write {name!r}: {error.strerror or error}. "
                    "Nothing was replaced (an earlier file of that name is intact). Free space in "
                    f"(or fix the permissions of) {folder!r}, or give `filepath` another folder."
                ) from error
            finally:
                if os.path.exists(temp):
                    os.remove(temp)
        if self.verbose and cluster.is_chief():
            print(f"\nEpoch {epoch + 1}: saved {'weights' if self.save_weights_only else 'model'} to {name}")

    @property
    def async_safe(self):
        """Saving once per epoch needs nothing per batch (Keras may then run batch hooks in a thread).

        Otherwise every step would wait for its logs to reach NumPy on the main
        thread.
        """
        return self.schedule is not None and self.schedule.per_epoch

    def on_epoch_begin(self, epoch, logs=None):
        """Starts counting the epoch's batches."""
        self._epoch = epoch
        self.schedule.new_epoch()

    def on_train_batch_end(self, batch, logs=None):
        """Saves when a batch-frequency save is due."""
        if self.schedule.batch_done(batch):
            self._save(self._epoch, batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        """Saves at the end of each epoch (`save_freq="epoch"`)."""
        if self.schedule.per_epoch:
            self._save(epoch, None, logs)


# A placeholder this close (difflib ratio) to a known name is taken as a typo.
_TYPO_CUTOFF = 0.8
_PLAIN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _fields(filepath):
    """`(field_name, format_spec, conversion)` of each placeholder; raises ValueError."""
    return [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(filepath) if f is not None]


def _log_placeholders(filepath):
    try:
        return [f for f, _, _ in _fields(filepath) if f not in ("epoch", "batch")]
    except ValueError:
        return []


def placeholder_problems(filepath, *, batch_freq, known=()):
    """What is wrong with `filepath`'s `{placeholders}` (see the module docstring).

    Args:
        filepath: The template.
        batch_freq: Whether saves happen every N batches (`{batch}` is filled).
        known: Log keys known to exist (for typo detection).

    Returns:
        A list of messages naming `filepath` and each bad placeholder.
    """
    shown = f"`filepath`={filepath!r}"
    try:
        fields = _fields(filepath)
    except ValueError as error:
        return [f"{shown} is not a valid template ({error}); write a literal brace as '{{{{' or '}}}}'"]
    problems = []
    candidates = sorted({"epoch", "batch", *known})
    for field, spec, conversion in fields:
        placeholder = "{" + field + ("!" + conversion if conversion else "") + (":" + spec if spec else "") + "}"
        if not _PLAIN_NAME.match(field):
            what = "positional" if field == "" or field.isdigit() else "attribute/index access"
            problems.append(
                f"{shown}: {placeholder} is {what}, which is never filled; use a plain name: "
                "{epoch}, {batch} or a log key such as {val_loss}"
            )
            continue
        if "{" in spec:
            problems.append(f"{shown}: {placeholder} has a nested placeholder in its format spec")
            continue
        if field == "batch" and not batch_freq:
            problems.append(
                f"{shown}: {{batch}} is only filled when `save_freq` is a number of batches; "
                "with save_freq='epoch' remove it"
            )
            continue
        if field not in ("epoch", "batch") and field not in known:
            close = difflib.get_close_matches(field, candidates, n=1, cutoff=_TYPO_CUTOFF)
            if close:
                problems.append(f"{shown}: {{{field}}} looks like a typo of {{{close[0]}}}; fix the name")
                continue
        sample = 1 if field in ("epoch", "batch") else 0.5
        kind = "a whole number" if field in ("epoch", "batch") else "a float (log values are floats)"
        try:
            ("{0" + ("!" + conversion if conversion else "") + (":" + spec if spec else "") + "}").format(sample)
        except (ValueError, TypeError) as error:
            problems.append(f"{shown}: the format spec of {placeholder} does not work for {kind} ({error})")
    return problems


def _location_problems(filepath):
    """Where `filepath` would be written: UTF-8, not a directory, not under a file, writable."""
    try:
        filepath.encode("utf-8")
    except UnicodeEncodeError:
        return [f"`filepath`={filepath!r} is not valid UTF-8 (its bytes {os.fsencode(filepath)!r}), "
                "and TensorFlow and Keras write UTF-8 paths only; choose a UTF-8 name"]
    if os.path.isdir(filepath):
        return [f"`filepath`={filepath!r} is a directory; give a file path"]
    # The folder part may itself hold placeholders; the nearest existing
    # folder above the first one is what must be a writable directory.
    fixed = filepath.split("{", 1)[0]
    folder = os.path.dirname(os.path.abspath(fixed if fixed == filepath else fixed + "x"))
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return [
            f"`filepath`={filepath!r} lies under {existing!r}, which is a file, so its folder "
            "cannot be created; choose a path under a directory"
        ]
    if cluster.is_chief() and not os.access(existing, os.W_OK | os.X_OK):
        return [
            f"`filepath`={filepath!r}: {existing!r} is not writable by this process; choose "
            "a folder it can write"
        ]
    return []


def expected_log_keys(model):
    """The log keys a compiled model's `fit` produces, with their `val_` forms.

    Empty when not known (no model, or not compiled).
    """
    if model is None or not getattr(model, "compiled", False):
        return set()
    names = set()
    for metric in model.metrics:
        if metric.name == "compile_metrics":
            inner = _keras_compat.compile_metric_log_keys(metric)
            if inner is None:
                return set()  # Not built yet: its metrics' names are not known.
            names |= inner
        else:
            names.add(metric.name)
    return names | {f"val_{n}" for n in names}
