"""tf-keras (Keras 2) under MirroredStrategy on 2 virtual CPUs, against one device.

Usage: python tests/scripts/tf_keras_contrast.py [JSON_OUT]

The exactness matrix's contrast for legacy Keras: every feature of
features.py that tf-keras can express, ported to tf_keras's API, is trained on
one device and under MirroredStrategy with the same initial weights, data and
global batches, and compared as features.compare does (weights, history,
evaluate, predict). tf-keras has no kd, so this measures tf-keras itself.
Each feature runs in its own child process (`--feature NAME`): some crash
TensorFlow outright (a failed CHECK aborts the process), and a crash is a
result. Prints one 'RESULT {json}' line per feature, then a Markdown table;
JSON_OUT, if given, receives {feature: table cell} for exactness_report.py.
"""

import contextlib
import json
import os
import re
import subprocess
import sys
import time

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
os.environ["CUDA_VISIBLE_DEVICES"] = ""
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tensorflow as tf  # noqa: E402

# Before anything touches a device: once TensorFlow initializes its devices,
# the CPU can no longer be split.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()],
)

import tf_keras  # noqa: E402

import features  # noqa: E402  (its data; its models are Keras 3 and are not used)

layers = tf_keras.layers
optimizers = tf_keras.optimizers


def _mlp(*, l2=0.0, activity=0.0, batch_norm=False, frozen=False, dtype=None):
    inputs = tf_keras.Input((5,))
    x = layers.Dense(
        8,
        activation="tanh",
        kernel_regularizer=tf_keras.regularizers.L2(l2) if l2 else None,
        activity_regularizer=tf_keras.regularizers.L2(activity) if activity else None,
        trainable=not frozen,
    )(inputs)
    if batch_norm:
        x = layers.BatchNormalization(synchronized=True, momentum=0.8)(x)
    x = layers.Dense(6, activation="tanh")(x)
    return tf_keras.Model(inputs, layers.Dense(1, dtype=dtype)(x))


def _classifier():
    inputs = tf_keras.Input((5,))
    hidden = layers.Dense(8, activation="relu")(inputs)
    return tf_keras.Model(inputs, layers.Dense(3, activation="softmax")(hidden))


def _two_heads():
    inputs = tf_keras.Input((5,))
    hidden = layers.Dense(8, activation="tanh")(inputs)
    value = layers.Dense(1, name="value")(hidden)
    grid = layers.Reshape((3, 2), name="grid")(layers.Dense(6)(hidden))
    return tf_keras.Model(inputs, {"value": value, "grid": grid})


def _two_inputs():
    left = tf_keras.Input((3,), name="left")
    right = tf_keras.Input((2,), name="right")
    hidden = layers.Dense(8, activation="tanh")(layers.Concatenate()([left, right]))
    return tf_keras.Model({"left": left, "right": right}, layers.Dense(1)(hidden))


def _masked_tagger():
    inputs = tf_keras.Input((6,), dtype="int32")
    x = layers.Embedding(12, 4, mask_zero=True)(inputs)
    x = layers.LSTM(5, return_sequences=True)(x)
    return tf_keras.Model(inputs, layers.Dense(1)(x))


def _sentiment():
    inputs = tf_keras.Input((6,), dtype="int32")
    x = layers.Embedding(12, 4)(inputs)
    x = layers.LSTM(5)(x)
    return tf_keras.Model(inputs, layers.Dense(1, activation="sigmoid")(x))


def _cnn():
    inputs = tf_keras.Input((8, 8, 1))
    x = layers.Conv2D(4, 3, activation="relu")(inputs)
    x = layers.MaxPooling2D()(x)
    x = layers.Flatten()(x)
    return tf_keras.Model(inputs, layers.Dense(3)(x))


class _GuideTrainStep(tf_keras.Model):
    """A `train_step` override written as tf-keras's guide writes it."""

    def train_step(self, data):
        x, y, sample_weight = tf_keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x, y, y_pred, sample_weight)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        return self.compute_metrics(x, y, y_pred, sample_weight)


def _custom_step_model():
    inputs = tf_keras.Input((5,))
    hidden = layers.Dense(8, activation="tanh", activity_regularizer=tf_keras.regularizers.L2(0.05))(
        inputs
    )
    return _GuideTrainStep(inputs, layers.Dense(1)(hidden))


def _regression_compile():
    return dict(loss="mse", metrics=["mae"])


def _port(optimizer, *, build=_mlp, compile=_regression_compile, policy=None):
    """A feature in tf_keras: builders for model, optimizer and compile arguments."""
    return dict(build=build, optimizer=optimizer, compile=compile, policy=policy)


