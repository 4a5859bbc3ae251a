"""Test your own model: parity with one device, and pytest fixtures for strategies.

`assert_parity(model_fn, data)` trains your model on one device and under
each strategy you name, from the same initial weights and on the same global
batches, compares the weights after every step, and on a mismatch raises an
`AssertionError` that names the first step and variable that differ, by how
much, and the likely cause (per-replica gradient clipping, unsynchronized
BatchNormalization, dropout or other randomness, a loss reduced per replica,
a plain `keras.Model` on an uneven batch). Comparing step by step is what
names the first step: after a few epochs every weight differs. Before it
blames a cause it tells round-off from a real difference: a float32
mismatch is trained again in float64, where an exact model matches to about
1e-12 and a real difference stays.

Where each strategy runs. A process holds one device layout and one
collective group, so:

- `"one_device"`, `"mirrored"` and `"central_storage"` run in this process,
  on logical CPU devices (`kd.virtual_devices`), which must be set up before
  TensorFlow starts its devices. As a pytest plugin this module does that
  at start-up (`--kd-devices N`, default 2); in a script, `assert_parity`
  does it if it still can.
- `"multi_worker"` (2 worker processes) and `"parameter_server"` (a fresh
  process holding a `kd.local_cluster`: connecting to a cluster makes every
  variable this process created before unreadable) run in other processes,
  started by `kd.launch`. There `model_fn` must be importable (a function
  at module level of a .py file) and `data` NumPy arrays.

Everything runs on CPUs: one device and several replicas then compute the
same float32 arithmetic, and a difference is a bug, not hardware.

As a pytest plugin (pytest is not a dependency of keras_distrib; the
fixtures exist when pytest runs): `pytest -p keras_distrib.testing`, or in a
`conftest.py`: `pytest_plugins = ["keras_distrib.testing"]`. It is not
registered to load by itself: it imports TensorFlow and splits the CPU, which
no unrelated test run should pay for. Fixtures:

- `kd_one_device`, `kd_mirrored`, `kd_central_storage`: a strategy in this
  process (2 replicas for the last two); `kd_strategy`: each of the three.
- `kd_multi_worker(fn, *args)`: runs `fn(strategy, *args)` in 2 worker
  processes under `MultiWorkerMirroredStrategy`; returns
  `{"worker 0": value, "worker 1": value}`.
- `kd_parameter_server(fn, *args)`: runs `fn(strategy, *args)` in a fresh
  coordinator process with an in-process cluster (1 worker, 1 ps by
  default); returns its value.
"""

import math
import os
import pickle
import shutil
import sys
import tempfile
import textwrap
import warnings

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from keras_distrib import _keras_compat
from keras_distrib.training import data as data_lib
from keras_distrib.cluster import devices
from keras_distrib.cluster import launcher
from keras_distrib.training import models
from keras_distrib import report
from keras_distrib.cluster import strategies
from keras_distrib import validation

__all__ = [
    "ClusterError",
    "IN_PROCESS",
    "STRATEGIES",
    "assert_parity",
    "kd_central_storage",
    "kd_mirrored",
    "kd_multi_worker",
    "kd_one_device",
    "kd_parameter_server",
    "kd_strategy",
    "local_strategy",
    "run_in_cluster",
]

IN_PROCESS = ("one_device", "mirrored", "central_storage")
"""The strategies `assert_parity` runs in this process, on logical CPU devices."""
_IN_CLUSTER = ("multi_worker", "parameter_server")
STRATEGIES = IN_PROCESS + _IN_CLUSTER
"""Every strategy name `assert_parity` takes: `IN_PROCESS`, then `"multi_worker"` and `"parameter_server"`."""
_PATHS = ("fit", "loop")
_FLOAT32_TOLERANCE = 2e-5
_FLOAT16_TOLERANCE = 5e-3
# An exact model re-run in float64 matches one device to about 1e-12 (Adam
# can magnify the last bits of a near-zero gradient a few thousand times).
_FLOAT64_TOLERANCE = 1e-9
_DEFAULT_DEVICES = 2


def _task_entry():
    # Imported when used: `keras_distrib.cluster._task_entry` is also the module that
    # launched tasks run with `python -m`, and importing it with the package
    # makes Python warn in every task (runpy's "found in sys.modules").
    from keras_distrib.cluster import _task_entry as module

    return module



# ---------------------------------------------------------------------------
# Strategies.


def _cpu_devices(count):
    """`count` logical CPU devices in this process, split now if TF allows."""
    if strategies._configured_cpu_count() < count:
        try:
            devices.virtual_devices(count)
        except RuntimeError as error:
            raise RuntimeError(
                f"{count} replicas need {count} logical CPU devices, and TensorFlow "
                f"already started this process's devices with "
                f"{strategies._configured_cpu_count()}. Split the CPU before anything "
                "touches TensorFlow: load kd.testing as a pytest plugin (`pytest -p "
                "keras_distrib.testing --kd-devices N`, or `pytest_plugins = "
                "['keras_distrib.testing']` in conftest.py), or call "
                "kd.virtual_devices(N) at the top of your script."
            ) from error
    return [f"/device:CPU:{i}" for i in range(count)]


