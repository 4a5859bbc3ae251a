"""The bandwidth sweep of `keras-distrib bench --network --rates ...`: big gradients over a thin link.

Where latency dominates, one all-reduce after the backward pass is the
cheapest step; where bandwidth dominates, a step that all-reduces after the
backward pass pays compute + communication, and one whose all-reduces start
as the backward pass produces each bucket of gradients tends to
max(compute, communication). This sweep puts each on the same page: for
each gradient size (an MLP sized to it) and link rate, on the same workers,
variants taking turns:

- `kd_fit`: kd `fit`, `gradient_buckets="auto"` (what kd chooses);
- `kd_fit_one`: kd `fit`, `gradient_buckets="one"` (one all-reduce after
  the backward pass, as kd did before buckets);
- `keras3_loop`: Keras 3 in TensorFlow's multi-worker custom-loop tutorial
  shape (`strategy.run`, a tape, `apply_gradients`);
- `tf_keras_fit`: tf-keras's multi-worker `fit` (when installed);
- `compute_alone`: one worker's step without any communication (plain Keras
  on its share of the global batch, no strategy);
- `all_reduce_alone`: one all-reduce of the model's gradient bytes, nothing
  else;
- `buckets_alone` (where kd buckets): the all-reduces of kd's buckets, one
  after another, nothing else: several smaller all-reduces may take less
  (or more) than one, so the overlap is also given against them.

From the last two: the overlap limit max(compute, comm), the serial sum
compute + comm, and for each kd variant the share of min(compute, comm) it
hides: (compute + comm - step) / min(compute, comm). Every model trains
with SGD (no optimizer slots: memory goes to the gradient).

`bench_network` owns the link (its rate: `tc tbf` on each worker's veth
end, `netem rate` with a delay, or the relay pacing bytes) and the
processes; this module owns the models, the worker's loop and the report.
"""

import gc
import math
import resource
import statistics
import time

from keras_distrib import collectives
from keras_distrib.commands import bench
from keras_distrib.training import buckets

__all__ = [
    "RATIOS",
    "VARIANTS",
    "memory_needed",
    "memory_problem",
    "print_table",
    "summarize",
    "width_for",
    "worker_loop",
]

VARIANTS = ("kd_fit", "kd_fit_one", "keras3_loop", "tf_keras_fit", "compute_alone", "all_reduce_alone",
            "buckets_alone")
RATIOS = {
    "kd_fit / keras3_loop": ("kd_fit", "keras3_loop"),
    "kd_fit / tf_keras_fit": ("kd_fit", "tf_keras_fit"),
    "kd_fit / kd_fit_one": ("kd_fit", "kd_fit_one"),
}
GLOBAL_BATCH = 64
# A worker's peak memory (`memory_needed`).
WORKER_BASE_BYTES = 900 * 10**6
WORKER_BYTES_PER_GRADIENT_BYTE = 16
PROGRESS = "PROGRESS"  # the first worker's lines the benchmark process prints as they come
DEPTH = 3  # hidden Dense layers of `width_for(mb)` units
CLASSES = 10


def width_for(gradient_mb):
    """Hidden width whose MLP (`DEPTH` square layers, a 10-way head) holds about `gradient_mb` MB of float32."""
    return max(8, int(math.sqrt(gradient_mb * 1e6 / 4 / DEPTH)))


