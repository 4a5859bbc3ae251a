"""Per-replica forward-pass bookkeeping: add_loss, batch normalization, masks, random layers, logits.

Part of `keras_distrib._keras_compat`: only these modules touch `keras.src`,
`tensorflow.python` or private attributes of Keras/TensorFlow objects.
"""

import weakref

import keras
import tensorflow as tf
from keras.src.backend.common import masking as keras_masking

__all__ = [
    "flatten_layers",
    "get_keras_mask",
    "graph_calls",
    "is_sync_batch_norm",
    "keep_keras_logits",
    "owned_seed_generators",
    "record_add_loss",
    "replace_batch_norm_moments",
    "replace_call",
    "replace_variable_updates",
    "set_keras_mask",
]


_LOSS_RECORDING_LAYERS = weakref.WeakSet()
_BATCH_NORM_LAYERS = weakref.WeakSet()


def flatten_layers(model):
    """Every layer of `model`, nested ones included (the model first)."""
    return model._flatten_layers(include_self=True, recursive=True)


def graph_calls(model):
    """`model`'s functional graph: `(its inputs, as structured, [(layer or op, symbolic outputs)])`.

    Each call from the inputs on, the model's own nodes: a layer called
    twice has two, and a layer shared with another model only its calls in
    this one (`layer.output` is the output of its first call, perhaps in
    the other model). None where `model` is no functional graph (a
    subclassed model).
    """
    by_depth = getattr(model, "_nodes_by_depth", None)
    if not by_depth or not getattr(model, "inputs", None):
        return None
    calls = [(node.operation, list(node.outputs)) for depth in sorted(by_depth, reverse=True)
             for node in by_depth[depth] if not isinstance(node.operation, keras.layers.InputLayer)]
    return model._inputs_struct, calls


def record_add_loss(layer, record):
    """Makes `layer.add_loss(loss)` also call `record(loss)` (idempotent).

    Keras keeps add_loss terms on the layer object, shared by the replicas
    of a MirroredStrategy; the replicas trace in turns, switching at every
    collective, so a replica may read another's terms. `record` puts them
    in the calling replica's own (thread-local) batch instead.
    """
    if layer in _LOSS_RECORDING_LAYERS:
        return
    add_loss = layer.add_loss

    def recording_add_loss(loss):
        record(loss)
        return add_loss(loss)

    object.__setattr__(layer, "add_loss", recording_add_loss)
    _LOSS_RECORDING_LAYERS.add(layer)


def is_sync_batch_norm(layer):
    """Whether `layer` is a BatchNormalization with `synchronized=True`."""
    return isinstance(layer, keras.layers.BatchNormalization) and bool(
        getattr(layer, "synchronized", False)
    )


def owned_seed_generators(layer):
    """The `keras.random.SeedGenerator`s `layer` itself holds (not its sublayers')."""
    return [v for v in vars(layer).values() if isinstance(v, keras.random.SeedGenerator)]


def replace_variable_updates(variable, make_updates):
    """Replaces `variable`'s `assign`, `assign_add`, `assign_sub` (idempotent).

    `make_updates(current, keras_assign)` gets the variable's current
    methods (a dict by name) and Keras's own `assign`, and returns the new
    methods by name.
    """
    if getattr(variable.assign, "replaced_by_kd", False):  # variables are unhashable
        return
    current = {name: getattr(variable, name) for name in ("assign", "assign_add", "assign_sub")}
    keras_assign = type(variable).assign.__get__(variable)
    for name, method in make_updates(current, keras_assign).items():
        method.replaced_by_kd = True
        object.__setattr__(variable, name, method)


_CALL_REPLACED_LAYERS = weakref.WeakSet()


def replace_call(layer, make_call):
    """Makes `layer` run `make_call(layer, original_call)` instead of its `call` (idempotent)."""
    if layer in _CALL_REPLACED_LAYERS:
        return
    object.__setattr__(layer, "call", make_call(layer, layer.call))
    _CALL_REPLACED_LAYERS.add(layer)


def replace_batch_norm_moments(layer, moments):
    """Makes a BatchNormalization use `moments(layer, x, mask, original, axes)`.

    `original` is Keras's `_moments`; `axes` the axes the layer reduces over
    (all but its channels), as a list.
    """
    if layer in _BATCH_NORM_LAYERS:
        return
    original = layer._moments
    object.__setattr__(
        layer, "_moments",
        lambda inputs, mask: moments(layer, inputs, mask, original, list(layer._reduction_axes)),
    )
    _BATCH_NORM_LAYERS.add(layer)


def get_keras_mask(tensor):
    """The Keras mask a tensor carries, or None."""
    return keras_masking.get_keras_mask(tensor)


def set_keras_mask(tensor, mask):
    """Sets the Keras mask a tensor carries."""
    keras_masking.set_keras_mask(tensor, mask)


# Keras's TF backend computes cross-entropy from the logits when the
# probabilities came straight out of a softmax or sigmoid: through the
# `_keras_logits` its activations set on their output, or through the op's
# type and input. Saturated probabilities are then not clipped to
# [epsilon, 1 - epsilon] (the loss and its gradient differ greatly there).
_LOGIT_OPS = ("Softmax", "Sigmoid")


def keep_keras_logits(value, transform):
    """`transform(value)`, still recognised by Keras's losses as probabilities of logits.

    `transform` acts on rows alone (kd's dropping of a padded row). When
    Keras would read `value`'s logits, the result carries `transform` of
    them the same way: the attribute, or the same op on the transformed
    logits (bit for bit the same probabilities). Otherwise it is plain
    `transform(value)`.
    """
    logits = getattr(value, "_keras_logits", None)
    if logits is not None:
        result = transform(value)
        result._keras_logits = transform(logits)
        return result
    op = getattr(value, "op", None)
    if op is not None and op.type in _LOGIT_OPS and len(op.inputs) == 1:
        logits = transform(op.inputs[0])
        return tf.nn.softmax(logits) if op.type == "Softmax" else tf.math.sigmoid(logits)
    return transform(value)