def local_strategy(kind, *, replicas=2):
    """A strategy of `kind` in this process, on logical CPU devices.

    Args:
        kind: `"one_device"`, `"mirrored"` or `"central_storage"`.
        replicas: Replicas of `"mirrored"` and `"central_storage"`.

    Returns:
        A `tf.distribute.Strategy`.

    Raises:
        ValueError: an unknown `kind` or `replicas`.
        RuntimeError: TensorFlow started its devices with fewer CPU devices
            than `replicas` (the message says how to split them in time).

    Example:
        >>> from keras_distrib import testing
        >>> testing.local_strategy("one_device").num_replicas_in_sync
        1
    """
    if kind not in IN_PROCESS:
        raise ValueError(
            f"`kind`={kind!r} does not run in this process. Expected one of "
            f"{list(IN_PROCESS)}; for {list(_IN_CLUSTER)} use run_in_cluster()."
        )
    if not validation.is_whole(replicas, 1):
        raise ValueError(f"`replicas`={replicas!r}: expected a whole number >= 1.")
    if kind == "one_device":
        return strategies.make_strategy("one_device", devices=_cpu_devices(1)[:1])
    if kind == "mirrored":
        # Several MirroredStrategy objects share a process here (one per test,
        # per assert_parity call): each gets collective keys of its own.
        return _keras_compat.isolated_mirrored_strategy(_cpu_devices(replicas)[:replicas])
    return strategies.make_strategy(kind, devices=_cpu_devices(replicas)[:replicas])


_ERROR_MARK = "kd.testing error: "


class ClusterError(AssertionError):
    """A process started by `run_in_cluster` failed (an `AssertionError`, so pytest reports it).

    Args:
        message: The whole report: the error in one line, then the
            process's last lines of output.
        summary: The error in one line (also `self.summary`).
    """

    def __init__(self, message, summary):
        super().__init__(message)
        self.summary = summary


def _cluster_task(kind, workers, spec, args):
    """What each launched process runs: `fn(strategy, *args)` (see run_in_cluster)."""
    from keras_distrib.cluster import inprocess as inprocess_cluster

    try:
        function = _task_entry()._resolve(spec)
        if kind == "parameter_server":
            # This process is the coordinator of its own cluster, not a task
            # of the launcher's one-process cluster.
            os.environ.pop("TF_CONFIG", None)
            resolver = inprocess_cluster.local_cluster(workers=workers, ps=1)
            strategy = strategies.make_strategy("parameter_server", cluster_resolver=resolver)
        else:
            strategy = strategies.make_strategy("multi_worker")
        return function(strategy, *args)
    except Exception as error:
        # One line for the caller's message; the traceback follows in the output.
        print(_ERROR_MARK + report.error_line(error), flush=True)
        raise


def run_in_cluster(fn, *args, kind="multi_worker", workers=2, timeout=300):
    """Runs `fn(strategy, *args)` under a strategy that needs other processes.

    Args:
        fn: An importable function (module level in a .py file).
        *args: Picklable arguments.
        kind: `"multi_worker"`: `workers` processes on localhost, each
            calling `fn` under `MultiWorkerMirroredStrategy` (one replica
            each). `"parameter_server"`: one fresh process, the coordinator
            of an in-process cluster of `workers` workers and 1 ps, calling
            `fn` once under `ParameterServerStrategy`.
        workers: Worker count.
        timeout: Seconds before every process is stopped.

    Returns:
        `{"worker 0": value, ...}` for `"multi_worker"`; `fn`'s value for
        `"parameter_server"`.

    Raises:
        ValueError: a bad `kind`, or `fn` cannot be imported elsewhere.
        ClusterError: (an `AssertionError`) a process failed or timed out;
            the message starts with its error in one line, then its last
            lines of output.
    """
    if kind not in _IN_CLUSTER:
        raise ValueError(f"`kind`={kind!r}: expected one of {list(_IN_CLUSTER)}.")
    spec = _task_entry().function_spec(fn)
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPUs only: see the module docstring
    lines = []
    result = launcher.launch(
        _cluster_task, workers=workers if kind == "multi_worker" else 1,
        args=(kind, workers, spec, tuple(args)), timeout=timeout, env=env, sink=lines.append,
    )
    if result.returncode != 0:
        errors = [line for line in lines if _ERROR_MARK in line]
        if errors:
            label, _, error = errors[0].partition(_ERROR_MARK)
            summary = f"{label.strip('[] ')}: {error}"
        elif result.timed_out:
            summary = f"timed out after {timeout:g} s"
        else:
            summary = f"exit code {result.returncode}"
        raise ClusterError(
            f"{spec} under {kind} failed: {summary}\nLast lines of its output:\n"
            + "\n".join(lines[-15:]), summary,
        )
    if kind == "parameter_server":
        return result.values["worker 0"]
    return result.values


# ---------------------------------------------------------------------------
# Training with a snapshot of the weights after every step.


class _Recorder(keras.callbacks.Callback):
    """Keeps the model's weights after every step (or every epoch) up to `steps`."""

    def __init__(self, steps_per_epoch, steps, per_epoch=False):
        super().__init__()
        self.steps_per_epoch = steps_per_epoch
        self.steps = steps
        self.per_epoch = per_epoch
        self.weights = {}
        self.epoch = 0

    def _keep(self, step):
        if step <= self.steps:
            self.weights[step] = [np.array(w) for w in self.model.get_weights()]
        if step >= self.steps:
            self.model.stop_training = True

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if not self.per_epoch:
            self._keep(self.epoch * self.steps_per_epoch + batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        if self.per_epoch:  # parameter server: one step per epoch, joined at its end
            self._keep(epoch + 1)


def _first_input(x):
    return tree.flatten(x)[0]


def _one_pipeline_dataset(dataset_fn):
    """`dataset_fn`'s dataset for one input pipeline and one replica: the global batches."""
    context = tf.distribute.InputContext(
        num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1)
    return dataset_fn(context)


def _is_dataset_source(data):
    return isinstance(data, tf.data.Dataset) or (callable(data) and not isinstance(data, (tuple, list)))


def _dataset_of(arrays):
    return _one_pipeline_dataset(arrays) if callable(arrays) else arrays


def _build(model, x):
    """Creates the model's variables (a subclassed model may have none yet).

    `x` is a batch of NumPy inputs, or a dataset's element spec (zeros of
    its shape: reading a batch would move a reshuffling dataset on).
    """
    if model.built and model.weights:
        return
    if isinstance(x, tf.data.Dataset):
        inputs = keras.utils.unpack_x_y_sample_weight(x.element_spec)[0]
        sample = tree.map_structure(
            lambda spec: tf.zeros([1] + [d or 1 for d in spec.shape[1:]], spec.dtype), inputs)
    else:
        sample = tree.map_structure(lambda a: a[:1], x)
    model(sample, training=False)


def _make_model(model_fn, seed, x, initial_weights=None):  # x: arrays' inputs, or a dataset
    keras.utils.set_random_seed(seed)  # the same dropout seeds in every run
    model = model_fn()
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`model_fn` returned a {type(model).__name__}; it must build, compile and "
            "return a keras.Model (assert_parity calls it inside each strategy's scope)."
        )
    if getattr(model, "optimizer", None) is None:
        raise ValueError(
            "`model_fn` returned a model that is not compiled. Call "
            "`model.compile(optimizer=..., loss=...)` inside `model_fn`."
        )
    _build(model, x)
    if initial_weights is not None:
        model.set_weights(initial_weights)
    return model


