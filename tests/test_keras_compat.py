"""Fails loudly when Keras or TensorFlow change what kd relies on.

Every private Keras/TensorFlow name keras_distrib touches is listed in
`_keras_compat.PRIVATE_NAMES` and used only inside `_keras_compat/`. These
tests resolve each listed name on the installed versions, scan the package
for private access elsewhere, check that importing kd replaces nothing and
that what a kd model's first step replaces is listed and inert for plain
Keras, and pin the Keras behaviours kd corrects.
"""

import ast
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_distrib import _keras_compat
from keras_distrib.training import losses as kd_losses
from keras_distrib.training import models as kd_models
from tests import _project

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "keras_distrib")


def test_versions_are_in_the_tested_range():
    assert _keras_compat.TESTED_KERAS[0] <= _keras_compat.KERAS_VERSION <= _keras_compat.TESTED_KERAS[1]
    assert (_keras_compat.TESTED_TENSORFLOW[0] <= _keras_compat.TENSORFLOW_VERSION
            <= _keras_compat.TESTED_TENSORFLOW[1])


def _admitted(name):
    """(first, last) minor versions pyproject.toml's dependencies admit for `name`."""
    with open(os.path.join(os.path.dirname(PACKAGE), "pyproject.toml")) as f:
        text = f.read()
    dependencies = text[text.index("dependencies = ["):text.index("]", text.index("dependencies = ["))]
    (low, high), = re.findall(rf'"{name}>=(\d+\.\d+),<(\d+\.\d+)"', dependencies)
    first = tuple(int(p) for p in low.split("."))
    ceiling = tuple(int(p) for p in high.split("."))
    return first, (ceiling[0], ceiling[1] - 1)


def test_pyproject_admits_exactly_the_tested_versions():
    assert _admitted("keras") == _keras_compat.TESTED_KERAS
    assert _admitted("tensorflow") == _keras_compat.TESTED_TENSORFLOW


@pytest.mark.parametrize("keras_version,tensorflow_version,found", [
    ("3.12.0", "2.21.0", "found Keras 3.12.0"),
    ("3.15.1", "2.19.0", "found TensorFlow 2.19.0"),
    ("3.16.0.dev2026010203", "2.22.0", "found Keras 3.16.0.dev2026010203 and TensorFlow 2.22.0"),
])
def test_an_untested_version_is_refused_naming_the_tested_ones(keras_version, tensorflow_version, found):
    def named(name, tested):
        first, last = (f"{major}.{minor}" for major, minor in tested)
        return f"{name} {first}" if first == last else f"{name} {first} to {last}"

    tested = (f"tested with {named('Keras', _keras_compat.TESTED_KERAS)} and "
              f"{named('TensorFlow', _keras_compat.TESTED_TENSORFLOW)}")
    with pytest.raises(ImportError, match=re.escape(tested) + ".*" + re.escape(found)) as raised:
        _keras_compat.check_versions(keras_version, tensorflow_version, {})
    message = str(raised.value)
    assert 'pip install "keras>=' in message and "KD_UNTESTED_VERSIONS=1" in message
    # Asked to run anyway, kd warns with the same facts.
    with pytest.warns(UserWarning, match=re.escape(found)):
        _keras_compat.check_versions(keras_version, tensorflow_version, {"KD_UNTESTED_VERSIONS": "1"})


def test_the_tested_versions_pass_the_check_silently(recwarn):
    for keras_range in _keras_compat.TESTED_KERAS:
        for tensorflow_range in _keras_compat.TESTED_TENSORFLOW:
            _keras_compat.check_versions(".".join(map(str, keras_range)) + ".4",
                                         ".".join(map(str, tensorflow_range)) + ".0rc1", {})
    assert not recwarn.list


def _resolve(path):
    if path.startswith("tf."):
        obj = tf
        parts = path.split(".")[1:]
    else:
        parts = path.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            parts = parts[cut:]
            break
    for part in parts:
        obj = getattr(obj, part)
    return obj


