"""`keras-distrib demo --quick`: the table's numbers are what it claims, on one screen."""

import json
import os
import subprocess
import sys

import pytest

import numpy as np

from keras_distrib.commands import demo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one_device_reference(epochs, rows):
    import keras

    x, y = demo.make_data(rows)
    model = demo.build(keras.Model)
    model.fit(x, y, batch_size=demo.GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model.get_weights()


@pytest.mark.cluster
@pytest.mark.long
def test_demo_quick(tmp_path):
    out = tmp_path / "demo"
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # the demo's own default: TensorFlow's notices hidden
    process = subprocess.run(
        [sys.executable, "-m", "keras_distrib", "demo", "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert process.returncode == 0, process.stdout[-4000:] + process.stderr[-4000:]
    table = {row["run"]: row for row in json.loads((out / "demo_table.json").read_text())}
    # The demo's reference is what it claims: plain Keras on one device,
    # retrained here independently of the demo.
    reference = _one_device_reference(epochs=2, rows=449)
    for run in ("one_device", "kd_mirrored", "kd_workers", "kd_loop"):
        weights, _, _ = demo._load(str(out), run)
        gap = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, reference))
        assert gap <= 1e-5, (run, gap)
    for run in ("kd_mirrored", "kd_workers", "kd_loop"):
        assert table[run]["max_weight_diff"] <= 1e-5, table[run]
        assert abs(table[run]["loss"] - table["one_device"]["loss"]) <= 1e-5
    # The contrast: plain Keras is measurably off on the 1-row last batch...
    assert table["plain_mirrored"]["max_weight_diff"] > 1e-4, table["plain_mirrored"]
    # ...and does not run on 2 workers at all: its error in one line.
    assert table["plain_workers"]["failed"].startswith("ValueError: "), table["plain_workers"]
    assert "PerReplica" in table["plain_workers"]["failed"]
    # Only the chief's files persist.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["model-01.keras", "model-02.keras"]
    events = [f for _, _, files in os.walk(out / "tensorboard") for f in files]
    assert len(events) == 1 and events[0].startswith("events.out.tfevents")
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoints", "tensorboard"]
    # A person can read it: one screen, no TensorFlow start-up logs, no traceback.
    output = process.stdout + process.stderr
    lines = output.splitlines()
    assert len(lines) <= 40, output
    for noise in ("I0000", "E0000", "W0000", "oneDNN", "cuInit", "absl::InitializeLog", "Traceback"):
        assert noise not in output, (noise, output)
    assert "[worker 0] chief: wrote 2 checkpoints" in output
    assert "[worker 1] not the chief" in output
    assert "  ValueError: Attempt to convert a value (PerReplica:{…})" in output
