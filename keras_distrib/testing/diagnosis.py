"""Comparing two runs' snapshots, and saying why they differ (the likely causes)."""

import keras
import numpy as np

from keras_distrib import _keras_compat
from keras_distrib.training import data as data_lib
from keras_distrib.training import forward
from keras_distrib.training import models

__all__ = ["Mismatch", "compare"]


def _relative(a, b):
    """max |a - b| / (1 + |a|), with matching non-finite values counting as equal."""
    a = np.asarray(a, dtype="float64")
    b = np.asarray(b, dtype="float64")
    if a.shape != b.shape:
        return float("inf")
    if not a.size:
        return 0.0
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    if not np.all(same | (np.isfinite(a) & np.isfinite(b))):
        return float("inf")
    with np.errstate(invalid="ignore"):
        return float(np.max(np.where(same, 0.0, np.abs(a - b) / (1.0 + np.abs(a)))))


def _layers(model):
    return [layer for layer in _keras_compat.flatten_layers(model) if layer is not model]


def _defining_module(model, method):
    for cls in type(model).__mro__:
        if method in vars(cls):
            return cls.__module__ or ""
    return ""


def _is_own_code(module):
    """Whether `module` is the user's code (not Keras's, TensorFlow's or kd's)."""
    return module.split(".")[0] not in ("keras", "keras_distrib", "tf_keras", "tensorflow")


def _state_owner(model, variable_name):
    """The layer holding `variable_name` if it is state a layer assigns in `call`, or None."""
    for layer, variable in forward.layer_state(model):
        if getattr(variable, "path", variable.name) == variable_name:
            return layer
    return None


def _likely_causes(model, *, replicas, uneven, first_step, variable_name=None):
    """Why a model may train differently on several replicas, most likely first."""
    causes = []
    layers = _layers(model)
    kd_model = isinstance(model, models.DistributedModelMixin)
    owner = _state_owner(model, variable_name) if variable_name else None
    if owner is not None:
        causes.append(
            f"layer state: {owner.name!r} ({type(owner).__name__}) updates its non-trainable "
            f"variable {variable_name!r} in `call`, and each replica updates it from its own "
            "rows" + (" (Keras averages the replicas' values)." if not kd_model else
                      ". kd sums `assign_add`/`assign_sub` of data over the replicas and refuses "
                      "`assign`: check what the layer adds per step.")
        )
    random_layers = [] if kd_model else [
        layer for layer in layers
        if isinstance(getattr(layer, "seed_generator", None), keras.random.SeedGenerator)
        and getattr(layer, "rate", 1) != 0
    ]
    if random_layers:
        names = ", ".join(f"{layer.name!r} ({type(layer).__name__})" for layer in random_layers[:3])
        causes.append(
            f"dropout or other randomness: {names} draw{'s' * (len(random_layers) == 1)} random "
            "numbers on each replica, so "
            "the replicas do not drop (or perturb) the rows one device does. kd models draw "
            "for the global batch and keep each replica's rows: build the model as kd.Model / "
            "kd.Sequential."
        )
    per_replica = not kd_model or getattr(model, "batch_norm", "global") == "per_replica"
    unsynced = [
        layer for layer in layers
        if isinstance(layer, keras.layers.BatchNormalization) and not layer.synchronized
    ] if per_replica else []
    if unsynced and replicas > 1:
        names = ", ".join(repr(layer.name) for layer in unsynced[:3])
        causes.append(
            f"unsynchronized BatchNormalization: {names} normalize{'s' * (len(unsynced) == 1)} "
            "each replica's rows with "
            "that replica's own mean and variance (and move their averages with them), not "
            "the global batch's" + (", and on this uneven batch some replicas have few rows "
                                    "or none" if uneven else "")
            + ". kd models compute global statistics (unless compiled with "
            "batch_norm=\"per_replica\"); or use BatchNormalization(synchronized=True)."
        )
    if kd_model and getattr(model, "rows_meet", "global") == "per_replica" and replicas > 1:
        causes.append(
            "rows left to each replica: the model was compiled with rows_meet=\"per_replica\", "
            "so wherever the rows of a batch meet (in-batch negatives, labels numbered from the "
            "batch size, a layer or loss reading statistics of the batch, a loss mining the "
            "batch), each replica sees only its own rows, not the global batch one device sees. "
            "Compile with rows_meet=\"global\" (the default), where kd gathers the global batch "
            "there."
        )
    if not kd_model and uneven:
        causes.append(
            f"a plain Keras model ({type(model).__name__}, not a kd model) on an uneven batch: Keras 3 "
            "divides each replica's loss by the replica's own row count, so a replica with "
            "few rows weighs as much as a full one. Build it as kd.Model / kd.Sequential, "
            "or put kd.DistributedModelMixin first in its bases."
        )
    optimizer = getattr(model, "optimizer", None)
    base = _keras_compat.base_optimizer(optimizer) if optimizer is not None else None
    if base is not None and not _keras_compat.has_gradient_pipeline(optimizer):
        settings = [f"`{name}`={getattr(base, name)}" for name in ("clipnorm", "clipvalue", "global_clipnorm")
                    if getattr(base, name, None)]
        if getattr(base, "gradient_accumulation_steps", None):
            settings.append(f"`gradient_accumulation_steps`={base.gradient_accumulation_steps}")
        if settings:
            causes.append(
                f"per-replica gradient clipping: the optimizer ({', '.join(settings)}) clips "
                "(or accumulates) each replica's partial gradient before the replicas' "
                "gradients are summed, which is not what one device does with the whole "
                "batch's gradient. Build the model as kd.Model / kd.Sequential (or put "
                "kd.DistributedModelMixin first in its bases); in your own loop, "
                "kd.exact_optimizer(optimizer)."
            )
    if _is_own_code(_defining_module(model, "train_step")):
        if kd_model:
            what = ("kd reads a loss it did not compute from its graph (a mean or a sum of "
                    "per-row terms is exact; where rows meet, kd computes on the global batch); "
                    "one through ops it cannot follow is taken as a mean over the replica's "
                    "rows, which it may not be")
            advice = "call self.compute_loss(...) or kd.losses.global_mean, which kd makes exact"
        else:
            what = ("a loss averaged over the replica's own rows (e.g. tf.reduce_mean) is a "
                    "per-replica mean, wrong whenever the replicas' rows differ from the "
                    "global batch")
            advice = "use kd.DistributedModelMixin and self.compute_loss(...)"
        causes.append(f"a custom reduction in {type(model).__name__}.train_step: {what}; {advice}.")
    loss = getattr(model, "loss", None)
    loss_module = getattr(loss, "__module__", None) or getattr(type(loss), "__module__", "")
    if loss is not None and not isinstance(loss, (str, dict, list, tuple)) and _is_own_code(loss_module):
        name = getattr(loss, "__name__", None) or getattr(loss, "name", None) or type(loss).__name__
        causes.append(
            f"a custom loss ({name}): if it reduces over the batch itself (returns a scalar, "
            "e.g. with tf.reduce_mean), each replica averages over its own rows. Return one "
            "loss per example and let Keras reduce it (reduction='sum_over_batch_size')."
        )
    if not causes:
        causes.append(
            "no usual suspect found in the model: look for a value reduced over a replica's "
            "own rows (a loss, a metric, an add_loss term or a layer computing batch "
            "statistics), or state that differs between replicas"
            + (" (the first step already differs)" if first_step == 1 else "")
            + "."
        )
    return causes