def _instances():
    """Built instances whose instance attributes the table names."""
    inputs = keras.Input((3,))
    normalized = keras.layers.BatchNormalization()(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(normalized))
    optimizer = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    model.fit(np.ones((4, 3), "float32"), np.ones((4, 2), "float32"), verbose=0)
    epoch_iterator = _keras_compat.epoch_iterator(
        x=np.ones((4, 3), "float32"), batch_size=2,
        distribute_strategy=tf.distribute.get_strategy(),
    )
    return {
        "keras.Model": model,
        "keras.layers.BatchNormalization": model.layers[1],
        "keras.optimizers.Optimizer": optimizer,
        "keras.src.trainers.compile_utils.CompileLoss": model._compile_loss,
        "keras.src.trainers.compile_utils.CompileMetrics": model._compile_metrics,
        "keras.Variable": model.layers[2].kernel,
        "keras.src.backend.tensorflow.trainer.TFEpochIterator": epoch_iterator,
        "tensorflow.python.distribute.values.PerReplicaSpec": _resolve(
            "tensorflow.python.distribute.values.PerReplicaSpec"
        )(tf.TensorSpec([None]), tf.TensorSpec([None])),
    }


@pytest.mark.parametrize("owner,name,needed", _keras_compat.PRIVATE_NAMES,
                         ids=[f"{o.rsplit('.', 1)[-1]}.{n}" for o, n, _ in _keras_compat.PRIVATE_NAMES])
def test_private_name_still_exists(owner, name, needed, built=_instances.__dict__.setdefault("cache", {})):
    target = _resolve(owner)
    if hasattr(target, name):
        value = getattr(target, name)
    else:
        if not built:
            built.update(_instances())
        instance = built.get(owner)
        if instance is None:
            # An attribute set in the constructor of a class kd cannot build here.
            source = inspect.getsource(target)
            assert f"self.{name} =" in source, f"{owner}.{name} not found (kd needs: {needed})"
            return
        assert hasattr(instance, name), f"{owner}.{name} not found on an instance (kd needs: {needed})"
        value = getattr(instance, name)
    if needed.startswith(("method(", "function(")):
        assert callable(value), (owner, name)
        wanted = needed.split("(", 1)[1].split(")", 1)[0]
        parameters = inspect.signature(value).parameters
        for argument in [a.split("=")[0].strip() for a in wanted.split(",") if a.strip()]:
            if argument in ("value", "values", "x", "x1", "x2", "logs", "loss", "grads", "arrays"):
                continue  # positional names Keras may rename
            assert argument in parameters, f"{owner}.{name} lost `{argument}` (kd needs: {needed})"


def _private_uses(tree):
    """`obj._name` reads and imports of private modules in a module's AST."""
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and (
            node.module.startswith(("keras.src", "tensorflow.python"))
        ):
            uses.append(node.module)
        elif isinstance(node, ast.Import):
            uses += [a.name for a in node.names if a.name.startswith(("keras.src", "tensorflow.python"))]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            uses.append(node.attr)
    return uses


def _own_names(trees):
    """Private names kd defines itself (functions, methods, attributes, modules)."""
    names = set()
    for path in _project.project_files("keras_distrib"):
        parts = os.path.relpath(path, PACKAGE).split(os.sep)
        names |= {os.path.splitext(part)[0] for part in parts}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) > 1:
                if isinstance(node.args[1], ast.Constant):
                    names.add(node.args[1].value)
    return names


# Underscored names that are Python's documented API, not Keras's or TensorFlow's:
# os._exit ends a process whose main thread is stuck (kd's watchdog);
# sys._current_frames gives every thread's stack (the first-step benchmark's profile).
_PYTHON_API = {"_exit", "_current_frames"}


