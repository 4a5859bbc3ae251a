"""`keras-distrib bench --first-step`: the wait before the first training step, kd against Keras 3.

A user's first `fit` traces the step, lets TensorFlow optimize the graph and
runs it; a fresh process has nothing traced yet, so the time from `fit` to
the end of its first step is what every new run (and every test) waits.
Each configuration runs in a fresh process (`--repeats` times, the
configurations taking turns, so a machine that speeds up or slows down
affects all of them alike) and reports the process's CPU seconds and the
wall time from the call of `fit` to the end of its first step (a callback's
`on_train_batch_end`), with global batches of 64 rows.

Frameworks (`--frameworks`):

- `keras_1`, `kd_1`: Keras 3's `keras.Model` and `kd.Model` on one device
  (no strategy);
- `keras`, `kd`: the same mirrored over `--replicas` virtual CPU devices
  (`kd.virtual_devices`, `kd.make_strategy("mirrored")`);
- `kd_bn_per_replica`: `kd` compiled with `batch_norm="per_replica"`
  (no global BatchNormalization statistics: what they cost);
- `kd_unchecked`: `kd` compiled with `first_step_check=False` (no check of
  the first step against one device: what the check costs, the ratio
  "kd / kd unchecked");
- `kd_before` (with `--before PATH`): `kd`, importing keras_distrib from
  another checkout, to compare a change with the code before it.

Models (`--models`): `mlp` and `cnn` (the steps-per-second benchmark's),
`resnetN` (a residual network with N BatchNormalization layers, N = 6b + 3
for b blocks per stage: `resnet9`, `resnet21`, `resnet39`, `resnet75`),
`transformer` (two encoder blocks with dropout) and `hub_bert` (a KerasHub
`BertTextClassifier` on a `BertBackbone` built from its config, no
download; kd's is `kd.DistributedModelMixin` over it).

The table gives medians over the repeats and the ratio kd / Keras 3 (the
median of each round's ratio: the two ran next to each other). With `kd`
among the frameworks it also gives the first-step check's own CPU seconds,
timed inside kd's processes (the checked call less the step it checks), and
their share of the rest of that first step: one round's ratio kd / kd
unchecked moves by about 0.1 either way, the check's own time does not. The depth
curve fits CPU seconds to the number of BatchNormalization layers of the
ResNets (seconds per layer): kd should grow no faster than Keras 3.

`--profile` then runs one more process per model and framework and splits the first step's CPU seconds into parts (see `PARTS`) by
sampling every thread's stack and CPU clock (MirroredStrategy traces each
replica on a thread of its own); a profiler that hooks every call would
slow the Python parts several times more than the rest.
"""

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from keras_distrib.commands import bench
from keras_distrib.commands import bench_network
from keras_distrib import validation

__all__ = [
    "FRAMEWORKS",
    "MODELS",
    "PARTS",
    "batch_norm_layers",
    "depth_curve",
    "main",
    "summarize",
    "task",
]

