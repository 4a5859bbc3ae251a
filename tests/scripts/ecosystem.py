"""Models and tools from the ecosystem under MirroredStrategy, against one device.

Usage: python ecosystem.py CASE [CASE ...]   (cases: see CASES)

Each case trains on one CPU device (the reference) and mirrored on 2
virtual CPU devices, from the same initial weights on the same global
batches: 33 rows in global batches of 16, so the last batch has 1 row and
one replica gets nothing. Tiny configurations and random weights: nothing is
downloaded. For each case it prints RESULT {"case", "kd", "keras"}: "kd" is
kd.testing.assert_parity's largest difference for the kd model, "keras" the
largest difference of the same model built on plain Keras (max |a - b| /
(1 + |a|) over the weights after the epoch), or the error it fails with.
"""

import json
import os
import sys
import tempfile
import time
import warnings

import keras
import numpy as np

import keras_distrib as kd
from keras_distrib import report

kd.virtual_devices(2)
import tensorflow as tf  # noqa: E402

ROWS, BATCH = 33, 16
rng = np.random.default_rng(0)


# ---------------------------------------------------------------------------
# KerasHub tasks: any keras.Model subclass becomes exact with the mixin first.

def _hub():
    import keras_hub

    return keras_hub


WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "a", "cat", "sat", "on", "mat"]


def _sentences():
    return [" ".join(rng.choice(WORDS, size=rng.integers(2, 7))) for _ in range(ROWS)]


def bert_classifier(base):
    hub = _hub()

    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    tokenizer = hub.models.BertTokenizer(vocabulary=vocabulary)
    preprocessor = hub.models.BertTextClassifierPreprocessor(tokenizer, sequence_length=8)
    x = {k: np.asarray(v) for k, v in preprocessor(_sentences()).items()}
    y = rng.integers(0, 2, size=(ROWS,))
    task = {"kd": ExactBertClassifier, "keras": hub.models.BertTextClassifier}[base]

    def model_fn():
        backbone = hub.models.BertBackbone(
            vocabulary_size=len(vocabulary), num_layers=1, num_heads=2, hidden_dim=8,
            intermediate_dim=16, max_sequence_length=8, dropout=0.0)
        model = task(backbone=backbone, num_classes=2, dropout=0.0)
        model.compile(optimizer=keras.optimizers.Adam(1e-2))  # the task's loss and metrics
        return model

    return model_fn, (x, y)


def gpt2_causal_lm(base):
    hub = _hub()

    # Token ids as GPT2CausalLMPreprocessor makes them: each row predicts its
    # next token; padding (the mask's zeros) weighs nothing.
    vocabulary_size, length = 20, 9
    lengths = rng.integers(3, length + 1, size=(ROWS, 1))
    mask = np.arange(length)[None, :] < lengths
    ids = np.where(mask, rng.integers(1, vocabulary_size, size=(ROWS, length)), 0)
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
    data = (x, ids[:, 1:], mask[:, 1:].astype("float32"))
    task = {"kd": ExactGPT2CausalLM, "keras": hub.models.GPT2CausalLM}[base]

    def model_fn():
        backbone = hub.models.GPT2Backbone(
            vocabulary_size=vocabulary_size, num_layers=1, num_heads=2, hidden_dim=8,
            intermediate_dim=16, max_sequence_length=length - 1, dropout=0.0)
        model = task(backbone=backbone)
        model.compile(optimizer=keras.optimizers.Adam(1e-2))
        return model

    return model_fn, data


# ---------------------------------------------------------------------------
# keras.applications: a frozen backbone and a new head.

def _images(size=32):
    return rng.normal(size=(ROWS, size, size, 3)).astype("float32"), rng.integers(0, 3, size=(ROWS,))