def test_no_private_keras_or_tensorflow_names_outside_compat():
    sources = {}
    for path in _project.project_files("keras_distrib", ".py"):
        with open(path) as f:
            sources[os.path.relpath(path, PACKAGE)] = ast.parse(f.read())
    own = _own_names(tree for path, tree in sources.items() if not path.startswith("_keras_compat" + os.sep))
    outside = {}
    for path, tree in sources.items():
        if path.startswith("_keras_compat" + os.sep):
            continue
        foreign = [u for u in _private_uses(tree) if ("." in u or u not in own) and u not in _PYTHON_API]
        if foreign:
            outside[path] = sorted(set(foreign))
    assert not outside, f"private Keras/TF names outside _keras_compat/: {outside}"


# One script, two processes: "kd" imports kd, trains a kd model's first step
# (which installs the process-wide replacements), then runs plain Keras code;
# "plain" runs the same plain Keras code in a process that never imports kd.
_SAME_PROCESS = r"""
import json, sys
import numpy as np
import keras, tensorflow as tf

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)


def attributes():
    # Every attribute of every Keras/TensorFlow class and every function of
    # their modules, by identity.
    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith(("keras", "tensorflow")) or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and value.__module__ == name:
                found.update({f"{name}.{attr}.{k}": id(v) for k, v in vars(value).items()})
            elif callable(value) and getattr(value, "__module__", None) == name:
                found[f"{name}.{attr}"] = id(value)
    return found


def changed(before, after):
    return sorted(k for k in before if k in after and before[k] != after[k])


def plain_keras():
    # Plain Keras: fit with Dropout, noise and BatchNormalization on one device
    # and under a MirroredStrategy, and a hand-written step with a loss object,
    # keras.random and tf.GradientTape.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(37, 5)).astype("float32")
    y = rng.normal(size=(37, 1)).astype("float32")
    weights = []

    def model():
        inputs = keras.Input((5,))
        h = keras.layers.Dense(8, activation="relu")(inputs)
        h = keras.layers.Dropout(0.4)(h)
        h = keras.layers.GaussianNoise(0.1)(h)
        h = keras.layers.BatchNormalization()(h)
        return keras.Model(inputs, keras.layers.Dense(1)(h))

    keras.utils.set_random_seed(1)
    one = model()
    one.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.MeanSquaredError())
    one.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    weights += one.get_weights()

    keras.utils.set_random_seed(2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        mirrored = model()
        mirrored.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    mirrored.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    weights += mirrored.get_weights()

    keras.utils.set_random_seed(3)
    own = model()
    optimizer = keras.optimizers.SGD(0.05)
    loss_fn = keras.losses.MeanAbsoluteError()
    seeds = keras.random.SeedGenerator(4)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            noisy = xb + 0.1 * keras.random.normal(tf.shape(xb), seed=seeds)
            loss = loss_fn(yb, own(noisy, training=True))
        grads = tape.gradient(loss, own.trainable_variables)
        optimizer.apply_gradients(zip(grads, own.trainable_variables))

    for start in range(0, 37, 8):
        step(x[start:start + 8], y[start:start + 8])
    weights += own.get_weights()
    return [np.asarray(w).tobytes().hex() for w in weights]


if sys.argv[1] == "plain":
    print("WEIGHTS " + json.dumps(plain_keras()))
    sys.exit(0)

before = attributes()
import keras_distrib as kd
for name in kd.__all__:  # each loads its module at first use
    getattr(kd, name)
print("CHANGED_ON_IMPORT " + json.dumps(changed(before, attributes())))

from keras_distrib import _keras_compat


class Custom(kd.Model):
    # A custom step that goes through all three: a loss object, keras.random, the tape.
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            noisy = x + 0.1 * keras.random.normal(tf.shape(x), seed=self.seeds)
            loss = self.loss_fn(y, self(noisy, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


with _keras_compat.isolated_mirrored_strategy(["/cpu:0", "/cpu:1"]).scope():
    inputs = keras.Input((5,))
    kd_model = Custom(inputs, keras.layers.Dense(1)(keras.layers.Dropout(0.5)(inputs)))
    kd_model.seeds = keras.random.SeedGenerator(0)
    kd_model.loss_fn = keras.losses.MeanSquaredError()
    kd_model.compile(optimizer="sgd")
rows = np.ones((6, 5), "float32")
kd_model.fit(rows, rows[:, :1], batch_size=6, epochs=1, verbose=0)
print("CHANGED_AT_FIRST_STEP " + json.dumps(changed(before, attributes())))
print("INSTALLED " + json.dumps(_keras_compat.installed_for_process()))
print("WEIGHTS " + json.dumps(plain_keras()))

# The contrast: a draw replacement that is not inert outside a kd step (it
# draws for a batch twice the size and keeps the second half, as a replica
# of a kd step would) changes what plain Keras trains.
from keras.src.backend.tensorflow import random as keras_tf_random
inner = keras_tf_random.dropout


def leaky(inputs, rate, noise_shape=None, seed=None):
    rows = tf.shape(inputs)[0]
    return inner(tf.concat([inputs, inputs], 0), rate, None, seed)[rows:]


keras_tf_random.dropout = leaky
print("CONTRAST " + json.dumps(plain_keras()))
"""