GLOBAL_BATCH = 64
BATCHES = 2  # the first step is timed; a second keeps the epoch from being all first step
MODELS = ("mlp", "cnn", "resnet9", "resnet21", "resnet39", "transformer", "hub_bert")
FRAMEWORKS = ("keras_1", "kd_1", "keras", "kd", "kd_bn_per_replica", "kd_unchecked", "kd_before")
DEFAULT_FRAMEWORKS = ("keras_1", "kd_1", "keras", "kd")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The profile's parts: (name, where). A sample of a thread's CPU time counts
# in a part when a frame of its stack is one of the part's functions (`dir/file.py:name`,
# `file.py:*`, `dir/*`), once however many match; with `top:`, only its top
# frame counts. Parts overlap (the graph walks run inside the replica step).
PARTS = (
    ("tracing (every function traced)",
     ("tensorflow/python/framework/func_graph.py:func_graph_from_py_func",
      "tensorflow/python/distribute/mirrored_run.py:run")),  # a replica's thread
    ("  step traced per replica (all replicas)",
     ("keras_distrib/training/step.py:replica_step",
      "keras/src/backend/tensorflow/trainer.py:one_step_on_data")),
    ("    forward pass", ("keras/src/layers/layer.py:__call__",)),
    ("    BatchNormalization statistics (forward)",
     ("keras_distrib/training/batch_norm.py:global_moments",
      "keras/src/layers/normalization/batch_normalization.py:_moments")),
    ("    tape.gradient", ("tensorflow/python/eager/backprop.py:gradient",)),
    ("    optimizer.apply", ("keras/src/optimizers/base_optimizer.py:apply_gradients",)),
    ("  kd's graph walks", ("keras_distrib/training/penalties.py:_walk",
                            "keras_distrib/training/step.py:_stateful_draws",
                            # (coupling's walks, not its wrappers, which call the layers)
                            "keras_distrib/training/coupling.py:meets",
                            "keras_distrib/training/coupling.py:row_layout",
                            "keras_distrib/training/coupling.py:request_anchors")),
    ("  functions from graphs (control deps, FunctionDef)",
     ("tensorflow/python/framework/auto_control_deps.py:__exit__",
      "tensorflow/python/eager/polymorphic_function/atomic_function.py:from_func_graph")),
    ("iterator construction", ("tensorflow/python/distribute/distribute_lib.py:"
                               "experimental_distribute_dataset",
                               "tensorflow/python/distribute/input_lib.py:__iter__",
                               "keras/src/trainers/epoch_iterator.py:__init__",
                               "keras/src/trainers/data_adapters/*",
                               "keras_distrib/training/loop.py:epoch_source")),
    ("AutoGraph converting code", ("tensorflow/python/autograph/pyct/*",
                                   "tensorflow/python/autograph/converters/*",
                                   "tensorflow/python/autograph/impl/conversion.py:*",
                                   "tensorflow/python/autograph/impl/api.py:_convert_actual")),
    ("the first-step check (copies, one device's step, comparison)",
     ("keras_distrib/training/first_step.py:*",)),
    ("first calls (graph optimization, run)",
     ("tensorflow/python/eager/execute.py:quick_execute",)),
    ("kd's own code (top frame)", ("top:keras_distrib/*",)),
)
SAMPLE_SECONDS = 0.002


# The models.


def batch_norm_layers(model):
    """BatchNormalization layers of a model name (`resnetN` has N)."""
    if model.startswith("resnet"):
        return int(model[len("resnet"):])
    return 0


def _check_model(name):
    if name in MODELS:
        return None
    if name.startswith("resnet") and name[len("resnet"):].isdigit():
        layers = int(name[len("resnet"):])
        if layers >= 9 and (layers - 3) % 6 == 0:
            return None
        return (f"`--models` names {name!r}: a ResNet has 6b + 3 BatchNormalization layers "
                "for b >= 1 blocks per stage (resnet9, resnet15, resnet21, ...)")
    return f"`--models` names unknown model {name!r}; choose from {list(MODELS)} or resnetN"


