"""Steps per second of kd `fit` with `steps_per_execution` 1 and 10, sparse gradients included.

    python tools/spe_speed.py --model embedding --steps 200 --repeats 5

One process, 2 virtual CPU devices, mirrored; after a warm-up epoch the two
settings take turns, epoch after epoch, so a machine that speeds up or slows
down affects both alike. Prints the median steps/s of each and their ratio.
`embedding` (Embedding -> pooling -> Dense) has sparse gradients; `mlp` has
none.
"""

import argparse
import statistics
import time


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("embedding", "mlp"), default="embedding")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    import keras_distrib as kd

    kd.virtual_devices(2)
    import keras
    import numpy as np

    strategy = kd.make_strategy("mirrored")
    batch = 64
    rng = np.random.default_rng(0)
    rows = batch * args.steps
    if args.model == "embedding":
        x = rng.integers(0, 1000, size=(rows, 20)).astype("int32")
    else:
        x = rng.normal(size=(rows, 20)).astype("float32")
    y = rng.integers(0, 10, size=(rows,)).astype("int32")

    def build(spe):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            if args.model == "embedding":
                inputs = keras.Input((20,), dtype="int32")
                h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(1000, 32)(inputs))
            else:
                inputs = keras.Input((20,))
                h = inputs
            h = keras.layers.Dense(64, activation="relu")(h)
            model = kd.Model(inputs, keras.layers.Dense(10)(h))
            model.compile(optimizer=keras.optimizers.Adam(1e-3),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          steps_per_execution=spe)
        return model

    models = {spe: build(spe) for spe in (1, 10)}
    for model in models.values():  # warm-up: tracing
        model.fit(x[: batch * 20], y[: batch * 20], batch_size=batch, verbose=0)
    speeds = {spe: [] for spe in models}
    for _ in range(args.repeats):
        for spe, model in models.items():
            started = time.perf_counter()
            model.fit(x, y, batch_size=batch, verbose=0, shuffle=False)
            speeds[spe].append(args.steps / (time.perf_counter() - started))
    for spe, runs in speeds.items():
        print(f"{args.model} spe={spe}: {statistics.median(runs):.1f} steps/s "
              f"(runs {', '.join(f'{r:.1f}' for r in runs)})")
    print(f"{args.model} spe=10 / spe=1: {statistics.median(speeds[10]) / statistics.median(speeds[1]):.2f}")


if __name__ == "__main__":
    main()
