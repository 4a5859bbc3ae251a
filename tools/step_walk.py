"""The walk of one compiled `fit` step through kd's code, counted by running it.

    PYTHONPATH=$PWD python tools/step_walk.py [--list]

One process, 2 virtual CPU devices, mirrored. A small functional `kd.Model`
(Dense, BatchNormalization, Dropout, Dense; compiled with kd's defaults but
`first_step_check=False`, whose one-device comparison is a walk of its own)
runs `fit` on one batch under a profile hook (`sys.setprofile`, and
`threading.setprofile` for the replica threads MirroredStrategy starts), so
the count covers the front door, the loop, the trace of the train function
and each replica's step. Only frames of kd's own files count:

- files: kd files entered;
- functions outside the replica: kd functions entered on the main thread
  (front, loop, `Step`, the trace around `strategy.run`), comprehensions
  and generator expressions aside;
- functions inside the replica: kd functions entered on a replica thread
  (the union over the replicas, which walk the same code);
- doublings back: places where kd file A calls (through other kd files B,
  possibly through Keras or TensorFlow) back into A while A's frame is still
  on the stack below, counted once per (A, B, function re-entered);
- crossings: entries into kd from a Keras or TensorFlow frame while a kd
  frame is below it (Keras calling kd's hooks), once per function entered.

`--list` prints each item counted.
"""

import argparse
import os
import sys
import threading


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="print each file, function and doubling")
    args = parser.parse_args(argv)

    import keras_distrib as kd

    kd.virtual_devices(2)
    import keras
    import numpy as np

    package = os.path.dirname(os.path.abspath(kd.__file__)) + os.sep
    strategy = kd.make_strategy("mirrored")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        inputs = keras.Input((4,))
        h = keras.layers.Dense(8)(inputs)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.Dropout(0.1, seed=1)(h)
        model = kd.Model(inputs, keras.layers.Dense(1)(h))
        model.compile(optimizer="sgd", loss="mse", first_step_check=False)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")

    main_thread = threading.main_thread()
    outside, inside, files = set(), set(), set()
    doublings, crossings = set(), set()

    comprehensions = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")

    def short(code):
        return f"{os.path.relpath(code.co_filename, package)}:{code.co_name}"

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(package):
            return
        here = os.path.relpath(code.co_filename, package)
        files.add(here)
        if code.co_name in comprehensions:
            return
        (outside if threading.current_thread() is main_thread else inside).add(short(code))
        caller = frame.f_back
        if caller is not None and not caller.f_code.co_filename.startswith(package):
            below = caller.f_back
            while below is not None and not below.f_code.co_filename.startswith(package):
                below = below.f_back
            if below is not None:
                crossings.add(short(code))
        # The kd files on the stack below, nearest first.
        chain = []
        below = frame.f_back
        while below is not None:
            name = below.f_code.co_filename
            if name.startswith(package):
                name = os.path.relpath(name, package)
                if not chain or chain[-1] != name:
                    chain.append(name)
            below = below.f_back
        if chain and chain[0] != here and here in chain[1:]:
            doublings.add((here, chain[0], code.co_name))

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)

    print(f"kd files entered:              {len(files)}")
    print(f"functions outside the replica: {len(outside)}")
    print(f"functions inside the replica:  {len(inside)}")
    print(f"functions in all:              {len(outside | inside)}")
    print(f"doublings back:                {len(doublings)}")
    print(f"crossings into kd from Keras/TF: {len(crossings)}")
    if args.list:
        for title, items in (("files", files), ("outside", outside), ("inside", inside),
                             ("crossings", crossings)):
            print(f"\n{title}:")
            for item in sorted(items):
                print(f"  {item}")
        print("\ndoublings back (file re-entered <- from file: function):")
        for here, back, name in sorted(doublings):
            print(f"  {here} <- {back}: {name}")


if __name__ == "__main__":
    main()