def _train(model, arrays, *, batch_size, steps, path, per_epoch):
    """Trains `model` for `steps` steps; returns its weights after each step, and history.

    `arrays` is (x, y, sample_weight), a batched `tf.data.Dataset` or a
    `dataset_fn` (called for one input pipeline).
    """
    if _is_dataset_source(arrays):
        dataset = _dataset_of(arrays)
        steps_per_epoch = _dataset_steps(dataset)
        recorder = _Recorder(steps_per_epoch, steps)
        kwargs = dict(x=dataset, epochs=math.ceil(steps / steps_per_epoch), shuffle=False)
    else:
        x, y, sample_weight = arrays
        steps_per_epoch = math.ceil(len(_first_input(x)) / batch_size)
        recorder = _Recorder(steps_per_epoch, steps, per_epoch=per_epoch)
        if per_epoch:
            # Parameter server: each worker repeats its dataset, so epochs are
            # counted in steps. One step per epoch (joined at its end) keeps the
            # global batches of one device's epochs, the uneven one included.
            sliced = tuple(a for a in (x, y, sample_weight) if a is not None)
            kwargs = dict(
                x=lambda context: tf.data.Dataset.from_tensor_slices(sliced).batch(batch_size),
                epochs=steps, steps_per_epoch=1)
        else:
            kwargs = dict(x=x, y=y, sample_weight=sample_weight, batch_size=batch_size,
                          epochs=math.ceil(steps / steps_per_epoch), shuffle=False)
    fit = model.fit
    if path == "loop":
        from keras_distrib.training import train_loop

        fit = train_loop.TrainLoop(model).fit
    history = fit(**kwargs, verbose=0, callbacks=[recorder])
    return {"weights": recorder.weights, "history": dict(history.history)}


def _parity_task(strategy, payload_path):
    """In a launched process: train the payload's model under `strategy`."""
    with open(payload_path, "rb") as f:
        payload = pickle.load(f)
    model_fn = _task_entry()._resolve(payload["model_fn"])
    arrays = payload["arrays"]
    keras.config.set_floatx(payload.get("floatx", "float32"))
    keras.config.set_dtype_policy(keras.config.floatx())
    if isinstance(arrays, tuple) and isinstance(arrays[0], str):  # a dataset_fn's spec
        arrays = _task_entry()._resolve(arrays[0])
    build_from = _dataset_of(arrays) if _is_dataset_source(arrays) else arrays[0]
    with strategy.scope():
        model = _make_model(model_fn, payload["seed"], build_from, payload["initial_weights"])
    return _train(model, arrays, batch_size=payload["batch_size"], steps=payload["steps"],
                  path=payload["path"], per_epoch=payload["per_epoch"])


# ---------------------------------------------------------------------------
# Comparing, and saying why.


def _relative(a, b):
    """max |a - b| / (1 + |a|), with matching non-finite values counting as equal."""
    a = np.asarray(a, dtype="float64")
    b = np.asarray(b, dtype="float64")
    if a.shape != b.shape:
        return float("inf")
    if not a.size:
        return 0.0
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    if not np.all(same | (np.isfinite(a) & np.isfinite(b))):
        return float("inf")
    with np.errstate(invalid="ignore"):
        return float(np.max(np.where(same, 0.0, np.abs(a - b) / (1.0 + np.abs(a)))))


def _layers(model):
    return [layer for layer in _keras_compat.flatten_layers(model) if layer is not model]


def _defining_module(model, method):
    for cls in type(model).__mro__:
        if method in vars(cls):
            return cls.__module__ or ""
    return ""


def _is_own_code(module):
    """Whether `module` is the user's code (not Keras's, TensorFlow's or kd's)."""
    return module.split(".")[0] not in ("keras", "keras_distrib", "tf_keras", "tensorflow")


def _state_owner(model, variable_name):
    """The layer holding `variable_name` if it is state a layer assigns in `call`, or None."""
    for layer, variable in models.layer_state(model):
        if getattr(variable, "path", variable.name) == variable_name:
            return layer
    return None


