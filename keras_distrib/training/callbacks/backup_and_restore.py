"""`kd.callbacks.BackupAndRestore`: resume an interrupted `fit` at the exact step.

Saves the model, the optimizer (with its step counter), the metric state and
the position in the epoch. On restart, the callback exposes that position
(`restored_position`, a `DataPosition`); kd's loop begins at the saved epoch
and moves the data past the batches already trained, without training them,
so the run continues with exactly the batch it would have trained next
(exact for input pipelines whose order does not depend on the run's history:
`shuffle=False`, or a dataset shuffled from a fixed seed per epoch).

On SIGTERM or SIGUSR1 (a preemption, Slurm's warning before a time limit, or
the launcher stopping a cluster) every worker
saves at the same agreed step and the process exits with
`kd.preemption.RESTART_EXIT_CODE` (42) to be restarted
(`keras_distrib.cluster.preemption`: the agreement goes through the coordination
service from background threads; no collective runs per step).
"""

import hashlib
import json
import logging
import math
import re
import time

import keras
import numpy as np
import tensorflow as tf

from keras_distrib import _keras_compat
from keras_distrib.checkpointing import checkpoint as checkpoint_lib
from keras_distrib.training import models
from keras_distrib.cluster import preemption
from keras_distrib import validation
from keras_distrib.training.loop import DataPosition
from keras_distrib.training.callbacks import _schedule

logger = logging.getLogger("keras_distrib")

