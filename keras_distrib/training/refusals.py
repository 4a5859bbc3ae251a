"""What kd refuses to run because it cannot make it exact: each setting named, with the way out.

Checked at a kd model's first step (`DistributedModelMixin._check_exactness`),
before anything runs.
"""

import keras

from keras_distrib import _keras_compat
from keras_distrib.training import batch_norm
from keras_distrib.training import forward
from keras_distrib.training import step as step_lib
from keras_distrib.cluster import strategies

__all__ = [
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
        # (`forward.global_batch_draw`); an RNN cell without dropout never draws.
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
