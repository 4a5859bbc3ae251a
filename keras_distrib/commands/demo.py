"""`keras-distrib demo`: the same global batches give the same model.

Trains one small classifier several ways and prints a table of final loss,
accuracy and the largest weight difference against plain Keras on one
device:

- plain Keras, one device (the reference);
- kd under MirroredStrategy on 2 virtual CPU devices;
- a kd.TrainLoop with 10 steps per compiled call, on 2 virtual devices;
- for contrast, plain Keras under the same mirrored strategy (wrong on the
  uneven last batch);
- kd on 2 local worker processes (MultiWorkerMirroredStrategy, via the
  launcher), the chief alone writing the checkpoint and TensorBoard logs;
- for contrast, plain Keras on 2 workers (it crashes).

The first four share one process split into 2 virtual devices (`LOCAL`: one
device layout, one collective group size; the reference runs on the first
device), so TensorFlow is imported once for them; each worker stage is its
own processes.

The whole output fits on one screen: a row per run as it finishes, a failed
run as its error's type and first line, the network the worker processes
got (the most private this machine allows, by default). Where no private
network can be made, the worker stages' rows say so, and which command runs
them; the other stages still run. `--verbose` shows every stage's
own output instead (epochs, TensorFlow's logs, tracebacks).
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import traceback

from keras_distrib import report
from keras_distrib import tf_logs

__all__ = [
    "STAGES",
    "build",
    "main",
    "make_data",
]

GLOBAL_BATCH = 64
FEATURES = 32
CLASSES = 10


def make_data(rows):
    """A deterministic 10-class problem; `rows` is not a multiple of 64."""
    import numpy as np

    rng = np.random.default_rng(0)
    centers = rng.normal(scale=0.5, size=(CLASSES, FEATURES))
    labels = rng.integers(0, CLASSES, size=rows)
    features = centers[labels] + rng.normal(size=(rows, FEATURES))
    return features.astype("float32"), labels.astype("int32")


def build(model_class):
    """The demo's classifier, built with `model_class` and a fixed seed, compiled."""
    import keras

    keras.utils.set_random_seed(7)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(
        32, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3)
    )(inputs)
    model = model_class(inputs, keras.layers.Dense(CLASSES)(hidden))
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


STAGES = (
    ("one_device", "plain Keras, 1 device (reference)"),
    ("kd_mirrored", "kd, mirrored, 2 virtual devices"),
    ("kd_loop", "kd.TrainLoop, 10 steps/call, 2 devices"),
    ("plain_mirrored", "plain Keras, mirrored, 2 devices"),
    ("kd_workers", "kd, 2 worker processes (launcher)"),
    ("plain_workers", "plain Keras, 2 worker processes"),
)
# The stages run one after the other in one process on 2 virtual devices.
LOCAL = ("one_device", "kd_mirrored", "kd_loop", "plain_mirrored")
_DONE = "kd-demo-done: "  # a local stage has ended (its name follows): its row can be printed
_SAY = "kd-demo: "  # stage lines the demo shows (the rest only with --verbose)
_NETWORK_NOTE = "[launcher] network: "  # the launcher's line naming the workers' network, shown too


def _stage(name, out, epochs, rows, verbose):
    """Runs one stage in this process; writes `<out>/<name>.npz` (chief only)."""
    import keras_distrib as kd

    if name in LOCAL:
        kd.virtual_devices(2)  # (once per process: a later call with the same layout does nothing)
    strategy = {
        "one_device": None,
        "kd_mirrored": "mirrored",
        "kd_loop": "mirrored",
        "plain_mirrored": "mirrored",
        "kd_workers": "multi_worker",
        "plain_workers": "multi_worker",
    }[name]
    strategy = kd.make_strategy(strategy) if strategy else None
    import keras
    import numpy as np

    from keras_distrib.cluster import info as cluster

    model_class = kd.Model if name.startswith("kd_") else keras.Model
    x, y = make_data(rows)
    if strategy is None:
        model = build(model_class)
    else:
        with strategy.scope():
            model = build(model_class)
    callbacks = []
    checkpoints = os.path.join(out, "checkpoints")
    if name == "kd_workers":
        callbacks = [
            kd.callbacks.ModelCheckpoint(os.path.join(checkpoints, "model-{epoch:02d}.keras"), monitor="loss"),
            kd.callbacks.TensorBoard(os.path.join(out, "tensorboard")),
        ]
    fit = kd.TrainLoop(model, steps_per_loop=10).fit if name == "kd_loop" else model.fit
    history = fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False,
        verbose=(2 if kd.is_chief() else 0) if verbose else 0, callbacks=callbacks,
    )
    with cluster.writer_directory(out) as directory:
        path = os.path.join(directory, f"{name}.npz")
        np.savez(
            path,
            *model.get_weights(),
            loss=history.history["loss"][-1],
            accuracy=history.history["accuracy"][-1],
        )
    if name == "kd_workers":
        if kd.is_chief():
            saved = len(os.listdir(checkpoints))
            print(f"{_SAY}chief: wrote {saved} checkpoints and the TensorBoard logs", flush=True)
        else:
            print(f"{_SAY}not the chief: took part in every save, kept no file", flush=True)


