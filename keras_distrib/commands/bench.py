"""`keras-distrib bench`: steps per second of each way to train, as ratios.

Every variant trains the same model on the same data with the same global
batch, in one process holding `--replicas` virtual devices; the variants run
in turn, repeat after repeat, so a machine that speeds up or slows down
affects all of them alike. Times are medians of `--repeats` epochs of
`--steps` steps, after a warm-up epoch (tracing, compilation).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from keras_distrib import validation

__all__ = [
    "first_step_task",
    "main",
    "run",
    "runners",
]

GLOBAL_BATCH = 64
VARIANTS = (
    "plain_fit_one_device",
    "plain_fit_mirrored",
    "tf_keras_fit_mirrored",
    "kd_fit_mirrored",
    "kd_fit_mirrored_spe50",
    "kd_fit_mirrored_one_all_reduce",
    "kd_fit_mirrored_buckets",
    "tutorial_loop_per_step",
    "kd_loop_1",
    "kd_loop_50",
    "kd_resume_skip",
    "kd_resume_skip_pulled",
    "kd_fit_mirrored_bn_per_replica",
    "plain_fit_mirrored_sync_bn",
    "tutorial_loop_sync_bn",
    "gathered_loop",
)
# Ratio name -> (numerator, denominator): the comparisons the targets use.
RATIOS = {
    "kd_fit / Keras 3 fit (mirrored)": ("kd_fit_mirrored", "plain_fit_mirrored"),
    "kd_fit / tf-keras fit (mirrored)": ("kd_fit_mirrored", "tf_keras_fit_mirrored"),
    "kd_fit_spe50 / kd_fit (mirrored)": ("kd_fit_mirrored_spe50", "kd_fit_mirrored"),
    "kd_fit_spe50 / Keras 3 fit (mirrored)": ("kd_fit_mirrored_spe50", "plain_fit_mirrored"),
    "kd_fit / kd_fit one all-reduce": ("kd_fit_mirrored", "kd_fit_mirrored_one_all_reduce"),
    "kd_fit small buckets / one all-reduce": ("kd_fit_mirrored_buckets", "kd_fit_mirrored_one_all_reduce"),
    "kd_loop_50 / tutorial_loop": ("kd_loop_50", "tutorial_loop_per_step"),
    "kd_loop_1 / tutorial_loop": ("kd_loop_1", "tutorial_loop_per_step"),
    "plain_fit_mirrored / plain_fit_one_device": ("plain_fit_mirrored", "plain_fit_one_device"),
    # Skipping a batch when resuming, as a fraction of training it: the
    # inverse of the speed ratio (lower is better).
    "resume: skip time / train time": ("kd_fit_mirrored", "kd_resume_skip"),
    "resume, pulled per batch: skip / train": ("kd_fit_mirrored", "kd_resume_skip_pulled"),
    # --model cnn_bn: global BatchNormalization statistics (kd's default,
    # exact) against per-replica ones (compile(batch_norm="per_replica")).
    "kd_fit BN global / BN per_replica": ("kd_fit_mirrored", "kd_fit_mirrored_bn_per_replica"),
    "kd_fit BN global / Keras 3 SyncBN": ("kd_fit_mirrored", "plain_fit_mirrored_sync_bn"),
    # --model contrastive: kd gathering the global batch where rows meet, against
    # a loop gathering it by hand (SimCLR's and CLIP's code) and plain Keras,
    # which compares each replica's rows only (not the same model).
    "kd_fit / hand-gathered loop (contrastive)": ("kd_fit_mirrored", "gathered_loop"),
}
# Built only when asked for by name (`only`, `--variants`): kd `fit` with
# `gradient_buckets="one"`, and with buckets forced small (`SMALL_BUCKET_BYTES`),
# against the latency benchmark's kd `fit` ("auto").
ON_REQUEST = ("kd_fit_mirrored_one_all_reduce", "kd_fit_mirrored_buckets")
# Splits the MLP's gradient in 2 buckets (the head's kernel and bias; the hidden
# layer's): a gradient is never cut, so a bucket holds whole variables.
SMALL_BUCKET_BYTES = 4096
TARGETS = {  # name -> (comparison, bound)
    "kd_fit / Keras 3 fit (mirrored)": (">=", 0.99),
    "kd_fit / tf-keras fit (mirrored)": (">=", 1.0),
    "kd_fit_spe50 / kd_fit (mirrored)": (">=", 1.2),
    "resume: skip time / train time": ("<=", 0.10),
}


def _model(kind, model_class, synchronized=False):
    import keras

    keras.utils.set_random_seed(0)
    if kind == "cnn":
        inputs = keras.Input((28, 28, 1))
        x = keras.layers.Conv2D(16, 3, activation="relu")(inputs)
        x = keras.layers.MaxPooling2D()(x)
        x = keras.layers.Conv2D(32, 3, activation="relu")(x)
        x = keras.layers.MaxPooling2D()(x)
        x = keras.layers.Flatten()(x)
    elif kind == "cnn_bn":
        inputs = keras.Input((28, 28, 1))
        x = inputs
        for filters in (16, 32):
            x = keras.layers.Conv2D(filters, 3, use_bias=False)(x)
            x = keras.layers.ReLU()(keras.layers.BatchNormalization(synchronized=synchronized)(x))
            x = keras.layers.MaxPooling2D()(x)
        x = keras.layers.Flatten()(x)
    else:
        inputs = keras.Input((28, 28, 1))
        x = keras.layers.Flatten()(inputs)
        x = keras.layers.Dense(128, activation="relu")(x)
    outputs = keras.layers.Dense(10)(x)
    return model_class(inputs, outputs)


def _compile(model, steps_per_execution=1, **kd_options):
    import keras

    loss = None if hasattr(model, "towers") else keras.losses.SparseCategoricalCrossentropy(
        from_logits=True)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss,
                  steps_per_execution=steps_per_execution, **kd_options)


def _tower(keras):
    inputs = keras.Input((28, 28, 1))
    hidden = keras.layers.Dense(128, activation="relu")(keras.layers.Flatten()(inputs))
    return keras.Model(inputs, keras.layers.Dense(32)(hidden))


def _views(images):
    """An image and its mirror image: the two views the contrastive model pairs."""
    import tensorflow as tf

    return images, tf.reverse(images, axis=[2])


def _contrastive_model(model_class):
    """A dual encoder with in-batch negatives (CLIP's symmetric loss in its own compute_loss)."""
    import keras
    import numpy as np
    import tensorflow as tf
    from keras import ops

    class DualEncoder(model_class):
        def __init__(self):
            super().__init__()
            self.towers = [_tower(keras), _tower(keras)]

        def call(self, images, training=False):
            first, second = _views(images)
            return (ops.normalize(self.towers[0](first), axis=1),
                    ops.normalize(self.towers[1](second), axis=1))

        def compute_loss(self, a, b):
            logits = ops.matmul(a, ops.transpose(b)) / 0.1
            pairs = ops.arange(ops.shape(a)[0])
            return (keras.losses.sparse_categorical_crossentropy(pairs, logits, from_logits=True)
                    + keras.losses.sparse_categorical_crossentropy(
                        pairs, ops.transpose(logits), from_logits=True)) / 2

        def train_step(self, data):
            images, _, _ = keras.utils.unpack_x_y_sample_weight(data)
            with tf.GradientTape() as tape:
                loss = self.compute_loss(*self(images, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"loss": ops.mean(loss)}

    keras.utils.set_random_seed(0)
    model = DualEncoder()
    model(np.zeros((1, 28, 28, 1), "float32"))
    return model


def step_clock(callback_class, on_step_end):
    """`fit`'s callbacks calling `on_step_end()` after each training step (none if it is None).

    `callback_class` is Keras 3's or tf-keras's `Callback`, so that either `fit` accepts it.
    """
    if on_step_end is None:
        return []

    class StepClock(callback_class):
        def on_train_batch_end(self, batch, logs=None):
            on_step_end()

    return [StepClock()]


def hand_loop(strategy, dataset, step, on_step_end=None):
    """One epoch of TensorFlow's custom-training-loop tutorial around `step`.

    The shape the tutorial teaches: the dataset distributed by the strategy,
    each batch through `strategy.run(step)` in a `tf.function`, the replicas'
    losses summed. The benchmarks' hand-written loops differ only in `step`.

    Args:
        strategy: The strategy `step` runs under.
        dataset: The global batches.
        step: One replica's training step on its share of a batch.
        on_step_end: Called with no argument after each step, or None.

    Returns:
        A callable running the epoch.
    """
    import tensorflow as tf

    @tf.function
    def distributed_step(inputs):
        return strategy.reduce("SUM", strategy.run(step, args=(inputs,)), axis=None)

    distributed = strategy.experimental_distribute_dataset(dataset)

    def run():
        for batch in distributed:
            distributed_step(batch)
            if on_step_end is not None:
                on_step_end()

    return run


def runners(kind, steps, strategy, only=None, on_step_end=None):
    """name -> callable running one epoch of `steps` steps (after building).

    Args:
        kind: The model: `"mlp"`, `"cnn"`, `"cnn_bn"`, or `"contrastive"` (a dual
            encoder with in-batch negatives, which the hand-gathered loop
            `gathered_loop` also trains).
        steps: Global batches (of `GLOBAL_BATCH` rows) in the epoch.
        strategy: The strategy every distributed variant trains under.
        only: Names from `VARIANTS` to build; all but `ON_REQUEST` by
            default. Building a model under a multi-worker strategy talks to
            every worker, so `keras-distrib bench --network` builds only
            those it times.
        on_step_end: Called with no argument after each training step of the
            `fit` variants (a callback) and of the tutorial loop, so that a
            caller can time steps without `fit`'s set-up and epoch end.

    Returns:
        A dict of the requested variants that can run here (tf-keras's
        are left out when it is not installed).
    """
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_distrib as kd

    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * steps, 28, 28, 1)).astype("float32")
    y = rng.integers(0, 10, size=(GLOBAL_BATCH * steps,)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).cache()

    def fit_runner(model_class, scope, steps_per_execution=1, synchronized=False, **kd_options):
        with scope:
            model = _contrastive_model(model_class) if kind == "contrastive" else \
                _model(kind, model_class, synchronized)
            _compile(model, steps_per_execution, **kd_options)
        callbacks = step_clock(keras.callbacks.Callback, on_step_end)

        def run():
            model.fit(dataset, epochs=1, verbose=0, callbacks=callbacks)

        run.model = model  # its traced step's collectives can be counted (`collectives.traced`)
        return run

    def loop_runner(steps_per_loop):
        with strategy.scope():
            model = _contrastive_model(kd.Model) if kind == "contrastive" else _model(kind, kd.Model)
            _compile(model)
        loop = kd.TrainLoop(model, steps_per_loop=steps_per_loop)
        distributed = loop.distribute(dataset)
        calls = -(-steps // steps_per_loop)

        def run():
            iterator = iter(distributed)
            for _ in range(calls):
                loop.train_step(iterator)

        return run

    def tutorial_runner(synchronized=False):
        # TensorFlow's custom-training tutorial: strategy.run per step,
        # compute_average_loss with the fixed global batch.
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        with strategy.scope():
            model = _model(kind, keras.Model, synchronized)
            optimizer = keras.optimizers.Adam(1e-3)
            optimizer.build(model.trainable_variables)

        def step(inputs):
            features, labels = inputs
            with tf.GradientTape() as tape:
                per_example = loss_fn(labels, model(features, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return hand_loop(strategy, dataset, step, on_step_end)

    def gathered_runner():
        # In-batch negatives gathered by hand, as SimCLR's and CLIP's own code
        # does: each replica's queries against every replica's keys
        # (`all_gather`, whose gradient is summed back to each replica), labels
        # offset by the replica's place, the loss over the fixed global batch.
        with strategy.scope():
            model = _contrastive_model(keras.Model)
            optimizer = keras.optimizers.Adam(1e-3)
            optimizer.build(model.trainable_variables)

        def step(images):
            context = tf.distribute.get_replica_context()
            with tf.GradientTape() as tape:
                a, b = model(images, training=True)
                keys = context.all_gather(b, axis=0)
                rows = tf.shape(a)[0]
                offset = context.replica_id_in_sync_group * rows
                logits = tf.matmul(a, keys, transpose_b=True) / 0.1
                labels = offset + tf.range(rows)
                per_row = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
                loss = tf.nn.compute_average_loss(per_row, global_batch_size=GLOBAL_BATCH)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return hand_loop(strategy, dataset.map(lambda x, y: x), step, on_step_end)

    def tf_keras_runner():
        # Legacy Keras 2 (the package users fall back to), same model and data.
        try:
            import tf_keras
        except ImportError:
            return None
        with strategy.scope():
            tf_keras.utils.set_random_seed(0)
            inputs = tf_keras.Input((28, 28, 1))
            if kind == "cnn_bn":  # tf-keras's default: per-replica statistics
                x = inputs
                for filters in (16, 32):
                    x = tf_keras.layers.Conv2D(filters, 3, use_bias=False)(x)
                    x = tf_keras.layers.ReLU()(tf_keras.layers.BatchNormalization()(x))
                    x = tf_keras.layers.MaxPooling2D()(x)
                x = tf_keras.layers.Flatten()(x)
            elif kind == "cnn":
                x = tf_keras.layers.Conv2D(16, 3, activation="relu")(inputs)
                x = tf_keras.layers.MaxPooling2D()(x)
                x = tf_keras.layers.Conv2D(32, 3, activation="relu")(x)
                x = tf_keras.layers.MaxPooling2D()(x)
                x = tf_keras.layers.Flatten()(x)
            else:
                x = tf_keras.layers.Dense(128, activation="relu")(tf_keras.layers.Flatten()(inputs))
            model = tf_keras.Model(inputs, tf_keras.layers.Dense(10)(x))
            model.compile(
                optimizer=tf_keras.optimizers.Adam(1e-3),
                loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        callbacks = step_clock(tf_keras.callbacks.Callback, on_step_end)
        return lambda: model.fit(dataset, epochs=1, verbose=0, callbacks=callbacks)

    def resume_runner(before_distribution):
        # What resuming mid-epoch adds: moving past the epoch's batches
        # without training them. Opening the epoch's distributed iterator
        # (0.1-0.2 s here) is left out: every epoch pays it, resumed or
        # not, and it would hide the skip. The runner returns the seconds
        # it counts.
        from keras_distrib import _keras_compat
        from keras_distrib.training import step as step_lib

        with strategy.scope():
            model = _model(kind, kd.Model)
            _compile(model)
        skipper = step_lib.Step(model, "train")
        distributed = strategy.experimental_distribute_dataset(dataset)

        def skip_before():
            # kd's loop.skip_before_distribution: the batched dataset wrapped
            # in `skip` and distributed again; the first pull moves past
            # every skipped batch.
            started = time.perf_counter()
            skipped = _keras_compat.redistributed(distributed, lambda d: d.skip(steps))
            made = time.perf_counter()
            iterator = iter(skipped)
            opened = time.perf_counter()
            skipper.skip(iterator, 1)
            return (made - started) + (time.perf_counter() - opened)

        def skip_pulled():
            # Step.skip: every batch pulled through the distributed iterator
            # (split per replica); kd's path where the data cannot be skipped
            # before distribution, and its only path before.
            iterator = iter(distributed)
            started = time.perf_counter()
            skipper.skip(iterator, steps)
            return time.perf_counter() - started

        return skip_before if before_distribution else skip_pulled

    if kind == "contrastive":
        builders = {
            "plain_fit_one_device": lambda: fit_runner(keras.Model, tf.distribute.get_strategy().scope()),
            "plain_fit_mirrored": lambda: fit_runner(keras.Model, strategy.scope()),
            "kd_fit_mirrored": lambda: fit_runner(kd.Model, strategy.scope()),
            "kd_loop_1": lambda: loop_runner(1),
            "gathered_loop": gathered_runner,
        }
        return {name: builders[name]() for name in VARIANTS
                if name in builders and (only is None or name in only)}
    builders = {
        "plain_fit_one_device": lambda: fit_runner(keras.Model, tf.distribute.get_strategy().scope()),
        "plain_fit_mirrored": lambda: fit_runner(keras.Model, strategy.scope()),
        "tf_keras_fit_mirrored": tf_keras_runner,
        "kd_fit_mirrored": lambda: fit_runner(kd.Model, strategy.scope()),
        "kd_fit_mirrored_spe50": lambda: fit_runner(kd.Model, strategy.scope(), steps_per_execution=50),
        "tutorial_loop_per_step": tutorial_runner,
        "kd_loop_1": lambda: loop_runner(1),
        "kd_loop_50": lambda: loop_runner(50),
        "kd_resume_skip": lambda: resume_runner(before_distribution=True),
        "kd_resume_skip_pulled": lambda: resume_runner(before_distribution=False),
    }
    if only is not None:
        builders["kd_fit_mirrored_one_all_reduce"] = lambda: fit_runner(
            kd.Model, strategy.scope(), gradient_buckets="one")
        builders["kd_fit_mirrored_buckets"] = lambda: fit_runner(
            kd.Model, strategy.scope(), gradient_buckets=SMALL_BUCKET_BYTES)
    if kind == "cnn_bn":
        builders["kd_fit_mirrored_bn_per_replica"] = lambda: fit_runner(
            kd.Model, strategy.scope(), batch_norm="per_replica")
        builders["plain_fit_mirrored_sync_bn"] = lambda: fit_runner(
            keras.Model, strategy.scope(), synchronized=True)
        # Keras 3's fit of this model failed under MultiWorkerMirroredStrategy
        # (a PerReplica conversion error in its workers); its
        # synchronized layers run there in the tutorial's loop.
        builders["tutorial_loop_sync_bn"] = lambda: tutorial_runner(synchronized=True)
    built = {}
    for name in VARIANTS:  # in VARIANTS' order, the order of the tables
        if name in builders and (only is None or name in only):
            runner = builders[name]()
            if runner is not None:
                built[name] = runner
    return built


def _measure(options):
    """Runs in the benchmark process (virtual devices already split)."""
    import keras_distrib as kd

    strategy = kd.make_strategy("mirrored")
    chosen = options.variants.split(",") if options.variants else None
    built = runners(options.model, options.steps, strategy, only=chosen)
    variants = list(built)
    for name in variants:  # Warm-up: trace and compile everything first.
        built[name]()
    timings = {name: [] for name in variants}
    for _ in range(options.repeats):
        for name in variants:
            started = time.perf_counter()
            counted = built[name]()
            elapsed = time.perf_counter() - started
            # A runner that returns a float says how many of those seconds count.
            timings[name].append(options.steps / (counted if isinstance(counted, float) else elapsed))
    return timings


def first_step_task():
    """What each launched task runs: prints the time of its first training step."""
    import keras_distrib as kd

    strategy = kd.make_strategy("multi_worker")
    import keras
    import numpy as np

    class FirstStep(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                print(f"FIRST_STEP {time.time()}", flush=True)

    with strategy.scope():
        inputs = keras.Input((8,))
        model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    x = np.zeros((64, 8), "float32")
    model.fit(x, x[:, :1], batch_size=16, epochs=1, verbose=0, callbacks=[FirstStep()])


def _launch_to_first_step(repeats):
    """`(seconds, None)`: from `kd.launch` to the first training step on 2 workers, each time;
    `([], why)` where no private network can be made for them (this command opens no ports)."""
    from keras_distrib.cluster import launcher
    from keras_distrib.cluster import requests

    times = []
    for _ in range(repeats):
        lines = []
        started = time.time()
        try:
            result = launcher.launch(
                "keras_distrib.commands.bench:first_step_task", workers=2, timeout=120,
                sink=lines.append,
                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""},
            )
        except requests.NoPrivateNetwork as error:
            return [], error.reason
        stamps = [float(l.rsplit(" ", 1)[1]) for l in lines if "FIRST_STEP " in l]
        if result.returncode != 0 or len(stamps) != 2:
            raise RuntimeError("launch benchmark failed:\n" + "\n".join(lines[-20:]))
        times.append(max(stamps) - started)
    return times, None


def run(model="cnn", replicas=2, steps=100, repeats=3, json_path=None, print_fn=print, variants=None):
    """Runs the benchmark (in a subprocess) and prints the table; returns the report.

    `variants`: names from `VARIANTS` to measure (all when None); with a
    choice, the launch timing is left out too.
    """
    command = [
        sys.executable, "-m", "keras_distrib.commands.bench", "--worker", "--model", model,
        "--replicas", str(replicas), "--steps", str(steps), "--repeats", str(repeats),
    ] + (["--variants", ",".join(variants)] if variants else [])
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    lines = [l for l in completed.stdout.splitlines() if l.startswith("TIMINGS ")]
    if completed.returncode != 0 or not lines:
        raise RuntimeError("benchmark process failed:\n" + completed.stderr[-3000:])
    timings = json.loads(lines[0][8:])
    launch, not_run = ([], None) if variants else _launch_to_first_step(max(1, min(repeats, 3)))
    report = {
        "format": 1,
        "config": {"model": model, "replicas": replicas, "steps": steps, "repeats": repeats,
                   "global_batch": GLOBAL_BATCH, "cpus": os.cpu_count()},
        "steps_per_second": {k: statistics.median(v) for k, v in timings.items()},
        "runs": timings,
        "launch_to_first_step_seconds": {"median": statistics.median(launch) if launch else None,
                                         "runs": launch, "not_run": not_run},
    }
    medians = report["steps_per_second"]
    report["ratios"] = {
        name: medians[a] / medians[b] for name, (a, b) in RATIOS.items() if a in medians and b in medians
    }
    print_fn(f"model={model} replicas={replicas} global_batch={GLOBAL_BATCH} steps={steps} repeats={repeats}")
    print_fn(f"{'variant':28s} {'steps/s (median)':>17s}")
    for name in VARIANTS:
        if name not in medians and (name == "kd_fit_mirrored_bn_per_replica" or name in ON_REQUEST
                                    or variants):
            continue  # --model cnn_bn only, asked for by name only, or not chosen
        shown = f"{medians[name]:17.1f}" if name in medians else f"{'(not installed)':>17s}"
        print_fn(f"{name:28s} {shown}")
    print_fn(f"{'ratio':44s} {'value':>7s} {'target':>9s}")
    for name, value in report["ratios"].items():
        mark = ""
        if name in TARGETS:
            comparison, bound = TARGETS[name]
            met = value >= bound if comparison == ">=" else value <= bound
            mark = f"{comparison}{bound:4.2f}" + (" ok" if met else " MISSED")
        print_fn(f"{name:44s} {value:7.3f} {mark:>9s}")
    if launch:
        print_fn(f"2-worker launch to first step: {statistics.median(launch):.1f} s (target <= 10)")
    elif not_run:
        print_fn(f"2-worker launch to first step: not run: {not_run}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)
    return report


def _worker_main(options):
    import keras_distrib as kd

    kd.virtual_devices(options.replicas)
    print("TIMINGS " + json.dumps(_measure(options)), flush=True)


def main(argv=None):
    """Runs `keras-distrib bench ARGS`; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="keras-distrib bench",
        description="Steps/s of plain Keras, tf-keras, kd fit and kd.TrainLoop on the same model, "
        "data and global batch (64), in one process with --replicas virtual devices, the "
        "variants taking turns; medians of --repeats epochs of --steps steps after a warm-up, "
        "and their ratios (cnn_bn: also kd fit with per-replica BatchNormalization statistics "
        "and Keras 3 with synchronized=True; contrastive: a dual encoder with in-batch "
        "negatives, kd against a loop that gathers the global batch by hand as SimCLR's code "
        "does, and plain Keras, which compares each replica's rows only). Without --variants, "
        "also the time from a 2-worker launch to the first training step.")
    parser.add_argument("--model", choices=("mlp", "cnn", "cnn_bn", "contrastive"), default="cnn")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--variants", default=None,
                        help="comma-separated variants to measure (default: all; skips the launch timing)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    problems = [f"`--{k}`={getattr(options, k)} must be >= 1" for k in ("replicas", "steps", "repeats")
                if getattr(options, k) < 1]
    unknown = [v for v in (options.variants or "").split(",") if v and v not in VARIANTS]
    if unknown:
        problems.append(f"`--variants` names unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    if options.json is not None:
        problems += filter(None, [validation.output_path_problem("--json", options.json)])
    if problems:
        parser.error("; ".join(problems))
    if options.worker:
        return _worker_main(options)
    variants = options.variants.split(",") if options.variants else None
    run(options.model, options.replicas, options.steps, options.repeats, options.json, variants=variants)
    return 0


if __name__ == "__main__":
    sys.exit(main())
