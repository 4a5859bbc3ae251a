"""`keras-distrib test`: a one-minute check that distributed training works here.

Like `accelerate test`: it runs the pieces kd relies on, end to end, and
prints a pass/fail table (exit code 1 if any check fails):

- devices: what TensorFlow finds (CPU, GPUs, TPU);
- an all-reduce over 2 replicas in this process (MirroredStrategy);
- training under mirrored against one device (`kd.testing.assert_parity`,
  an uneven last batch with an empty replica);
- on 2 worker processes on localhost (MultiWorkerMirroredStrategy over
  gRPC, started by `kd.launch`): a collective all-reduce, the same training
  against one device, data sharding (every example seen exactly once, summed
  over the workers with a collective) and a chief-only checkpoint write,
  in the most private network this machine allows (`--network`); where no
  private network can be made, one skipped row says why and which command
  runs them.

`keras-distrib test --gpu` checks the GPU path instead, in this process,
in a few minutes: one GPU split into 2 logical GPUs (or the first 2 GPUs
of a machine that has several), an NCCL all-reduce, and kd's training
against plain Keras on one GPU in float32 (NCCL), `mixed_float16` and
`jit_compile=True` (XLA compiles kd's whole step on GPUs). TensorFloat-32
is turned off, so float32 compares to float32 round-off. NCCL needs a GPU
per replica: where it refuses 2 logical GPUs of one card, its row says so
(SKIP) and the training rows all-reduce as TensorFlow does there (RING
collectives). Without a GPU it says so and exits 2.

Run inside a real cluster (TF_CONFIG names several workers, one
`keras-distrib test` per task), the worker checks run on that cluster
instead of a local one, and every task prints its own table. Everything
trains on CPUs: the training checks compare float32 arithmetic, which GPUs
(TF32, unordered reductions) do not reproduce bit for bit.
"""

import dataclasses
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np

__all__ = [
    "Check",
    "cluster_checks",
    "gpu_checks",
    "launched_checks",
    "local_checks",
    "main",
    "print_table",
]

ROWS = 33  # global batch 16: the last batch has 1 row, so one replica of 2 is empty
GLOBAL_BATCH = 16
EPOCHS = 2
TOLERANCE = 2e-5
FLOAT16_TOLERANCE = 5e-3
CLUSTER_TIMEOUT = 120
# Exit code of `--gpu` where TensorFlow finds no GPU.
NO_GPU = 2


@dataclasses.dataclass
class Check:
    """One row of the table."""

    name: str
    ok: bool
    detail: str
    seconds: float = 0.0
    skipped: bool = False  # not run here (the detail says why); not a failure


def _run(name, function):
    """Runs `function() -> detail`; a raised exception fails the check."""
    from keras_distrib import report

    started = time.monotonic()
    try:
        detail, ok = function(), True
    except Exception as error:  # a failed check is a row, not a crash
        detail, ok = report.error_line(error), False
    return Check(name, ok, detail, time.monotonic() - started)


class _Failed(Exception):
    """A check's expectation was not met (its message is the table's detail)."""


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1)) + 0.1 * rng.normal(size=(ROWS, 1))).astype("float32")
    return x, y


def _model(model_class=None):
    """A small regression model with gradient clipping (what plain Keras gets wrong)."""
    import keras

    import keras_distrib as kd

    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = (model_class or kd.Model)(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9, clipnorm=0.5),
                  loss="mse", metrics=["mae"])
    return model


# ---------------------------------------------------------------------------
# Checks in this process.


def _devices():
    import tensorflow as tf

    from keras_distrib import tf_logs

    with tf_logs.hidden_notices():
        found = {kind: tf.config.list_physical_devices(kind) for kind in ("CPU", "GPU", "TPU")}
    if not found["CPU"]:
        raise _Failed("TensorFlow finds no CPU device")
    logical = len(tf.config.get_logical_device_configuration(found["CPU"][0]) or [None])
    parts = [f"CPU ({logical} logical device{'s' * (logical != 1)})"]
    parts.append(f"{len(found['GPU'])} GPU" if found["GPU"] else "no GPU")
    parts.append(f"{len(found['TPU'])} TPU" if found["TPU"] else "no TPU")
    return ", ".join(parts)


