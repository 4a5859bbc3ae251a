"""What a backup's manifest costs: writing it and checking it, on a model of 100 MB.

Usage: PYTHONPATH=. python tools/backup_manifest_cost.py [--repeats 3] [--dir DIR]

A Dense(5000 -> 5000) model (25 M float32 weights, 100 MB) with SGD (the
checkpoint holds the weights: 100 MB) and with Adam (weights and two slots:
300 MB). For each, `kd.CheckpointManager.save` and `restore` are timed
`--repeats` times; inside them, the manifest's part: hashing every file and
writing manifest.json on save, checking every file's SHA-256 on restore.
Prints the medians and the manifest's share. Written to `--dir` (a temporary
directory by default, removed at the end).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import keras_distrib as kd
import keras  # noqa: E402  (after kd: the TensorFlow backend)
import tensorflow as tf  # noqa: E402

from keras_distrib.checkpointing import checkpoint as checkpoint_lib  # noqa: E402


def _timed(module, name, spent):
    """Wraps `module.name` so each call adds its seconds to `spent`."""
    original = getattr(module, name)

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - started)

    setattr(module, name, timed)
    return original


def measure(optimizer_name, directory, repeats):
    inputs = keras.Input((5000,))
    model = kd.Model(inputs, keras.layers.Dense(5000)(inputs))
    optimizer = {"sgd": keras.optimizers.SGD(0.01), "adam": keras.optimizers.Adam(0.01)}[optimizer_name]
    optimizer.build(model.trainable_variables)
    manager = kd.CheckpointManager(tf.train.Checkpoint(model=model, optimizer=optimizer),
                                   os.path.join(directory, optimizer_name), max_to_keep=1)
    rows = {"save": [], "manifest written": [], "restore": [], "manifest checked": []}
    for _ in range(repeats):
        written, checked = [], []
        original_write = _timed(checkpoint_lib, "write_manifest", written)
        try:
            started = time.perf_counter()
            path = manager.save(epoch=1)
            rows["save"].append(time.perf_counter() - started)
        finally:
            checkpoint_lib.write_manifest = original_write
        rows["manifest written"].append(sum(written))
        manager._verified = None  # check again, as a restart does
        original_check = _timed(checkpoint_lib, "manifest_problems", checked)
        try:
            started = time.perf_counter()
            manager.restore()
            rows["restore"].append(time.perf_counter() - started)
        finally:
            checkpoint_lib.manifest_problems = original_check
        rows["manifest checked"].append(sum(checked))
    size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    manager.delete_all()
    return size, {k: statistics.median(v) for k, v in rows.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=options.dir) as directory:
        for name in ("sgd", "adam"):
            size, times = measure(name, directory, options.repeats)
            print(f"{name}: checkpoint {size / 1e6:.0f} MB; save {times['save']:.3f} s, of which "
                  f"the manifest {times['manifest written']:.3f} s "
                  f"({100 * times['manifest written'] / times['save']:.0f}%); restore "
                  f"{times['restore']:.3f} s, of which the check {times['manifest checked']:.3f} s "
                  f"({100 * times['manifest checked'] / times['restore']:.0f}%)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
