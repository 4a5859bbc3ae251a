"""A parameter-server coordinator: schedules steps on launched or local servers.

Usage: ps_coordinator.py launched|local
"""

import json
import sys

import keras_distrib as kd
from keras_distrib.cluster import strategies

if sys.argv[1] == "local":
    resolver = kd.local_cluster(workers=2, ps=1)
    strategy = kd.make_strategy("parameter_server", cluster_resolver=resolver)
else:
    strategy = kd.make_strategy("parameter_server")
import tensorflow as tf  # noqa: E402

coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
with strategy.scope():
    total = tf.Variable(0.0)


@tf.function
def step():
    def replica():
        total.assign_add(1.0)
        return tf.constant(1.0)

    return strategy.run(replica)


for _ in range(10):
    coordinator.schedule(step)
coordinator.join()
devices = sorted({total.device.split("/task")[0]})
print("RESULT " + json.dumps({"total": float(total.numpy()), "devices": devices,
                              "workers": strategies.traits(strategy).workers,
                              "kind": strategies.traits(strategy).kind}),
      flush=True)