# What a kd model's first step changes, by defining path, and the target
# `_keras_compat.replacements` names for it.
_PROCESS_WIDE = {
    "keras.src.losses.loss.Loss.__call__": "keras.losses.Loss.__call__",
    "tensorflow.python.eager.backprop.GradientTape.gradient": "tf.GradientTape.gradient",
    **{f"keras.src.backend.tensorflow.random.{name}": f"keras.src.backend.tensorflow.random.{name}"
       for name in _keras_compat.replacements.RANDOM_DRAWS},
}


def _outputs(process, timeout):
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    found = {}
    for line in stdout.splitlines():
        key, _, value = line.partition(" ")
        if key.isupper() and value.startswith("["):
            found[key] = json.loads(value)
    return found, stderr


@pytest.mark.cluster
def test_replacements_are_listed_installed_at_the_first_step_and_inert_for_plain_keras():
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.path.dirname(PACKAGE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TF_CONFIG", None)
    started = [subprocess.Popen([sys.executable, "-c", _SAME_PROCESS, kind], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for kind in ("kd", "plain")]
    try:
        (with_kd, kd_errors), (without_kd, plain_errors) = (_outputs(p, 300) for p in started)
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert "CONTRAST" in with_kd, kd_errors[-3000:]
    assert "WEIGHTS" in without_kd, plain_errors[-3000:]
    # Importing kd replaces nothing; its first step replaces exactly what the
    # list says is process-wide, and says so.
    assert with_kd["CHANGED_ON_IMPORT"] == []
    assert with_kd["CHANGED_AT_FIRST_STEP"] == sorted(_PROCESS_WIDE)
    listed = [r.target for r in _keras_compat.REPLACEMENTS
              if r.scope == _keras_compat.replacements.THIS_PROCESS]
    assert sorted(with_kd["INSTALLED"]) == sorted(listed) == sorted(_PROCESS_WIDE.values())
    # Plain Keras after a kd model's first step: bit for bit the process without kd.
    assert len(with_kd["WEIGHTS"]) == len(without_kd["WEIGHTS"]) == 24
    different = [i for i, (a, b) in enumerate(zip(with_kd["WEIGHTS"], without_kd["WEIGHTS"])) if a != b]
    assert different == []
    # The contrast: a replacement that leaks out of kd's steps is caught.
    assert with_kd["CONTRAST"] != without_kd["WEIGHTS"]


def _installs(tree):
    """Names of the functions in `tree` that replace an attribute of an object or class.

    `setattr(...)`, `object.__setattr__(...)`, an assignment to an attribute
    of a class reached through a module (`tf.GradientTape.gradient = ...`),
    or to a class's `__bases__`.
    """
    found = set()
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("setattr", "object.__setattr__"):
                found.add(function.name)
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Attribute) and (isinstance(t.value, ast.Attribute) or t.attr == "__bases__")
                    for t in node.targets):
                found.add(function.name)
    return found


