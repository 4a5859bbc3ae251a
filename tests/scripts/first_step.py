"""The first-step check on the user's own models, against one device.

Usage: first_step.py CONFIG

CONFIG "mirrored2": two virtual CPU replicas in this process; "multi_worker":
one replica per worker process (run under kd.launch). Every case trains a
kd model under CONFIG's strategy and the same class body on `keras.Model`
on one device (the reference, Keras's own, no kd step), from the same
initial weights, on 72 rows in global batches of 32 (the last batch holds
8 rows). Prints one `RESULT {json}` line per case:

- `exact` (float64, float32): Dense, BatchNormalization and Dropout with an
  accuracy metric, trained with the check on and off: the largest relative
  difference of the weights and logs from one device (with the check on),
  and whether every variable (weights, moving statistics, optimizer slots,
  metric states, seed states) is bitwise the same with the check on and off
  (`same_on_and_off`). With steps_per_execution=2 too (`exact_spe2`).
- `exact_summed` (float64): the same with a metric of the user's own besides
  accuracy, whose state has `aggregation="sum"` and whose `result()` is a
  dict (a count of every row seen): its logs must be one device's (the
  whole batch's count, not one replica's), so the check passes.
- `blinded` (float64): a layer that centres its input on the batch mean (the
  rows meet), with kd's classifier blinded (`penalties._kind_of_op_output`
  reads what it cannot place as rows, so kd computes the layer on each
  replica's rows): with the check on,
  the error `fit` raises and whether every variable is bitwise as before
  `fit` (`restored`); with it off, the weights' and logs' difference from one
  device (the contrast: kd then trains another model without a word).
- `exact_sub`, `blinded_sub` (float64): `exact` and `blinded` with the global
  batch counted as too big for one device (`first_step.WHOLE_BATCH_BYTES`
  = 0): the check compares the step on a sub-batch of a few rows of each
  replica's.
"""

import json
import os
import sys
import traceback

import numpy as np

import keras_distrib as kd

ROWS, BATCH, EPOCHS = 72, 32, 2


def _data(dtype):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(ROWS, 6)).astype(dtype)
    y = rng.integers(0, 3, size=(ROWS,)).astype("int32")
    return x, y


def build(case, base):
    import keras
    from keras import ops

    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh", name="embed")(inputs)
    if case == "blinded":
        centred = keras.layers.Lambda(lambda h: h - ops.mean(h, axis=0, keepdims=True), name="centre")
        hidden = keras.layers.Dense(5, name="mix")(centred(hidden))
    else:
        hidden = keras.layers.Dense(8, use_bias=False, name="mix")(hidden)
        hidden = keras.layers.Dropout(0.3)(keras.layers.BatchNormalization()(hidden))
    return base(inputs, keras.layers.Dense(3, name="head")(hidden))


def _seen_rows():
    """A metric of the user's own: rows seen per class, state summed over replicas, a dict result."""
    import keras
    from keras import ops

    class SeenRows(keras.metrics.Metric):
        def __init__(self, name="seen", **kwargs):
            super().__init__(name=name, **kwargs)
            self.counts = self.add_variable(shape=(3,), initializer="zeros", name="counts",
                                            aggregation="sum")

        def update_state(self, y_true, y_pred, sample_weight=None):
            hot = ops.one_hot(ops.cast(ops.reshape(y_true, [-1]), "int32"), 3, dtype=self.counts.dtype)
            self.counts.assign_add(ops.sum(hot, axis=0))

        def result(self):
            return {"seen_rows": ops.sum(self.counts), "seen_most": ops.max(self.counts)}

    return SeenRows()


def _compile(model, check=True, spe=1, summed=False):
    import keras

    options = {} if not hasattr(model, "replica_batch") else {"first_step_check": check}
    model.compile(optimizer=keras.optimizers.Adam(0.02),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"] + ([_seen_rows()] if summed else []),
                  steps_per_execution=spe, **options)


def _state(model):
    from keras_distrib import _keras_compat

    return [np.array(c.read_value()) for v in _keras_compat.model_variables(model)
            for c in _keras_compat.variable_copies(v)]