def _all_reduce(strategy):
    """Each replica sends replica_id + 1; every replica must get the sum."""
    import tensorflow as tf

    replicas = strategy.num_replicas_in_sync

    def replica_step():
        context = tf.distribute.get_replica_context()
        value = tf.cast(context.replica_id_in_sync_group, tf.float32) + 1.0
        return context.all_reduce(tf.distribute.ReduceOp.SUM, value)

    # Compiled, as collectives are meant to run (eagerly TensorFlow warns).
    summed = tf.function(lambda: strategy.run(replica_step))()
    expected = replicas * (replicas + 1) / 2
    got = [float(v) for v in strategy.experimental_local_results(summed)]
    if any(v != expected for v in got):
        raise _Failed(f"expected {expected:g} on every replica, got {got}")
    terms = " + ".join(str(i + 1) for i in range(replicas))
    return f"{terms} = {expected:g} on every replica"


def _mirrored_parity():
    from keras_distrib import testing

    x, y = _data()
    results = testing.assert_parity(_model, (x, y), strategies=["mirrored"], batch_size=GLOBAL_BATCH,
                                    steps=EPOCHS * -(-ROWS // GLOBAL_BATCH))
    (difference,) = results.values()
    return (f"{ROWS} rows, last batch 1 row (a replica empty), clipnorm: "
            f"max difference {difference:.1e}")


def local_checks():
    """The checks that run in this process (it must not have started TensorFlow's devices)."""
    import keras_distrib as kd
    from keras_distrib import testing

    try:
        kd.virtual_devices(2)
    except RuntimeError as error:
        return [Check("2 logical CPU devices", False, str(error))]
    checks = [_run("devices", _devices)]
    strategy = testing.local_strategy("mirrored")
    checks.append(_run("all-reduce, 2 replicas (mirrored)", lambda: _all_reduce(strategy)))
    checks.append(_run("training: mirrored vs one device", _mirrored_parity))
    return checks


# ---------------------------------------------------------------------------
# The GPU path (`keras-distrib test --gpu`).


def _gpu_model(model_class, *, batch_norm=True, jit_compile=False):
    """The training checks' model with a BatchNormalization layer (global statistics in kd)."""
    import keras

    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    if batch_norm:
        hidden = keras.layers.BatchNormalization()(hidden)
    model = model_class(inputs, keras.layers.Dense(1, dtype="float32")(hidden))
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9, clipnorm=0.5)
    if keras.config.dtype_policy().compute_dtype == "float16":
        # A loss scale at which no float16 gradient overflows: where the
        # global batch's would and a replica's would not, one device skips
        # a step that the replicas take (README, "Exactness").
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=256.0)
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"], jit_compile=jit_compile)
    return model


def _against_one_device(strategy, reference_device, *, policy="float32", batch_norm=True,
                        jit_compile=False):
    """Trains plain Keras on `reference_device` and kd under `strategy`; compares the weights."""
    import keras
    import tensorflow as tf

    import keras_distrib as kd

    x, y = _data()
    tolerance = FLOAT16_TOLERANCE if "16" in policy else TOLERANCE
    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        with tf.device(reference_device):
            reference = _gpu_model(keras.Model, batch_norm=batch_norm, jit_compile=jit_compile)
            initial = reference.get_weights()
            reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        with strategy.scope():
            model = _gpu_model(kd.Model, batch_norm=batch_norm, jit_compile=jit_compile)
        model.set_weights(initial)
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    finally:
        keras.config.set_dtype_policy(before)
    difference = max(
        float(np.max(np.abs(a - b) / (1 + np.abs(a))))
        for a, b in zip(reference.get_weights(), model.get_weights())
    )
    if not difference <= tolerance:
        raise _Failed(f"weights differ from one device by {difference:.2e} (tolerance {tolerance:g})")
    return (f"{EPOCHS} epochs of {ROWS} rows, last batch 1 row (a replica empty): "
            f"max difference {difference:.1e} (tolerance {tolerance:g})")