# Functions that replace attributes only for an installer that is listed
# (it calls them), and the closures inside listed installers.
_HELPERS = {
    "_replace_on_instance": "replace_metric_result, replace_mean_update, replace_seed_next, ...",
    "_write_from_one_replica": "write_from_first_replica, write_seed_state_from_last_replica",
    "inject": "make_functional",
}


def test_every_replacement_of_keras_behaviour_is_listed():
    listed = {r.installer.__name__ for r in _keras_compat.REPLACEMENTS}
    assert {r.scope for r in _keras_compat.REPLACEMENTS} == {
        _keras_compat.replacements.THIS_PROCESS, _keras_compat.replacements.THIS_MODEL,
        _keras_compat.replacements.WHILE_SAVING}
    installers = set()
    for path in _project.project_files(os.path.join("keras_distrib", "_keras_compat"), ".py"):
        with open(path) as f:
            installers |= _installs(ast.parse(f.read()))
    assert set(_HELPERS) <= installers  # each helper still is one
    assert sorted(installers - set(_HELPERS) - listed) == []
    # The contrast: an installer that is not listed is found.
    unlisted = ast.parse("def quietly(layer):\n    object.__setattr__(layer, 'call', None)\n")
    assert _installs(unlisted) - listed == {"quietly"}


def test_keras_saves_the_model_config_through_the_name_kd_wraps(tmp_path):
    # A kd model's save names its classes as Keras's by wrapping saving_lib's
    # serialize_keras_object for the save (trainer.saved_config): Keras must
    # still call it, once, on the model, for config.json.
    saving_lib = _resolve("keras.src.saving.saving_lib")
    assert _keras_compat.saving_hook_found()
    assert inspect.getsource(saving_lib).count("serialize_keras_object(model)") == 1
    inputs = keras.Input((2,))
    model = kd_models.Model(inputs, keras.layers.Dense(1)(inputs))
    model.save(tmp_path / "m.keras")
    assert saving_lib.serialize_keras_object is _resolve(
        "keras.src.saving.serialization_lib.serialize_keras_object")  # put back after the save
    with zipfile.ZipFile(tmp_path / "m.keras") as archive:
        assert json.loads(archive.read("config.json"))["class_name"] == "Functional"


def test_a_keras_that_saves_otherwise_gets_its_own_file_and_a_warning(tmp_path, monkeypatch):
    saving_lib = _resolve("keras.src.saving.saving_lib")
    keras_serialize = saving_lib.serialize_keras_object
    monkeypatch.setattr(saving_lib, "serialize_keras_object", lambda obj: keras_serialize(obj))
    inputs = keras.Input((2,))
    model = kd_models.Model(inputs, keras.layers.Dense(1)(inputs))
    with pytest.warns(UserWarning, match=r"writes \.keras files in a way kd does not know.*"
                                         r"kd\.save_for_keras"):
        model.save(tmp_path / "m.keras")
    with zipfile.ZipFile(tmp_path / "m.keras") as archive:
        assert json.loads(archive.read("config.json"))["class_name"] == "FunctionalModel"


def test_every_random_function_of_keras_is_one_kd_lays_out():
    # A draw kd does not replace would be drawn per replica: each Keras
    # random function (the backend's public functions) must be listed.
    from keras.src.backend.tensorflow import random as keras_tf_random

    functions = {name for name, value in vars(keras_tf_random).items()
                 if inspect.isfunction(value) and value.__module__ == keras_tf_random.__name__
                 and not name.startswith("_")}
    assert functions == set(_keras_compat.replacements.RANDOM_DRAWS)