__all__ = [
    "BackupAndRestore",
    "metric_state",
    "run_record",
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


def _without_names(value):
    """`value` (a config) without `name` entries: Keras numbers auto-names per process."""
    if isinstance(value, dict):
        return {str(k): _without_names(v) for k, v in value.items() if k != "name"}
    if isinstance(value, (list, tuple)):
        return [_without_names(v) for v in value]
    return value


def _plain(value):
    """`value` as JSON data: objects by their repr, without memory addresses."""
    text = json.dumps(_without_names(value), sort_keys=True, default=repr)
    # Floats to float32's 7 digits: a learning rate held in a float32 variable reads 0.02.
    return json.loads(re.sub(r" at 0x[0-9a-fA-F]+", "", text),
                      parse_float=lambda number: float(f"{float(number):.7g}"))


def _digest(value):
    return hashlib.sha256(json.dumps(_plain(value), sort_keys=True).encode()).hexdigest()[:12]


def _describe(value):
    """A loss or optimizer as JSON data: its class and configuration (names left out)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): _describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if hasattr(value, "get_config"):
        try:
            return _plain({"class": type(value).__name__, **value.get_config()})
        except Exception:  # noqa: BLE001 - a config that cannot be made: the class alone
            return {"class": type(value).__name__}
    return getattr(value, "__qualname__", type(value).__name__)


def _leaf_layers(layer):
    for child in getattr(layer, "layers", None) or ():
        if getattr(child, "layers", None):
            yield from _leaf_layers(child)
        else:
            yield child


def _layer_signature(layer):
    """`Class:digest` of a layer's settings (its name aside) and weights' shapes and dtypes."""
    try:
        config = layer.get_config()
    except Exception:  # noqa: BLE001 - layers of your own may have none
        config = {}
    shapes = [[list(weight.shape), str(weight.dtype)] for weight in layer.weights]
    return f"{type(layer).__name__}:{_digest([config, shapes])}"


def run_record(model):
    """What defines a training run of `model`, as the backup records it.

    The architecture (each layer's class, settings and weights' shapes), the
    optimizer with its configuration (learning rate, clipping, ...), the
    loss, and the parts a parameter server's `variable_partitioner` split
    weights into (the optimizer's state is per part); `BackupAndRestore`
    adds the global batch size and the batches per epoch. Taken when
    training begins, before a backup is restored, so a learning rate that a
    callback lowers later does not change it.

    Returns:
        A dict of JSON data: `model`, `optimizer`, `loss`, and `partitions`
        where a weight is partitioned.
    """
    layers = [_layer_signature(layer) for layer in _leaf_layers(model)]
    if not layers:
        layers = [_layer_signature(model)]
    record = {"model": layers, "optimizer": _describe(model.optimizer),
              "loss": _describe(getattr(model, "loss", None))}
    partitions = _keras_compat.weight_partitions(model)
    if partitions:
        record["partitions"] = partitions
    return record


def _short(value, limit=80):
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _run_changes(saved, now, weights=()):
    """How this run differs from the backup's record: `(key, phrase)` per difference.

    `key` names a change a resume may declare (`BackupAndRestore(declared_changes=...)`):
    `"optimizer.<setting>"` for a setting of the same optimizer class,
    `"loss"`; None for one it may not (another architecture, optimizer
    class or partitioning: the state would not fit or mean the same).
    `weights`: this model's weights (to name a weight whose partition changed).
    """
    changes = []
    old_layers, new_layers = saved.get("model"), now["model"]
    if old_layers != new_layers:
        if not isinstance(old_layers, list) or len(old_layers) != len(new_layers):
            count = len(old_layers) if isinstance(old_layers, list) else "?"
            changes.append((None, f"the model has {len(new_layers)} layers, the backup's had {count}"))
        else:
            index = next(i for i, (a, b) in enumerate(zip(old_layers, new_layers)) if a != b)
            changes.append((None,
                f"the model's layer {index} ({new_layers[index].split(':')[0]}) differs from the "
                f"backup's ({str(old_layers[index]).split(':')[0]}) in its settings or weights' shapes"))
    old_opt, new_opt = saved.get("optimizer"), now["optimizer"]
    if old_opt != new_opt:
        if isinstance(old_opt, dict) and isinstance(new_opt, dict) and old_opt.get("class") == new_opt.get("class"):
            for key in sorted(set(old_opt) | set(new_opt)):
                if old_opt.get(key) != new_opt.get(key):
                    changes.append((f"optimizer.{key}",
                                    f"the optimizer's `{key}` is {_short(new_opt.get(key))}, the "
                                    f"backup's was {_short(old_opt.get(key))}"))
        else:
            changes.append((None, f"the optimizer is {_short(new_opt)}, the backup's was {_short(old_opt)}"))
    if saved.get("loss") != now["loss"]:
        changes.append(("loss", f"the loss is {_short(now['loss'])}, the backup's was "
                                f"{_short(saved.get('loss'))}"))
    old_parts, new_parts = saved.get("partitions") or {}, now.get("partitions") or {}
    for index in sorted(set(old_parts) | set(new_parts), key=int):
        if old_parts.get(index) != new_parts.get(index):
            describe = lambda rows: f"{len(rows)} parts of {rows} rows" if rows else "not partitioned"
            name = weights[int(index)].path if int(index) < len(weights) else f"number {index}"
            changes.append((None,
                f"the weight `{name}` is {describe(new_parts.get(index))} over the parameter "
                f"servers, the backup's was {describe(old_parts.get(index))} (the optimizer's "
                "state is kept per part: resume with the backup's `variable_partitioner`)"))
    return changes


def _value_of(saved, now, key):
    """The backup's and this run's value of a change's `key` (`optimizer.<setting>`, `loss`)."""
    if key == "loss":
        return saved.get("loss"), now.get("loss")
    setting = key.split(".", 1)[1]
    return (saved.get("optimizer") or {}).get(setting), (now.get("optimizer") or {}).get(setting)


_DECLARABLE = re.compile(r"^(loss|optimizer\.[A-Za-z_][A-Za-z0-9_]*)$")


def _declared_changes(value):
    """`declared_changes` as a tuple of keys; ValueError naming what is wrong."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(k, str) for k in items):
        raise ValueError(f"`declared_changes`={value!r}: expected a list of settings changed on "
                         "purpose, e.g. ['optimizer.learning_rate', 'optimizer.clipnorm']")
    bad = [k for k in items if not _DECLARABLE.match(k)]
    if bad:
        raise ValueError(f"`declared_changes` lists {bad}: expected 'optimizer.<setting>' (a "
                         "setting of the optimizer's config, e.g. 'optimizer.learning_rate') or "
                         "'loss'; the architecture, the optimizer's class and the batch size "
                         "cannot change across a resume")
    return tuple(dict.fromkeys(items))


def _setting(optimizer, name):
    """An optimizer setting's current value (a variable's value, not the variable)."""
    value = getattr(optimizer, name, None)
    return np.asarray(value.numpy()) if hasattr(value, "assign") else value


def _set_setting(optimizer, name, value):
    """Puts `value` back into an optimizer setting (into its variable, if it has one)."""
    current = getattr(optimizer, name, None)
    if hasattr(current, "assign"):
        current.assign(value)
    elif value is not None:
        setattr(optimizer, name, value)


def _non_finite_losses(logs):
    """`name=value` of the logged losses that are NaN or Inf (the epoch's mean so far)."""
    bad = []
    for name, value in (logs or {}).items():
        if name == "loss" or name.endswith("_loss"):
            try:
                number = float(np.asarray(value))
            except (TypeError, ValueError):
                continue
            if not math.isfinite(number):
                bad.append(f"{name}={number}")
    return bad


def _non_finite_weights(model):
    """Names of the model's weights holding NaN or Inf (empty when all are finite)."""
    bad = []
    for weight in model.weights:
        if "float" in str(weight.dtype):
            values = np.asarray(weight.numpy(), dtype=np.float64)
            if not np.all(np.isfinite(values)):
                bad.append(weight.path)
    return bad


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up training state so an interrupted `fit` resumes exactly.

    Args:
        backup_dir: Directory for the backup (the chief's is kept; other
            workers write to scratch space that is removed).
        save_freq: `"epoch"`, or a number of batches between backups.
        delete_checkpoint: Remove the backup after training completes.
        save_on_preemption: On SIGTERM or SIGUSR1 (or when `termination_watcher`
            fires), every worker backs up at the same agreed step, then the
            process exits with code 42 so that `keras-distrib launch --max-restarts`, Slurm's requeue
            or a Kubernetes Job restarts it; the restart resumes exactly.
            The agreement costs nothing per step.
        grace_period: Seconds between the signal and the forced kill that
            training may use: 0 (default) saves at the first agreed step and
            exits; more saves then, trains on, and saves again before the
            grace period ends (as TensorFlow's PreemptionCheckpointHandler).
        termination_watcher: Optional `callable() -> bool`, polled every
            second, True when termination is imminent (e.g. a cloud's
            maintenance notice); it acts like SIGTERM.
        declared_changes: Settings this run changed on purpose from the
            backup's run, e.g. `["optimizer.learning_rate"]` after a
            divergence, `["optimizer.clipnorm"]` to add clipping:
            `"optimizer.<setting>"` (a key of the optimizer's config) or
            `"loss"`. A resume that finds them changed goes on with this
            run's values (a learning rate the backup restored is set back to
            this run's), records each change (epoch, step, old and new value)
            in the run record (`run_record`'s `changes`), and later resumes
            compare with the new values. Undeclared changes are refused.
            A declared setting whose compiled value is the backup's is not a
            change: the backup's live value stays (a learning rate that
            `ReduceLROnPlateau` lowered stays lowered). A learning-rate
            schedule may replace a schedule or a constant; a constant may not
            replace a schedule (the backup holds no learning-rate variable):
            give it as a schedule of one value, e.g.
            `keras.optimizers.schedules.PiecewiseConstantDecay([0], [lr, lr])`.
        max_to_keep: Backups kept (2: the newest and the one before, which
            a resume offers when the newest fails its manifest check). The
            oldest is removed before a new one is written, so the disk holds
            at most `max_to_keep` backups at any moment.
        adopt_checkpoint: The name (`"ckpt-7"`) of a backup in `backup_dir`
            that another run wrote, to resume from it on purpose. Each backup
            records the run that wrote it: a backup of another run (copied
            in, copied over, renamed) is refused, naming both runs, unless
            adopted here (see `kd.CheckpointManager`).

    Every file of a backup is checked against its manifest (size and
    SHA-256, written last) before anything is restored: a changed,
    truncated or missing file is refused by name, with the backup before it.

    Only the chief writes (and locks) `backup_dir`: a second live run on
    the same directory is refused at the start of training, before it
    restores or writes anything; the lock of a run that died is taken over.

    The interrupted epoch is not ended: no `on_epoch_end`, so no
    `ModelCheckpoint` file, log line or History entry counts it; the
    restarted run finishes it and ends it once, with its real logs.

    A backup holds everything that decides the rest of the run: weights,
    optimizer, metrics, the position in the epoch and every random state
    (the model's and its layers' seed generators; a dataset that reshuffles
    each epoch is replayed to the resumed epoch's order), so a resume on
    another replica or worker count ends at the uninterrupted one-device
    model. Weights or a logged loss holding NaN or Inf are never backed up
    (the last finite backup is kept, and kept at the end). A backup records
    what defines its run (each layer's class, settings and weights' shapes;
    the optimizer and its configuration; the loss; the global batch size,
    also of a `tf.data` pipeline of unknown length; the batches per epoch;
    under a parameter server, the parts a `variable_partitioner` split each
    weight into): a resume that differs is refused before anything is
    restored, naming what changed, and so is a hand-edited progress file.
    `backup_dir` itself is removed at the end only if kd created it (never
    a symbolic link or a mount point); a failing clean-up only warns.

    Raises:
        CheckpointError: `backup_dir` is a file or not writable; at the
            start of training, the directory is in use by another live run,
            or holds only damaged backups.
        ValueError: invalid `save_freq`, or the model is not a kd model
            (when the callback is given to `fit`).
    """

    def __init__(self, backup_dir, *, save_freq="epoch", delete_checkpoint=True,
                 save_on_preemption=True, grace_period=0.0, termination_watcher=None,
                 max_to_keep=2, declared_changes=(), adopt_checkpoint=None):
        super().__init__()
        self.backup_dir = checkpoint_lib.validate_directory(backup_dir, "backup_dir")
        adoption = checkpoint_lib.adoption_problem(adopt_checkpoint, "`backup_dir`")
        if adoption:
            raise ValueError(adoption)
        self.adopt_checkpoint = adopt_checkpoint
        self.declared_changes = _declared_changes(declared_changes)
        if not validation.is_whole(max_to_keep, 1):
            raise ValueError(f"`max_to_keep`={max_to_keep!r}: expected a whole number >= 1 (the "
                             "backups kept; 2 keeps one to go back to if the newest is damaged)")
        self.max_to_keep = max_to_keep
        self.schedule = _schedule.SaveSchedule(save_freq)
        self.delete_checkpoint = delete_checkpoint
        self.save_on_preemption = save_on_preemption
        # Validated here, before anything trains (ValueError names the argument).
        self._preemption_settings = dict(grace_period=grace_period, watcher=termination_watcher)
        preemption.PreemptionHandler(**self._preemption_settings)
        self._manager = None
        self._epoch = 0
        self._resume = None
        self.restored_position = None
        self._handler = None
        self._runner = None
        self._chunks = 0
        self._exit_after_training = False
        self._diverged = False
        self._run = None
        self._backup_run = None  # the run record of the backup being resumed
        self._saved_at = None
        self._last_step = None

    @property
    def epoch_interrupted(self):
        """True once a preemption's backup stopped the epoch part-way (kd's loop then
        ends training without ending that epoch: the restart finishes it)."""
        return self._exit_after_training

    def set_model(self, model):
        """Sets the model; refuses a plain `keras.Model` (see below) before anything is written."""
        # A plain keras.Model divides each replica's loss by its own rows and
        # does not follow kd's resume position (it would train batches twice):
        # refuse it when the model becomes known, before anything is written.
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
        self._run = run_record(model)
        self._check_declared(model)
        self._manager = checkpoint_lib.CheckpointManager(
            self._checkpoint(), self.backup_dir, max_to_keep=self.max_to_keep,
            adopt_checkpoint=self.adopt_checkpoint)
        self._backup_run = None
        newest = self._manager.newest
        if newest is not None:
            # Before anything is read: every file is the one kd wrote (its
            # manifest), this run's (not copied from another), and another
            # experiment's backup must not touch this model.
            try:
                self._manager.verify(newest)
                self._manager.check_identity(newest)
            except checkpoint_lib.CheckpointError:
                self._manager.close()
                raise
            self._check_data_matches(self._manager.read_progress(newest), newest)
        # A declared setting that changed and is also state (a learning rate
        # held in a variable) is this run's, not the backup's, after the restore.
        changed = self._declared_and_changed()
        declared = {key: _setting(model.optimizer, key.split(".", 1)[1]) for key in changed}
        try:
            progress = self._manager.restore_or_initialize()
        except checkpoint_lib.CheckpointError:
            self._manager.close()
            raise
        if progress is not None:
            for key, value in declared.items():
                _set_setting(model.optimizer, key.split(".", 1)[1], value)
        self.restored_position = None
        if progress is not None:
            if "metrics" not in progress:
                raise checkpoint_lib.CheckpointError(
                    f"The checkpoint {self._manager.restored_path!r} in `backup_dir` has no "
                    "metric state: it was not written by kd.callbacks.BackupAndRestore (a "
                    "kd.CheckpointManager's, perhaps). Give the callback a directory of its own."
                )
            self._check_data_matches(progress, self._manager.restored_path, announce=True)
            self.restored_position = DataPosition(progress["epoch"], progress["step"])
            if progress["step"] > 0:
                self._resume = progress
        self._chunks = 0
        self._exit_after_training = False
        self._diverged = False
        self._saved_at = self._last_step = None
        if self.save_on_preemption:
            self._handler = preemption.PreemptionHandler(
                strategy=model.distribute_strategy, **self._preemption_settings
            )
            self._handler.start()

    def _declared_and_changed(self):
        """The declared optimizer settings whose compiled value differs from the backup run's.

        Only those are set to this run's value after the restore: a declared
        setting that did not change keeps the backup's live value. A
        schedule is this run's object (the restore does not touch it), so
        there is nothing to set; a constant cannot replace a schedule (the
        backup holds no learning-rate variable): refused here, before anything
        is restored.
        """
        saved = (self._backup_run or {}).get("optimizer")
        if not isinstance(saved, dict):
            return []
        now = self._run["optimizer"]
        changed = []
        for key in self.declared_changes:
            if not key.startswith("optimizer."):
                continue
            setting = key.split(".", 1)[1]
            was, is_now = saved.get(setting), now.get(setting)
            if was == is_now:
                logger.info("`declared_changes` lists %r, whose compiled value is the backup run's "
                            "(%s): not a change, so the backup's live value stays.", key, _short(was))
                continue
            if isinstance(is_now, dict):
                continue  # a schedule: this run's object, which the restore leaves as it is
            if isinstance(was, dict) and setting == "learning_rate":
                self._manager.close()
                raise checkpoint_lib.CheckpointError(
                    f"`declared_changes` lists {key!r}, and this run's learning rate is the constant "
                    f"{is_now!r} where the backup's run had a schedule "
                    f"({was.get('class_name', 'a LearningRateSchedule') if isinstance(was, dict) else was}): "
                    "the backup holds no learning-rate variable (a schedule computes the rate from "
                    "the step), so a constant cannot take over from it, and nothing was restored. "
                    "Give the constant as a schedule of one value, e.g. `learning_rate=keras."
                    f"optimizers.schedules.PiecewiseConstantDecay([0], [{is_now!r}, {is_now!r}])`, "
                    "and declare it the same way.")
            changed.append(key)
        return changed

    def on_train_abort(self):
        """Training raised (kd's loop calls this; Keras calls no `on_train_end` then).

        Puts the SIGTERM/SIGUSR1 handlers back as they were and releases the
        directory's lock; the backups stay for a resume.
        """
        if self._handler is not None:
            self._handler.stop()
            self._handler = None
        if self._manager is not None:
            self._manager.close()

    def _check_declared(self, model):
        """Refuses a declared optimizer setting the optimizer does not have (nothing restored yet)."""
        settings = self._run["optimizer"] if isinstance(self._run.get("optimizer"), dict) else {}
        unknown = [key for key in self.declared_changes
                   if key.startswith("optimizer.") and key.split(".", 1)[1] not in settings]
        if unknown:
            raise ValueError(
                f"`declared_changes` lists {unknown}, which the optimizer "
                f"({type(model.optimizer).__name__}) does not have; its settings: "
                f"{sorted(k for k in settings if k != 'class')}.")

    def set_runner(self, runner):
        """The loop's runner (kd's loop calls this before training begins)."""
        self._runner = runner

    def _save(self, epoch, step, logs=None):
        if self._runner is not None:
            # Steps scheduled on parameter-server workers may still be running:
            # the backup must hold exactly the steps its position counts.
            self._runner.wait()
        # A loss that is NaN or Inf diverged as surely as a weight that is
        # (the weights may stay finite: a step whose gradient is zero or NaN-free).
        bad = _non_finite_weights(self.model) + _non_finite_losses(logs)
        if bad:
            # Diverged: the backup in place is the last good state; keep it.
            self._diverged = True
            logger.warning("Training diverged (NaN or Inf: %s) at epoch %d, step %d, so the backup "
                           "was not written; %s", ", ".join(bad[:3]) + (" ..." if len(bad) > 3 else ""),
                           epoch, step, self._divergence_advice())
            return
        self._manager.save(epoch=epoch, step=step, metrics=metric_state(self.model),
                           run=self._run, **self._data_shape())
        self._saved_at = (epoch, step)

    def _divergence_advice(self):
        """Where the last finite state is (if a backup holds one), and how to resume from it."""
        latest = self._manager.latest
        if latest is None:
            return (f"no backup was written in {self.backup_dir} before it, so there is none to "
                    "resume from: lower the learning rate (or clip gradients) and start again.")
        try:
            progress = self._manager.read_progress(latest)
            where = f" (epoch {progress['epoch']}, step {progress['step']})"
        except checkpoint_lib.CheckpointError:
            where = ""
        return (f"the backup {latest}{where} holds the last finite weights and is kept. Lower the "
                "learning rate (or clip gradients) and resume from it, declaring the change: "
                "`kd.callbacks.BackupAndRestore(..., declared_changes=['optimizer.learning_rate'])` "
                "(or 'optimizer.clipnorm').")

    def _data_shape(self):
        """What the backup's position counts in: batches per epoch and the global batch size."""
        params = self.params or {}
        return {key: params.get(name) for key, name in
                (("batches_per_epoch", "steps"), ("global_batch_size", "batch_size"))
                if isinstance(params.get(name), int)}

    def _check_data_matches(self, progress, path, announce=False):
        """Refuses to resume a backup of another run, or whose position no longer means the same examples."""
        fresh = ("Resume with what it was written with, or give `backup_dir` another directory "
                 "(or delete this backup) to start from scratch.")
        now = self._data_shape()
        malformed = [f"`{key}`={progress[key]!r} (expected a whole number >= 1)"
                     for key in ("global_batch_size", "batches_per_epoch")
                     if key in progress and not validation.is_whole(progress[key], 1)]
        # kd records them with every backup of a run whose data tells them (this one's does).
        malformed += [f"`{key}` is missing (kd records it with every backup of a run whose data "
                      f"has one; this run's is {now[key]})"
                      for key in ("global_batch_size", "batches_per_epoch")
                      if key in now and key not in progress]
        run = progress.get("run")
        if run is not None and not (isinstance(run, dict) and isinstance(run.get("model"), list)):
            malformed.append(f"`run`={_short(run)} (expected kd's record of the run)")
        if run is None:
            self._manager.close()
            raise checkpoint_lib.CheckpointError(
                f"The backup {path!r} does not record what defines its run (model, optimizer, loss, "
                "batch size; `run` in its progress.json): kd writes that record into every backup, "
                "so it was removed from the file, or a kd older than the record wrote it. kd cannot "
                "check that the backup belongs to this run. If an older kd wrote it, finish it with "
                "that version; else " + fresh[fresh.index("give"):])
        if malformed:
            self._manager.close()
            raise checkpoint_lib.CheckpointError(
                f"The backup {path!r} has a progress.json kd did not write: " + "; ".join(malformed)
                + ". It may have been edited by hand; kd cannot tell which run it belongs to. " + fresh)
        self._backup_run = run
        changes = _run_changes(run, self._run, self.model.weights)
        problems = [phrase for key, phrase in changes if key not in self.declared_changes]
        undeclared = [key for key, phrase in changes if key and key not in self.declared_changes]
        for key, what in (("global_batch_size", "global batch size"),
                          ("batches_per_epoch", "batches per epoch")):
            saved = progress.get(key)
            if saved is not None and key in now and now[key] != saved:
                problems.append(f"the {what} is {now[key]}, the backup's was {saved}")
        batches = now.get("batches_per_epoch")
        if batches is not None and progress["step"] > batches:
            problems.append(f"the backup's position, step {progress['step']} of epoch "
                            f"{progress['epoch']}, is past the epoch's {batches} batches")
        if problems:
            self._manager.close()
            declare = ""
            if undeclared:
                declare = (f" If this run changed {'it' if len(undeclared) == 1 else 'them'} on "
                           f"purpose (a lower learning rate after a divergence, a clip added), "
                           f"declare it: `kd.callbacks.BackupAndRestore(..., declared_changes="
                           f"{undeclared!r})` (or `kd.TrainLoop.fit(..., declared_changes=...)`); "
                           "the resume then goes on with this run's values and records the change.")
            raise checkpoint_lib.CheckpointError(
                f"The backup {path!r} does not match this run: " + "; ".join(problems)
                + ". Resuming it would train something else, or skip or repeat examples." + declare
                + (" Otherwise: " + fresh[0].lower() + fresh[1:] if declare else " " + fresh)
            )
        # Declared changes: accepted, and recorded in the run record the next backups hold.
        history = list(run.get("changes") or [])
        for key, phrase in changes:
            was, now_value = _value_of(run, self._run, key)
            history.append({"epoch": progress["epoch"], "step": progress["step"], "setting": key,
                            "was": was, "now": now_value,
                            "why": f"declared: `declared_changes` lists {key!r}"})
            if announce:
                logger.warning("Resuming %s with a declared change: %s.", path, phrase)
        if history:
            self._run["changes"] = history
        if progress["step"] > 0 and "global_batch_size" not in now:
            logger.warning(
                "Resuming %s at epoch %d, step %d: the global batch size of this run's data is not "
                "known, so kd cannot check that the %d batches it skips are the ones the backup "
                "trained. Resume with the same data and batch size.", path, progress["epoch"],
                progress["step"], progress["step"])

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

    def on_train_chunk_end(self, batch, logs=None):
        """After a chunk of steps ending at index `batch`: back up if due or preempted.

        kd's loop calls it on the main thread, between steps; it is not
        `on_train_batch_end`, so that Keras can keep dispatching that (and
        the logs' conversion to NumPy) from a background thread.
        """
        due = self.schedule.batch_done(batch)
        step = batch + 1
        self._last_step = step
        self._chunks += 1
        decision = self._handler.check(self._chunks) if self._handler is not None else None
        if decision is not None:
            started = time.monotonic()
            self._save(self._epoch, step, logs)
            self._handler.saved(time.monotonic() - started)
            logger.warning("Preemption (%s): backed up epoch %d, step %d (chunk %d)%s.",
                           self._handler.reason or "agreed by another worker", self._epoch, step,
                           self._chunks, "" if decision == preemption.EXIT else "; training on")
            if decision == preemption.EXIT:
                self.model.stop_training = True
                self._exit_after_training = True
            return
        if due:
            self._save(self._epoch, step, logs)

    def on_epoch_end(self, epoch, logs=None):
        if self._exit_after_training:
            return
        if self.schedule.per_epoch:
            self._save(epoch + 1, 0, logs)
        elif self._saved_at == (epoch, self._last_step):
            # The backup was taken at this epoch's last step, and the epoch has
            # now ended: a resume starts the next one, so the epoch is not ended twice.
            self._manager.relabel(epoch=epoch + 1, step=0)
            self._saved_at = (epoch + 1, 0)

    def on_train_end(self, logs=None):
        if self._handler is not None:
            self._handler.stop()
        if self._exit_after_training:
            self._manager.close()
            self._handler.exit()
        self._handler = None
        if self._diverged:
            logger.warning("Training diverged: %s", self._divergence_advice())
            self._manager.close()
            return
        try:
            if self.delete_checkpoint:
                self._manager.delete_all()
            else:
                self._manager.mark_finished()
        except (OSError, checkpoint_lib.CheckpointError) as error:
            # Training is complete: a failing clean-up must not fail it.
            logger.warning("Training finished, but cleaning up the backup in %s failed (%s); "
                           "remove it by hand.", self.backup_dir, error)
        self._manager.close()
