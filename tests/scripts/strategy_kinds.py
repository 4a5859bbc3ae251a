import dataclasses
import json
import os

import keras_distrib as kd

kd.virtual_devices(2)
from keras_distrib.cluster import strategies  # noqa: E402

auto = kd.make_strategy()
result = {
    "auto": type(auto).__name__,
    "auto_replicas": auto.num_replicas_in_sync,
    "central_storage": kd.make_strategy("central_storage").num_replicas_in_sync,
    "reduce_to_one_device": kd.make_strategy(
        "mirrored", cross_device_ops="reduce_to_one_device"
    ).num_replicas_in_sync,
}
ring = kd.make_strategy("multi_worker", communication="ring")
import tensorflow as tf  # noqa: E402

result["ring_multi_worker"] = [
    isinstance(ring, tf.distribute.MultiWorkerMirroredStrategy),
    ring.extended._communication_options.implementation.name,
]
os.environ["TF_CONFIG"] = json.dumps(
    {"cluster": {"worker": ["localhost:1", "localhost:2"]}, "task": {"type": "worker", "index": 0}}
)
result["traits"] = {
    kind: dataclasses.astuple(strategies.traits(ring if kind == "multi_worker" else kd.make_strategy(kind)))
    for kind in ("default", "one_device", "mirrored", "central_storage", "multi_worker")
}
result["auto_with_tf_config"] = strategies.resolve_auto_kind()
os.environ["TF_CONFIG"] = json.dumps(
    {"cluster": {"chief": ["localhost:1"], "worker": ["localhost:2"], "ps": ["localhost:3"]},
     "task": {"type": "chief", "index": 0}}
)
result["auto_with_ps"] = strategies.resolve_auto_kind()
print("RESULT " + json.dumps(result), flush=True)