def _resnet(keras, model_class, batch_norms):
    blocks = (batch_norms - 3) // 6
    inputs = keras.Input((28, 28, 1))
    x = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(blocks):
            strides = 2 if stage and not block else 1
            y = keras.layers.Conv2D(filters, 3, strides=strides, padding="same", use_bias=False)(x)
            y = keras.layers.ReLU()(keras.layers.BatchNormalization()(y))
            y = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
            y = keras.layers.BatchNormalization()(y)
            shortcut = x
            if strides == 2 or (stage == 0 and block == 0):
                shortcut = keras.layers.Conv2D(filters, 1, strides=strides, use_bias=False)(x)
                shortcut = keras.layers.BatchNormalization()(shortcut)
            x = keras.layers.ReLU()(keras.layers.Add()([shortcut, y]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return model_class(inputs, keras.layers.Dense(10)(x))


def _transformer(keras, model_class):
    inputs = keras.Input((32,), dtype="int32")
    x = keras.layers.Embedding(1000, 64)(inputs)
    for _ in range(2):
        attention = keras.layers.MultiHeadAttention(num_heads=4, key_dim=16)(x, x)
        x = keras.layers.LayerNormalization()(x + keras.layers.Dropout(0.1)(attention))
        feed = keras.layers.Dense(128, activation="relu")(x)
        feed = keras.layers.Dense(64)(feed)
        x = keras.layers.LayerNormalization()(x + keras.layers.Dropout(0.1)(feed))
    x = keras.layers.GlobalAveragePooling1D()(x)
    return model_class(inputs, keras.layers.Dense(10)(x))


def _hub_bert(keras, kd, distributed):
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=1000, num_layers=2, num_heads=2, hidden_dim=64, intermediate_dim=128,
        max_sequence_length=32,
    )
    task_class = keras_hub.models.BertTextClassifier
    if distributed:
        task_class = type("BertTextClassifier", (kd.DistributedModelMixin, task_class), {})
    return task_class(backbone, num_classes=10, preprocessor=None)


def _build(name, framework, keras, kd):

    keras.utils.set_random_seed(0)
    distributed = framework.startswith("kd")
    model_class = kd.Model if distributed else keras.Model
    if name in ("mlp", "cnn"):
        return bench._model(name, model_class)
    if name.startswith("resnet"):
        return _resnet(keras, model_class, batch_norm_layers(name))
    if name == "transformer":
        return _transformer(keras, model_class)
    return _hub_bert(keras, kd, distributed)


def _data(name, np):
    rng = np.random.default_rng(0)
    rows = GLOBAL_BATCH * BATCHES
    y = rng.integers(0, 10, size=(rows,)).astype("int32")
    if name == "transformer":
        return rng.integers(0, 1000, size=(rows, 32)).astype("int32"), y
    if name == "hub_bert":
        x = {"token_ids": rng.integers(0, 1000, size=(rows, 32)).astype("int32"),
             "segment_ids": np.zeros((rows, 32), "int32"),
             "padding_mask": np.ones((rows, 32), "int32")}
        return x, y
    return rng.normal(size=(rows, 28, 28, 1)).astype("float32"), y


# The child process.


def _matches(filename, name, pattern):
    """Whether a function (its file and name) is `pattern`: `dir/file.py:name`, `file.py:*`, `dir/*`."""
    path = "/" + filename.replace(os.sep, "/")
    where, _, wanted = pattern.partition(":")
    if where.endswith("/*"):
        return f"/{where[:-1]}" in path
    return path.endswith("/" + where) and wanted in ("*", name)


class _Sampler:
    """Splits the CPU time of every Python thread into `PARTS` by sampling stacks.

    Every `SAMPLE_SECONDS` a thread of its own reads each thread's CPU clock
    and stack; the CPU time a thread used since the last sample counts in
    every part its stack is in. CPU time of threads TensorFlow runs without
    Python (its kernels' pools) is not in any part; `report` gives it as the
    process's CPU time less the sampled threads'. A thread's last moments
    before it ends are lost (at most one interval each).
    """

    def __init__(self):
        import threading

        self._threading = threading
        self._stop = threading.Event()
        self._clocks = {}  # thread id -> its CPU seconds at the last sample
        self._codes = {}  # code object -> (parts it matches, parts its top frame matches)
        self.seconds = [0.0] * len(PARTS)
        self.sampled = 0.0
        self._thread = threading.Thread(target=self._run, name="kd-first-step-sampler", daemon=True)

    def start(self):
        self._cpu = time.process_time()
        self._sample(first=True)
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()
        self._sample()
        self._cpu = time.process_time() - self._cpu

    def _run(self):
        while not self._stop.wait(SAMPLE_SECONDS):
            self._sample()

    def _parts_of(self, code):
        known = self._codes.get(code)
        if known is None:
            anywhere, top = set(), set()
            for index, (_, patterns) in enumerate(PARTS):
                for pattern in patterns:
                    if _matches(code.co_filename, code.co_name, pattern.removeprefix("top:")):
                        (top if pattern.startswith("top:") else anywhere).add(index)
            known = self._codes[code] = (frozenset(anywhere), frozenset(top))
        return known

    def _sample(self, first=False):
        import sys

        own = self._thread.ident  # None before it starts: every thread is sampled
        for ident, frame in sys._current_frames().items():
            if ident == own:
                continue
            try:
                now = time.clock_gettime(time.pthread_getcpuclockid(ident))
            except (OSError, AttributeError):
                continue
            used = 0.0 if first else now - self._clocks.get(ident, 0.0)
            self._clocks[ident] = now
            if used <= 0:
                continue
            self.sampled += used
            parts = set(self._parts_of(frame.f_code)[1])
            while frame is not None:
                parts.update(self._parts_of(frame.f_code)[0])
                frame = frame.f_back
            for index in parts:
                self.seconds[index] += used

    def report(self):
        """`{part: CPU seconds}`, with the sampled and the process's totals."""
        parts = {name: seconds for (name, _), seconds in zip(PARTS, self.seconds)}
        parts["sampled Python threads"] = self.sampled
        parts["not sampled (TensorFlow's own threads)"] = self._cpu - self.sampled
        return parts


class _CheckClock:
    """The CPU seconds of the first-step check in this process, the step it checks aside.

    A checked call (`Step._checked_call`) copies the variables, runs the
    step (its first `Step._call`) and checks it; `seconds` is the checked
    calls' CPU time less that step's: the check's own cost, measured in the
    process rather than as the difference of two processes' noisy totals.
    """

    def __init__(self):
        from keras_distrib.training import step

        self.seconds = 0.0
        self._class = step.Step
        self._kept = None
        if not hasattr(step.Step, "_checked_call"):  # a checkout from before the check (--before)
            return
        self._kept = (step.Step._checked_call, step.Step._call)
        checked_call, call = self._kept
        inside = []

        def timed_checked_call(step_self, *args, **kwargs):
            inside.append(None)  # the first `_call` inside is the step checked
            started = time.process_time()
            try:
                return checked_call(step_self, *args, **kwargs)
            finally:
                inside.pop()
                self.seconds += time.process_time() - started

        def timed_call(step_self, *args, **kwargs):
            if not inside or inside[-1] is not None:
                return call(step_self, *args, **kwargs)
            inside[-1] = "step"
            started = time.process_time()
            try:
                return call(step_self, *args, **kwargs)
            finally:
                self.seconds -= time.process_time() - started

        step.Step._checked_call, step.Step._call = timed_checked_call, timed_call

    def close(self):
        if self._kept is not None:
            self._class._checked_call, self._class._call = self._kept


def task(framework, model_name, replicas, profile=False):
    """Runs in the child process: builds, compiles and fits one model; prints its times.

    Prints one line `FIRST_STEP {json}`: `cpu` and `wall` from the call of
    `fit` to the end of its first step, `fit_cpu`/`fit_wall` to the end of
    `fit`, `build_cpu` for building and compiling the model, and with
    `profile` the profile's parts (`parts`, CPU seconds) and Python calls.
    """
    replicas = int(replicas)
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_distrib as kd

    if replicas > 1:
        kd.virtual_devices(replicas)
        strategy = kd.make_strategy("mirrored")
    else:
        strategy = tf.distribute.get_strategy()
    options = {"kd_bn_per_replica": {"batch_norm": "per_replica"},
               "kd_unchecked": {"first_step_check": False}}.get(framework, {})
    build_cpu = time.process_time()
    with strategy.scope():
        model = _build(model_name, framework, keras, kd)
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **options)
    build_cpu = time.process_time() - build_cpu
    x, y = _data(model_name, np)
    marks = {}

    class FirstStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if "wall" not in marks:
                marks["wall"], marks["cpu"] = time.perf_counter(), time.process_time()
                if sampler is not None:
                    sampler.stop()

    sampler = _Sampler() if profile else None
    check = _CheckClock()
    if sampler is not None:
        sampler.start()
    wall, cpu = time.perf_counter(), time.process_time()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False,
              callbacks=[FirstStep()])
    fit_wall, fit_cpu = time.perf_counter() - wall, time.process_time() - cpu
    result = {"cpu": marks["cpu"] - cpu, "wall": marks["wall"] - wall,
              "fit_cpu": fit_cpu, "fit_wall": fit_wall, "build_cpu": build_cpu,
              "check_cpu": check.seconds}
    check.close()
    if sampler is not None:
        result["parts"] = sampler.report()
    print("FIRST_STEP " + json.dumps(result), flush=True)


