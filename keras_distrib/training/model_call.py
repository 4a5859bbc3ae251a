"""A kd model's call inside a replica: the forward pass the model's `__call__` runs.

In kd's step, the model's call feeds an empty replica one padded row and
drops its outputs (`StepPlan.pad_empty`), runs the forward pass compiled
with XLA where the step asks for it (`StepPlan.xla_forward`), runs the
model's own `call` where its rows may meet as `coupling` says, records
the forward pass's `add_loss` terms on the replica's batch, and marks its
outputs where a custom step's own computations start (`coupling.anchor`).
In a hand-written loop (`strategy.run` without kd's step), the call opens
the replica's batch itself, so the layers lay out BatchNormalization
statistics and random draws over the global batch as in `fit`.
Elsewhere (no replica, or inside the forward pass already) it is Keras's
own call.
"""

import tensorflow as tf
from keras import tree

from keras_distrib import _keras_compat
from keras_distrib.training import coupling
from keras_distrib.training import forward
from keras_distrib.training import gradients
from keras_distrib.training import hooks
from keras_distrib.training import losses as kd_losses
from keras_distrib.training import penalties
from keras_distrib.training import replica
from keras_distrib.training import step as step_lib

__all__ = ["call", "losses"]


def call(model, keras_call, args, kwargs):
    """`model(*args, **kwargs)` in a replica, as one device computes it for the global batch.

    `keras_call`: Keras's own `__call__` of `model` (the forward pass as
    Keras runs it).
    """
    if not model._kd_replica_writes and tf.distribute.has_strategy() \
            and not tf.distribute.in_cross_replica_context():
        # A hand-written loop may call the model in a replica without
        # compiling it: its BatchNormalization updates need kd's
        # central-storage writes all the same.
        hooks.install_replica_writes(model)
    batch = replica.current_batch()
    if batch is None and forward.opens_own_batch(model, args, kwargs):
        return _call_opening_batch(model, args, kwargs)
    if batch is None or batch.forward.in_forward:
        return keras_call(*args, **kwargs)
    plan = batch.plan
    padding = bool(args) and plan.pad_empty and not batch.coupling.global_region
    if padding:
        args = (forward.pad_empty_batch(args[0], batch),) + args[1:]
        batch.forward.padded.append(tf.logical_not(batch.rows.has_rows))
    batch.forward.losses, batch.forward.owner, batch.forward.in_forward = [], model, True
    try:
        if plan.xla_forward:
            if any(_keras_compat.owned_seed_generators(layer)
                   for layer in _keras_compat.flatten_layers(model)):
                batch.rows.offset  # all-reduced here: XLA's forward pass cannot synchronize
            outputs, batch.forward.losses = _xla_forward(model, args, kwargs)
        elif forward.may_meet(model):
            # The model's own `call` (a subclass's, a functional model's
            # own ops) may make rows meet: see coupling.layer_call.
            own_call = coupling.layer_call(model, keras_call, pad=False)
            outputs = own_call(*args, **kwargs)
        else:
            outputs = keras_call(*args, **kwargs)
    finally:
        batch.forward.in_forward = False
        if padding:
            batch.forward.padded.pop()
    if plan.pad_empty and not batch.coupling.global_region:
        outputs = forward.drop_padding(outputs, batch, forward.first_input(args, kwargs), model)
    return coupling.anchor(outputs, model, batch)


def _call_opening_batch(model, args, kwargs):
    # A hand-written loop calls the model in `strategy.run` without kd's
    # step: the forward pass opens the replica's batch itself, so
    # BatchNormalization statistics and random layers are laid out over
    # the global batch as in `fit`.
    hooks.install_layer_hooks(model)
    # A Keras loss object called after this forward pass gives each replica's
    # mean / R: refused there (`losses.loss_object_call`); so is a loss whose
    # summed gradient is not one device's (`gradients.check_loop_target`).
    _keras_compat.replace_loss_object_call(kd_losses.loss_object_call)
    _keras_compat.replace_tape_gradient(gradients.classify_gradient_target)
    forward.check_loop_shape()
    first = forward.first_input(args, kwargs)
    with replica.replica_batch(replica.batch_rows(first), forward.loop_plan(model)) as batch:
        batch.step = replica.StepIdentity(rows_meet=getattr(model, "rows_meet", "global"))
        batch.rows.leaves = [t for t in tree.flatten(first) if isinstance(t, tf.Tensor) and t.shape.rank][:1]
        outputs = model(*args, **kwargs)
        replica.keep_losses(model, batch.forward.losses)
    return outputs


def _xla_forward(model, args, kwargs):
    # The forward pass (and its gradient) compiled on the replica's
    # device; the all-reduces stay outside (see StepPlan.xla_forward).
    # What the outputs and `add_loss` terms are to the rows is read in the
    # compiled function's own graph (the call op hides them) and marked
    # on what it returns.
    compiled, kinds = model._kd_xla_function or (None, {})
    if compiled is None:
        def forward_pass(*args, **kwargs):
            batch = replica.current_batch()
            batch.forward.losses = []
            outputs = model(*args, **kwargs)  # in_forward: Keras's own call
            kinds["outputs"] = [penalties.kind_of_value(v) if isinstance(v, tf.Tensor) else None
                                for v in tree.flatten(outputs)]
            kinds["losses"] = [penalties.kind_of(term) for term in batch.forward.losses]
            return outputs, list(batch.forward.losses)

        compiled = step_lib.on_replica_device(
            tf.function(forward_pass, jit_compile=True, reduce_retracing=True)
        )
        object.__setattr__(model, "_kd_xla_function", (compiled, kinds))
    outputs, losses = compiled(*args, **kwargs)
    for value, kind in zip(tree.flatten(outputs), kinds["outputs"]):
        if kind is not None:
            penalties.mark_kind(value, kind)
    for value, kind in zip(losses, kinds["losses"]):
        penalties.mark_kind(value, kind)
    return outputs, losses


def losses(model):
    """`model.losses`: the `add_loss` terms of its forward pass in this replica, and the weight penalties.

    Within a step, the terms this replica's forward pass recorded, and the
    weight penalties (the same on every replica). After a forward pass that
    opened its own batch (a hand-written loop), the terms that pass
    recorded on this replica's thread: Keras's own list is shared by the
    replicas' threads. Elsewhere None: Keras's own list is the model's.
    """
    batch = replica.current_batch()
    if batch is not None and batch.forward.owner is model and batch.forward.losses is not None:
        recorded = batch.forward.losses
    else:
        recorded = replica.kept_losses(model)
        if recorded is None:
            return None
    weight_penalties = [
        v.regularizer(v) for v in model.trainable_weights
        if getattr(v, "regularizer", None) is not None
    ]
    return list(recorded) + weight_penalties
