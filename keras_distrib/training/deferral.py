"""Whether a step defers the global-batch scale (the rule and its arithmetic: `scaling`).

Deferred scale saves an all-reduce: N, the global batch's rows, is not
needed before the loss, and the gradient all-reduce brings it along. It
is exact only where kd computes the whole loss and reduces the gradients
itself; this module decides that, from the model's layers, losses,
tracker and optimizer, once per traced step (`DistributedModelMixin.train_step`).
"""

import keras

from keras_distrib import _keras_compat
from keras_distrib.training import batch_norm
from keras_distrib.training import coupling
from keras_distrib.training import forward
from keras_distrib.training import losses as kd_losses
from keras_distrib.training import replica

__all__ = ["defers_scaling"]


def defers_scaling(model, *, training, kd_compute_loss):
    """Whether `model`'s step can scale its loss without the global row count first.

    Deferred scaling (`scaling.defer`) changes what the loss
    share is until the gradient all-reduce corrects it, so it is used only
    where kd computes the whole loss and reduces the gradients itself: kd's
    own `compute_loss`, losses that reduce to a scalar, a model whose
    optimizer has kd's gradient pipeline. A step that reads the share in
    any other way keeps the global count, read before the loss.

    Nor where a layer's backward pass crosses replicas (BatchNormalization
    with global statistics): a replica's gradient then holds parts of the
    other replicas' loss shares, which the correction by its own R * n_r
    would scale wrongly on uneven batches. N then travels in the layer's
    own all-reduce (`batch_norm.global_moments`), at no extra collective.

    `kd_compute_loss`: kd's own `compute_loss` (the model's must be it, not
    an override).
    """
    if replica.replicas_in_sync() == 1:
        return False
    layers = _keras_compat.flatten_layers(model)
    if training and any(batch_norm.global_batch_norm(layer) and layer.trainable for layer in layers):
        return False
    if training and any(type(layer) in forward.ROWS_MEET_LAYERS for layer in layers):
        return False  # MixUp, CutMix: computed on the global batch, their gradient crosses replicas
    if coupling.meets_at_any(layers + _compiled_loss_objects(model)):
        return False  # computed on the global batch: shares are exact, a layer's gradient crosses replicas
    for name, own in (("compute_loss", kd_compute_loss),
                      ("_compute_loss", getattr(keras.Model, "_compute_loss"))):
        if getattr(getattr(model, name), "__func__", None) is not own:
            return False
    compiled = _keras_compat.compiled_loss(model)
    if compiled is not None:
        losses = _keras_compat.compiled_losses(compiled)
        if losses is None or not all(
            isinstance(loss, kd_losses.GlobalReductionLoss) and loss.reduction not in (None, "none")
            for loss in losses
        ):
            return False
    if not isinstance(_keras_compat.loss_tracker(model), (kd_losses.GlobalShareMean, type(None))):
        return False
    if training:
        return model.optimizer is not None and _keras_compat.has_gradient_pipeline(model.optimizer)
    return True


def _compiled_loss_objects(model):
    compiled = _keras_compat.compiled_loss(model)
    losses = _keras_compat.compiled_losses(compiled) if compiled is not None else None
    return [getattr(loss, "inner", loss) for loss in losses or ()]