def application(name):
    def case(base):
        model_class = {"kd": kd.Model, "keras": keras.Model}[base]

        def model_fn():
            backbone = getattr(keras.applications, name)(
                input_shape=(32, 32, 3), include_top=False, weights=None,
                **({"alpha": 0.35} if name == "MobileNetV2" else {}))
            backbone.trainable = False
            inputs = keras.Input((32, 32, 3))
            features = keras.layers.GlobalAveragePooling2D()(backbone(inputs, training=False))
            model = model_class(inputs, keras.layers.Dense(3)(features))
            model.compile(optimizer=keras.optimizers.Adam(1e-2),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
            return model

        return model_fn, _images()

    return case


def synchronized_mobilenet(base):
    """MobileNetV2 training every layer, its BatchNormalization synchronized."""
    model_class = {"kd": kd.Model, "keras": keras.Model}[base]

    def synchronize(layer):
        config = layer.get_config()
        if isinstance(layer, keras.layers.BatchNormalization):
            config["synchronized"] = True
        return type(layer).from_config(config)

    def model_fn():
        backbone = keras.applications.MobileNetV2(
            input_shape=(32, 32, 3), include_top=False, weights=None, alpha=0.35)
        backbone = keras.models.clone_model(backbone, clone_function=synchronize)
        inputs = keras.Input((32, 32, 3))
        features = keras.layers.GlobalAveragePooling2D()(backbone(inputs))
        model = model_class(inputs, keras.layers.Dense(3)(features))
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    return model_fn, _images()


# ---------------------------------------------------------------------------
# KerasTuner: trials under distribution_strategy, each checked against one device.

_TRIALS = []


class _Record(keras.callbacks.Callback):
    """Keeps each trial's initial and final weights (KerasTuner copies callbacks per trial)."""

    def on_train_begin(self, logs=None):
        _TRIALS.append({"initial": self.model.get_weights()})

    def on_train_end(self, logs=None):
        _TRIALS[-1]["final"] = self.model.get_weights()


def _tuner_model(model_class):
    def build_model(hp):
        inputs = keras.Input((5,))
        hidden = keras.layers.Dense(hp.Choice("units", [4, 8]), activation="tanh")(inputs)
        model = model_class(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer=keras.optimizers.SGD(hp.Choice("lr", [0.05, 0.1]), momentum=0.9,
                                                     clipnorm=0.5), loss="mse")
        return model
    return build_model


def tuner_differences(base, strategy):
    """Runs a 2-trial RandomSearch under `strategy`; each trial's difference from one device."""
    import keras_tuner

    model_class = {"kd": kd.Model, "keras": keras.Model}[base]
    build_model = _tuner_model(model_class)
    x = rng.normal(size=(ROWS, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    _TRIALS.clear()
    with tempfile.TemporaryDirectory() as directory:
        tuner = keras_tuner.RandomSearch(
            build_model, objective="loss", max_trials=2, seed=1, distribution_strategy=strategy,
            directory=directory, project_name="search", overwrite=True)
        tuner.search(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[_Record()])
        trials = sorted(tuner.oracle.trials.values(), key=lambda t: t.trial_id)
        differences = []
        for trial, recorded in zip(trials, _TRIALS):
            with tf.device("/CPU:0"):
                model = build_model(trial.hyperparameters)
                model.set_weights(recorded["initial"])
                model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
            differences.append(max(_relative(a, b) for a, b in zip(model.get_weights(), recorded["final"])))
    return differences


# ---------------------------------------------------------------------------
# TensorBoard: kd's callback on a kd model under the strategy, Keras's on one device.

def _summaries(log_dir):
    from tensorboard.backend.event_processing import event_accumulator

    values = {}
    for run in ("train", "validation"):
        events = event_accumulator.EventAccumulator(os.path.join(log_dir, run),
                                                    size_guidance={"tensors": 0})
        events.Reload()
        for tag in events.Tags()["tensors"]:
            for event in events.Tensors(tag):
                if tag != "keras":
                    values[(run, tag, event.step)] = float(tf.make_ndarray(event.tensor_proto))
        values[(run, "keras graph", 0)] = "keras" in events.Tags()["tensors"]
    return values


def tensorboard_comparison(strategy):
    """Tags, steps and values kd's TensorBoard writes under `strategy` vs Keras's on one device."""
    x = rng.normal(size=(ROWS, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")

    def build(model_class):
        inputs = keras.Input((5,))
        model = model_class(inputs, keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(inputs)))
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        return model

    with tempfile.TemporaryDirectory() as directory:
        keras.utils.set_random_seed(0)
        with tf.device("/CPU:0"):
            reference = build(keras.Model)
            initial = reference.get_weights()
            reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, validation_split=0.25,
                          callbacks=[keras.callbacks.TensorBoard(os.path.join(directory, "keras"))])
        with strategy.scope():
            model = build(kd.Model)
            model.set_weights(initial)
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, validation_split=0.25,
                  callbacks=[kd.callbacks.TensorBoard(os.path.join(directory, "kd"))])
        expected = _summaries(os.path.join(directory, "keras"))
        got = _summaries(os.path.join(directory, "kd"))
    numbers = [key for key, value in expected.items() if not isinstance(value, bool)]
    return {
        "same_tags_and_steps": sorted(expected) == sorted(got),
        "summaries": len(numbers),
        "keras_graph": [expected[("train", "keras graph", 0)], got.get(("train", "keras graph", 0))],
        "max_difference": max(_relative(expected[k], got[k]) for k in numbers if k in got),
    }


# ---------------------------------------------------------------------------
# Measuring.

def _relative(a, b):
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    return float(np.max(np.abs(a - b) / (1 + np.abs(a)))) if a.size else 0.0


def plain_keras_difference(model_fn, data, strategy):
    """The plain Keras model's largest weight difference after one epoch, or its error."""
    x, y, sample_weight = (tuple(data) + (None,))[:3]
    keras.utils.set_random_seed(0)
    with tf.device("/CPU:0"):
        reference = model_fn()
        reference(tf.nest.map_structure(lambda a: a[:1], x))
        initial = reference.get_weights()
        reference.fit(x, y, sample_weight=sample_weight, batch_size=BATCH, shuffle=False, verbose=0)
    try:
        with strategy.scope():
            model = model_fn()
            model(tf.nest.map_structure(lambda a: a[:1], x))
            model.set_weights(initial)
        model.fit(x, y, sample_weight=sample_weight, batch_size=BATCH, shuffle=False, verbose=0)
    except Exception as error:  # noqa: BLE001 - the contrast records what plain Keras raises
        return report.error_line(error)
    return max(_relative(a, b) for a, b in zip(reference.get_weights(), model.get_weights()))


def reload_check(model_fn, data, strategy):
    """Trains under `strategy`, saves, reloads: the class, optimizer steps, same predictions."""
    x, y, sample_weight = (tuple(data) + (None,))[:3]
    with strategy.scope():
        model = model_fn()
    model.fit(x, y, sample_weight=sample_weight, batch_size=BATCH, shuffle=False, verbose=0)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "task.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
    # The trained model predicts on its replicas, the loaded one on one device:
    # the same up to float32 round-off (the rows are split differently).
    same = all(_relative(a, b) <= 2e-5 for a, b in zip(
        tf.nest.flatten(model.predict(x, verbose=0)), tf.nest.flatten(loaded.predict(x, verbose=0))))
    return {"class": type(loaded).__name__, "iterations": int(loaded.optimizer.iterations.numpy()),
            "same_predictions": bool(same)}


def kd_difference(model_fn, data):
    """assert_parity's largest difference, and the float32 one if float64 had to decide."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (difference,) = kd.testing.assert_parity(model_fn, data, batch_size=BATCH).values()
    notes = [str(w.message) for w in caught if "float64" in str(w.message)]
    return difference, notes


CASES = {
    "bert_classifier": bert_classifier,
    "gpt2_causal_lm": gpt2_causal_lm,
    "mobilenet_v2_frozen": application("MobileNetV2"),
    "efficientnet_b0_frozen": application("EfficientNetB0"),
    "mobilenet_v2_synchronized": synchronized_mobilenet,
}


if __name__ == "__main__":
    hub_tasks = {}
    if {"bert_classifier", "gpt2_causal_lm"} & set(sys.argv[1:]):
        hub = _hub()

        # The documented way: kd's mixin first, then the task; registered so a
        # saved model reloads (see docs/guides/ecosystem.md).
        @keras.saving.register_keras_serializable(package="ecosystem")
        class ExactBertClassifier(kd.DistributedModelMixin, hub.models.BertTextClassifier):
            pass

        @keras.saving.register_keras_serializable(package="ecosystem")
        class ExactGPT2CausalLM(kd.DistributedModelMixin, hub.models.GPT2CausalLM):
            pass

    strategy = kd.make_strategy("mirrored")
    for case in sys.argv[1:]:
        started = time.process_time()
        if case == "tensorboard":
            result = {"case": case, **tensorboard_comparison(strategy)}
        elif case == "keras_tuner":
            result = {"case": case, "kd": tuner_differences("kd", strategy),
                      "keras": tuner_differences("keras", strategy)}
        else:
            model_fn, data = CASES[case]("kd")
            difference, notes = kd_difference(model_fn, data)
            plain_fn, plain_data = CASES[case]("keras")
            result = {"case": case, "kd": difference, "float64_notes": notes,
                      "keras": plain_keras_difference(plain_fn, plain_data, strategy)}
            if case == "bert_classifier":
                result["reload"] = reload_check(model_fn, data, strategy)
        result["cpu_seconds"] = round(time.process_time() - started, 1)
        print("RESULT " + json.dumps(result), flush=True)