def _likely_causes(model, *, replicas, uneven, first_step, variable_name=None):
    """Why a model may train differently on several replicas, most likely first."""
    causes = []
    layers = _layers(model)
    kd_model = isinstance(model, models.DistributedModelMixin)
    owner = _state_owner(model, variable_name) if variable_name else None
    if owner is not None:
        causes.append(
            f"layer state: {owner.name!r} ({type(owner).__name__}) updates its non-trainable "
            f"variable {variable_name!r} in `call`, and each replica updates it from its own "
            "rows" + (" (Keras averages the replicas' values)." if not kd_model else
                      ". kd sums `assign_add`/`assign_sub` of data over the replicas and refuses "
                      "`assign`: check what the layer adds per step.")
        )
    random_layers = [] if kd_model else [
        layer for layer in layers
        if isinstance(getattr(layer, "seed_generator", None), keras.random.SeedGenerator)
        and getattr(layer, "rate", 1) != 0
    ]
    if random_layers:
        names = ", ".join(f"{layer.name!r} ({type(layer).__name__})" for layer in random_layers[:3])
        causes.append(
            f"dropout or other randomness: {names} draw{'s' * (len(random_layers) == 1)} random "
            "numbers on each replica, so "
            "the replicas do not drop (or perturb) the rows one device does. kd models draw "
            "for the global batch and keep each replica's rows: build the model as kd.Model / "
            "kd.Sequential."
        )
    per_replica = not kd_model or getattr(model, "batch_norm", "global") == "per_replica"
    unsynced = [
        layer for layer in layers
        if isinstance(layer, keras.layers.BatchNormalization) and not layer.synchronized
    ] if per_replica else []
    if unsynced and replicas > 1:
        names = ", ".join(repr(layer.name) for layer in unsynced[:3])
        causes.append(
            f"unsynchronized BatchNormalization: {names} normalize{'s' * (len(unsynced) == 1)} "
            "each replica's rows with "
            "that replica's own mean and variance (and move their averages with them), not "
            "the global batch's" + (", and on this uneven batch some replicas have few rows "
                                    "or none" if uneven else "")
            + ". kd models compute global statistics (unless compiled with "
            "batch_norm=\"per_replica\"); or use BatchNormalization(synchronized=True)."
        )
    if kd_model and getattr(model, "rows_meet", "global") == "per_replica" and replicas > 1:
        causes.append(
            "rows left to each replica: the model was compiled with rows_meet=\"per_replica\", "
            "so wherever the rows of a batch meet (in-batch negatives, labels numbered from the "
            "batch size, a layer or loss reading statistics of the batch, a loss mining the "
            "batch), each replica sees only its own rows, not the global batch one device sees. "
            "Compile with rows_meet=\"global\" (the default), where kd gathers the global batch "
            "there."
        )
    if not kd_model and uneven:
        causes.append(
            f"a plain Keras model ({type(model).__name__}, not a kd model) on an uneven batch: Keras 3 "
            "divides each replica's loss by the replica's own row count, so a replica with "
            "few rows weighs as much as a full one. Build it as kd.Model / kd.Sequential, "
            "or put kd.DistributedModelMixin first in its bases."
        )
    optimizer = getattr(model, "optimizer", None)
    base = _keras_compat.base_optimizer(optimizer) if optimizer is not None else None
    if base is not None and not _keras_compat.has_gradient_pipeline(optimizer):
        settings = [f"`{name}`={getattr(base, name)}" for name in ("clipnorm", "clipvalue", "global_clipnorm")
                    if getattr(base, name, None)]
        if getattr(base, "gradient_accumulation_steps", None):
            settings.append(f"`gradient_accumulation_steps`={base.gradient_accumulation_steps}")
        if settings:
            causes.append(
                f"per-replica gradient clipping: the optimizer ({', '.join(settings)}) clips "
                "(or accumulates) each replica's partial gradient before the replicas' "
                "gradients are summed, which is not what one device does with the whole "
                "batch's gradient. Build the model as kd.Model / kd.Sequential (or put "
                "kd.DistributedModelMixin first in its bases); in your own loop, "
                "kd.exact_optimizer(optimizer)."
            )
    if _is_own_code(_defining_module(model, "train_step")):
        if kd_model:
            what = ("kd reads a loss it did not compute from its graph (a mean or a sum of "
                    "per-row terms is exact; where rows meet, kd computes on the global batch); "
                    "one through ops it cannot follow is taken as a mean over the replica's "
                    "rows, which it may not be")
            advice = "call self.compute_loss(...) or kd.losses.global_mean, which kd makes exact"
        else:
            what = ("a loss averaged over the replica's own rows (e.g. tf.reduce_mean) is a "
                    "per-replica mean, wrong whenever the replicas' rows differ from the "
                    "global batch")
            advice = "use kd.DistributedModelMixin and self.compute_loss(...)"
        causes.append(f"a custom reduction in {type(model).__name__}.train_step: {what}; {advice}.")
    loss = getattr(model, "loss", None)
    loss_module = getattr(loss, "__module__", None) or getattr(type(loss), "__module__", "")
    if loss is not None and not isinstance(loss, (str, dict, list, tuple)) and _is_own_code(loss_module):
        name = getattr(loss, "__name__", None) or getattr(loss, "name", None) or type(loss).__name__
        causes.append(
            f"a custom loss ({name}): if it reduces over the batch itself (returns a scalar, "
            "e.g. with tf.reduce_mean), each replica averages over its own rows. Return one "
            "loss per example and let Keras reduce it (reduction='sum_over_batch_size')."
        )
    if not causes:
        causes.append(
            "no usual suspect found in the model: look for a value reduced over a replica's "
            "own rows (a loss, a metric, an add_loss term or a layer computing batch "
            "statistics), or state that differs between replicas"
            + (" (the first step already differs)" if first_step == 1 else "")
            + "."
        )
    return causes


