"""`kd.SidecarEvaluator`: evaluate each checkpoint as the chief writes it.

Keras 3 dropped tf-keras's evaluator task. A sidecar evaluator is a process
beside the training cluster (TF_CONFIG task type `evaluator`; `keras-distrib
launch --evaluator` starts one) that watches the directory where the chief
writes kd checkpoints (`kd.CheckpointManager`, `kd.callbacks.BackupAndRestore`),
restores each new complete checkpoint into its own copy of the model,
evaluates it, logs the results to TensorBoard, can keep the best model, and
stops when training ends: a `finished` marker in the directory, or SIGTERM
(the launcher sends it when every training task has exited), after one last
look for checkpoints it has not evaluated yet.
"""

import os
import signal
import threading
import time

import tensorflow as tf

from keras_distrib.checkpointing import checkpoint as checkpoint_lib
from keras_distrib import files
from keras_distrib import validation

__all__ = ["SidecarEvaluator"]

_MODES = ("min", "max")


def _checkpoints(directory):
    """Complete checkpoints in `directory`, oldest first: (number, path)."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        number = name[len("ckpt-"):] if name.startswith("ckpt-") else ""
        path = os.path.join(directory, name)
        if number.isdigit() and os.path.exists(os.path.join(path, checkpoint_lib.PROGRESS_FILE)):
            found.append((int(number), path))
    return sorted(found)


class SidecarEvaluator:
    """Evaluates every new checkpoint of a training job, until it ends.

    Args:
        model: A compiled Keras model with the trained model's architecture
            (a `kd.Model` or a plain one; no strategy needed).
        data: Evaluation data: a `tf.data.Dataset`, `(x, y)` or
            `(x, y, sample_weight)` arrays, or `x` alone with `y`.
        checkpoint_dir: Where the chief writes kd checkpoints.
        y: Labels when `data` holds the inputs only.
        batch_size: Batch size for array data.
        steps: Evaluation steps per checkpoint (all the data when `None`).
        log_dir: Write each evaluation's metrics to TensorBoard here (step:
            the optimizer's iterations, when the model has an optimizer).
        best_model_path: Save the model here (`.keras` or `.weights.h5`)
            whenever `monitor` improves.
        monitor: The metric that decides "best".
        mode: `"min"` or `"max"` for `monitor`.
        max_evaluations: Stop after this many evaluations (`None`: no limit).
        poll_seconds: How often to look for new checkpoints.
        timeout: Give up after this many seconds without a new checkpoint
            (`None`: wait for the end of training).

    Raises:
        ValueError: listing every invalid argument.

    Examples:
        >>> import keras, numpy as np, tempfile, keras_distrib as kd
        >>> inputs = keras.Input((2,))
        >>> model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> evaluator = kd.SidecarEvaluator(model, (np.ones((4, 2)), np.ones((4, 1))),
        ...                                 tempfile.mkdtemp(), max_evaluations=0)
        >>> evaluator.start()
        []
    """

    def __init__(self, model, data, checkpoint_dir, *, y=None, batch_size=None, steps=None,
                 log_dir=None, best_model_path=None, monitor="loss", mode="min",
                 max_evaluations=None, poll_seconds=1.0, timeout=None):
        problems = []
        if not getattr(model, "compiled", False):
            problems.append("`model` is not compiled: compile it with its loss and metrics")
        if not isinstance(checkpoint_dir, (str, os.PathLike)) or not str(checkpoint_dir):
            problems.append(f"`checkpoint_dir`={checkpoint_dir!r} must be a directory path")
        if mode not in _MODES:
            problems.append(f"`mode`={mode!r} must be one of {list(_MODES)}")
        if not isinstance(monitor, str):
            problems.append(f"`monitor`={monitor!r} must be a metric name (a string)")
        if best_model_path is not None and not str(best_model_path).endswith((".keras", ".weights.h5")):
            problems.append(f"`best_model_path`={best_model_path!r} must end with '.keras' or '.weights.h5'")
        for name, value in (("max_evaluations", max_evaluations), ("steps", steps)):
            if value is not None and not validation.is_whole(value, 0):
                problems.append(f"`{name}`={value!r} must be a whole number >= 0, or None")
        for name, value in (("poll_seconds", poll_seconds), ("timeout", timeout)):
            if value is None and name == "timeout":
                continue
            if not validation.is_seconds(value):
                problems.append(f"`{name}`={value!r} must be a finite number of seconds > 0")
        if problems:
            raise ValueError("Invalid SidecarEvaluator arguments:\n  - " + "\n  - ".join(problems))
        self.model = model
        self.data = data
        self.y = y
        self.batch_size = batch_size
        self.steps = steps
        self.checkpoint_dir = os.fspath(checkpoint_dir)
        self.log_dir = log_dir
        self.best_model_path = best_model_path
        self.monitor = monitor
        self.mode = mode
        self.max_evaluations = max_evaluations
        self.poll_seconds = float(poll_seconds)
        self.timeout = timeout
        self.best = None
        self.results = []
        self._stop = threading.Event()
        self._evaluated = set()

    # Watching.

    def stop(self):
        """Asks `start` to finish: one last look for checkpoints, then return."""
        self._stop.set()

    def _finished(self):
        return os.path.exists(os.path.join(self.checkpoint_dir, checkpoint_lib.FINISHED_FILE))

    def start(self):
        """Evaluates checkpoints as they appear until training ends.

        Returns:
            A list of `(checkpoint_path, logs)`, in the order evaluated.
        """
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, lambda signum, frame: self._stop.set())
        try:
            self._watch()
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        return self.results

    def _watch(self):
        last_new = time.monotonic()
        while not self._done():
            if self._evaluate_new():
                last_new = time.monotonic()
                continue
            if self._stop.is_set() or self._finished():
                self._evaluate_new()  # Whatever was written just before the end.
                return
            if self.timeout is not None and time.monotonic() - last_new > self.timeout:
                print(f"SidecarEvaluator: no new checkpoint in {self.checkpoint_dir} for "
                      f"{self.timeout:g} s; stopping.", flush=True)
                return
            self._stop.wait(self.poll_seconds)

    def _done(self):
        return self.max_evaluations is not None and len(self.results) >= self.max_evaluations

    def _evaluate_new(self):
        """Evaluates the newest unseen checkpoint (skipping older unseen ones)."""
        pending = [(n, p) for n, p in _checkpoints(self.checkpoint_dir) if p not in self._evaluated]
        if not pending or self._done():
            return False
        for _, path in pending[:-1]:
            self._evaluated.add(path)  # Superseded before we got to them.
        _, path = pending[-1]
        self._evaluated.add(path)
        try:
            self._evaluate(path)
        except (tf.errors.OpError, ValueError, OSError, IndexError) as error:
            # Removed under us (max_to_keep) or unreadable (a truncated data
            # file raises IndexError): the next one will do.
            print(f"SidecarEvaluator: skipped {path}: {type(error).__name__}: "
                  f"{str(error).splitlines()[0][:200]}", flush=True)
            return True
        return True

    # Evaluating one checkpoint.

    def _evaluate(self, path):
        items = {"model": self.model}
        if self.model.optimizer is not None:
            items["optimizer"] = self.model.optimizer
        # CheckpointError (a ValueError) names each file that is not the one kd wrote.
        problems = checkpoint_lib.manifest_problems(path)
        if problems:
            raise checkpoint_lib.CheckpointError(f"{path} fails its manifest check: " + "; ".join(problems))
        progress = checkpoint_lib.read_progress_file(path)
        tf.train.Checkpoint(**items).read(os.path.join(path, "state")).expect_partial()
        logs = self._run_evaluation()
        step = int(self.model.optimizer.iterations.numpy()) if self.model.optimizer is not None else 0
        print(f"SidecarEvaluator: {os.path.basename(path)} (epoch {progress.get('epoch')}, step "
              f"{progress.get('step')}): " + ", ".join(f"{k}={v:.4g}" for k, v in logs.items()),
              flush=True)
        if self.log_dir:
            writer = tf.summary.create_file_writer(self.log_dir)
            with writer.as_default():
                for name, value in logs.items():
                    tf.summary.scalar(f"evaluation_{name}", value, step=step)
            writer.close()
        self._keep_best(logs)
        self.results.append((path, logs))

    def _run_evaluation(self):
        data = self.data
        if isinstance(data, tf.data.Dataset) or self.y is not None or not isinstance(data, tuple):
            return self.model.evaluate(data, self.y, batch_size=self.batch_size, steps=self.steps,
                                       verbose=0, return_dict=True)
        x, y, *rest = data
        return self.model.evaluate(x, y, sample_weight=rest[0] if rest else None,
                                   batch_size=self.batch_size, steps=self.steps, verbose=0,
                                   return_dict=True)

    def _keep_best(self, logs):
        if self.best_model_path is None:
            return
        if self.monitor not in logs:
            raise ValueError(
                f"`monitor`={self.monitor!r} is not among the evaluation's metrics "
                f"{sorted(logs)}. Pass one of them."
            )
        value = logs[self.monitor]
        better = self.best is None or (value < self.best if self.mode == "min" else value > self.best)
        if not better:
            return
        self.best = value
        folder, name = os.path.split(os.path.abspath(self.best_model_path))
        os.makedirs(folder, exist_ok=True)
        temp = files.staging_file(folder, suffix=name)
        try:
            if name.endswith(".weights.h5"):
                self.model.save_weights(temp, overwrite=True)
            else:
                self.model.save(temp, overwrite=True)
            files.publish(temp, self.best_model_path)  # with Keras's permissions
        finally:
            if os.path.exists(temp):
                os.remove(temp)