def test_eager_ops_run_as_their_kernels_only_inside_eager_ops_as_kernels():
    # TensorFlow wraps every eager op in a function of that one op, listed in
    # the context's function library as "__wrapped__<Op>..."; the first-step
    # check turns the wrapping off around its eager work. A TensorFlow that
    # drops the switch or wraps ops another way fails here. (Op signatures
    # no other test runs: a cached kernel would make no function either way.)
    from tensorflow.python.eager import context

    def functions_made_by(op):
        before = set(context.context().list_function_names())
        op()
        return set(context.context().list_function_names()) - before

    x = tf.constant([[0.5, -1.5]], tf.float64)
    with _keras_compat.eager_ops_as_kernels():
        with _keras_compat.eager_ops_as_kernels():
            pass  # a nested use ending leaves the outer one's setting
        assert functions_made_by(lambda: tf.math.bessel_i0e(x)) == set()
    wrapped = functions_made_by(lambda: tf.math.bessel_i1e(x))
    assert [name for name in wrapped if name.startswith("__wrapped__BesselI1e")], wrapped


def test_step_calls_drop_the_gradients_traced_all_reduces_register_and_keep_a_users():
    # In graph mode TensorFlow registers a gradient for every
    # ReplicaContext.all_reduce it traces (a tf.custom_gradient) and never
    # removes it, so the traced graph lives as long as the process. kd's step
    # calls drop those (and kd's own) at their end and keep a user's. A
    # TensorFlow that registers them otherwise fails here.
    from tensorflow.python.framework import ops

    registry = ops._gradient_registry._registry
    strategy = tf.distribute.MirroredStrategy(["CPU:0"])

    @tf.custom_gradient
    def users_own(x):
        return tf.identity(x), lambda dy: 2.0 * dy

    def trace():
        before = set(registry)
        replica_step = lambda x: users_own(tf.distribute.get_replica_context().all_reduce(
            "sum", tf.identity(x)))  # (an op on the replica's device: its destination)
        tf.function(lambda x: strategy.run(replica_step, args=(x,)))(tf.constant(1.0))
        return _keras_compat.strategies.custom_gradients(set(registry) - before)

    registered = trace()  # as TensorFlow leaves them: both stay
    assert sorted(name for _, name in registered.values()) == [
        "ReplicaContextBase.all_reduce.<locals>.grad_wrapper.<locals>.<lambda>",
        "test_step_calls_drop_the_gradients_traced_all_reduces_register_and_keep_a_users"
        ".<locals>.users_own.<locals>.<lambda>",
    ], registered
    with _keras_compat.released_custom_gradients():
        registered = trace()
    left = [owner for name, owner in registered.items() if name in registry]
    assert len(registered) == 2 and [name.rsplit(".", 3)[-3] for _, name in left] == ["users_own"], \
        (registered, left)


def test_keras_still_scales_losses_by_replica_count():
    # GlobalShareMean undoes exactly this multiplication by R.
    source = inspect.getsource(_resolve("keras.src.losses.loss.unscale_loss_for_distribution"))
    assert "num_replicas_in_sync" in source and "multiply" in source


def test_keras_assign_add_is_still_assign_of_sum():
    # fix_variables exists because of this implementation.
    source = inspect.getsource(_resolve("keras.src.backend.common.variables.Variable.assign_add"))
    assert "self.assign(self + value)" in source


def test_keras_optimizer_still_reduces_inside_its_update_step():
    # kd all-reduces first and makes this reduction an identity.
    source = inspect.getsource(_resolve("keras.src.backend.tensorflow.optimizer.TFOptimizer._backend_update_step"))
    assert "_all_reduce_sum_gradients" in source
    source = inspect.getsource(_resolve("keras.src.optimizers.base_optimizer.BaseOptimizer._backend_apply_gradients"))
    for piece in ("gradient_accumulation_steps", "_clip_gradients", "_apply_weight_decay",
                  "_backend_update_step", "_backend_increment_gradient_accumulators",
                  "_update_model_variables_moving_average", "ema_overwrite_frequency"):
        assert piece in source, piece
    # kd's copy of it (its conditionals in cross-replica context) reads the
    # optimizer's state and methods Keras's reads, no more, no fewer: a step
    # Keras adds to its method fails here, not silently in training.
    copy = inspect.getsource(_keras_compat.optimizer._apply_in_cross_replica)
    assert set(re.findall(r"\bself\.(\w+)", source)) == set(re.findall(r"\boptimizer\.(\w+)", copy))