def _step_text(step, steps_per_epoch, rows, batch_size, replicas):
    epoch, batch = divmod(step - 1, steps_per_epoch)
    text = f"step {step} (epoch {epoch + 1}, batch {batch + 1} of {steps_per_epoch}"
    if rows is None:  # a dataset: its batches' sizes are its own
        return text + ")"
    batch_rows = min(batch_size, rows - batch * batch_size)
    if batch_rows < batch_size:
        split = data_lib.replica_split(batch_rows, replicas)
        text += (f"; the uneven last batch: {batch_rows} row{'s' * (batch_rows != 1)}, split "
                 f"{split} over the {replicas} replicas")
    return text + ")"


class _Mismatch(AssertionError):
    """A difference beyond the tolerance: the message, and its size."""

    def __init__(self, message, gap):
        super().__init__(message)
        self.gap = gap


def _compare(label, reference, candidate, *, names, shapes, tolerance, model, replicas,
             steps_per_epoch, rows, batch_size, compare_history):
    """Raises an AssertionError describing the first difference; returns the largest one."""
    steps = sorted(reference["weights"])
    missing = [s for s in steps if s not in candidate["weights"]]
    if missing:
        raise AssertionError(
            f"kd.testing.assert_parity: under {label}, training stopped before step "
            f"{missing[0]} of {steps[-1]} (one device ran them all)."
        )
    largest, matched = 0.0, 0.0
    for step in steps:
        gaps = [_relative(a, b) for a, b in zip(reference["weights"][step], candidate["weights"][step])]
        worst = max(gaps, default=0.0)
        if worst <= tolerance:
            largest = max(largest, worst)
            matched = largest
            continue
        first = next(i for i, gap in enumerate(gaps) if gap > tolerance)
        top = int(np.argmax(gaps))
        uneven = rows is not None and (
            min(batch_size, rows - ((step - 1) % steps_per_epoch) * batch_size) < batch_size)
        causes = _likely_causes(model, replicas=replicas, uneven=uneven, first_step=step,
                                variable_name=names[first])
        lines = [
            f"kd.testing.assert_parity: {label} does not train like one device.",
            f"  first mismatch: {_step_text(step, steps_per_epoch, rows, batch_size, replicas)}",
            f"  first variable: {names[first]} {tuple(shapes[first])}: max |a - b| / (1 + |a|) = "
            f"{gaps[first]:.3g} (tolerance {tolerance:g}; a = one device)",
        ]
        if top != first:
            lines.append(f"  largest at that step: {names[top]} {tuple(shapes[top])}: {gaps[top]:.3g}")
        lines.append(f"  steps before it: {f'1-{step - 1} match (largest difference {matched:.2g})' if step > 1 else 'none'}")
        lines.append(f"  likely cause: {causes[0]}")
        lines.extend(f"  also possible: {cause}" for cause in causes[1:])
        raise _Mismatch("\n".join(lines), gaps[top])
    if compare_history:
        for key, expected in reference["history"].items():
            got = candidate["history"].get(key)
            if got is None:
                raise AssertionError(
                    f"kd.testing.assert_parity: under {label}, fit reported no `{key}` "
                    f"(one device did)."
                )
            for epoch, (a, b) in enumerate(zip(expected, got), start=1):
                gap = _relative(a, b)
                if gap > tolerance:
                    raise _Mismatch(
                        f"kd.testing.assert_parity: {label} trains the same weights as one device "
                        f"(largest difference {largest:.2g}), but reports `{key}`={b:.6g} for epoch "
                        f"{epoch} where one device reports {a:.6g} (difference {gap:.3g}).\n"
                        "  likely cause: a loss or metric reduced per replica (plain Keras averages "
                        "each replica's result, and under CentralStorageStrategy counts them twice). "
                        "kd models report the global values.", gap,
                    )
                largest = max(largest, gap)
    return largest


# ---------------------------------------------------------------------------
# assert_parity.


def _check_arguments(model_fn, data, strategies_, steps, path, batch_size, replicas):
    problems = []
    if not callable(model_fn):
        problems.append(f"`model_fn`={model_fn!r} is not callable: pass a function that builds "
                        "and compiles the model")
    if path not in _PATHS:
        problems.append(f"`path`={path!r}: expected one of {list(_PATHS)}")
    for kind in strategies_:
        if not isinstance(kind, tf.distribute.Strategy) and kind not in STRATEGIES:
            problems.append(f"`strategies` item {kind!r}: expected one of {list(STRATEGIES)} or a "
                            "tf.distribute.Strategy")
    if steps is not None and not validation.is_whole(steps, 1):
        problems.append(f"`steps`={steps!r}: expected a whole number >= 1, or None (one epoch)")
    if not validation.is_whole(batch_size, 1):
        problems.append(f"`batch_size`={batch_size!r}: expected a whole number >= 1 (the global batch)")
    if not validation.is_whole(replicas, 1):
        problems.append(f"`replicas`={replicas!r}: expected a whole number >= 1")
    if isinstance(data, tf.data.Dataset):
        cluster = [k for k in strategies_ if not isinstance(k, tf.distribute.Strategy) and k in _IN_CLUSTER]
        if cluster:
            problems.append(f"`data` is a tf.data.Dataset, which cannot reach the processes of "
                            f"{cluster}: pass a `dataset_fn(input_context)` defined at module level "
                            "of a .py file instead")
    elif callable(data) and not isinstance(data, (tuple, list)):
        if "parameter_server" in strategies_:
            problems.append("`data` is a dataset_fn and `strategies` names 'parameter_server', "
                            "which compares on NumPy data only: pass (x, y) arrays for it")
    elif not isinstance(data, (tuple, list)) or len(data) not in (2, 3):
        problems.append(f"`data` is a {type(data).__name__}: expected (x, y) or (x, y, sample_weight) "
                        "as NumPy arrays (x and y may be dicts or lists of arrays), a batched "
                        "tf.data.Dataset, or a dataset_fn(input_context)")
    if problems:
        raise ValueError("kd.testing.assert_parity: invalid arguments:\n  - " + "\n  - ".join(problems))


