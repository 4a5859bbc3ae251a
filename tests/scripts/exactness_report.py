"""Runs the whole exactness matrix and prints it as a Markdown table (for docs/concepts/exactness.md).

Usage: python tests/scripts/exactness_report.py [TF_KERAS_JSON]

Each cell is the largest of max |a - b| / (1 + |a|) over weights, history,
evaluate and predict against plain Keras on one device ("refused" where kd
refuses the setting with an error). The "Keras 3" column is plain Keras 3
under MirroredStrategy on 2 devices, the same comparison; TF_KERAS_JSON (from
tf_keras_contrast.py, a {feature: figure or text} object) adds tf-keras's.
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests import _harness  # noqa: E402
from tests import test_exactness as matrix  # noqa: E402


def _cell(result):
    if result is None:
        return ""
    if "error" in result:
        return "refused" if "ValueError" in result["error"] else "fails"
    worst = max(result[k] for k in ("weights", "history", "evaluate", "predict") if k in result)
    return f"{worst:.0e}" if worst else "0"


def main():
    tf_keras = {}
    if len(sys.argv) > 1:
        with open(sys.argv[1]) as f:
            tf_keras = json.load(f)
    table = {}
    runs = {path: features + matrix.FULL_EXTRA.get(path, []) for path, features in matrix.MATRIX.items()}
    runs["plain-mirrored2"] = matrix.ALL
    for path, features in runs.items():
        code, output = _harness.run_script("exactness.py", path, ",".join(features), timeout=900)
        for result in _harness.results_of(output):
            table.setdefault(result["feature"], {})[path] = result
        print(f"{path}: exit {code}", file=sys.stderr, flush=True)
    multi_worker = matrix.MULTI_WORKER + matrix.FULL_EXTRA["multi_worker"]
    _, output = _harness.run_cluster(
        "exactness.py", "multi_worker", ",".join(multi_worker), workers=2, timeout=900
    )
    for result in _harness.results_by_task(output).get("worker 0", []):
        table.setdefault(result["feature"], {})["multi_worker"] = result
    paths = list(matrix.MATRIX) + ["multi_worker"]
    print("| feature | " + " | ".join(paths) + " | Keras 3 mirrored2 | tf-keras mirrored2 |")
    print("|---" * (len(paths) + 3) + "|")
    for feature in matrix.ALL:
        cells = [_cell(table.get(feature, {}).get(path)) for path in paths]
        keras3 = _cell(table.get(feature, {}).get("plain-mirrored2"))
        print(f"| {feature} | " + " | ".join(cells) + f" | {keras3} | {tf_keras.get(feature, '')} |")


if __name__ == "__main__":
    main()