def _local_stages(names, out, epochs, rows, verbose, env, timeout=600):
    """Runs the local stages `names` in one process, in order; yields `(name, code, output, said)`
    for each as it ends (code 0: it wrote its result).

    A stage the process did not reach (it crashed, or ran out of `timeout`
    seconds) ends with the process's exit code and its last output.
    """
    argv = [sys.executable, "-u", "-m", "keras_distrib.commands.demo", "--out", out,
            "--epochs", str(epochs), "--rows", str(rows), "--stage", ",".join(names)]
    if verbose:
        argv.append("--verbose")
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=env)
    timer = threading.Timer(timeout, process.kill)
    timer.start()
    left, lines = list(names), []
    try:
        for line in process.stdout:
            if line.startswith(_DONE):
                name = line[len(_DONE):].strip()
                code = 0 if os.path.exists(os.path.join(out, f"{name}.npz")) else 1
                yield name, code, "".join(lines), _said(lines)
                left.remove(name)
                lines = []
                continue
            lines.append(line)
            if verbose:
                print(line, end="", flush=True)
    finally:
        timer.cancel()
        if process.poll() is None:
            process.kill()
        process.wait()
    for name in left:
        yield name, process.returncode or 1, "".join(lines), _said(lines)
        lines = []


def _said(lines):
    return [line.rstrip("\n").replace(_SAY, "", 1) for line in lines if line.startswith(_SAY)]


def _load(out, name):
    import numpy as np

    data = np.load(os.path.join(out, f"{name}.npz"))
    weights = [data[k] for k in sorted((k for k in data.files if k.startswith("arr_")), key=lambda k: int(k[4:]))]
    return weights, float(data["loss"]), float(data["accuracy"])


def _error_path(out, name):
    return os.path.join(out, f"{name}.error")


def _failure(out, name, output):
    """The stage's error as one line (written by the stage), else its last line."""
    try:
        with open(_error_path(out, name)) as f:
            return f.read().strip()
    except OSError:
        lines = [line for line in output.splitlines() if line.strip()]
        return report.error_line(lines[-1] if lines else "failed (no output)")


def _run_stage(name, out, epochs, rows, verbose, env, network):
    """Runs a stage (in a process, or 2 for the worker stages); returns (code, output, said).

    A worker stage that no private network allows here gives code None and,
    as its output, why and the command that runs it. (`main` runs the
    `LOCAL` stages together, through `_local_stages`.)
    """
    stage_args = ["--out", out, "--epochs", str(epochs), "--rows", str(rows), "--stage", name]
    if verbose:
        stage_args.append("--verbose")
    said = []
    if name.endswith("_workers"):
        from keras_distrib.cluster import launcher
        from keras_distrib.cluster import requests

        lines = []

        def sink(line):
            lines.append(line)
            if verbose:
                print(line, flush=True)
            elif _SAY in line:
                said.append(line.replace(_SAY, "", 1))
            elif name == "kd_workers" and line.startswith(_NETWORK_NOTE):
                said.append(line.replace("[launcher] ", "", 1))

        try:
            result = launcher.launch(
                "keras_distrib.commands.demo:_stage_main", workers=2, args=[stage_args], timeout=300,
                env=env, sink=sink, verbose=verbose,
                private_network=requests.NETWORK_OPTIONS[network],
            )
        except requests.NoPrivateNetwork as error:
            return None, f"not run: {error.reason}; {error.remedy('keras-distrib demo')}", said
        return result.returncode, "\n".join(lines), said
    ((_, code, output, said),) = _local_stages([name], out, epochs, rows, verbose, env, timeout=300)
    return code, output, said