def _dataset_steps(dataset):
    """Batches in one pass of `dataset`; a clear error when it is unknown or endless."""
    if not isinstance(dataset, tf.data.Dataset):
        raise ValueError(
            f"`data`: the dataset_fn returned a {type(dataset).__name__}; expected a batched "
            "tf.data.Dataset (the global batches, for one input pipeline)."
        )
    count = int(dataset.cardinality())
    if count < 0:
        count = sum(1 for _ in dataset)  # unknown cardinality (e.g. filter): count once
    if count == 0 or dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            f"`data`: the dataset has {'no' if count == 0 else 'endless'} batches; expected a "
            "finite, batched tf.data.Dataset (use .take(n) on a repeated one)."
        )
    return count


def _label(kind, replicas, path):
    if isinstance(kind, tf.distribute.Strategy):
        return f"{type(kind).__name__} ({kind.num_replicas_in_sync} replicas, {path})"
    count = {"one_device": 1, "multi_worker": 2, "parameter_server": 1}.get(kind, replicas)
    where = {"multi_worker": "2 worker processes", "parameter_server": "1 worker, 1 ps"}.get(
        kind, f"{count} replica{'s' * (count != 1)}")
    return f"{kind} ({where}, {path})"


def assert_parity(model_fn, data, *, strategies=None, steps=None, path="fit", batch_size=32,
                  replicas=2, tolerance=None, seed=0, timeout=300):
    """Asserts that `model_fn`'s model trains under each strategy as on one device.

    Trains on one CPU device (the reference) and under each strategy, from
    the same initial weights and on the same global batches in the same
    order, and compares every weight (BatchNormalization's moving statistics
    and the state layers keep, such as counters, included) after every step,
    then the loss and metrics `fit` reports. A mismatch in layer state names
    the layer and the variable.
    Give it data whose row count is not a multiple of `batch_size`: the
    uneven last batch (some replicas get few rows, or none) is where
    per-replica arithmetic shows.

    Args:
        model_fn: A function without arguments that builds, compiles and
            returns a `keras.Model`. It is called inside each strategy's
            scope (after `keras.utils.set_random_seed(seed)`). For
            `"multi_worker"` and `"parameter_server"` it must be importable:
            a function at module level of a .py file.
        data: `(x, y)` or `(x, y, sample_weight)`: NumPy arrays (x and y may
            be dicts or lists of arrays), fed in order (no shuffling) in
            batches of `batch_size`; or a finite `tf.data.Dataset` of global
            batches (in this process only); or a `dataset_fn(input_context)`,
            called for one input pipeline in every run, so every run trains
            on the same global batches (module level of a .py file for
            `"multi_worker"`; not for `"parameter_server"`).
        strategies: Names from `STRATEGIES` (`"one_device"`, `"mirrored"`,
            `"central_storage"`, `"multi_worker"`, `"parameter_server"`) or
            `tf.distribute.Strategy` objects of this process; `["mirrored"]`
            when `None`.
        steps: Training steps to compare; one epoch when `None`. More than
            one epoch's steps train several epochs.
        path: `"fit"` (`model.fit`) or `"loop"` (`kd.TrainLoop(model).fit`;
            kd models only). The reference always uses one-device `fit`.
        batch_size: The global batch size.
        replicas: Replicas of `"mirrored"` and `"central_storage"`.
        tolerance: Largest allowed max |a - b| / (1 + |a|); 2e-5 (float32
            round-off), or 5e-3 for a mixed-precision model, when `None`.
            A float32 difference above it is checked again in float64
            (both runs, from the same initial weights): if float64 matches
            to 1e-9, the difference was round-off
            (an optimizer such as Adam magnifies the last bits of a
            near-zero gradient), and the strategy passes with a warning.
        seed: Passed to `keras.utils.set_random_seed` before each build.
        timeout: Seconds for each strategy that runs in other processes.

    Returns:
        A dict: for each strategy's label, the largest difference found
        (in float64 where the float64 re-check decided).

    Raises:
        AssertionError: a strategy trains differently. The message names
            the first step and the first variable that differ, the size of
            the difference, the likely cause and what the float64 re-check
            found; also when training fails under a strategy but not on one
            device (with the whole error, TensorFlow's included).
        ValueError: invalid arguments (each one listed).
        RuntimeError: a strategy needs more logical CPU devices than this
            process can still have (the message says how to split them).

    Example:
        >>> import keras, numpy as np, keras_distrib as kd
        >>> def model_fn():
        ...     inputs = keras.Input((4,))
        ...     model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
        ...     model.compile(optimizer=keras.optimizers.SGD(0.1, clipnorm=0.5), loss="mse")
        ...     return model
        >>> x = np.random.default_rng(0).normal(size=(33, 4)).astype("float32")
        >>> kd.testing.assert_parity(model_fn, (x, x[:, :1]), batch_size=16, strategies=["one_device"])
        {'one_device (1 replica, fit)': ...}

        The default, `strategies=["mirrored"]`, needs 2 logical CPU devices
        (see the module docstring); `"multi_worker"` needs `model_fn` in a
        .py file.
    """
    if strategies is None:
        strategies_ = ["mirrored"]
    elif isinstance(strategies, (str, tf.distribute.Strategy)):
        strategies_ = [strategies]
    else:
        strategies_ = list(strategies)
    _check_arguments(model_fn, data, strategies_, steps, path, batch_size, replicas)
    if _is_dataset_source(data):
        arrays = data
        x = _dataset_of(data)
        rows, steps_per_epoch = None, _dataset_steps(x)
    else:
        x, y, sample_weight = (tuple(data) + (None,))[:3]
        rows = len(_first_input(x))
        steps_per_epoch = math.ceil(rows / batch_size)
        arrays = (x, y, sample_weight)
    steps = steps or steps_per_epoch

    if any(not isinstance(k, tf.distribute.Strategy) and k in ("mirrored", "central_storage")
           for k in strategies_):
        _cpu_devices(replicas)  # before the reference touches TensorFlow's devices
    with tf.device("/CPU:0"):
        reference_model = _make_model(model_fn, seed, x)
        if path == "loop" and not isinstance(reference_model, models.DistributedModelMixin):
            raise ValueError(
                f"`path`='loop' trains with kd.TrainLoop, which takes kd models only, and "
                f"`model_fn` returned a plain {type(reference_model).__name__}. Build a kd.Model "
                "/ kd.Sequential, or use path='fit'."
            )
        initial = [np.array(w) for w in reference_model.get_weights()]
        reference = _train(reference_model, arrays, batch_size=batch_size, steps=steps,
                           path="fit", per_epoch=False)
    names = [getattr(v, "path", v.name) for v in reference_model.weights]
    shapes = [tuple(w.shape) for w in initial]
    if tolerance is None:
        policy = getattr(getattr(reference_model, "dtype_policy", None), "name", "")
        tolerance = _FLOAT16_TOLERANCE if "16" in policy else _FLOAT32_TOLERANCE

    def train_under(kind, arrays, initial, floatx="float32"):
        label = _label(kind, replicas, path)
        try:
            if not isinstance(kind, tf.distribute.Strategy) and kind in _IN_CLUSTER:
                shipped = arrays
                if callable(arrays) and not isinstance(arrays, tuple):
                    shipped = (_task_entry().function_spec(arrays),)
                return _train_in_cluster(kind, model_fn, shipped, initial, batch_size=batch_size,
                                         steps=steps, path=path, seed=seed, timeout=timeout,
                                         floatx=floatx)
            strategy = kind if isinstance(kind, tf.distribute.Strategy) else local_strategy(
                kind, replicas=replicas)
            build_from = _dataset_of(arrays) if _is_dataset_source(arrays) else arrays[0]
            with strategy.scope():
                model = _make_model(model_fn, seed, build_from, initial)
            return _train(model, arrays, batch_size=batch_size, steps=steps, path=path,
                          per_epoch=False)
        except ClusterError as error:
            raise AssertionError(
                f"kd.testing.assert_parity: training under {label} failed (on one device it "
                f"runs): {error.summary}\n  the whole error:\n{textwrap.indent(str(error), '    ')}"
            ) from error
        except AssertionError:
            raise
        except Exception as error:
            raise AssertionError(
                f"kd.testing.assert_parity: training under {label} failed (on one device it "
                f"runs): {report.error_line(error)}\n  the whole error:\n"
                + textwrap.indent(report.error_text(error), "    ")
            ) from error

    def compare(kind, reference, candidate, tolerance):
        count = (kind.num_replicas_in_sync if isinstance(kind, tf.distribute.Strategy)
                 else {"one_device": 1, "multi_worker": 2, "parameter_server": 1}.get(kind, replicas))
        return _compare(
            _label(kind, replicas, path), reference, candidate, names=names, shapes=shapes,
            tolerance=tolerance, model=reference_model, replicas=count,
            steps_per_epoch=steps_per_epoch, rows=rows, batch_size=batch_size,
            compare_history=kind != "parameter_server",
        )

    results = {}
    for kind in strategies_:
        candidate = train_under(kind, arrays, initial)
        try:
            results[_label(kind, replicas, path)] = compare(kind, reference, candidate, tolerance)
        except _Mismatch as mismatch:
            if tolerance >= _FLOAT16_TOLERANCE or _is_dataset_source(arrays):
                # Mixed precision: float64 would be another model. A dataset
                # holds its own dtypes: only NumPy data is re-run in float64.
                raise
            results[_label(kind, replicas, path)] = _recheck_in_float64(
                mismatch, kind, model_fn, arrays, initial, seed=seed, batch_size=batch_size,
                steps=steps, tolerance=tolerance, train_under=train_under, compare=compare,
            )
    return results