_NO_ACCUMULATION = "tf_keras optimizers have no `gradient_accumulation_steps`"

# Feature name -> its tf_keras port, or why tf_keras cannot express it. The
# data and fit/evaluate/predict arguments come from features.py unchanged.
PORTS = {
    "base": _port(lambda: optimizers.Adam(0.01)),
    "clipnorm": _port(lambda: optimizers.SGD(0.05, momentum=0.9, clipnorm=0.5)),
    "global_clipnorm": _port(lambda: optimizers.SGD(0.05, momentum=0.9, global_clipnorm=0.5)),
    "clipvalue": _port(lambda: optimizers.SGD(0.05, momentum=0.9, clipvalue=0.05)),
    "accumulation": _NO_ACCUMULATION,
    "accumulation_clip": _NO_ACCUMULATION,
    # Keras 3's `loss_scale_factor` multiplies the loss by a constant and
    # divides the gradients by it; tf_keras spells that a static loss scale.
    "loss_scale_factor": _port(
        lambda: tf_keras.mixed_precision.LossScaleOptimizer(
            optimizers.SGD(0.05), dynamic=False, initial_scale=128.0
        )
    ),
    "mixed_float16": _port(
        lambda: tf_keras.mixed_precision.LossScaleOptimizer(optimizers.Adam(0.01), initial_scale=256.0),
        build=lambda: _mlp(dtype="float32"),
        policy="mixed_float16",
    ),
    "nonfinite_on_one_replica": _port(
        lambda: tf_keras.mixed_precision.LossScaleOptimizer(optimizers.SGD(0.05), initial_scale=256.0),
        build=lambda: _mlp(dtype="float32"),
        policy="mixed_float16",
    ),
    "ema": _port(
        lambda: optimizers.Adam(0.01, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2)
    ),
    "adamw_schedule": _port(
        lambda: optimizers.AdamW(
            optimizers.schedules.ExponentialDecay(0.02, decay_steps=2, decay_rate=0.7),
            weight_decay=0.1,
        )
    ),
    "regularizers": _port(lambda: optimizers.Adam(0.01), build=lambda: _mlp(l2=0.01, activity=0.05)),
    "frozen_layer": _port(lambda: optimizers.Adam(0.01), build=lambda: _mlp(frozen=True)),
    "sync_batch_norm": _port(lambda: optimizers.Adam(0.01), build=lambda: _mlp(batch_norm=True)),
    "weights": _port(
        lambda: optimizers.Adam(0.01),
        compile=lambda: dict(loss="mse", metrics=["mae"], weighted_metrics=["mse"]),
    ),
    "class_weights": _port(
        lambda: optimizers.Adam(0.01),
        build=_classifier,
        compile=lambda: dict(loss="sparse_categorical_crossentropy", metrics=["accuracy"]),
    ),
    "multi_output": _port(
        lambda: optimizers.Adam(0.01),
        build=_two_heads,
        compile=lambda: dict(
            loss={"value": "mse", "grid": "mae"},
            loss_weights={"value": 1.0, "grid": 0.5},
            metrics={"value": ["mae"]},
        ),
    ),
    "dict_inputs": _port(lambda: optimizers.Adam(0.01), build=_two_inputs),
    "masks": _port(lambda: optimizers.Adam(0.01), build=_masked_tagger),
    "lstm_auc": _port(
        lambda: optimizers.Adam(0.01),
        build=_sentiment,
        compile=lambda: dict(
            loss="binary_crossentropy", metrics=[tf_keras.metrics.AUC(name="auc"), "accuracy"]
        ),
    ),
    "cnn": _port(
        lambda: optimizers.SGD(0.05, momentum=0.9),
        build=_cnn,
        compile=lambda: dict(
            loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
        ),
    ),
    "reshuffled_dataset": _port(lambda: optimizers.Adam(0.01)),
    "custom_train_step": _port(
        lambda: optimizers.SGD(0.05, momentum=0.9, clipnorm=0.5), build=_custom_step_model
    ),
}


