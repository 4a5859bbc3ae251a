"""What a local launch's private network costs: start-up, training speed, outbound throughput.

Usage: PYTHONPATH=. python tools/private_network_cost.py [--repeats 5] [--epochs 4] [--no-training]

Every figure compares the default (a network namespace of the launch's own,
with slirp4netns as its route out) with `private_network=False` (the host's
network) and, where it applies, `"offline"` (the namespace without a route
out) and "pasta" (the default where slirp4netns is not found: pasta is the
route out; where pasta is installed), the variants taking turns repeat after
repeat so that a machine slowing down affects them alike; the medians are
printed.

- start-up: making and closing the namespace alone (`PrivateNetwork`), and a
  whole `kd.launch` of two tasks that return at once;
- training: two workers (MultiWorkerMirroredStrategy over the namespace's
  loopback) fit an MLP (784-256-256-10, global batch 64, 4096 rows); steps
  per second over the epochs after the first;
- outbound: one task reads 256 MB from a server on this host (its address
  on the default route), through slirp4netns, pasta or directly.
"""

import contextlib

import argparse
import os
import socket
import statistics
import sys
import threading
import time

ROWS, BATCH = 4096, 64
OUTBOUND_BYTES = 256 << 20


def _task(kind, *args):
    """What each launched task runs (this file, `--task KIND ...`)."""
    if kind == "quick":
        return
    if kind == "read":
        host, port = args[0], int(args[1])
        started = time.perf_counter()
        total = 0
        with socket.create_connection((host, port), timeout=30) as connection:
            while True:
                piece = connection.recv(1 << 20)
                if not piece:
                    break
                total += len(piece)
        print(f"RATE {total / (time.perf_counter() - started) / 1e6:.1f}", flush=True)
        return
    import keras_distrib as kd
    import keras
    import numpy as np

    epochs = int(args[0])
    strategy = kd.make_strategy("multi_worker")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 784)).astype("float32")
    y = rng.integers(0, 10, size=ROWS)
    with strategy.scope():
        model = kd.Sequential([keras.Input((784,)), keras.layers.Dense(256, activation="relu"),
                               keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    times = []

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            times.append(time.perf_counter())

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter())

    model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, shuffle=False, callbacks=[Clock()])
    seconds = sum(times[i + 1] - times[i] for i in range(2, len(times), 2))
    if kd.is_chief():
        print(f"RATE {(epochs - 1) * (ROWS // BATCH) / seconds:.2f}", flush=True)


@contextlib.contextmanager
def _variant(name):
    """The route out as variant `name` has it: "pasta" hides slirp4netns from kd."""
    from keras_distrib.cluster import network

    slirp = network.SLIRP
    if name == "pasta":
        network.SLIRP = "kd-hidden-slirp4netns"
    try:
        yield
    finally:
        network.SLIRP = slirp


def _launch(private, *args, timeout=600):
    import keras_distrib as kd

    lines = []
    started = time.perf_counter()
    result = kd.launch(os.path.abspath(__file__), workers=len(args) and 2 or 2,
                       args=["--task", *map(str, args)], sink=lines.append, timeout=timeout,
                       private_network=private)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"launch ({private=}) failed:\n" + "\n".join(lines[-30:]))
    rates = [float(line.rsplit(" ", 1)[1]) for line in lines if " RATE " in line]
    return seconds, rates


def _host_address():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))
        return probe.getsockname()[0]


def _serve(server):
    block = b"\0" * (1 << 20)
    while True:
        try:
            connection, _ = server.accept()
        except OSError:
            return
        with connection:
            try:
                for _ in range(OUTBOUND_BYTES // len(block)):
                    connection.sendall(block)
            except OSError:
                pass


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--task"]:
        return _task(*argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--no-training", action="store_true", help="skip the training figures")
    options = parser.parse_args(argv)
    from keras_distrib.cluster import network

    variants = {"private": True, "offline": "offline", "open": False}
    if any(name == network.PASTA for name, _ in network.routes_out()):
        variants = {"private": True, "pasta": True, "offline": "offline", "open": False}
    made = {name: [] for name in variants if name != "open"}
    for _ in range(4 * options.repeats):
        for name in made:
            started = time.perf_counter()
            with _variant(name):
                network.PrivateNetwork(outbound=variants[name] is True).close()
            made[name].append(time.perf_counter() - started)
    for name, seconds in made.items():
        print(f"namespace made and closed ({name}): {1e3 * statistics.median(seconds):.1f} ms")
    launches = {name: [] for name in variants}
    for _ in range(options.repeats):
        for name, value in variants.items():
            with _variant(name):
                launches[name].append(_launch(value, "quick")[0])
    for name, seconds in launches.items():
        print(f"kd.launch of 2 tasks that return at once ({name}): "
              f"{statistics.median(seconds):.3f} s")

    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen()
    threading.Thread(target=_serve, args=(server,), daemon=True).start()
    host, port = _host_address(), server.getsockname()[1]
    outbound = {name: [] for name in variants if name != "offline"}
    for _ in range(options.repeats):
        for name in outbound:
            with _variant(name):
                outbound[name] += _launch(variants[name], "read", host, port)[1]
    server.close()
    for name, rates in outbound.items():
        print(f"outbound: a task reads {OUTBOUND_BYTES >> 20} MB from this host ({name}): "
              f"{statistics.median(rates):.0f} MB/s")

    if options.no_training:
        return
    training = {"private": [], "open": []}
    for _ in range(options.repeats):
        for name in training:
            training[name] += _launch(variants[name], "train", options.epochs)[1]
    for name, rates in training.items():
        print(f"training, 2 workers, MLP, global batch {BATCH} ({name}): "
              f"{statistics.median(rates):.1f} steps/s (each: {', '.join(f'{r:.1f}' for r in rates)})")
    print(f"ratio private / open: {statistics.median(training['private']) / statistics.median(training['open']):.3f}")


if __name__ == "__main__":
    sys.exit(main())
