"""The exactness matrix: every feature, on one path, against one device.

Usage: exactness.py PATH FEATURE[,FEATURE...]

PATH names a strategy layout and a way to train (see PATHS). The process
splits the CPU into the path's virtual devices, then trains each feature
with kd and compares it with plain Keras on one device (cached across
processes in $KD_REFERENCE_DIR). Prints one 'RESULT {json}' line per feature.
A path named 'plain-...' trains plain Keras instead of kd (the contrast).
A path named 'float64-...' trains kd and the reference in float64 (no cache):
where float32 round-off is in doubt, exact code then matches to ~1e-12.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras_distrib as kd

# name -> (virtual devices, strategy kind, compile extras, steps_per_loop, strategy options)
PATHS = {
    "one_device": (1, "default", {}, None, {}),
    "mirrored1": (1, "mirrored", {}, None, {}),
    "mirrored2": (2, "mirrored", {}, None, {}),
    # Bucketed: gradients summed in buckets of 64 bytes (a few variables
    # each), the row count and metric states in the first (see
    # keras_distrib/training/buckets.py); the other paths make one all-reduce.
    "mirrored4": (4, "mirrored", {"gradient_buckets": 64}, None, {}),
    "mirrored2_reduce_to_one_device": (2, "mirrored", {}, None, {"cross_device_ops": "reduce_to_one_device"}),
    "central_storage2": (2, "central_storage", {}, None, {}),
    "loop_mirrored2": (2, "mirrored", {}, 3, {}),
    "loop_one_device": (1, "default", {}, 3, {}),
    "spe3_mirrored2": (2, "mirrored", {"steps_per_execution": 3}, None, {}),
    "jit_mirrored2": (2, "mirrored", {"jit_compile": True}, None, {}),
    "bn_per_replica_mirrored2": (2, "mirrored", {"batch_norm": "per_replica"}, None, {}),
    "jit_one_device": (1, "default", {"jit_compile": True}, None, {}),
    "multi_worker1": (1, "multi_worker", {}, None, {}),
    "multi_worker": (2, "multi_worker", {"gradient_buckets": 64}, None, {}),
    "loop_multi_worker": (2, "multi_worker", {}, 3, {}),
    # evaluate and predict on the reference's weights, in-process cluster
    "parameter_server": (1, "parameter_server", {}, None, {}),
    "plain-mirrored2": (2, "mirrored", {}, None, {}),
    "plain-central_storage2": (2, "central_storage", {}, None, {}),
    "plain-jit_one_device": (1, "default", {"jit_compile": True}, None, {}),
}


def main(path, names):
    float64 = path.startswith("float64-")
    devices, kind, compile_extra, steps_per_loop, options = PATHS[path.removeprefix("float64-")]
    if devices > 1:
        kd.virtual_devices(devices)
    import keras

    if float64:
        keras.config.set_floatx("float64")
        os.environ.pop("KD_REFERENCE_DIR", None)  # the cache holds float32 references

    import features

    evaluate_only = kind == "parameter_server"
    if evaluate_only:
        resolver = kd.local_cluster(workers=2, ps=1)
        strategy = kd.make_strategy(kind, cluster_resolver=resolver)
    else:
        strategy = kd.make_strategy(kind, **options)
    model_class = keras.Model if path.startswith("plain-") else kd.Model
    if kind not in ("multi_worker", "parameter_server"):  # (workers take the features together)
        names = features.in_ready_order(names)
    for name in names:
        started = time.monotonic()
        result = features.compare(
            name, model_class, strategy=strategy, compile_extra=compile_extra,
            steps_per_loop=steps_per_loop, evaluate_only=evaluate_only,
        )
        result.update(
            path=path, replicas=strategy.num_replicas_in_sync, task=kd.cluster_info().label,
            seconds=round(time.monotonic() - started, 2),
        )
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
