"""Every place kd replaces Keras or TensorFlow behaviour, with its scope.

Importing keras_distrib replaces nothing. What kd replaces, it replaces in
one of three scopes:

- `THIS_PROCESS`: an attribute of a Keras or TensorFlow class or module, so
  every caller in the process goes through kd's version once it is there.
  These three are installed together by `install_for_process`, at a kd
  model's first step (`make_train_function` and its siblings), never on
  import; `Loss.__call__` and `GradientTape.gradient` also at a kd model's
  first forward pass in a hand-written loop (where they refuse a reducing
  loss object, and a loss whose summed gradient is not one device's). Each returns at once with Keras's or TensorFlow's own result
  outside a kd replica step (no `ReplicaBatch` open on the calling thread),
  so plain Keras code run later in the same process trains bit for bit as
  in a process without kd (`tests/test_keras_compat.py` compares the
  weights with a process that never imported kd).
- `THIS_MODEL`: an attribute of one object a kd model owns (its layers,
  variables, optimizer, metrics, compiled loss) or of kd's own epoch
  iterators. Other objects in the process are not touched. Installed when
  the model compiles and at its first step (`DistributedModelMixin.compile`,
  `training.hooks`), or by `kd.exact_optimizer` on
  the optimizer it is given.
- `WHILE_SAVING`: an attribute of a Keras module for the length of a kd
  model's `save`, put back when it returns (`trainer.saved_config`).

`REPLACEMENTS` lists them all, each with the function here (in
`_keras_compat`) that installs it; every installer is idempotent.
`tests/test_keras_compat.py` checks the list against the package (a new
`object.__setattr__`/`setattr` on a Keras or TensorFlow object must be
listed) and, in a process of its own, that the process-wide ones are
exactly the Keras/TensorFlow attributes a kd model's first step changes.
"""

import dataclasses
import functools

import tensorflow as tf
from keras.src.backend.tensorflow import random as keras_tf_random
from keras.src.losses import loss as keras_loss

from keras_distrib._keras_compat import data
from keras_distrib._keras_compat import layers
from keras_distrib._keras_compat import losses
from keras_distrib._keras_compat import optimizer
from keras_distrib._keras_compat import trainer
from keras_distrib._keras_compat import variables

__all__ = [
    "RANDOM_DRAWS",
    "REPLACEMENTS",
    "Replacement",
    "THIS_MODEL",
    "THIS_PROCESS",
    "WHILE_SAVING",
    "install_for_process",
    "installed_for_process",
    "replace_loss_object_call",
    "replace_random_draws",
    "replace_tape_gradient",
]

THIS_PROCESS = "this process"
THIS_MODEL = "this model"
WHILE_SAVING = "while a kd model saves"

# Every random function of Keras's TensorFlow backend (`tests/test_keras_compat.py`
# checks the list against the module): name -> whether the first argument is
# a shape (else an input tensor). kd lays each draw shaped by the batch out
# over the global batch; `shuffle` along the rows permutes them, which no
# layout makes per row: kd marks it as where the rows meet.
RANDOM_DRAWS = {"normal": True, "uniform": True, "truncated_normal": True, "randint": True,
                "gamma": True, "beta": True, "binomial": True, "dropout": False,
                "categorical": False, "shuffle": False}


@dataclasses.dataclass(frozen=True)
class Replacement:
    """One Keras/TensorFlow behaviour kd replaces.

    Attributes:
        target: What is replaced (a dotted attribute; `<layer>` etc. stand
            for instances).
        scope: `THIS_PROCESS`, `THIS_MODEL` or `WHILE_SAVING`.
        installer: The `_keras_compat` function that installs it.
        why: What kd's version does, and when it is Keras's own.
    """

    target: str
    scope: str
    installer: object
    why: str


# ---------------------------------------------------------------------------
# This process: installed together, at a kd model's first step.

_LOSS_CALL_REPLACED = []


def replace_loss_object_call(make_call):
    """Makes every `keras.losses.Loss` object call `make_call(keras_call)` (once, idempotent).

    `keras_call(loss, y_true, y_pred, sample_weight)` is Keras's own
    `Loss.__call__`. Subclasses with a `__call__` of their own (Keras's
    `CompileLoss`, kd's wrappers) are not affected.
    """
    if _LOSS_CALL_REPLACED:
        return
    keras_loss.Loss.__call__ = make_call(keras_loss.Loss.__call__)
    _LOSS_CALL_REPLACED.append(True)