# The parent.


def _child(framework, model_name, replicas, profile, before, timeout):
    """Runs one configuration in a fresh process; its times, or a string saying why not."""
    root = before if framework == "kd_before" else _ROOT
    replicas = 1 if framework.endswith("_1") else replicas
    # `-c`: the script's own folder is not put first on the path, and the
    # child's folder is the checkout whose keras_distrib it imports.
    code = ("import runpy, sys; runpy.run_path(sys.argv[1])['task'](*sys.argv[2:])")
    command = [sys.executable, "-c", code, os.path.abspath(__file__), framework, model_name,
               str(replicas)] + (["1"] if profile else [])
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "")
                                                    .split(os.pathsep) if p])}
    with tempfile.TemporaryDirectory(prefix="kd_first_step_") as scratch:
        # TensorFlow's AutoGraph writes its converted sources to the
        # temporary folder; each child keeps its own, removed afterwards.
        env["TMPDIR"] = scratch
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=env, cwd=root, start_new_session=True)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout:.0f} s"
        finally:
            # Ended, timed out, or this process stopped (SIGINT, SIGTERM,
            # SIGHUP): nothing the child started outlives it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    completed = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    lines = [l for l in completed.stdout.splitlines() if l.startswith("FIRST_STEP ")]
    if completed.returncode != 0 or not lines:
        tail = (completed.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"exit code {completed.returncode}: {tail[:300]}"
    return json.loads(lines[-1][len("FIRST_STEP "):])


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs, frameworks, models):
    """Medians and ratios from `runs[(framework, model)]` (a list per round, None where failed).

    Returns `{model: {framework: {"cpu", "wall", "runs"}, "ratio_cpu", "ratio_wall",
    "before_ratio_cpu"}}`: the ratios are medians over the rounds of kd / keras
    (and kd / kd_before) measured in the same round.
    """
    table = {}
    for model in models:
        row = {}
        for framework in frameworks:
            times = runs.get((framework, model), [])
            good = [t for t in times if isinstance(t, dict)]
            row[framework] = {
                "cpu": _median([t["cpu"] for t in good]),
                "check_cpu": _median([t.get("check_cpu", 0.0) for t in good]),
                "wall": _median([t["wall"] for t in good]),
                "runs": len(good),
                "failed": [t for t in times if isinstance(t, str)],
            }
        for name, (top, bottom) in {"kd / Keras 3": ("kd", "keras"),
                                    "kd / Keras 3, one device": ("kd_1", "keras_1"),
                                    "kd / kd unchecked": ("kd", "kd_unchecked"),
                                    "kd / kd before": ("kd", "kd_before")}.items():
            pairs = list(zip(runs.get((top, model), []), runs.get((bottom, model), [])))
            for measure in ("cpu", "wall"):
                ratios = [a[measure] / b[measure] for a, b in pairs
                          if isinstance(a, dict) and isinstance(b, dict) and b[measure] > 0]
                row[f"{name} ({measure})"] = _median(ratios)
        table[model] = row
    return table


