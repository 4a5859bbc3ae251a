"""How long deleting a MirroredStrategy distributed iterator takes, by how long it lived.

Two logical CPU devices; a distributed iterator over a small repeated
dataset is read by a `tf.function` step every half second for LIFE seconds,
then dropped and collected. Each lifetime runs with TensorFlow's default
input (a multi-device iterator prefetching to each replica's device) and
with `tf.distribute.InputOptions(experimental_fetch_to_device=False)`,
taking turns.

Either variant can stall: which iterator waits, and how long, follows
tf.data's autotuning sleep, not the input option (in two runs of `45`, the
first iterator took 0.4 s to delete and the second 37 s, whichever option
it had).

    python tools/iterator_delete_stall.py 2 12 45
"""

import gc
import sys
import time

import tensorflow as tf


def main(lives):
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    tf.config.threading.set_inter_op_parallelism_threads(4)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])

    @tf.function
    def step(iterator):
        return strategy.run(tf.reduce_sum, args=(next(iterator),))

    variants = {"default": None,
                "fetch_to_device=False": tf.distribute.InputOptions(experimental_fetch_to_device=False)}
    for life in lives:
        for name, options in variants.items():
            dataset = tf.data.Dataset.from_tensor_slices(tf.range(100.0)).batch(16).repeat()
            iterator = iter(strategy.experimental_distribute_dataset(dataset, options=options))
            start = time.monotonic()
            while time.monotonic() - start < life:
                step(iterator)
                time.sleep(0.5)
            start = time.monotonic()
            del iterator
            gc.collect()
            print(f"lived {life:5.1f} s  {name:22s}  deleting it took {time.monotonic() - start:6.2f} s",
                  flush=True)


if __name__ == "__main__":
    main([float(a) for a in sys.argv[1:]] or [2.0, 12.0, 45.0])
