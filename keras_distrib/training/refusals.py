"""What kd refuses to run because it cannot make it exact: each setting named, with the way out.

Checked at a kd model's first step (`check_exactness`), before anything runs;
and a model used under a strategy it was not created in (`check_strategy`).
"""

import keras
import tensorflow as tf

from keras_distrib import _keras_compat
from keras_distrib.training import batch_norm
from keras_distrib.training import forward
from keras_distrib.training import step as step_lib
from keras_distrib.cluster import strategies

__all__ = [
    "check_exactness",
    "check_strategy",
    "unsupported_settings",
]

def _random_layer_problem(layer):
    """Why kd cannot lay out `layer`'s random draws over the global batch, or None."""
    if type(layer) in forward.GLOBAL_BATCH_RANDOM_LAYERS + forward.ROWS_MEET_LAYERS or \
            not _keras_compat.owned_seed_generators(layer):
        return None
    rates = [getattr(layer, name, None) for name in ("dropout", "recurrent_dropout")]
    if not any(rates):
        # Its `keras.random` draws are laid out over the global batch
        # (`draws.global_batch_draw`); an RNN cell without dropout never draws.
        return None
    return (
        f"layer {layer.name!r} ({type(layer).__name__}) draws random numbers in a way kd "
        "cannot lay out over the global batch, so each replica's draws would differ from "
        "one device's. Use Keras's random layers (Dropout, GaussianNoise, GaussianDropout, "
        "SpatialDropout, Random* augmentation, MixUp, CutMix), which kd makes exact, set its "
        "dropout rates to 0, or train on one replica."
    )


def _spreads_strategy(strategy):
    traits = strategies.traits(strategy)
    return traits.replicas > 1 and not traits.is_parameter_server


def unsupported_settings(model, *, training):
    """What in `model`'s setup kd cannot make exact under its strategy.

    Returns a list of messages, each naming the setting and the way out.
    """
    strategy = model.distribute_strategy
    problems = []
    layers = _keras_compat.flatten_layers(model)
    optimizer = getattr(model, "optimizer", None)  # None: never compiled
    base = _keras_compat.base_optimizer(optimizer) if optimizer is not None else None
    if training and strategies.traits(strategy).is_central_storage:
        fix = "Use kd.make_strategy('mirrored') on the same devices, which is exact with it."
        why = ("CentralStorageStrategy keeps one copy of each variable, and Keras updates "
               "this variable on every replica, which TensorFlow refuses to aggregate")
        if base is not None and base.gradient_accumulation_steps:
            problems.append(f"`gradient_accumulation_steps`={base.gradient_accumulation_steps}: {why}. {fix}")
        if base is not None and base.use_ema:
            problems.append(f"`use_ema`=True: {why}. {fix}")
        if optimizer is not base:
            problems.append(f"LossScaleOptimizer (mixed precision): {why}. {fix}")
    if training and _spreads_strategy(strategy):
        # The model's own generators are drawn in its train_step, once per
        # replica from the one state: the same draws on every replica, which
        # is one device's for a draw that does not depend on the rows (a
        # loss weight, weight noise). Its layers' are refused unless kd lays
        # them out over the global batch.
        problems.extend(filter(None, map(_random_layer_problem, layers[1:])))
    plan = step_lib.plan_for(model)
    if training and plan.xla_forward:
        why = ("`jit_compile=True` with several CPU replicas (or workers) compiles only the "
               "forward pass with XLA, because TensorFlow cannot synchronize replicas inside XLA here")
        fix = "Use jit_compile=False (or GPUs, where XLA compiles the whole step)."
        for layer in layers:
            if batch_norm.global_batch_norm(layer):
                problems.append(f"layer {layer.name!r} (BatchNormalization) all-reduces its global "
                                f"statistics inside the forward pass: {why}. {fix} Or compile with "
                                "batch_norm=\"per_replica\" (per-replica statistics, not exact).")
            elif isinstance(layer, keras.layers.RNN):
                problems.append(f"layer {layer.name!r} ({type(layer).__name__}) keeps TensorLists that "
                                f"cannot leave an XLA forward pass: {why}. {fix}")
    if training and strategies.traits(strategy).is_parameter_server:
        if base is not None and base.gradient_accumulation_steps:
            problems.append(
                f"`gradient_accumulation_steps`={base.gradient_accumulation_steps}: parameter-server "
                "workers update the variables asynchronously, so no worker's micro-steps form one "
                "update. Use a larger batch per step, or a synchronous strategy (multi_worker)."
            )
    return problems


def check_strategy(model, training=False):
    """Refuses to run `model` under a strategy it (or its parts) was not created in."""
    if not tf.distribute.has_strategy():
        return
    active = tf.distribute.get_strategy()
    scope = f"`{type(active).__name__}.scope()`"
    created = _keras_compat.created_strategy(model)
    if created is not active:
        built_in = type(created).__name__ if created is not None else "no strategy"
        raise ValueError(
            f"This model was created under {built_in}, but is used inside "
            f"{scope}. Its variables are not "
            "distributed, so training would silently ignore the strategy. "
            "Create (and compile) the model inside `with strategy.scope():`."
        )
    if isinstance(active, (tf.distribute.MirroredStrategy,
                           tf.distribute.MultiWorkerMirroredStrategy)):
        stray = [v.path for v in model.weights
                 if not active.extended.variable_created_in_scope(v.value)]
        if stray:
            shown = ", ".join(f"`{p}`" for p in stray[:4]) + (" ..." if len(stray) > 4 else "")
            raise ValueError(
                f"The model was created inside {scope}, but {len(stray)} of its "
                f"variables were not ({shown}): a layer was built before the scope was "
                "entered, so its weights are not mirrored and each replica would train "
                "its own copy. Create the layers (and the model) inside "
                "`with strategy.scope():`."
            )
    optimizer = getattr(model, "optimizer", None)
    if training and optimizer is not None:
        optimizer_strategy = _keras_compat.optimizer_strategy(optimizer, active)
        if optimizer_strategy is not active:
            raise ValueError(
                f"The optimizer `{optimizer.name}` ({type(optimizer).__name__}) was created "
                f"under {_strategy_name(optimizer_strategy)}, but the model trains inside "
                f"{scope}: its step count and slots would not be distributed. Create the "
                "optimizer inside `with strategy.scope():` (e.g. "
                "`model.compile(optimizer=keras.optimizers.Adam(...))` there)."
            )

def check_exactness(model, *, training):
    """Refuses the settings of `model` kd cannot make exact here (`unsupported_settings`), naming each one."""
    problems = unsupported_settings(model, training=training)
    if problems:
        strategy = type(model.distribute_strategy).__name__
        raise ValueError(
            f"kd cannot make this model exact under {strategy}:\n  - "
            + "\n  - ".join(problems)
        )


def _strategy_name(strategy):
    if strategy is None or strategy is _keras_compat.default_strategy():
        return "no strategy"
    return type(strategy).__name__
