"""`keras-distrib demo`: the same global batches give the same model.

Trains one small classifier several ways (each in its own process, since a
process holds one device layout) and prints a table of final loss, accuracy
and the largest weight difference against plain Keras on one device:

- plain Keras, one device (the reference);
- kd under MirroredStrategy on 2 virtual CPU devices;
- kd on 2 local worker processes (MultiWorkerMirroredStrategy, via the
  launcher), the chief alone writing the checkpoint and TensorBoard logs;
- a kd.TrainLoop with 10 steps per compiled call, on 2 virtual devices;
- for contrast, plain Keras under the same mirrored strategy (wrong on the
  uneven last batch) and on 2 workers (it crashes).
"""

import argparse
import json
import os
import subprocess
import sys
import time

__all__ = [
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


def _stage(name, out, epochs, rows):
    """Runs one stage in this process; writes `<out>/<name>.npz` (chief only)."""
    import keras_distrib as kd

    if name in ("kd_mirrored", "plain_mirrored", "kd_loop"):
        kd.virtual_devices(2)
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

    from keras_distrib import cluster

    model_class = kd.Model if name.startswith("kd_") else keras.Model
    x, y = make_data(rows)
    if strategy is None:
        model = build(model_class)
    else:
        with strategy.scope():
            model = build(model_class)
    verbose = 2 if kd.is_chief() else 0
    callbacks = []
    if name == "kd_workers":
        callbacks = [
            kd.callbacks.ModelCheckpoint(os.path.join(out, "checkpoints", "model-{epoch:02d}.keras"), monitor="loss"),
            kd.callbacks.TensorBoard(os.path.join(out, "tensorboard")),
        ]
    fit = kd.TrainLoop(model, steps_per_loop=10).fit if name == "kd_loop" else model.fit
    history = fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=verbose,
        callbacks=callbacks,
    )
    with cluster.writer_directory(out) as directory:
        path = os.path.join(directory, f"{name}.npz")
        np.savez(
            path,
            *model.get_weights(),
            loss=history.history["loss"][-1],
            accuracy=history.history["accuracy"][-1],
        )


def _run(argv, timeout):
    process = subprocess.run(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    return process.returncode, process.stdout


def _load(out, name):
    import numpy as np

    data = np.load(os.path.join(out, f"{name}.npz"))
    weights = [data[k] for k in sorted((k for k in data.files if k.startswith("arr_")), key=lambda k: int(k[4:]))]
    return weights, float(data["loss"]), float(data["accuracy"])


def _last_error(output):
    lines = [line.split("]", 1)[-1].strip() for line in output.splitlines() if "Error:" in line]
    return (lines[-1] if lines else "failed")[:100]


def main(quick=False, out="kd_demo_out"):
    """Runs every stage, prints the table; returns 0 if kd matched one device."""
    import numpy as np

    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    epochs, rows = (2, 449) if quick else (5, 1985)
    env_argv = [sys.executable, "-u", "-m", "keras_distrib.demo", "--out", out,
                "--epochs", str(epochs), "--rows", str(rows), "--stage"]
    print(f"keras-distrib demo: {rows} rows, global batch {GLOBAL_BATCH} "
          f"(last batch {rows % GLOBAL_BATCH} rows), {epochs} epochs; output in {out}")
    rows_out, failures = [], {}
    stages = [
        ("one_device", "plain Keras, 1 device (reference)"),
        ("kd_mirrored", "kd, mirrored, 2 virtual devices"),
        ("kd_workers", "kd, 2 worker processes (launcher)"),
        ("kd_loop", "kd.TrainLoop, 10 steps/call, 2 devices"),
        ("plain_mirrored", "plain Keras, mirrored, 2 devices"),
        ("plain_workers", "plain Keras, 2 worker processes"),
    ]
    from keras_distrib import launcher as launch_lib

    for name, title in stages:
        started = time.monotonic()
        print(f"== {title}", flush=True)
        if name.endswith("_workers"):
            lines = []
            result = launch_lib.launch(
                "keras_distrib.demo:_stage_main",
                workers=2,
                args=[["--out", out, "--epochs", str(epochs), "--rows", str(rows), "--stage", name]],
                timeout=300,
                sink=lambda line: (lines.append(line), print(line, flush=True)),
            )
            code, output = result.returncode, "\n".join(lines)
        else:
            code, output = _run(env_argv + [name], timeout=300)
            print("\n".join(l for l in output.splitlines() if " - loss:" in l or "Epoch" in l))
        if code != 0:
            failures[name] = _last_error(output)
        print(f"   ({time.monotonic() - started:.1f} s)", flush=True)
        rows_out.append((name, title))

    reference = _load(out, "one_device")
    table = []
    print()
    print(f"{'run':40s} {'loss':>8s} {'accuracy':>9s} {'max |w - w_ref|':>16s}")
    for name, title in rows_out:
        if name in failures:
            print(f"{title:40s} FAILED: {failures[name]}")
            table.append({"run": name, "failed": failures[name]})
            continue
        weights, loss, accuracy = _load(out, name)
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, reference[0]))
        print(f"{title:40s} {loss:8.4f} {accuracy:9.4f} {diff:16.2e}")
        table.append({"run": name, "loss": loss, "accuracy": accuracy, "max_weight_diff": diff})
    with open(os.path.join(out, "demo_table.json"), "w") as f:
        json.dump(table, f, indent=1)
    print(f"\nkd runs match the one-device run to float32 round-off. Written by the "
          f"chief of the 2-worker run: checkpoints in {os.path.join(out, 'checkpoints')}, "
          f"TensorBoard logs in {os.path.join(out, 'tensorboard')} "
          f"(tensorboard --logdir {os.path.join(out, 'tensorboard')}); "
          f"the table in {os.path.join(out, 'demo_table.json')}.")
    kd_ok = all(
        row.get("max_weight_diff", 1.0) <= 1e-5 for row in table if row["run"].startswith(("kd_", "one_"))
    )
    return 0 if kd_ok else 1


def _stage_main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--rows", type=int, required=True)
    options = parser.parse_args(argv)
    _stage(options.stage, options.out, options.epochs, options.rows)


if __name__ == "__main__":
    _stage_main()