def _gpu_devices(device_type):
    """Splits the device into 2 logical ones (unless there are 2 GPUs); returns (names, description)."""
    import tensorflow as tf

    import keras_distrib as kd
    from keras_distrib import tf_logs

    with tf_logs.hidden_notices():
        physical = tf.config.list_physical_devices(device_type)
    if device_type == "CPU":
        return kd.virtual_devices(2, "CPU"), (
            "no GPU: the GPU path's logic on 2 logical CPU devices (a stand-in; run "
            "`keras-distrib test --gpu` on a GPU machine for the real thing)")
    details = tf.config.experimental.get_device_details(physical[0])
    name = details.get("device_name", "GPU")
    capability = details.get("compute_capability")
    card = name + (f", compute capability {capability[0]}.{capability[1]}" if capability else "")
    if len(physical) >= 2:
        tf.config.set_visible_devices(physical[:2], "GPU")
        return [f"/device:GPU:{i}" for i in range(2)], f"{len(physical)} GPUs ({card}): using 2"
    devices = kd.virtual_devices(2, "GPU")
    return devices, f"1 GPU ({card}), split into 2 logical GPUs"


def _nccl_refused_on_one_card(error, devices_on_one_card):
    return devices_on_one_card and ("nccl" in str(error).lower() or "duplicate gpu" in str(error).lower())


def gpu_checks(device_type="GPU"):
    """The GPU path's checks, in this process (it must not have started TensorFlow's devices).

    `device_type="CPU"` runs the same logic on 2 logical CPU devices, where
    NCCL does not exist: its row runs TensorFlow's RING collectives instead
    and says so, and `jit_compile=True` trains a model without
    BatchNormalization (kd refuses that layer with XLA on CPU replicas).
    """
    import tensorflow as tf

    import keras_distrib as kd

    on_gpu = device_type == "GPU"
    # TensorFloat-32 rounds float32 matmuls to 10 bits: not float32 round-off.
    tf.config.experimental.enable_tensor_float_32_execution(False)
    started = time.monotonic()
    try:
        devices, description = _gpu_devices(device_type)
    except (RuntimeError, ValueError) as error:
        return [Check("2 devices", False, str(error), time.monotonic() - started)]
    checks = [Check("devices", True, description, time.monotonic() - started)]
    one_card = on_gpu and "split" in description
    strategy, collective = None, "RING"
    if on_gpu:
        started = time.monotonic()
        name = "all-reduce, 2 GPU replicas (NCCL)"
        try:
            nccl = kd.make_strategy("mirrored", devices=devices, cross_device_ops="nccl")
            detail = _all_reduce(nccl)
            strategy, collective = nccl, "NCCL"
            checks.append(Check(name, True, detail, time.monotonic() - started))
        except Exception as error:  # a failed check is a row, not a crash
            from keras_distrib import report

            seconds = time.monotonic() - started
            if _nccl_refused_on_one_card(error, one_card):
                checks.append(Check(
                    name, True,
                    "NCCL refused 2 logical GPUs of one card (it needs a GPU per replica): "
                    f"{report.error_line(error)}. The rows below all-reduce as "
                    "TensorFlow does on logical GPUs (RING collectives); run on 2 GPUs to check NCCL.",
                    seconds, skipped=True))
            else:
                checks.append(Check(name, False, report.error_line(error), seconds))
                collective = "TensorFlow's choice"
    if strategy is None:
        strategy = kd.make_strategy("mirrored", devices=devices)
        if not on_gpu:
            checks.append(_run("all-reduce, 2 replicas (RING, NCCL's stand-in on CPU)",
                               lambda: _all_reduce(strategy) + "; NCCL all-reduces GPU memory only"))
    reference = devices[0]
    unit = "GPU" if on_gpu else "device"
    checks.append(_run(f"training: float32, {collective} vs one {unit}",
                       lambda: _against_one_device(strategy, reference)))
    checks.append(_run(f"training: mixed_float16 vs one {unit}",
                       lambda: _against_one_device(strategy, reference, policy="mixed_float16")))
    jit_name = f"training: jit_compile=True vs one {unit}"
    if on_gpu:
        checks.append(_run(jit_name, lambda: _against_one_device(strategy, reference, jit_compile=True)))
    else:
        checks.append(_run(jit_name, lambda: _against_one_device(
            strategy, reference, batch_norm=False, jit_compile=True)
            + "; on CPU without BatchNormalization, which kd refuses with XLA on CPU replicas"))
    return checks


