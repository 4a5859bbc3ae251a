"""Time to the first training step, kd against Keras 3, each run in a fresh process.

A fresh process holds nothing traced, so the time from `fit` to the end of
its first compiled call is what a user waits for before the first step
(tracing the step function and building the graph). Every configuration
runs `--repeats` times, each in its own process, interleaved so that a
machine that speeds up or slows down affects all of them alike; the table
gives the median and the spread.

    python tools/first_fit_time.py --models mlp,cnn,resnet --spe 1,10 --repeats 3

`--before PATH` adds a framework `kd_before`: kd imported from another checkout
(PYTHONPATH=PATH), to compare a change with the code before it.

`--profile` runs one configuration under cProfile instead and prints the
number of Python calls and the heaviest functions of the first `fit`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

GLOBAL_BATCH = 64
STEPS = 12  # with spe=10: one full and one partial execution


def _model(kind, model_class, keras):
    keras.utils.set_random_seed(0)
    if kind == "embedding":
        inputs = keras.Input((20,), dtype="int32")
        x = keras.layers.Embedding(1000, 32)(inputs)
        x = keras.layers.GlobalAveragePooling1D()(x)
        x = keras.layers.Dense(64, activation="relu")(x)
        return model_class(inputs, keras.layers.Dense(10)(x))
    if kind in ("mlp", "cnn"):
        from keras_distrib.commands import bench

        return bench._model(kind, model_class)  # the benchmark's own models
    inputs = keras.Input((28, 28, 1))
    # resnet: residual blocks with BatchNormalization
    x = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    for filters in (16, 32, 64):
        shortcut = keras.layers.Conv2D(filters, 1, strides=2, use_bias=False)(x)
        y = keras.layers.Conv2D(filters, 3, strides=2, padding="same", use_bias=False)(x)
        y = keras.layers.ReLU()(keras.layers.BatchNormalization()(y))
        y = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
        y = keras.layers.BatchNormalization()(y)
        x = keras.layers.ReLU()(keras.layers.Add()([keras.layers.BatchNormalization()(shortcut), y]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return model_class(inputs, keras.layers.Dense(10)(x))


def _data(kind, np):
    rng = np.random.default_rng(0)
    # Whole batches: plain Keras under mirrored cannot loop over an uneven
    # last batch (its collectives keep their first shape). With spe=10 the
    # epoch is one full and one partial execution.
    rows = GLOBAL_BATCH * STEPS
    if kind == "embedding":
        x = rng.integers(0, 1000, size=(rows, 20)).astype("int32")
    else:
        x = rng.normal(size=(rows, 28, 28, 1)).astype("float32")
    return x, rng.integers(0, 10, size=(rows,)).astype("int32")


def task(framework, kind, spe, profile=False):
    """Runs in the child process: prints the seconds to the first step and of the first fit."""
    started = time.time()
    import keras
    import numpy as np

    import keras_distrib as kd

    kd.virtual_devices(2)
    strategy = kd.make_strategy("mirrored")
    model_class = keras.Model if framework == "keras" else kd.Model
    # kd_bn_per_replica: BatchNormalization's statistics per replica, as
    # plain Keras computes them (no all-reduce in the forward pass).
    options = {"batch_norm": "per_replica"} if framework == "kd_bn_per_replica" else {}
    with strategy.scope():
        model = _model(kind, model_class, keras)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=spe, **options,
        )
    x, y = _data(kind, np)
    marks = {}

    class FirstStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            marks.setdefault("first", time.time())
            marks.setdefault("first_cpu", time.process_time())

    imported = time.time()
    if profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
    begin, begin_cpu = time.time(), time.process_time()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, callbacks=[FirstStep()])
    end = time.time()
    if profile:
        profiler.disable()
        stats = pstats.Stats(profiler)
        print(f"PYTHON_CALLS {stats.total_calls}")
        stats.sort_stats("cumulative").print_stats(60)
        stats.sort_stats("tottime").print_stats(30)
    print("TIMES " + json.dumps({
        "first_step": marks["first"] - begin, "first_fit": end - begin,
        # CPU seconds of the process: what tracing costs, less disturbed by
        # other work on a shared machine than the wall time.
        "first_step_cpu": marks["first_cpu"] - begin_cpu,
        "setup": imported - started,
    }), flush=True)


def _run_child(framework, kind, spe, profile=False, before=None):
    command = [sys.executable, os.path.abspath(__file__), "--task", framework.replace("_before", ""),
               kind, str(spe)]
    if profile:
        command.append("--profile")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    if framework == "kd_before":
        env["PYTHONPATH"] = before
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if completed.returncode != 0:
        # Keras 3.15 on TF 2.21 fails any spe > 1 fit under MirroredStrategy
        # ("You must feed a value for placeholder tensor ... while/cond").
        print(f"FAILED {framework} {kind} spe={spe}: {completed.stderr.strip().splitlines()[-1]}",
              file=sys.stderr)
        return None
    if profile:
        print(completed.stdout)
    line = [l for l in completed.stdout.splitlines() if l.startswith("TIMES ")][-1]
    return json.loads(line[6:])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,cnn,resnet")
    parser.add_argument("--spe", default="1,10")
    parser.add_argument("--frameworks", default="keras,kd",
                        help="keras, kd, kd_bn_per_replica (comma-separated)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--keras-spe", action="store_true", help="run Keras with spe > 1 too")
    parser.add_argument("--before", help="a checkout of kd to compare with, as `kd_before`")
    parser.add_argument("--task", nargs=3)
    args = parser.parse_args(argv)
    if args.task:
        framework, kind, spe = args.task
        task(framework, kind, int(spe), profile=args.profile)
        return
    frameworks = args.frameworks.split(",") + (["kd_before"] if args.before else [])
    # Keras 3.15 on TF 2.21 fails any spe > 1 fit under MirroredStrategy
    # ("You must feed a value for placeholder tensor ... while/cond"):
    # `--keras-spe` runs it anyway, to check.
    configs = [(f, m, int(s)) for m in args.models.split(",") for s in args.spe.split(",")
               for f in frameworks if f != "keras" or int(s) == 1 or args.keras_spe]
    if args.profile:
        for config in configs:
            _run_child(*config, profile=True, before=args.before)
        return
    runs = {config: [] for config in configs}
    for _ in range(args.repeats):
        for config in configs:
            runs[config].append(_run_child(*config, before=args.before))
    print(f"{'model':10}{'spe':>5} {'framework':10}{'first step s (median, min-max)':>34}"
          f"{'CPU s (median)':>16}{'first fit s':>14}")
    for (framework, kind, spe), times in runs.items():
        times = [t for t in times if t is not None]
        if not times:
            print(f"{kind:10}{spe:>5} {framework:10}{'failed':>16}")
            continue
        first = [t["first_step"] for t in times]
        fit = [t["first_fit"] for t in times]
        cpu = [t["first_step_cpu"] for t in times]
        print(f"{kind:10}{spe:>5} {framework:10}{statistics.median(first):>16.2f} "
              f"({min(first):.2f}-{max(first):.2f}){statistics.median(cpu):>18.2f}"
              f"{statistics.median(fit):>14.2f}")
    print("RUNS " + json.dumps({"/".join(map(str, k)): v for k, v in runs.items()}))


if __name__ == "__main__":
    main()