def depth_curve(table, framework):
    """Least-squares CPU seconds per BatchNormalization layer over the ResNets measured, or None."""
    points = [(batch_norm_layers(m), row[framework]["cpu"]) for m, row in table.items()
              if m.startswith("resnet") and framework in row and row[framework]["cpu"] is not None]
    if len(points) < 2:
        return None
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread == 0:
        return None
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return {"seconds_per_layer": slope, "intercept": mean_y - slope * mean_x}


def _cell(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(table, frameworks, print_fn=print):
    """The table in Markdown: CPU s and wall s per framework, then the ratios."""
    names = {"keras_1": "Keras 3, 1 device", "kd_1": "kd, 1 device", "keras": "Keras 3",
             "kd": "kd", "kd_bn_per_replica": "kd BN per replica", "kd_unchecked": "kd unchecked",
             "kd_before": "kd before"}
    ratios = [r for r in ("kd / Keras 3", "kd / Keras 3, one device", "kd / kd unchecked",
                          "kd / kd before")
              if any(table[m].get(f"{r} (cpu)") is not None for m in table)]
    checked = "kd" in frameworks and any(table[m]["kd"]["check_cpu"] for m in table)
    header = ["model"] + [f"{names[f]} CPU s / wall s" for f in frameworks] + \
        [f"{r} (CPU / wall)" for r in ratios] + \
        (["kd's first-step check alone: CPU s (share of the rest of kd's first step)"] if checked else [])
    print_fn("| " + " | ".join(header) + " |")
    print_fn("|---|" + "---:|" * (len(header) - 1))
    for model, row in table.items():
        cells = [model]
        for framework in frameworks:
            entry = row[framework]
            cells.append(f"{_cell(entry['cpu'])} / {_cell(entry['wall'])}"
                         if entry["runs"] else "failed")
        for name in ratios:
            cells.append(f"{_cell(row[f'{name} (cpu)'])} / {_cell(row[f'{name} (wall)'])}")
        if checked:
            cells.append(_check_cell(row["kd"]))
        print_fn("| " + " | ".join(cells) + " |")
    for model, row in table.items():
        for framework in frameworks:
            for why in row[framework]["failed"][:1]:
                print_fn(f"{model} {framework} failed: {why}")


def _check_cell(entry):
    """The check's median CPU s, and its share of the rest of the first step (same processes)."""
    check, whole = entry["check_cpu"], entry["cpu"]
    if not entry["runs"] or check is None or whole is None or whole <= check:
        return "-"
    return f"{check:.3f} ({check / (whole - check):.0%})"


def print_depth(table, frameworks, print_fn=print):
    """CPU seconds per BatchNormalization layer (least squares over the ResNets)."""
    curves = {f: depth_curve(table, f) for f in frameworks}
    curves = {f: c for f, c in curves.items() if c is not None}
    if not curves:
        return curves
    print_fn("depth: CPU s per BatchNormalization layer (least squares over "
             + ", ".join(m for m in table if m.startswith("resnet")) + ")")
    for framework, curve in curves.items():
        print_fn(f"  {framework:18s} {curve['seconds_per_layer']:.3f} s/layer "
                 f"(+ {curve['intercept']:.2f} s)")
    if "kd" in curves and "keras" in curves and curves["keras"]["seconds_per_layer"] > 0:
        print_fn(f"  kd / Keras 3 per layer: "
                 f"{curves['kd']['seconds_per_layer'] / curves['keras']['seconds_per_layer']:.2f}")
    return curves


def print_profile(profiles, print_fn=print):
    """The profile's parts in CPU seconds, per model and framework (and kd - Keras 3)."""
    for model, by_framework in profiles.items():
        failed = {f: r for f, r in by_framework.items() if not isinstance(r, dict)}
        done = {f: r for f, r in by_framework.items() if isinstance(r, dict)}
        for framework, why in failed.items():
            print_fn(f"profile of {model} {framework} failed: {why}")
        if not done:
            continue
        both = "kd" in done and "keras" in done
        print_fn(f"\nprofile of {model}: CPU s to the first step, sampled every "
                 f"{SAMPLE_SECONDS * 1000:.0f} ms in every thread (process: "
                 + ", ".join(f"{f} {r['cpu']:.2f}" for f, r in done.items()) + "; parts overlap)")
        print_fn("| part | " + " | ".join(done) + (" | kd - keras |" if both else " |"))
        print_fn("|---|" + "---:|" * (len(done) + both))
        for name in next(iter(done.values()))["parts"]:
            depth = (len(name) - len(name.lstrip(" "))) // 2
            cells = [f"{r['parts'].get(name, 0.0):.2f}" for r in done.values()]
            if both:
                cells.append(f"{done['kd']['parts'][name] - done['keras']['parts'][name]:+.2f}")
            print_fn(f"| {'· ' * depth}{name.strip()} | " + " | ".join(cells) + " |")


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="keras-distrib bench --first-step",
        description="CPU seconds and wall time from fit to the end of its first step, Keras 3 "
        "and kd, each run in a fresh process, the configurations taking turns; medians of "
        "--repeats and the ratio kd / Keras 3 per round; the depth curve over the ResNets; "
        "with --profile, kd's and Keras 3's first step split into parts.")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, from {', '.join(MODELS)} or resnetN (N = 6b + 3)")
    parser.add_argument("--frameworks", default=",".join(DEFAULT_FRAMEWORKS),
                        help=f"comma-separated, from {', '.join(FRAMEWORKS[:-1])} "
                        "(kd_before comes with --before)")
    parser.add_argument("--replicas", type=int, default=2,
                        help="virtual CPU devices of the mirrored runs (keras, kd)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", default=None,
                        help="a checkout of keras_distrib to compare with (framework kd_before)")
    parser.add_argument("--profile", action="store_true",
                        help="then run each framework once more per model and split its first "
                        "step into parts")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per process")
    parser.add_argument("--json", default=None, help="write the measurements here")
    options = parser.parse_args(argv)
    problems = [f"`--{k}`={getattr(options, k)} must be >= 1" for k in ("replicas", "repeats")
                if getattr(options, k) < 1]
    if options.timeout <= 0:
        problems.append(f"`--timeout`={options.timeout} must be > 0")
    models = [m for m in options.models.split(",") if m]
    problems += list(filter(None, map(_check_model, models)))
    if not models:
        problems.append("`--models` is empty; name at least one model")
    frameworks = [f for f in options.frameworks.split(",") if f]
    unknown = [f for f in frameworks if f not in FRAMEWORKS[:-1]]
    if unknown:
        problems.append(f"`--frameworks` names unknown framework(s) {unknown}; choose from "
                        f"{list(FRAMEWORKS[:-1])} (kd_before comes with --before)")
    if options.before is not None and not os.path.isdir(
            os.path.join(options.before, "keras_distrib")):
        problems.append(f"`--before`={options.before!r} holds no keras_distrib package; pass "
                        "the root of a keras_distrib checkout")
    if options.json is not None:
        problems += filter(None, [validation.output_path_problem("--json", options.json)])
    if problems:
        parser.error("; ".join(problems))
    if options.before:
        frameworks.append("kd_before")
        options.before = os.path.abspath(options.before)
    return options, models, frameworks