def main(quick=False, out="kd_demo_out", verbose=False, network="auto"):
    """Runs every stage, prints the table; returns 0 if every kd stage that ran matched one device.

    `verbose` shows every stage's own output (epochs, TensorFlow's logs,
    tracebacks) instead of one row per run. `network` is the worker stages'
    `--network` (`requests.NETWORK_OPTIONS`); where it cannot be met, their
    rows say why and which command runs them.
    """
    import numpy as np

    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    for name, _ in STAGES:
        for path in (os.path.join(out, f"{name}.npz"), _error_path(out, name)):
            if os.path.exists(path):
                os.remove(path)
    epochs, rows = (2, 449) if quick else (5, 1985)
    env = tf_logs.task_environment(os.environ, verbose=verbose)
    last = rows % GLOBAL_BATCH
    print(f"keras-distrib demo: one classifier trained {len(STAGES)} ways on the same {rows} rows "
          f"and global batches\n({GLOBAL_BATCH} per step, the last one {last} row{'s' * (last != 1)}; "
          f"{epochs} epochs), compared with plain Keras on one device.\n", flush=True)
    headers = ("run", "loss", "accuracy", "max |w - w_ref|", "time")
    widths = (40, 8, 10, 17, 8)

    def row(cells):
        left, *right = cells
        return (f"{left:{widths[0]}s}" + "".join(f"{c:>{w}s}" for c, w in zip(right, widths[1:]))).rstrip()

    print(row(headers), flush=True)
    titles = dict(STAGES)
    table, reference, not_run = [], None, None

    def ended():
        """`(name, code, output, said)` of each stage as it ends, in the order of STAGES."""
        yield from _local_stages([n for n, _ in STAGES if n in LOCAL], out, epochs, rows, verbose, env)
        for name, _ in STAGES:
            if name in LOCAL:
                continue
            if not_run is not None:
                yield name, None, "not run: as above", []
            else:
                yield (name, *_run_stage(name, out, epochs, rows, verbose, env, network))

    started = time.monotonic()
    for name, code, output, said in ended():
        title = titles[name]
        seconds = f"{time.monotonic() - started:.1f} s"
        if code is None:
            not_run = output
            print(row((title, "not run", "", "", seconds)), flush=True)
            print(f"  {output.removeprefix('not run: ')}", flush=True)
            table.append({"run": name, "not_run": output})
        elif code != 0 or not os.path.exists(os.path.join(out, f"{name}.npz")):
            failure = _failure(out, name, output)
            print(row((title, "FAILED", "", "", seconds)), flush=True)
            print(f"  {failure}", flush=True)
            table.append({"run": name, "failed": failure})
        else:
            weights, loss, accuracy = _load(out, name)
            if reference is None:
                reference = weights
            diff = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, reference))
            print(row((title, f"{loss:.4f}", f"{accuracy:.4f}", f"{diff:.2e}", seconds)), flush=True)
            table.append({"run": name, "loss": loss, "accuracy": accuracy, "max_weight_diff": diff})
        for line in said:
            print(f"  {line}", flush=True)
        started = time.monotonic()
    with open(os.path.join(out, "demo_table.json"), "w") as f:
        json.dump(table, f, indent=1)
    kd_ok = all(
        row.get("max_weight_diff", 1.0) <= 1e-5 for row in table
        if row["run"].startswith(("kd_", "one_")) and "not_run" not in row
    )
    workers = ("on 2 workers it does not run." if not_run is None else
               "the 2-worker stages did not run here (see above).")
    verdict = (f"kd matches one device to float32 round-off. Plain Keras does not: on the "
               f"{last}-row last batch\neach replica divides its loss by its own rows; {workers}"
               if kd_ok else
               "A kd run does NOT match one device: please report it, with --verbose output.")
    print(f"\n{verdict}")
    if not_run is None:
        print(f"Written by the chief of the 2-worker run alone:\n"
              f"  checkpoints  {os.path.join(out, 'checkpoints')}\n"
              f"  TensorBoard  tensorboard --logdir {os.path.join(out, 'tensorboard')}")
    print(f"The table: {os.path.join(out, 'demo_table.json')}. Every stage's own output: --verbose.")
    return 0 if kd_ok else 1


def _stage_main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--verbose", action="store_true")
    options = parser.parse_args(argv)
    failed = False
    for name in options.stage.split(","):
        try:
            _stage(name, options.out, options.epochs, options.rows, options.verbose)
        except Exception as error:
            failed = True
            if options.verbose:
                traceback.print_exc()
            # The contrast stages fail on purpose: one line for the table, not
            # a traceback that prints whole tensors.
            path = _error_path(options.out, name)
            with open(f"{path}.{os.getpid()}.tmp", "w") as f:
                f.write(report.error_line(error))
            os.replace(f"{path}.{os.getpid()}.tmp", path)
            print(f"{report.error_line(error)} (--verbose shows the traceback)", flush=True)
        print(f"{_DONE}{name}", flush=True)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    _stage_main()