def _runners(gradient_mb, steps, strategy, workers, on_step_end, batch=GLOBAL_BATCH):
    """name -> callable running one timed epoch of `steps` steps, for the MLP of `gradient_mb` MB."""
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_distrib as kd

    width = width_for(gradient_mb)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, width)).astype("float32")
    y = rng.integers(0, CLASSES, size=(batch * steps,)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).cache()
    local = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch // workers).take(steps).cache()

    def mlp(api, model_class):  # api: keras, or tf_keras
        inputs = api.Input((width,))
        hidden = inputs
        for _ in range(DEPTH):
            hidden = api.layers.Dense(width, activation="relu")(hidden)
        return model_class(inputs, api.layers.Dense(CLASSES)(hidden))

    def loss():
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def kd_fit(setting):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = mlp(keras, kd.Model)
            model.compile(optimizer=keras.optimizers.SGD(1e-3), loss=loss(), gradient_buckets=setting)
        callbacks = bench.step_clock(keras.callbacks.Callback, on_step_end)

        def run():
            model.fit(dataset, epochs=1, verbose=0, callbacks=callbacks)

        run.model = model  # its traced step's collectives are counted (`collectives.traced`)
        return run

    def keras3_loop():
        per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = mlp(keras, keras.Model)
            optimizer = keras.optimizers.SGD(1e-3)
            optimizer.build(model.trainable_variables)

        def step(inputs):
            features, labels = inputs
            with tf.GradientTape() as tape:
                loss_value = tf.nn.compute_average_loss(
                    per_example(labels, model(features, training=True)), global_batch_size=batch)
            grads = tape.gradient(loss_value, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss_value

        return bench.hand_loop(strategy, dataset, step, on_step_end)

    def tf_keras_fit():
        try:
            import tf_keras
        except ImportError:
            return None
        with strategy.scope():
            tf_keras.utils.set_random_seed(0)
            model = mlp(tf_keras, tf_keras.Model)
            model.compile(optimizer=tf_keras.optimizers.SGD(1e-3),
                          loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        callbacks = bench.step_clock(tf_keras.callbacks.Callback, on_step_end)
        return lambda: model.fit(dataset, epochs=1, verbose=0, callbacks=callbacks)

    def compute_alone():
        # One worker's share of the global batch, no strategy: the step's compute.
        keras.utils.set_random_seed(0)
        model = mlp(keras, keras.Model)
        model.compile(optimizer=keras.optimizers.SGD(1e-3), loss=loss())
        callbacks = bench.step_clock(keras.callbacks.Callback, on_step_end)
        return lambda: model.fit(local, epochs=1, verbose=0, callbacks=callbacks)

    def all_reduce(sizes):
        # The all-reduces of `sizes` elements each, one after another (TensorFlow
        # orders them), of buffers made once: communication and nothing else.
        buffers = [tf.ones([size]) for size in sizes]

        @tf.function
        def reduce_once():
            def replica():
                context = tf.distribute.get_replica_context()
                return [context.all_reduce("sum", buffer)[0] for buffer in buffers]

            return strategy.run(replica)

        def run():
            for _ in range(steps):
                reduce_once()
                on_step_end()

        return run

    shapes = _shapes(width)
    elements = [math.prod(shape) for shape in shapes]
    plan = buckets.choose("auto", gradient_bytes=4 * sum(elements), workers=workers)
    groups = buckets.split([4 * n for n in elements], plan.bucket_bytes)

    made = {"kd_fit": lambda: kd_fit("auto"), "kd_fit_one": lambda: kd_fit("one"),
            "keras3_loop": keras3_loop, "tf_keras_fit": tf_keras_fit,
            "compute_alone": compute_alone, "all_reduce_alone": lambda: all_reduce([sum(elements)]),
            # What kd's buckets send, without compute (only where kd buckets).
            "buckets_alone": lambda: all_reduce([sum(elements[i] for i in group) for group in groups])
            if plan.bucketed else None}
    built = {name: make() for name, make in made.items()}
    return {name: run for name, run in built.items() if run is not None}


def _shapes(width):
    shapes = []
    for _ in range(DEPTH):
        shapes += [(width, width), (width,)]
    return shapes + [(width, CLASSES), (CLASSES,)]


def gradient_bytes(gradient_mb):
    """The exact float32 gradient bytes of the sweep's MLP for `gradient_mb`."""
    return 4 * sum(math.prod(shape) for shape in _shapes(width_for(gradient_mb)))


def memory_needed(gradient_mb, workers):
    """About the bytes of memory a sweep of `workers` workers needs at `gradient_mb` MB.

    Every variant of a size lives at once in each worker (five models, the
    all-reduce buffers, a step's transient gradients and TensorFlow's
    copies): `WORKER_BASE_BYTES` + `WORKER_BYTES_PER_GRADIENT_BYTE` x the
    gradient's bytes, a line through a worker's resident memory measured at
    4 and 400 MB (docs/benchmarks/2026-11-29-bandwidth.md).
    """
    return workers * (WORKER_BASE_BYTES + WORKER_BYTES_PER_GRADIENT_BYTE * gradient_bytes(gradient_mb))


def memory_problem(gradient_mbs, worker_counts, available=None):
    """Why the machine's memory cannot hold the sweep (a sentence naming the fix), or None.

    `available`: bytes; by default /proc/meminfo's MemAvailable.
    """
    if available is None:
        try:
            with open("/proc/meminfo") as f:
                available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError, IndexError):
            return None  # not Linux, or no figure: nothing to check against
    workers, size = max(worker_counts), max(gradient_mbs)
    needed = memory_needed(size, workers)
    if needed <= available:
        return None
    return (f"{workers} workers at `--gradient-mb` {size:g} need about {needed / 1e9:.1f} GB of memory "
            f"(each worker holds every variant at once: about {memory_needed(size, 1) / 1e9:.1f} GB), "
            f"but {available / 1e9:.1f} GB is available: pass fewer `--workers` or a smaller "
            "`--gradient-mb`, or run on a machine with more memory.")


def trace_overlap(run, profile):
    """Where each all-reduce of a step starts, against the end of that step's backward pass.

    Runs `run` (an epoch) under TensorFlow's profiler when `profile` (the
    other workers run it unprofiled: the collectives need them) and reads
    the host trace: for step i, the i-th run of each op. The backward pass
    is every op TensorFlow's tape made (`gradient_tape/...`); an all-reduce
    is a `CollectiveReduceV2` kernel's run.

    Returns:
        `{"backward_ms": [...], "starts_ms": [[...], ...]}` per step: the
        backward pass's length (its first op's start to its last op's end),
        and each all-reduce's start relative to the backward pass's end
        (negative: it started while the backward pass still ran). None
        when not `profile`.
    """
    import glob
    import tempfile

    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    if not profile:
        run()
        return None
    with tempfile.TemporaryDirectory(prefix="kdbench-trace-") as folder:
        tf.profiler.experimental.start(folder)
        try:
            run()
        finally:
            tf.profiler.experimental.stop()
        space = xplane_pb2.XSpace()
        for path in glob.glob(f"{folder}/**/*.xplane.pb", recursive=True):
            with open(path, "rb") as f:
                space.ParseFromString(f.read())
    backward, reduces = [], []  # (start ms, end ms) of each op run
    for plane in space.planes:
        names = {key: meta.name for key, meta in plane.event_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                name = names.get(event.metadata_id, "")
                if name.startswith("gradient_tape/") or name.endswith(":CollectiveReduceV2"):
                    start = (line.timestamp_ns + event.offset_ps / 1e3) / 1e6
                    (backward if name.startswith("gradient_tape/") else reduces).append(
                        (start, start + event.duration_ps / 1e9))
    return _per_step(sorted(backward), sorted(reduces))


def _per_step(backward, reduces):
    """Splits op runs into steps: step i runs from the start of its backward pass to the next one's.

    A backward pass starts where one begins after a gap longer than any
    inside one (the forward pass and the update lie between two). The last
    step is left out: its window holds what follows the epoch.
    """
    if not backward:
        return {"backward_ms": [], "starts_ms": []}
    gaps = [later[0] - earlier[1] for earlier, later in zip(backward, backward[1:])]
    widest = sorted(gaps)[-1] if gaps else 0.0
    # The steps' gaps are the widest ones: a step's forward pass and update
    # take longer than any wait between two of its own backward ops.
    threshold = widest / 2
    starts = [backward[0][0]] + [later[0] for gap, later in zip(gaps, backward[1:]) if gap > threshold]
    result = {"backward_ms": [], "starts_ms": []}
    for begin, end in zip(starts, starts[1:]):
        ops = [op for op in backward if begin <= op[0] < end]
        finish = max(stop for _, stop in ops)
        result["backward_ms"].append(finish - begin)
        result["starts_ms"].append([start - finish for start, _ in reduces if begin <= start < end])
    return result


def worker_loop(*, sizes, rates, steps, repeats, strategy, workers, ask_for_rate, first=False,
                batch=GLOBAL_BATCH):
    """One worker's sweep; returns `{size: {rate: {variant: [steps/s, ...]}}}`.

    For each gradient size: every variant is built and run once at the
    link's full rate (trace, compile, warm-up); then, `repeats` times, each
    rate in turn (`ask_for_rate(rate)`: the first worker asks the
    benchmark process to set it), every variant, each going first in turn.
    Steps/s count from the end of an epoch's first step to its last's;
    the first worker prints each epoch's step time (a `PROGRESS` line).
    Then, at the last rate, one epoch of each kd variant runs under the
    first worker's profiler (`trace_overlap`), kept under `"trace"`. The
    worker's peak resident memory (MB, all sizes) is under `"peak_rss_mb"`.
    """
    step_ends = []
    timings = {"trace": {}}

    def progress(text):
        # The benchmark process shows these as they come: a run stopped by
        # its timeout still says what it had measured.
        if first:
            print(f"{PROGRESS} {text}", flush=True)

    for size in sizes:
        built = _runners(size, steps, strategy, workers, lambda: step_ends.append(time.perf_counter()), batch)
        names = [name for name in VARIANTS if name in built]
        ask_for_rate(0)
        for name in names:
            built[name]()
        progress(f"{size:g} MB: {len(names)} variants built and warmed up")
        by_rate = {f"{rate:g}": {name: [] for name in names} for rate in rates}
        for repeat in range(repeats):
            for rate in rates:
                ask_for_rate(rate)
                for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                    step_ends.clear()
                    built[name]()
                    speed = (len(step_ends) - 1) / (step_ends[-1] - step_ends[0])
                    by_rate[f"{rate:g}"][name].append(speed)
                    progress(f"{size:g} MB @ {rate:g} Gbit/s, repeat {repeat + 1}: {name} "
                             f"{1000 / speed:.0f} ms/step")
        timings[f"{size:g}"] = by_rate
        timings["trace"][f"{size:g}"] = {
            name: {**(trace_overlap(built[name], first) or {}),
                   "collectives": collectives.traced(built[name].model)["train"]}
            for name in ("kd_fit", "kd_fit_one")}
        del built
        gc.collect()
    # Every variant of a size lives at once (they take turns): what a worker
    # needs grows with the gradient, and a machine should hold workers x this.
    timings["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return timings


def summarize(timings, throughputs):
    """The sweep's report for one worker count: speeds, step times, the overlap and the ratios.

    `throughputs[rate]`: the link's measured Gbit/s at each setting of `rate`.
    """
    speeds, overlap, ratios = {}, {}, {}
    timings = dict(timings)
    traces = timings.pop("trace", {})
    peak_rss_mb = timings.pop("peak_rss_mb", None)
    for size, by_rate in timings.items():
        for rate, runs in by_rate.items():
            key = f"{size} MB @ {rate} Gbit/s"
            cells = {name: {"median": statistics.median(r), "min": min(r), "max": max(r), "runs": r}
                     for name, r in runs.items()}
            speeds[key] = cells
            ratios[key] = {name: cells[a]["median"] / cells[b]["median"]
                           for name, (a, b) in RATIOS.items() if a in cells and b in cells}
            ms = {name: 1000.0 / cell["median"] for name, cell in cells.items()}
            compute, comm = ms.get("compute_alone"), ms.get("all_reduce_alone")
            point = {"compute_ms": compute, "all_reduce_ms": comm,
                     "measured_gbit": throughputs.get(rate)}
            if compute and comm:
                point["overlap_limit_ms"] = max(compute, comm)
                point["serial_ms"] = compute + comm
                for name in ("kd_fit", "kd_fit_one", "keras3_loop", "tf_keras_fit"):
                    if name in ms:
                        point[f"{name}_ms"] = ms[name]
                        point[f"{name}_hidden"] = (compute + comm - ms[name]) / min(compute, comm)
                buckets_ms = ms.get("buckets_alone")
                if buckets_ms and "kd_fit" in ms:
                    point["buckets_alone_ms"] = buckets_ms
                    point["kd_fit_hidden_of_buckets"] = (
                        (compute + buckets_ms - ms["kd_fit"]) / min(compute, buckets_ms))
            overlap[key] = point
    return {"steps_per_second": speeds, "overlap": overlap, "ratios": ratios, "trace": traces,
            "first_worker_peak_rss_mb": peak_rss_mb}


def print_table(report, print_fn):
    """The step times (ms) and the share of min(compute, comm) each variant hides, per worker count and point."""
    print_fn("step ms (median) per variant; hidden = (compute + comm - step) / min(compute, comm); "
             "buckets: kd's bucket all-reduces alone, and kd's hidden share against them")
    names = ("kd_fit", "kd_fit_one", "keras3_loop", "tf_keras_fit")
    header = (f"{'workers':>7s} {'point':>22s} {'link Gbit/s':>11s} {'compute':>8s} {'comm':>8s} "
              f"{'max':>8s} {'sum':>8s} {'buckets':>8s} {'kd hidden of buckets':>20s}"
              + "".join(f" {name:>12s} {'hidden':>7s}" for name in names)
              + "".join(f" {name:>22s}" for name in RATIOS))
    print_fn(header)
    for count, part in report["bandwidth"].items():
        for key, point in part["overlap"].items():
            measured = point.get("measured_gbit")
            row = (f"{count:>7s} {key:>22s} {'-' if measured is None else format(measured, '.3g'):>11s} "
                   + " ".join(f"{_ms(point.get(name)):>8s}" for name in
                              ("compute_ms", "all_reduce_ms", "overlap_limit_ms", "serial_ms",
                               "buckets_alone_ms")))
            of_buckets = point.get("kd_fit_hidden_of_buckets")
            row += f" {'-' if of_buckets is None else format(of_buckets, '.2f'):>20s}"
            for name in names:
                hidden = point.get(f"{name}_hidden")
                row += f" {_ms(point.get(f'{name}_ms')):>12s} {'-' if hidden is None else format(hidden, '.2f'):>7s}"
            for name in RATIOS:
                value = part["ratios"][key].get(name)
                row += f" {'-' if value is None else format(value, '.2f'):>22s}"
            print_fn(row)
    for count, part in report["bandwidth"].items():
        if part.get("first_worker_peak_rss_mb"):
            print_fn(f"{count:>7s} workers: the first worker's peak memory {part['first_worker_peak_rss_mb']:.0f} MB "
                     "(every variant of a size lives at once)")
    print_fn("all-reduce starts, ms from the end of the backward pass (median over a profiled epoch; "
             "negative: while it ran)")
    for count, part in report["bandwidth"].items():
        for size, by_name in part.get("trace", {}).items():
            for name, trace in by_name.items():
                if trace.get("collectives"):
                    print_fn(f"{count:>7s} {size + ' MB':>9s} {name:>12s}: collective ops per step in the "
                             f"traced graph: {trace['collectives']['step']} {trace['collectives']['ops']}")
                if not trace.get("starts_ms"):
                    continue
                starts = [statistics.median(column) for column in zip(*trace["starts_ms"])]
                print_fn(f"{count:>7s} {size + ' MB':>9s} {name:>12s}: backward "
                         f"{statistics.median(trace['backward_ms']):.0f} ms, all-reduces at "
                         + ", ".join(f"{start:+.0f}" for start in starts))


def _ms(value):
    return "-" if value is None else f"{value:.0f}"