def _in_float64(arrays):
    """`arrays` with every floating NumPy array as float64."""
    def cast(value):
        value = np.asarray(value) if value is not None else None
        if value is not None and np.issubdtype(value.dtype, np.floating):
            return value.astype("float64")
        return value
    return tuple(tree.map_structure(cast, part) if part is not None else None for part in arrays)


def _recheck_in_float64(mismatch, kind, model_fn, arrays, initial, *, seed, batch_size, steps,
                        tolerance, train_under, compare):
    """Tells float32 round-off from a real difference: both runs again in float64.

    An exact model matches one device to about 1e-12 in float64, while a
    real difference (a per-replica mean, unsynchronized statistics) stays
    the size it was. Returns the float64 difference when it is round-off
    (and warns with the float32 one); raises the float32 report, with what
    float64 showed, when it is not.
    """
    previous = keras.config.floatx(), keras.config.dtype_policy()
    # Keras fixes its global dtype policy at first use: set_floatx alone
    # would leave new layers in float32.
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        wide = _in_float64(arrays)
        initial64 = [np.asarray(w, dtype="float64") if np.issubdtype(np.asarray(w).dtype, np.floating)
                     else w for w in initial]
        with tf.device("/CPU:0"):
            reference_model = _make_model(model_fn, seed, wide[0], initial64)
            narrow = sorted({v.path for v in reference_model.weights
                             if np.issubdtype(np.dtype(v.dtype), np.floating) and v.dtype != "float64"})
            if narrow:
                raise TypeError(f"variables stay in lower precision: {narrow[:3]} (a layer's "
                                "`dtype` or a dtype policy fixes them)")
            reference = _train(reference_model, wide, batch_size=batch_size, steps=steps,
                               path="fit", per_epoch=False)
        candidate = train_under(kind, wide, initial64, floatx="float64")
        gap64 = compare(kind, reference, candidate, min(tolerance, _FLOAT64_TOLERANCE))
    except _Mismatch as real:
        raise AssertionError(
            f"{mismatch}\n  float64 re-check: the same training in float64 still differs by "
            f"{real.gap:.3g} (an exact model matches to about 1e-12): a real difference, not "
            "round-off."
        ) from None
    except Exception as error:  # the model cannot run in float64: keep the float32 verdict
        raise AssertionError(
            f"{mismatch}\n  float64 re-check: not possible ({report.error_line(error)}), so "
            "this may still be float32 round-off."
        ) from None
    finally:
        keras.config.set_floatx(previous[0])
        keras.config.set_dtype_policy(previous[1])
    warnings.warn(
        f"kd.testing.assert_parity: {_label_of(mismatch)}: float32 differs from one device by "
        f"{mismatch.gap:.3g} (tolerance {tolerance:g}), and the same training in float64 "
        f"matches to {gap64:.3g}: float32 round-off (magnified by the optimizer, e.g. Adam on "
        "near-zero gradients), not a difference in the arithmetic.",
        stacklevel=3,
    )
    return gap64