def _gpu_main(say, started, device_type):
    import tensorflow as tf

    from keras_distrib import tf_logs

    if device_type == "GPU":
        with tf_logs.hidden_notices():
            gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            built = "with" if tf.test.is_built_with_cuda() else "without"
            say(f"keras-distrib test --gpu: TensorFlow finds no GPU here{hint}; this TensorFlow is "
                f"built {built} CUDA. Run it on a machine with a GPU (`pip install "
                "\"tensorflow[and-cuda]\"` on Linux), or `keras-distrib test` for the CPU checks.")
            return NO_GPU
    say(f"checking the GPU path ({'on 2 logical CPU devices' if device_type == 'CPU' else 'on GPUs'})...")
    checks = gpu_checks(device_type)
    say()
    print_table(checks, time.monotonic() - started, print_fn=say)
    return 0 if all(check.ok for check in checks) else 1


# ---------------------------------------------------------------------------
# Checks on every worker of a cluster.


def _barrier(strategy):
    """Waits until every worker got here (an all-reduce of nothing much)."""
    _all_reduce(strategy)


def _training(strategy, directory):
    """Trains on the cluster (saving a checkpoint per epoch) and on one device here."""
    import keras
    import tensorflow as tf

    import keras_distrib as kd

    x, y = _data()
    with tf.device("/CPU:0"):
        reference = _model(keras.Model)
        initial = reference.get_weights()
        reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    with strategy.scope():
        model = _model()
    model.set_weights(initial)
    saver = kd.callbacks.ModelCheckpoint(os.path.join(directory, "model-{epoch}.keras"), monitor="loss")
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[saver])
    difference = max(
        float(np.max(np.abs(a - b) / (1 + np.abs(a))))
        for a, b in zip(reference.get_weights(), model.get_weights())
    )
    if not difference <= TOLERANCE:
        raise _Failed(f"weights differ from one device by {difference:.2e} (tolerance {TOLERANCE:g})")
    return f"{EPOCHS} epochs of {ROWS} rows, last batch 1 row: max difference {difference:.1e}"


def _sharding(strategy):
    """Every example of kd.distribute_dataset reaches exactly one replica, once."""
    import tensorflow as tf

    import keras_distrib as kd

    rows = 37
    local = strategy.extended.worker_devices
    counts = [np.zeros(rows, "float32") for _ in local]
    dataset = kd.distribute_dataset(np.arange(rows), strategy=strategy,
                                    global_batch_size=4 * strategy.num_replicas_in_sync)
    for batch in dataset:
        for i, ids in enumerate(strategy.experimental_local_results(batch)):
            np.add.at(counts[i], ids.numpy(), 1.0)
    first = kd.cluster_info().task_index * len(local) if kd.cluster_info().num_workers > 1 else 0
    values = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(counts[context.replica_id_in_sync_group - first])
    )
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None).numpy()
    missing = int(np.sum(total == 0))
    repeated = int(np.sum(total > 1))
    if missing or repeated:
        raise _Failed(f"{rows} examples: {missing} never seen, {repeated} seen more than once")
    return f"{rows} examples over {strategy.num_replicas_in_sync} replicas: each seen exactly once"