def main(argv=None, print_fn=print):
    """Runs `keras-distrib bench --first-step ARGS`; returns the exit code."""
    options, models, frameworks = _parse(argv)
    try:
        with bench_network._signals_raise():
            return _measure(options, models, frameworks, print_fn)
    except bench_network._Stopped as stopped:
        print_fn(f"stopped by {signal.Signals(stopped.signum).name}")
        return 128 + stopped.signum


def _measure(options, models, frameworks, print_fn):
    runs = {(f, m): [] for m in models for f in frameworks}
    total = len(runs) * options.repeats
    done = 0
    for _ in range(options.repeats):
        for model in models:
            for framework in frameworks:
                result = _child(framework, model, options.replicas, False, options.before,
                                options.timeout)
                runs[(framework, model)].append(result)
                done += 1
                shown = (f"{result['cpu']:.2f} CPU s, {result['wall']:.2f} s"
                         if isinstance(result, dict) else f"failed: {result}")
                print_fn(f"[{done}/{total}] {model} {framework}: {shown}")
                sys.stdout.flush()
    table = summarize(runs, frameworks, models)
    print_fn(f"\nfirst step, global batch {GLOBAL_BATCH}, {options.replicas} virtual CPU devices "
             f"(mirrored), {os.cpu_count()} CPUs, medians of {options.repeats}:")
    print_table(table, frameworks, print_fn)
    curves = print_depth(table, frameworks, print_fn)
    profiles = {}
    if options.profile:
        for model in models:
            profiles[model] = {f: _child(f, model, options.replicas, True, options.before,
                                         options.timeout) for f in frameworks}
        print_profile(profiles, print_fn)
    if options.json:
        report = {"format": 1,
                  "config": {"models": models, "frameworks": frameworks,
                             "replicas": options.replicas, "repeats": options.repeats,
                             "global_batch": GLOBAL_BATCH, "cpus": os.cpu_count(),
                             "before": options.before},
                  "runs": {f"{f}/{m}": v for (f, m), v in runs.items()},
                  "table": table, "depth": curves, "profiles": profiles}
        with open(options.json, "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)
    return 0