def test_compile_loss_layout_is_as_expected():
    compile_loss = _resolve("keras.src.trainers.compile_utils.CompileLoss")
    assert compile_loss.Loss._fields == ("path", "loss", "loss_weights", "name")
    assert "metric.update_state" in inspect.getsource(compile_loss.call)


def test_global_reduction_loss_matches_keras_on_one_device():
    rng = np.random.default_rng(0)
    cases = [
        # labels with an extra dimension: per-element losses of shape (6, 3)
        ((6, 3, 2), rng.uniform(size=(6, 3)).astype("float32")),
        ((6, 4), rng.uniform(size=(6,)).astype("float32")),
    ]
    for shape, weights in cases:
        y_true = rng.normal(size=shape).astype("float32")
        y_pred = rng.normal(size=shape).astype("float32")
        for reduction in ("sum_over_batch_size", "sum", "mean_with_sample_weight", "mean"):
            inner = keras.losses.MeanSquaredError(reduction=reduction)
            wrapped = kd_losses.GlobalReductionLoss(inner)
            for sample_weight in (None, weights):
                expected = float(inner(y_true, y_pred, sample_weight))
                actual = float(wrapped(y_true, y_pred, sample_weight))
                assert actual == np.float32(expected), (shape, reduction)


def test_global_reduction_loss_matches_keras_with_mask():
    y_true = tf.constant([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    y_pred = tf.constant([[1.5, 2.0, 0.0], [4.0, 1.0, 6.5]])
    mask = tf.constant([[True, True, False], [True, False, True]])
    y_pred._keras_mask = mask
    inner = keras.losses.MeanAbsoluteError()
    expected = float(inner(y_true[..., None], y_pred[..., None]))
    wrapped = kd_losses.GlobalReductionLoss(inner)
    assert float(wrapped(y_true[..., None], y_pred[..., None])) == np.float32(expected)


@pytest.mark.parametrize("activation,loss", [
    ("softmax", keras.losses.sparse_categorical_crossentropy),
    ("sigmoid", keras.losses.binary_crossentropy),
])
def test_keras_cross_entropy_still_reads_the_logits_kd_keeps(activation, loss):
    # Saturated probabilities: Keras's loss from the logits is ~40 per row;
    # clipped probabilities give ~16. kd drops padded rows with a cond and
    # must keep Keras's route to the logits (`_keras_logits` or the op).
    logits = tf.constant([[40.0, -40.0, 0.0], [-40.0, 40.0, 0.0]])
    labels = tf.constant([1, 0]) if activation == "softmax" else tf.constant([[0.0, 1.0, 0.0]] * 2)
    keras_activation = getattr(keras.activations, activation)
    tf_activation = tf.nn.softmax if activation == "softmax" else tf.math.sigmoid

    @tf.function
    def losses(has_rows):
        def cut(value):
            return tf.cond(has_rows, lambda: value, lambda: value[:0])

        kept = [_keras_compat.keep_keras_logits(f(logits), cut) for f in (keras_activation, tf_activation)]
        rows = cut(labels)
        return ([loss(rows, p) for p in kept], loss(rows, cut(tf_activation(logits))),
                loss(rows, cut(logits), from_logits=True))

    kept, lost, exact = losses(tf.constant(True))
    for value in kept:
        np.testing.assert_allclose(value, exact, rtol=1e-6)
    assert float(tf.reduce_max(tf.abs(lost - exact))) > 1.0
    kept_empty, _, _ = losses(tf.constant(False))
    assert [value.shape[0] for value in kept_empty] == [0, 0]


def test_keras_opens_the_iterators_per_epoch_kd_replays_on_resume(monkeypatch):
    # A resumed `fit` replays a reshuffling dataset's orders by opening the
    # iterators Keras's epoch iterator opened before (2 per epoch, one of
    # them at each epoch's end): if Keras changes this, the replay is wrong.
    import tensorflow as tf

    import keras_distrib as kd
    from keras_distrib.training import loop as kd_loop

    opened = []
    rows = tf.data.Dataset.from_tensor_slices((np.ones((6, 1)), np.ones((6, 1)))).batch(2)
    inputs = keras.Input((1,))
    model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    source = kd_loop.epoch_source(model, x=rows)
    distributed = _keras_compat.epoch_distributed_dataset(source)
    original = type(distributed).__iter__
    monkeypatch.setattr(type(distributed), "__iter__", lambda self: opened.append(1) or original(self))
    for _ in range(3):
        with source.catch_stop_iteration():
            for _begin, _end, iterator in source:
                next(iterator)
    assert len(opened) == _keras_compat.iterators_before_epoch(source, 3) == 6


def _epochs_of(source, strategy, epochs=3):
    """Each epoch's batches from an epoch iterator under `strategy`, replica by replica."""
    batches = []
    for _ in range(epochs):
        epoch = []
        with source.catch_stop_iteration():
            for _begin, _end, iterator in source:
                data, _ = next(iterator)
                epoch.append([np.asarray(part).ravel().tolist()
                              for part in strategy.experimental_local_results(data)])
        batches.append(epoch)
    return batches


def test_kd_opens_one_distributed_iterator_per_epoch_and_keeps_keras_orders(monkeypatch):
    # Keras's epoch iterator opens 2 distributed iterators per epoch; it never
    # reads the one it opens as a pass ends, yet that opening draws a
    # reshuffling dataset's next order. kd's opens only the one it reads (each
    # traces TensorFlow functions per device) and draws the other order from a
    # plain tf.data iterator: the batches of every epoch stay Keras's. (One
    # device in this process; the exactness matrix's `reshuffled_dataset`
    # checks 2 replicas and 2 workers.)
    from keras.src.backend.tensorflow import trainer as keras_tf_trainer

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])

    def source(iterator_class):
        rows = tf.data.Dataset.range(13).map(lambda i: (tf.cast(i, "float32")[None], tf.zeros([1])))
        rows = rows.shuffle(13, seed=7, reshuffle_each_iteration=True).batch(4)
        return iterator_class(x=rows, distribute_strategy=strategy)

    opened = []
    keras_source = source(keras_tf_trainer.TFEpochIterator)
    distributed = _keras_compat.epoch_distributed_dataset(keras_source)
    original = type(distributed).__iter__
    monkeypatch.setattr(type(distributed), "__iter__", lambda self: opened.append(1) or original(self))
    keras_batches = _epochs_of(keras_source, strategy)
    keras_opened, opened[:] = len(opened), []
    kd_batches = _epochs_of(source(_keras_compat.epoch_iterator), strategy)
    assert (keras_opened, len(opened)) == (6, 3)
    assert kd_batches == keras_batches
    assert keras_batches[0] != keras_batches[1]  # the data did reshuffle
    assert [len(batch[0]) for batch in keras_batches[0]] == [4, 4, 4, 1]


def test_pipeline_batch_size_reads_tf_datas_batch_through_other_transformations():
    # TensorFlow's private `_input_dataset` / `_batch_size`: fails loudly if they change.
    import tensorflow as tf

    from keras_distrib import _keras_compat

    rows = tf.data.Dataset.range(100)
    assert _keras_compat.pipeline_batch_size(
        rows.filter(lambda x: x % 2 == 0).batch(16).map(lambda x: x * 2).prefetch(2)) == 16
    assert _keras_compat.pipeline_batch_size(rows.padded_batch(5).shuffle(3)) == 5
    assert _keras_compat.pipeline_batch_size(rows.batch(4).unbatch().batch(7)) == 7
    assert _keras_compat.pipeline_batch_size(rows.batch(4).unbatch()) is None
    assert _keras_compat.pipeline_batch_size(rows) is None