def _checkpoints(strategy, directory, scratch_before):
    import keras_distrib as kd
    from keras_distrib import files

    info = kd.cluster_info()
    _barrier(strategy)  # the chief's last file is in place before anyone looks
    expected = sorted(f"model-{epoch}.keras" for epoch in range(1, EPOCHS + 1))
    found = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    # A worker that is not the chief writes into scratch directories of its own.
    prefix = files.own_scratch_prefix()
    leftovers = sorted(
        name for name in os.listdir(tempfile.gettempdir())
        if name.startswith(prefix) and name not in scratch_before
    )
    if leftovers:
        raise _Failed(f"{info.label} left temporary directories: {leftovers}")
    if info.is_chief and found != expected:
        raise _Failed(f"the chief should have written {expected}, found {found}")
    if not info.is_chief and found not in ([], expected):  # [] unless the directory is shared
        raise _Failed(f"{info.label} (not the chief) left {found}")
    if info.is_chief:
        return f"{info.label or 'the chief'} (chief) wrote {', '.join(expected)}"
    return f"{info.label} kept no file"


def cluster_checks(strategy, directory):
    """The checks every worker of a cluster runs; returns a list of `Check`s."""
    import keras_distrib as kd

    scratch_before = set(os.listdir(tempfile.gettempdir()))
    workers = kd.cluster_info().num_workers
    replicas = strategy.num_replicas_in_sync
    checks = [_run(f"all-reduce, {workers} worker processes", lambda: _all_reduce(strategy))]
    checks.append(_run(f"training: {workers} workers vs one device", lambda: _training(strategy, directory)))
    checks.append(_run(f"data sharding, {workers} workers x {replicas // workers} replica",
                       lambda: _sharding(strategy)))
    checks.append(_run("chief-only checkpoint write", lambda: _checkpoints(strategy, directory, scratch_before)))
    return checks


def _cluster_task(directory):
    """What each launched worker runs; returns its checks as dicts."""
    from keras_distrib.cluster import strategies

    strategy = strategies.make_strategy("multi_worker")
    return [dataclasses.asdict(check) for check in cluster_checks(strategy, directory)]


# What each network a launch gets (`ClusterResult.network`) is, in the table.
_NETWORKS = {"private": "a private network with a route out", "offline":
             "a private network without a route out", "open": "this host's network, ports open"}


def launched_checks(workers=2, verbose=False, timeout=CLUSTER_TIMEOUT, network="auto"):
    """`cluster_checks` on `workers` local processes; one merged row per check.

    `network` is the `--network` they run in (`requests.NETWORK_OPTIONS`);
    where it cannot be met, one skipped row says why and which command runs
    them.
    """
    from keras_distrib.cluster import launcher
    from keras_distrib.cluster import requests
    from keras_distrib import report

    directory = tempfile.mkdtemp(prefix="kd_selftest_")
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPUs: see the module docstring
    env.pop("TF_CONFIG", None)
    lines = []
    started = time.monotonic()
    name = f"start {workers} worker processes"
    try:
        result = launcher.launch(
            _cluster_task, workers=workers, args=(directory,), timeout=timeout, env=env,
            sink=print if verbose else lines.append, verbose=verbose,
            private_network=requests.NETWORK_OPTIONS[network],
        )
    except requests.NoPrivateNetwork as error:
        return [Check(name, True, f"not run: {error.reason}; {error.remedy('keras-distrib test')}",
                      time.monotonic() - started, skipped=True)]
    except launcher.LaunchError as error:
        return [Check(name, False, report.error_line(error), time.monotonic() - started)]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    elapsed = time.monotonic() - started
    if result.returncode != 0 or len(result.values) != workers:
        cause = "timed out" if result.timed_out else f"exit code {result.returncode}"
        errors = [line for line in lines if "Error" in line and "Traceback" not in line]
        detail = report.error_line(errors[-1].split("] ", 1)[-1]) if errors else cause
        return [Check(name, False, f"{cause}: {detail}", elapsed)]
    per_task = [[Check(**row) for row in rows] for _, rows in sorted(result.values.items())]
    labels = sorted(result.values)
    checked = max(sum(row.seconds for row in rows) for rows in per_task)
    merged = [Check(name, True,
                    "kd.launch: a TF_CONFIG each; MultiWorkerMirroredStrategy over gRPC in "
                    + _NETWORKS[result.network], elapsed - checked)]
    for rows in zip(*per_task):
        seconds = max(row.seconds for row in rows)
        failed = [(label, row) for label, row in zip(labels, rows) if not row.ok]
        if failed:
            label, row = failed[0]
            merged.append(Check(row.name, False, f"{label}: {row.detail}", seconds))
        elif rows[0].name.startswith("chief-only"):
            merged.append(Check(rows[0].name, True, "; ".join(row.detail for row in rows), seconds))
        else:
            merged.append(Check(rows[0].name, True, rows[0].detail, seconds))
    return merged