def _label_of(mismatch):
    first = str(mismatch).splitlines()[0]
    return first.removeprefix("kd.testing.assert_parity: ").split(" does not train")[0].split(
        " trains the same")[0]


def _train_in_cluster(kind, model_fn, arrays, initial, *, batch_size, steps, path, seed, timeout,
                      floatx="float32"):
    """Trains under `kind` in other processes; returns the chief's snapshots."""
    spec = _task_entry().function_spec(model_fn)
    folder = tempfile.mkdtemp(prefix="kd_parity_")
    try:
        payload_path = os.path.join(folder, "payload.pkl")
        with open(payload_path, "wb") as f:
            pickle.dump({
                "model_fn": spec, "arrays": arrays, "initial_weights": initial, "seed": seed,
                "batch_size": batch_size, "steps": steps, "path": path,
                "per_epoch": kind == "parameter_server", "floatx": floatx,
            }, f)
        # One worker under a parameter server: several would each read their
        # own copy of the data, at their own pace (not one device's order).
        values = run_in_cluster(_parity_task, payload_path, kind=kind,
                                workers=2 if kind == "multi_worker" else 1, timeout=timeout)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return values["worker 0"] if kind == "multi_worker" else values


# ---------------------------------------------------------------------------
# pytest plugin: options, device split, fixtures.


def _fixture(**options):
    """`pytest.fixture(**options)` when pytest runs; the plain function otherwise."""
    pytest = sys.modules.get("pytest")
    if pytest is None:
        return lambda function: function
    return pytest.fixture(**options)


def pytest_addoption(parser):
    group = parser.getgroup("keras_distrib")
    group.addoption(
        "--kd-devices", type=int, default=None,
        help=f"logical CPU devices keras_distrib.testing splits the CPU into (default {_DEFAULT_DEVICES})",
    )
    parser.addini("kd_devices", f"logical CPU devices for kd.testing (default {_DEFAULT_DEVICES})",
                  default=str(_DEFAULT_DEVICES))


def _requested_devices(config):
    try:
        option = config.getoption("kd_devices")
    except ValueError:  # loaded from a conftest.py below the root: no options
        option = None
    if option is not None:
        return option
    try:
        return int(config.getini("kd_devices"))
    except (ValueError, TypeError):
        return _DEFAULT_DEVICES


def pytest_configure(config):
    """Splits the CPU into logical devices before any test touches TensorFlow."""
    import pytest

    count = _requested_devices(config)
    if count < 1:
        raise pytest.UsageError(f"--kd-devices={count}: expected 1 or more logical CPU devices.")
    if count > 1:
        try:
            devices.virtual_devices(count)
        except RuntimeError as error:
            raise pytest.UsageError(
                f"keras_distrib.testing could not split the CPU into {count} devices: {error} "
                "(Something created a tensor before the plugin loaded: load it with `-p "
                "keras_distrib.testing`, or pass --kd-devices 1 to keep one device.)"
            ) from None


@_fixture()
def kd_one_device():
    """A `OneDeviceStrategy` on the first CPU."""
    return local_strategy("one_device")


@_fixture()
def kd_mirrored():
    """A `MirroredStrategy` on 2 logical CPU devices."""
    return local_strategy("mirrored")


@_fixture()
def kd_central_storage():
    """A `CentralStorageStrategy` on 2 logical CPU devices."""
    return local_strategy("central_storage")


@_fixture(params=IN_PROCESS)
def kd_strategy(request):
    """Each in-process strategy in turn: one device, mirrored, central storage.

    Args:
        request: pytest's fixture request (its `param` is the strategy's name).
    """
    return local_strategy(request.param)


@_fixture()
def kd_multi_worker():
    """`run(fn, *args)`: `fn(strategy, *args)` on 2 worker processes; {task: value}."""
    return lambda fn, *args, **options: run_in_cluster(fn, *args, kind="multi_worker", **options)


@_fixture()
def kd_parameter_server():
    """`run(fn, *args)`: `fn(strategy, *args)` in a coordinator process with its own cluster."""
    return lambda fn, *args, workers=1, **options: run_in_cluster(
        fn, *args, kind="parameter_server", workers=workers, **options
    )
