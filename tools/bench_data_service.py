"""Steps per second of an input-bound fit: local input against tf.data service with 1 and 2 data workers.

One training process (one device). Its input's map function costs more CPU
than a step (matrix products on each example). Three variants take turns,
`--repeats` times, in one run:

- local: `Dataset.map(preprocess, num_parallel_calls=AUTOTUNE).batch(...)`
  in the training process (kd.distribute_dataset's pipeline);
- service, 1 data worker: `kd.data.serve(..., mode="exact")` against a
  dispatcher with one data worker process;
- service, 2 data workers: the same against another dispatcher with two.

The dispatchers and data workers are processes started here
(`python -m keras_distrib.cluster.data_service`) and killed at the end.
Steps/second count from the end of an epoch's first step to the end of its
last. Prints a Markdown table (median and min-max of the repeats). With
`--pin`, the training process (and so the local input) runs on CPU 0 only
and the data workers on the others, as on a training host whose CPUs the
preprocessing outgrows.

    python tools/bench_data_service.py --steps 30 --repeats 3 [--size 192] [--pin]
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

import keras_distrib as kd

strategy = kd.make_strategy("one_device")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_distrib.cluster import ports  # noqa: E402

FEATURES, BATCH = 64, 32


def make_preprocess(size):
    """A map of 8 products of size x size matrices per example (192: far more CPU than a step)."""

    def preprocess(x, y):
        m = tf.reshape(tf.tile(x, [size * size // FEATURES]), [size, size]) * 1e-2
        for _ in range(8):
            m = tf.tanh(tf.matmul(m, m))
        return x + tf.reduce_mean(m, axis=0)[:FEATURES], y

    return preprocess


class StepTimes(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.times = []

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter())

    def rate(self):
        return (len(self.times) - 1) / (self.times[-1] - self.times[0])


def start_service(workers, cpus=None):
    """`(address, processes)`: a dispatcher and `workers` data workers (on `cpus` when given)."""
    port = ports.pick_ports(1)[0]
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    module = [sys.executable, "-m", "keras_distrib.cluster.data_service"]
    quiet = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    processes = [subprocess.Popen(module + ["dispatcher", "--port", str(port)], env=quiet,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    processes += [subprocess.Popen(module + ["worker", "--dispatcher", f"localhost:{port}"],
                                   env=quiet, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, preexec_fn=pin)
                  for _ in range(workers)]
    return f"grpc://localhost:{port}", processes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size", type=int, default=192,
                        help="matrix size of the map's products (its cost grows as size**3)")
    parser.add_argument("--pin", action="store_true",
                        help="training on CPU 0 only, data workers on the other CPUs: a training "
                        "host whose CPUs the preprocessing outgrows")
    options = parser.parse_args()
    data_cpus = None
    if options.pin:
        data_cpus = sorted(os.sched_getaffinity(0) - {0})
        os.sched_setaffinity(0, {0})
    preprocess = make_preprocess(options.size)
    rows = options.steps * BATCH
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = rng.normal(size=(rows, 1)).astype("float32")
    services = {}
    processes = []
    try:
        for count in (1, 2):
            address, started = start_service(count, data_cpus)
            services[count] = address
            processes += started
        with strategy.scope():
            model = kd.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(64, activation="relu"),
                                   keras.layers.Dense(1)])
            model.compile("sgd", "mse")
            inputs = {
                "local": tf.data.Dataset.from_tensor_slices((x, y)).map(
                    preprocess, num_parallel_calls=tf.data.AUTOTUNE).batch(BATCH).prefetch(2),
                "service, 1 data worker": kd.data.serve((x, y), global_batch_size=BATCH,
                                                        service=services[1], preprocess=preprocess,
                                                        connect_timeout=300),
                "service, 2 data workers": kd.data.serve((x, y), global_batch_size=BATCH,
                                                         service=services[2], preprocess=preprocess,
                                                         connect_timeout=300),
            }
        rates = {name: [] for name in inputs}
        timer = StepTimes()
        for name, data in inputs.items():  # warm-up: trace, connect, start the data workers' jobs
            model.fit(data, epochs=1, verbose=0, callbacks=[timer])
        for _ in range(options.repeats):
            for name, data in inputs.items():
                model.fit(data, epochs=1, verbose=0, callbacks=[timer])
                rates[name].append(timer.rate())
        print(f"| input | steps/s (median, min-max of {options.repeats}) | vs local |")
        print("|---|---|---|")
        local = statistics.median(rates["local"])
        for name, values in rates.items():
            median = statistics.median(values)
            print(f"| {name} | {median:.2f} ({min(values):.2f}-{max(values):.2f}) | "
                  f"{median / local:.2f}x |")
    finally:
        for process in processes:
            process.send_signal(signal.SIGKILL)
            process.wait()


if __name__ == "__main__":
    main()