# ---------------------------------------------------------------------------
# The command.


def _versions():
    import keras
    import tensorflow as tf

    import keras_distrib as kd

    return (f"TensorFlow {tf.__version__}, Keras {keras.__version__}, keras_distrib "
            f"{kd.__version__}, Python {platform.python_version()}")


def print_table(checks, seconds, print_fn=print):
    """Prints `checks` as a pass/fail table, then the verdict and the time taken."""
    from keras_distrib import report

    rows = [(c.name, "SKIP" if c.skipped else "PASS" if c.ok else "FAIL", f"{c.seconds:.1f} s", c.detail)
            for c in checks]
    for line in report.table(rows, ("check", "result", "time", "detail"), align=["<", "<", ">", "<"],
                             wrap=shutil.get_terminal_size().columns):
        print_fn(line)
    failed = sum(not c.ok for c in checks)
    skipped = sum(c.skipped for c in checks)
    ran = len(checks) - skipped
    verdict = f"{failed} of {ran} checks FAILED" if failed else f"All {ran} checks passed"
    if skipped:
        verdict += f" ({skipped} skipped)"
    print_fn(f"\n{verdict} in {seconds:.1f} s (TensorFlow's start-up included).")


# How `keras-distrib test` names where the cluster came from (`ClusterInfo.source`).
_SOURCE_NAMES = {"tf_config": "TF_CONFIG", "slurm": "Slurm", "kubernetes": "Kubernetes"}


def main(*, workers=2, verbose=False, timeout=CLUSTER_TIMEOUT, directory=None, gpu=False,
         device_type="GPU", network="auto"):
    """Runs the checks and prints the table; returns the exit code (0: all that ran passed).

    `gpu=True` runs `gpu_checks` instead (exit code 2 without a GPU);
    `device_type="CPU"` runs their logic on CPU devices (the test suite).
    `network`: the local worker processes' `--network`; where it cannot be
    met, their row is skipped, saying why and which command runs them.
    """
    import keras_distrib as kd
    from keras_distrib import tf_logs

    started = tf_logs.STARTED  # when keras_distrib (and TensorFlow) began to import
    info = kd.cluster_info()
    # kd.launch prefixes every line with the task already.
    label = f"[{info.label}] " if info.label and not os.environ.get("KD_TASK") else ""

    def say(text=""):
        for line in text.split("\n"):
            print(label + line if line else line, flush=True)

    say(f"keras-distrib test{' --gpu' if gpu else ''}: {_versions()}")
    if gpu:
        return _gpu_main(say, started, device_type)
    if info.num_workers > 1:
        from keras_distrib.cluster import strategies

        where = _SOURCE_NAMES.get(info.source, info.source)
        say(f"in the cluster of {where}: {info.num_workers} workers; this is {info.label}")
        own_directory = directory is None
        directory = directory or tempfile.mkdtemp(prefix="kd_selftest_")
        try:
            checks = [_run("devices", _devices)]
            checks += cluster_checks(strategies.make_strategy("multi_worker"), directory)
        finally:
            if own_directory:
                shutil.rmtree(directory, ignore_errors=True)
    else:
        say("checking this process...")
        checks = local_checks()
        say(f"checking {workers} worker processes on localhost...")
        checks += launched_checks(workers=workers, verbose=verbose, timeout=timeout, network=network)
    say()
    print_table(checks, time.monotonic() - started, print_fn=say)
    return 0 if all(check.ok for check in checks) else 1
