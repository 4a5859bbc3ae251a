"""TensorFlow's "Migrate multi-worker CPU/GPU training" guide, TF2 code, with kd.

Usage: guide_migrate.py ps | multi_worker

`ps`: the guide's parameter-server section in one process: an in-process
cluster (3 workers with 4 inter-op threads, 2 parameter servers, this process
as the chief), TFConfigClusterResolver, ParameterServerStrategy, a
`Sequential([Dense(1)])` without an Input layer, Adagrad, `fit` on a
shuffled, repeated, batched Dataset instance with steps_per_epoch, then
`evaluate(eval_dataset, steps=10, return_dict=True)`; and its three variable
partitioners. `multi_worker` (launched on 2 workers): the guide's
MultiWorkerMirroredStrategy section. Changes: the model class
(kd.Sequential), Keras 3 renames (optimizers.legacy.Adagrad -> Adagrad).
Prints one RESULT line with the one-device references beside.
"""

import json
import os
import sys

mode = sys.argv[1]
import keras_distrib as kd  # noqa: E402

if mode == "ps":
    import portpicker  # noqa: E402
    import tensorflow as tf  # noqa: E402

    def create_in_process_cluster(num_workers, num_ps):
        """The guide's helper: servers in this process, TF_CONFIG naming this one chief."""
        ports = [portpicker.pick_unused_port() for _ in range(num_workers + num_ps + 1)]
        cluster_dict = {
            "worker": [f"localhost:{p}" for p in ports[:num_workers]],
            "ps": [f"localhost:{p}" for p in ports[num_workers:-1]],
            "chief": [f"localhost:{ports[-1]}"],
        }
        cluster_spec = tf.train.ClusterSpec(cluster_dict)
        worker_config = tf.compat.v1.ConfigProto()
        worker_config.inter_op_parallelism_threads = 4
        for i in range(num_workers):
            tf.distribute.Server(cluster_spec, job_name="worker", task_index=i, config=worker_config,
                                 protocol="grpc")
        for i in range(num_ps):
            tf.distribute.Server(cluster_spec, job_name="ps", task_index=i, protocol="grpc")
        os.environ["TF_CONFIG"] = json.dumps({"cluster": cluster_dict, "task": {"type": "chief", "index": 0}})

    create_in_process_cluster(num_workers=3, num_ps=2)
    cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
features = rng.normal(size=(3, 2)).astype("float32")
labels = rng.uniform(size=(3, 1)).astype("float32")
eval_features = rng.normal(size=(3, 2)).astype("float32")
eval_labels = rng.uniform(size=(3, 1)).astype("float32")


def datasets():
    tf.random.set_seed(0)
    dataset = tf.data.Dataset.from_tensor_slices((features, labels)).shuffle(10, seed=1).repeat().batch(64)
    eval_dataset = tf.data.Dataset.from_tensor_slices((eval_features, eval_labels)).repeat().batch(1)
    return dataset, eval_dataset


def one_device_evaluate(weights, eval_dataset):
    model = keras.models.Sequential([keras.layers.Dense(1)])
    model.build((None, 2))
    model.compile("adagrad", "mse")
    model.set_weights(weights)
    return model.evaluate(eval_dataset, steps=10, return_dict=True, verbose=0)


result = {}
if mode == "ps":
    variable_partitioners = {
        "none": None,
        "min_size": tf.distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=4, max_shards=2),
        "fixed_shards": tf.distribute.experimental.partitioners.FixedShardsPartitioner(num_shards=2),
        "max_size": tf.distribute.experimental.partitioners.MaxSizePartitioner(max_shard_bytes=8),
    }
    for name, partitioner in variable_partitioners.items():
        strategy = tf.distribute.experimental.ParameterServerStrategy(
            cluster_resolver, variable_partitioner=partitioner
        )
        dataset, eval_dataset = datasets()
        with strategy.scope():
            model = kd.Sequential([keras.layers.Dense(1)])
            optimizer = keras.optimizers.Adagrad(learning_rate=0.05)
            model.compile(optimizer, "mse")
        history = model.fit(dataset, epochs=5, steps_per_epoch=10, verbose=0)
        logs = model.evaluate(eval_dataset, steps=10, return_dict=True, verbose=0)
        result[name] = {
            "loss": history.history["loss"],
            "evaluate": logs,
            "reference_evaluate": one_device_evaluate(model.get_weights(), eval_dataset),
            "iterations": int(model.optimizer.iterations.numpy()),
        }
else:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    runs = {}
    for name, scope_strategy in (("multi_worker", strategy), ("reference", tf.distribute.get_strategy())):
        dataset, eval_dataset = datasets()
        keras.utils.set_random_seed(0)
        with scope_strategy.scope():
            model_class = kd.Sequential if name == "multi_worker" else keras.models.Sequential
            model = model_class([keras.layers.Dense(1)])
            optimizer = keras.optimizers.Adagrad(learning_rate=0.05)
            model.compile(optimizer, "mse")
        history = model.fit(dataset, epochs=5, steps_per_epoch=10, verbose=0)
        runs[name] = (model.get_weights(), history.history["loss"],
                      model.evaluate(eval_dataset, steps=10, return_dict=True, verbose=0))
    result = {
        "task": kd.cluster_info().label,
        "weights": max(float(np.max(np.abs(a - b))) for a, b in zip(runs["multi_worker"][0], runs["reference"][0])),
        "losses": max(abs(a - b) for a, b in zip(runs["multi_worker"][1], runs["reference"][1])),
        "evaluate": abs(runs["multi_worker"][2]["loss"] - runs["reference"][2]["loss"]),
    }
print("RESULT " + json.dumps(result), flush=True)
if mode == "ps":
    sys.stdout.flush()
    os._exit(0)  # in-process servers do not shut down cleanly