def _same(a, b):
    return len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


def relative(reference, candidate):
    a = np.asarray(reference, dtype="float64")
    b = np.asarray(candidate, dtype="float64")
    return float(np.max(np.abs(a - b) / (1.0 + np.abs(a)), initial=0.0))


def _train(case, base, strategy, dtype, start, check=True, spe=1, summed=False):
    x, y = _data(dtype)
    with strategy.scope():
        model = build(case, base)
        _compile(model, check=check, spe=spe, summed=summed)
    model.set_weights(start)
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history
    return model, history


def _differences(reference, model, history):
    ref_model, ref_history = reference
    weights = max(relative(a, b) for a, b in zip(ref_model.get_weights(), model.get_weights()))
    logs = max(relative(ref_history[k], history[k]) for k in ref_history)
    return weights, logs


def report(case, dtype, strategy):
    import keras
    import tensorflow as tf

    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)
    from keras_distrib.training import first_step

    item = dict(case=case, float64=dtype == "float64", task=kd.cluster_info().label)
    # `_sub`: the global batch counts as too big for one device, so the
    # check compares the step on a sub-batch of a few rows of each replica's.
    whole_batch_bytes = first_step.WHOLE_BATCH_BYTES
    if case.endswith("_sub"):
        first_step.WHOLE_BATCH_BYTES = 0
    try:
        summed = case == "exact_summed"
        start = build(case.split("_")[0], keras.Model).get_weights()
        reference = _train(case.split("_")[0], keras.Model, tf.distribute.get_strategy(), dtype, start,
                           summed=summed)
        if case.startswith("exact"):
            spe = 2 if case == "exact_spe2" else 1
            on, on_history = _train("exact", kd.Model, strategy, dtype, start, spe=spe, summed=summed)
            off, _ = _train("exact", kd.Model, strategy, dtype, start, check=False, spe=spe,
                            summed=summed)
            item["weights"], item["logs"] = _differences(reference, on, on_history)
            item["same_on_and_off"] = _same(_state(on), _state(off))
        else:
            from keras_distrib.training import penalties

            # kd's classifier blinded: what it finds the rows meeting in (the
            # centring layer's batch mean) it reads as rows, as a classifier
            # that missed an op would.
            original = penalties._kind_of_op_output

            def blinded(op, index, kinds):
                kind = original(op, index, kinds)
                return penalties.ROWS if isinstance(kind, penalties.Unknown) else kind

            penalties._kind_of_op_output = blinded
            try:
                with strategy.scope():
                    model = build("blinded", kd.Model)
                    _compile(model)
                model.set_weights(start)
                x, y = _data(dtype)
                model.build_from_data(data_batch=(x[:BATCH], y[:BATCH]))
                before = _state(model)
                try:
                    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
                except ValueError as error:
                    item["refusal"] = f"{type(error).__name__}: {error}"
                item["restored"] = _same(before, _state(model))
                off, off_history = _train("blinded", kd.Model, strategy, dtype, start, check=False)
                item["weights_off"], item["logs_off"] = _differences(reference, off, off_history)
            finally:
                penalties._kind_of_op_output = original
    except Exception as error:  # reported; the test decides
        item["error"] = f"{type(error).__name__}: {error}"[:3000]
        item["trace"] = traceback.format_exc()[-6000:]
    finally:
        first_step.WHOLE_BATCH_BYTES = whole_batch_bytes
    print("RESULT " + json.dumps(item), flush=True)


def main(config):
    if config == "mirrored2":
        kd.virtual_devices(2)
        strategy = kd.make_strategy("mirrored")
        cases = [("exact", "float64"), ("exact", "float32"), ("exact_spe2", "float64"),
                 ("exact_summed", "float64"), ("blinded", "float64"), ("exact_sub", "float64"),
                 ("blinded_sub", "float64")]
    else:
        strategy = kd.make_strategy("multi_worker")
        cases = [("exact", "float64"), ("blinded", "float64")]
    for case, dtype in cases:
        report(case, dtype, strategy)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1])
