"""How far the first-step check finds exact models from one device: the round-off its bounds must leave.

For each model of `keras-distrib bench --first-step` and each dtype, a fresh
process trains one step of the kd model on 2 mirrored virtual CPU replicas
(global batch 64, the check on) and prints the largest difference the check
measured between the distributed step and one device's: over the logs, and
over the gradients (each relative to the largest gradient of its update,
as `keras_distrib.training.first_step.difference` measures them). The
models are exact, so these are round-off: the check's bounds
(`first_step.TOLERANCE`, `GRADIENT_TOLERANCE`) must stay above them.

    python tools/first_step_margins.py --models mlp,cnn,resnet9,resnet21,resnet39,transformer \
        --dtypes float64,float32,mixed_float16,mixed_bfloat16

Run from the checkout whose keras_distrib it measures (it is put first on
the children's path).
"""

import argparse
import json
import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(model_name, dtype):
    """One model and dtype, in this process: prints `MARGIN {json}`."""
    import runpy

    import keras_distrib as kd

    kd.virtual_devices(2)
    import keras
    import numpy as np

    from keras_distrib.training import first_step

    bench = runpy.run_path(os.path.join(_ROOT, "keras_distrib", "commands", "bench_first_step.py"))
    keras.config.set_floatx("float32" if dtype.startswith("mixed") else dtype)
    keras.config.set_dtype_policy(dtype)
    found = {"logs": 0.0, "gradients": 0.0, "worst": None}
    measured = first_step._differences

    def spy(model, logs, reference_logs, gradients, reference_gradients):
        for (variables, values), (_, references) in zip(gradients, reference_gradients):
            largest = max([float(np.max(np.abs(first_step._dense(r)), initial=0.0))
                           for r in references if r is not None] + [0.0])
            for variable, value, reference in zip(variables, values, references):
                if value is not None and reference is not None:
                    distance = first_step.difference(value, reference, largest)
                    if distance > found["gradients"]:
                        found["gradients"], found["worst"] = distance, variable.path
        for key, reference in reference_logs.items():
            if key in logs:
                found["logs"] = max(found["logs"], first_step.difference(logs[key], reference))
        return measured(model, logs, reference_logs, gradients, reference_gradients)

    first_step._differences = spy
    strategy = kd.make_strategy("mirrored")
    with strategy.scope():
        model = bench["_build"](model_name, "kd", keras, kd)
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = bench["_data"](model_name, np)
    if x.dtype.kind == "f":
        x = x.astype(keras.config.floatx())
    error = None
    try:
        model.fit(x[:64], y[:64], batch_size=64, epochs=1, verbose=0, shuffle=False)
    except ValueError as refused:
        error = str(refused).split(". ")[0]
    print("MARGIN " + json.dumps(dict(model=model_name, dtype=dtype, error=error, **found)), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,cnn,resnet9,resnet21,transformer")
    parser.add_argument("--dtypes", default="float64,float32")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([_ROOT] + [p for p in os.environ.get("PYTHONPATH", "")
                                                    .split(os.pathsep) if p])}
    print("| model | dtype | logs | gradients | worst gradient |")
    print("|---|---|---:|---:|---|")
    for model_name in args.models.split(","):
        for dtype in args.dtypes.split(","):
            command = [sys.executable, os.path.abspath(__file__), "--child", model_name, dtype]
            try:
                done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=_ROOT,
                                      timeout=args.timeout)
                lines = [l for l in done.stdout.splitlines() if l.startswith("MARGIN ")]
            except subprocess.TimeoutExpired:  # subprocess.run kills the child
                lines = []
            if not lines:
                print(f"| {model_name} | {dtype} | failed | | |", flush=True)
                continue
            found = json.loads(lines[-1][len("MARGIN "):])
            worst = found["error"] or found["worst"] or ""
            print(f"| {model_name} | {dtype} | {found['logs']:.2g} | {found['gradients']:.2g} | {worst} |",
                  flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(*sys.argv[2:4])
    else:
        main()