def replace_tape_gradient(before_gradient):
    """Makes `tf.GradientTape.gradient` call `before_gradient(target, sources)` first (idempotent).

    Not a Keras internal: TensorFlow's public tape. `before_gradient`
    returns at once outside a kd step or a hand-written loop's replica; its
    result is not used (it records on kd's batch how the target adds up
    over replicas, or refuses a loop's target that does not).
    """
    current = tf.GradientTape.gradient
    if getattr(current, "replaced_by_kd", False):
        return

    @functools.wraps(current)
    def gradient(self, target, sources, *args, **kwargs):
        before_gradient(target, sources)
        return current(self, target, sources, *args, **kwargs)

    gradient.replaced_by_kd = True
    tf.GradientTape.gradient = gradient


def replace_random_draws(make_draw):
    """Makes Keras's random functions call `make_draw(name, shaped, keras_draw)` (idempotent).

    Every `keras.random.*` call of those in `RANDOM_DRAWS` (Keras's layers
    included) goes through the backend module patched here.
    """
    for name, shaped in RANDOM_DRAWS.items():
        current = getattr(keras_tf_random, name)
        if getattr(current, "replaced_by_kd", False):
            continue
        draw = make_draw(name, shaped, current)
        draw.replaced_by_kd = True
        setattr(keras_tf_random, name, draw)


def install_for_process(*, loss_call, before_gradient, random_draw):
    """Installs the `THIS_PROCESS` replacements (idempotent): called at a kd model's first step.

    Each argument must return Keras's or TensorFlow's own result at once
    outside a kd replica step.

    Args:
        loss_call: `make_call(keras_call)` for `keras.losses.Loss.__call__`.
        before_gradient: Called with `tape.gradient`'s target and sources first.
        random_draw: `make_draw(name, shaped, keras_draw)` for each of
            `RANDOM_DRAWS`.
    """
    replace_loss_object_call(loss_call)
    replace_tape_gradient(before_gradient)
    replace_random_draws(random_draw)


def installed_for_process():
    """The targets of the `THIS_PROCESS` replacements installed in this process now."""
    found = []
    if _LOSS_CALL_REPLACED:
        found.append("keras.losses.Loss.__call__")
    if getattr(tf.GradientTape.gradient, "replaced_by_kd", False):
        found.append("tf.GradientTape.gradient")
    found.extend(f"keras.src.backend.tensorflow.random.{name}" for name in RANDOM_DRAWS
                 if getattr(getattr(keras_tf_random, name), "replaced_by_kd", False))
    return found


