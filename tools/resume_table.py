"""The resume table: a backup made on N replicas resumed on M, against plain Keras.

Runs tests/scripts/resume_random.py (float64; random flips, BatchNormalization,
Dropout, GaussianNoise, `keras.random` in `train_step`; Adam; 225 rows in global
batches of 32; BackupAndRestore(save_freq=2)): each cell trains on N replicas
until a crash (os._exit) after global step STOP, then resumes from the backup in
a new process on M replicas; the cell is the largest weight difference from
plain Keras on one device, uninterrupted, on the same data.

Usage: python tools/resume_table.py [--modes fit] [--data arrays,dataset]
       [--layouts 2:2,2:4,2:1,4:2] [--stops 11,9]
(STOP 11: the backup at step 10 is mid-epoch 2; STOP 9: the backup at step 8
is the first epoch's last step.)
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "resume_random.py")


def run(*args, timeout=900):
    env = dict(os.environ, PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, SCRIPT, *map(str, args)], env=env, timeout=timeout,
                            capture_output=True, text=True)
    return result


def largest_difference(path, reference):
    got, want = np.load(path), np.load(reference)
    return max(float(np.abs(got[k] - want[k]).max()) for k in want.files)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default="fit")
    parser.add_argument("--data", default="arrays,dataset")
    parser.add_argument("--layouts", default="2:2,2:4,2:1,4:2")
    parser.add_argument("--stops", default="11,9")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="kd-resume-table-")
    references = {}
    for mode in sorted({"manual" if m == "manual" else "fit" for m in args.modes.split(",")}):
        for data in args.data.split(","):
            # A hand-written loop opens one iterator per epoch, Keras's fit two.
            path = os.path.join(work, f"reference-{mode}-{data}.npz")
            result = run(1, mode, data, os.path.join(work, "unused"), path, -1, "plain")
            assert result.returncode == 0, result.stderr[-3000:]
            references[mode == "manual", data] = path
    print("| mode | data | resumed on | backup | largest difference from plain Keras, one device |")
    print("|---|---|---|---|---|")
    for mode in args.modes.split(","):
        for data in args.data.split(","):
            for layout in args.layouts.split(","):
                first, second = layout.split(":")
                for stop in args.stops.split(","):
                    cell = tempfile.mkdtemp(dir=work)
                    backup, out = os.path.join(cell, "backup"), os.path.join(cell, "weights.npz")
                    started = time.monotonic()
                    crashed = run(first, mode, data, backup, out, stop)
                    resumed = run(second, mode, data, backup, out, -1)
                    if crashed.returncode != 3 or resumed.returncode != 0:
                        value = (f"failed (rc {crashed.returncode}, {resumed.returncode}): "
                                 + (resumed.stderr or crashed.stderr).strip().splitlines()[-1][:200])
                    else:
                        reference = references[mode == "manual", data]
                        value = f"{largest_difference(out, reference):.1e}"
                    where = "mid-epoch 2 (step 10)" if stop == "11" else "end of epoch 1 (step 8)"
                    names = {"1": "1 device"}
                    shape = (f"{names.get(first, first + ' replicas')} -> "
                             f"{names.get(second, second + ' replicas')}")
                    print(f"| {mode} | {data} | {shape} | {where} | {value} |", flush=True)
                    print(f"  ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
