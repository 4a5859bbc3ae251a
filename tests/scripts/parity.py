"""Parity of kd under one strategy configuration against one-device Keras.

Usage: parity.py DEVICES KIND COMPILE_JSON SCENARIO[,SCENARIO...] [OPTIONS_JSON]

OPTIONS_JSON holds make_strategy options, and `steps_per_loop` to train
through kd.TrainLoop (compared with both one-device Keras and kd fit).
Prints one 'RESULT {json}' line per scenario.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras_distrib as kd

devices, kind = int(sys.argv[1]), sys.argv[2]
compile_kwargs = json.loads(sys.argv[3])
scenarios = sys.argv[4].split(",")
options = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
if devices > 1:
    kd.virtual_devices(devices)

import scenarios as sc  # noqa: E402

steps_per_loop = options.pop("steps_per_loop", None)
strategy = kd.make_strategy(kind, **options)
for name in scenarios:
    result = sc.compare(
        name, kd.Model, strategy=strategy, compile_kwargs=compile_kwargs,
        steps_per_loop=steps_per_loop,
    )
    result.update(
        replicas=strategy.num_replicas_in_sync,
        task=kd.cluster_info().label,
    )
    print("RESULT " + json.dumps(result), flush=True)