def _step_text(step, steps_per_epoch, rows, batch_size, replicas):
    epoch, batch = divmod(step - 1, steps_per_epoch)
    text = f"step {step} (epoch {epoch + 1}, batch {batch + 1} of {steps_per_epoch}"
    if rows is None:  # a dataset: its batches' sizes are its own
        return text + ")"
    batch_rows = min(batch_size, rows - batch * batch_size)
    if batch_rows < batch_size:
        split = data_lib.replica_split(batch_rows, replicas)
        text += (f"; the uneven last batch: {batch_rows} row{'s' * (batch_rows != 1)}, split "
                 f"{split} over the {replicas} replicas")
    return text + ")"


class Mismatch(AssertionError):
    """A difference beyond the tolerance: the message, and its size."""

    def __init__(self, message, gap):
        super().__init__(message)
        self.gap = gap


def compare(label, reference, candidate, *, names, shapes, tolerance, model, replicas,
             steps_per_epoch, rows, batch_size, compare_history):
    """Raises an AssertionError describing the first difference; returns the largest one."""
    steps = sorted(reference["weights"])
    missing = [s for s in steps if s not in candidate["weights"]]
    if missing:
        raise AssertionError(
            f"kd.testing.assert_parity: under {label}, training stopped before step "
            f"{missing[0]} of {steps[-1]} (one device ran them all)."
        )
    largest, matched = 0.0, 0.0
    for step in steps:
        gaps = [_relative(a, b) for a, b in zip(reference["weights"][step], candidate["weights"][step])]
        worst = max(gaps, default=0.0)
        if worst <= tolerance:
            largest = max(largest, worst)
            matched = largest
            continue
        first = next(i for i, gap in enumerate(gaps) if gap > tolerance)
        top = int(np.argmax(gaps))
        uneven = rows is not None and (
            min(batch_size, rows - ((step - 1) % steps_per_epoch) * batch_size) < batch_size)
        causes = _likely_causes(model, replicas=replicas, uneven=uneven, first_step=step,
                                variable_name=names[first])
        lines = [
            f"kd.testing.assert_parity: {label} does not train like one device.",
            f"  first mismatch: {_step_text(step, steps_per_epoch, rows, batch_size, replicas)}",
            f"  first variable: {names[first]} {tuple(shapes[first])}: max |a - b| / (1 + |a|) = "
            f"{gaps[first]:.3g} (tolerance {tolerance:g}; a = one device)",
        ]
        if top != first:
            lines.append(f"  largest at that step: {names[top]} {tuple(shapes[top])}: {gaps[top]:.3g}")
        lines.append(f"  steps before it: {f'1-{step - 1} match (largest difference {matched:.2g})' if step > 1 else 'none'}")
        lines.append(f"  likely cause: {causes[0]}")
        lines.extend(f"  also possible: {cause}" for cause in causes[1:])
        raise Mismatch("\n".join(lines), gaps[top])
    if compare_history:
        for key, expected in reference["history"].items():
            got = candidate["history"].get(key)
            if got is None:
                raise AssertionError(
                    f"kd.testing.assert_parity: under {label}, fit reported no `{key}` "
                    f"(one device did)."
                )
            for epoch, (a, b) in enumerate(zip(expected, got), start=1):
                gap = _relative(a, b)
                if gap > tolerance:
                    raise Mismatch(
                        f"kd.testing.assert_parity: {label} trains the same weights as one device "
                        f"(largest difference {largest:.2g}), but reports `{key}`={b:.6g} for epoch "
                        f"{epoch} where one device reports {a:.6g} (difference {gap:.3g}).\n"
                        "  likely cause: a loss or metric reduced per replica (plain Keras averages "
                        "each replica's result, and under CentralStorageStrategy counts them twice). "
                        "kd models report the global values.", gap,
                    )
                largest = max(largest, gap)
    return largest
