import json

import keras_distrib as kd

kd.virtual_devices(2)
import tensorflow as tf  # noqa: E402

strategy = kd.make_strategy("mirrored")
result = {}
try:
    with strategy.scope():
        kd.losses.global_mean(tf.constant([1.0]))
    result["cross_replica_error"] = ""
except RuntimeError as error:
    result["cross_replica_error"] = str(error)

data = [tf.constant([2.0, 3.0]), tf.constant([4.0, 5.0, 9.0])]


def values_fn(context):
    return data[context.replica_id_in_sync_group]


per_replica = strategy.experimental_distribute_values_from_function(values_fn)


@tf.function
def shares(values):
    def step(v):
        return kd.losses.global_mean(v), tf.reduce_mean(v)

    return strategy.run(step, args=(values,))


share, local_mean = shares(per_replica)
result["sum_of_shares"] = float(strategy.reduce("SUM", share, axis=None))
result["mean_of_local_means"] = float(strategy.reduce("MEAN", local_mean, axis=None))


@tf.function
def regularization(values):
    def step(v):
        penalty = [tf.constant(0.5), tf.constant(0.3)]
        return (
            kd.losses.scale_regularization(penalty),
            kd.losses.scale_regularization(penalty, local_rows=tf.shape(v)[0]),
        )

    return strategy.run(step, args=(values,))


even, by_rows = regularization(per_replica)
result["reg_even"] = float(strategy.reduce("SUM", even, axis=None))
result["reg_rows"] = float(strategy.reduce("SUM", by_rows, axis=None))

empty = strategy.experimental_distribute_values_from_function(
    lambda ctx: [tf.constant([1.0, 2.0]), tf.zeros((0,))][ctx.replica_id_in_sync_group]
)
_, with_empty = regularization(empty)
result["reg_rows_with_empty"] = [float(v) for v in strategy.experimental_local_results(with_empty)]
print("RESULT " + json.dumps(result), flush=True)