REPLACEMENTS = (
    Replacement(
        "keras.losses.Loss.__call__", THIS_PROCESS, replace_loss_object_call,
        "In a kd replica step (a custom train_step's `self.loss_fn(y, y_pred)`): this replica's "
        "share of the global-batch loss. In a hand-written loop's replica after a kd model's "
        "forward pass on several replicas, a reducing loss object is refused (each replica's "
        "mean / R is not one device's loss). Elsewhere, and in a kd model's forward pass: Keras's."),
    Replacement(
        "tf.GradientTape.gradient", THIS_PROCESS, replace_tape_gradient,
        "In a kd replica step on several replicas: first reads how the target adds up over "
        "replicas (a share, a sum over rows, rows meeting). In a hand-written loop's replica "
        "after a kd model's forward pass on several replicas, a loss whose summed gradient is "
        "not one device's (a mean over the replica's rows, a weight term not divided by the "
        "replicas) is refused. Elsewhere: returns at once; the gradient is always TensorFlow's."),
    *(Replacement(
        f"keras.src.backend.tensorflow.random.{name}", THIS_PROCESS, replace_random_draws,
        "In a kd replica step on several replicas, a draw shaped by the batch: drawn for the "
        "global batch, each replica keeping its rows (a shuffle of the rows: marked as where "
        "the rows meet, computed on the global batch or refused). Elsewhere: Keras's draw.")
      for name in RANDOM_DRAWS),
    Replacement(
        "<model>.compiled_loss, <model>.loss tracker", THIS_MODEL, losses.set_compiled_loss,
        "The compiled loss gives this replica's share of the exact global mean; the tracker "
        "reports one device's value (`kd.losses`' GlobalCompileLoss, GlobalShareMean)."),
    Replacement(
        "<compiled loss>'s losses and per-output trackers", THIS_MODEL,
        losses.replace_compile_losses,
        "Each resolved loss reduced over the global batch; per-output trackers global."),
    Replacement(
        "<metric>.result, <metric>.update_state", THIS_MODEL, losses.replace_metric_result,
        "A metric's result read in a kd step is its global value; updates with values computed "
        "on the global batch count once (also `replace_metric_update`)."),
    Replacement(
        "<metric>.update_state (of keras.metrics.Mean trackers fed values)", THIS_MODEL,
        losses.replace_mean_update, "A tracker fed a loss share adds one device's value."),
    Replacement(
        "<metric>.update_state (other metrics)", THIS_MODEL, losses.replace_metric_update,
        "Values computed on the global batch update the metric once."),
    Replacement(
        "<optimizer>.apply, _all_reduce_sum_gradients, _backend_apply_gradients, assign",
        THIS_MODEL, optimizer.install_gradient_pipeline,
        "One all-reduce of the gradients first, then Keras's unscale, accumulate, clip and "
        "update in one-device order (a kd model's optimizers, or `kd.exact_optimizer`'s)."),
    Replacement(
        "<layer>.add_loss", THIS_MODEL, layers.record_add_loss,
        "Also records the term on the calling replica's own batch (Keras's list is shared by "
        "the replicas' threads)."),
    Replacement(
        "<layer>.call (random layers, MixUp and CutMix, Keras's row-wise layers, plain Keras "
        "sub-models, layers kd reads)",
        THIS_MODEL, layers.replace_call,
        "Random layers draw for the global batch; MixUp and CutMix run on the global batch; "
        "Keras's row-wise layers mark their outputs as rows; a sub-model gets a padded row on "
        "an empty replica; where rows meet (or an op kd cannot read), the layer runs on the "
        "global batch. Outside a kd step: the layer's own call."),
    Replacement(
        "<BatchNormalization>._moments", THIS_MODEL, layers.replace_batch_norm_moments,
        "Moments over the global batch (batch_norm='global'); Keras's outside a kd step."),
    Replacement(
        "<variable>.assign, assign_add, assign_sub (state a layer updates in call)",
        THIS_MODEL, layers.replace_variable_updates,
        "assign_add of data adds the sum over replicas; assign is refused in a kd step."),
    Replacement(
        "<variable>.assign_add, assign_sub, NumPy reads (a kd model's variables)", THIS_MODEL,
        variables.fix_variables,
        "The variable's own atomic update under central storage and parameter servers."),
    Replacement(
        "<BatchNormalization moving statistics>.assign (central storage)", THIS_MODEL,
        variables.write_from_first_replica, "Replica 0 writes the one copy."),
    Replacement(
        "<SeedGenerator state>.assign (central storage)", THIS_MODEL,
        variables.write_seed_state_from_last_replica,
        "The last replica writes, after every replica has read the state."),
    Replacement(
        "<SeedGenerator>.next", THIS_MODEL, variables.replace_seed_next,
        "Counts a step's draws so the state advances as one device's."),
    Replacement(
        "<kd's epoch iterator>.reset", THIS_MODEL, data.set_epoch_batches,
        "kd's own iterator: the step count survives reset()."),
    Replacement(
        "<kd's epoch iterator>._get_iterator", THIS_MODEL, data.next_epoch_over,
        "kd's own iterator: the next epoch comes from kd's distributed dataset, once."),
    Replacement(
        "<kd's epoch iterator's distributed dataset>._enable_get_next_as_optional", THIS_MODEL,
        data.skip_batch_agreement,
        "kd's own dataset, where every worker holds the same known batch count: no all-reduce "
        "per fetch asking whether a worker ran out."),
    Replacement(
        "<a subclass of kd.Model>.__bases__ (functional construction)", THIS_MODEL,
        trainer.make_functional,
        "A subclass built with inputs and outputs becomes functional through kd's "
        "FunctionalModel, as keras.Model rewrites its own subclasses' bases."),
    Replacement(
        "keras.src.saving.saving_lib.serialize_keras_object", WHILE_SAVING, trainer.saved_config,
        "During a kd model's `save`: config.json names kd's functional and Sequential classes "
        "as Keras's (module and class), keeping kd's registered name, so plain Keras loads the "
        "file and kd gets its class back. Other classes' configs are Keras's."),
)