def train(port, spec, *, strategy=None, initial_weights=None):
    """Builds, compiles and trains a port; returns its results and initial weights.

    With `initial_weights`, starts from them instead of the fresh model's.
    """
    if port["policy"]:
        tf_keras.mixed_precision.set_global_policy(port["policy"])
    try:
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            tf_keras.utils.set_random_seed(1)
            model = port["build"]()
            model.compile(optimizer=port["optimizer"](), **port["compile"]())
        if initial_weights is not None:
            model.set_weights(initial_weights)
        start = model.get_weights()
        batch = features.GLOBAL_BATCH
        fit_args = dict(spec["fit"])
        if callable(fit_args.get("x")):  # a tf.data pipeline, built per run
            fit_args["x"] = fit_args["x"]()
        else:
            fit_args.update(batch_size=batch, shuffle=False)
        history = model.fit(**fit_args, epochs=features.EPOCHS, verbose=0)
        logs = model.evaluate(**spec["evaluate"], batch_size=batch, verbose=0, return_dict=True)
        predictions = model.predict(**spec["predict"], batch_size=batch, verbose=0)
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    results = dict(
        weights=model.get_weights(),
        history=history.history,
        evaluate=logs,
        predict=predictions,
        iterations=int(model.optimizer.iterations.numpy()),
    )
    return results, start


def contrast(name):
    """One feature: tf_keras mirrored against tf_keras on one device."""
    spec = features.FEATURES[name]()
    strategy = tf.distribute.MirroredStrategy(
        [device.name for device in tf.config.list_logical_devices("CPU")]
    )
    assert strategy.num_replicas_in_sync == 2
    stage = "one device"
    try:
        # The stage goes to stdout first, for the parent to name it if we abort.
        print(f"STAGE {stage}", flush=True)
        with tf.device("/CPU:0"):
            expected, start = train(PORTS[name], spec)
        stage = "mirrored"
        print(f"STAGE {stage}", flush=True)
        actual, _ = train(PORTS[name], spec, strategy=strategy, initial_weights=start)
        detail = {
            key: features.relative_difference(expected[key], actual[key])
            for key in ("weights", "history", "evaluate", "predict")
        }
    except Exception as error:  # reported: a crash is a result here
        summary = f"{type(error).__name__} ({stage}): {features.error_summary(error)}"
        return {"feature": name, "tf_keras": None, "error": summary}
    detail["iterations"] = [expected["iterations"], actual["iterations"]]
    worst = max(detail[key] for key in ("weights", "history", "evaluate", "predict"))
    return {"feature": name, "tf_keras": worst, "detail": detail}


def _abort_summary(stdout, stderr, code):
    """What killed a child that printed no result: TF's fatal CHECK, and where."""
    stages = re.findall(r"^STAGE (.+)$", stdout, re.M)
    stage = stages[-1] if stages else "start-up"
    fatal = re.search(r"^F\d{4} [^\]]*\] (.+)$", stderr, re.M)  # absl's fatal-log prefix
    kernel = re.search(r"tensorflow::(\w+Op)\b[^\n]*::Compute", stderr)
    lines = [line for line in stderr.splitlines() if line.strip()]
    message = fatal.group(1) if fatal else (lines[-1] if lines else "no output")
    if kernel:
        message += f" (in {kernel.group(1)})"
    return f"abort, exit {code} ({stage}): {message.strip()[:600]}"


def run_child(name, timeout=300):
    """Runs one feature in a fresh process; returns its result."""
    if isinstance(PORTS[name], str):
        return {"feature": name, "tf_keras": None, "n/a": PORTS[name]}
    command = [sys.executable, os.path.abspath(__file__), "--feature", name]
    try:
        child = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"feature": name, "tf_keras": None, "error": f"timeout after {timeout} s"}
    for line in child.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    error = _abort_summary(child.stdout, child.stderr, child.returncode)
    return {"feature": name, "tf_keras": None, "error": error}


def cell(result):
    """The table cell, in exactness_report.py's number format."""
    if "n/a" in result:
        return "n/a"
    if "error" in result:
        return "fails"
    return f"{result['tf_keras']:.0e}" if result["tf_keras"] else "0"


def main(json_out=None):
    started = time.monotonic()
    results = []
    for name in features.FEATURES:
        begun = time.monotonic()
        result = run_child(name)
        result["seconds"] = round(time.monotonic() - begun, 1)
        results.append(result)
        print("RESULT " + json.dumps(result), flush=True)
    print(f"\n{len(results)} features in {time.monotonic() - started:.0f} s\n")
    print("| feature | tf-keras mirrored 2 vs one device |")
    print("|---|---|")
    for result in results:
        print(f"| {result['feature']} | {cell(result)} |")
    notes = [r for r in results if "n/a" in r or "error" in r]
    if notes:
        print()
    for result in notes:
        print(f"- {result['feature']}: {result.get('n/a') or result.get('error')}")
    if json_out:
        with open(json_out, "w") as f:
            json.dump({r["feature"]: cell(r) for r in results}, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--feature"]:
        print("RESULT " + json.dumps(contrast(sys.argv[2])), flush=True)
    else:
        main(*sys.argv[1:2])
