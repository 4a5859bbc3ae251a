"""The one front door of `fit`, `evaluate` and `predict`.

`kd.Model.fit/evaluate/predict` and `kd.TrainLoop.fit/evaluate/predict`
both come through here: the same arguments, the same validation (before any
step runs), and the one place that decides between the local loop
(`keras_distrib.training.loop`: one device, mirrored, multi-worker) and
parameter-server training (`keras_distrib.training.parameter_server`). What differs
between the two callers is only where the compiled steps come from:
`steps_for(kind)` returns the `Step` of `kind` ("train", "test",
"predict"), the model's own (`ModelSteps`: `steps_per_execution`
steps per call) or the `TrainLoop`'s (`steps_per_loop`). Either way the
steps come from `keras_distrib.training.step`; nothing here calls back
into the model's class to build them.
"""

import dataclasses

from keras_distrib.training import hooks
from keras_distrib.training import loop
from keras_distrib.training import parameter_server
from keras_distrib.training import refusals
from keras_distrib.training import step as step_lib
from keras_distrib.cluster import strategies
from keras_distrib.training import inputs
from keras_distrib.training import served
from keras_distrib.cluster import info as cluster
from keras_distrib import validation

__all__ = ["ModelSteps", "evaluate", "fit", "on_parameter_server", "predict"]


def on_parameter_server(model):
    """Whether `model`'s steps are scheduled on parameter-server workers (else the local loop)."""
    return strategies.traits(model.distribute_strategy).is_parameter_server


def fit(model, steps_for, request):
    """`Model.fit` for `model`, as `request` (an `inputs.FitRequest`) asks, with its steps from `steps_for`.

    Returns the History.
    """
    request = _served_input(model, request)
    inputs.validate_fit(model, request)
    if on_parameter_server(model):
        return parameter_server.fit(model, request, steps_per_call=steps_for("train").steps_per_call)
    return loop.fit(model, steps_for("train"), request, test_function=steps_for("test"))


def _served_input(model, request):
    """`request` with a `kd.data.serve` input as the dataset it trains on; says what its epochs are."""
    source = _served_source(model, request.x, "fit")
    if source is None:
        return request
    if cluster.cluster_info().is_chief:
        print(source.description(), flush=True)
    # A served epoch is in slot order (exact) or arrival order: nothing for Keras to shuffle.
    return dataclasses.replace(request, x=source.distributed, shuffle=False)


def _served_source(model, x, method):
    """The `kd.data.serve` input behind `x`, or None; refuses what kd cannot run as asked."""
    source = served.description_of(x)
    if source is None:
        served.refuse_own_service_pipeline(x)
        return None
    if on_parameter_server(model):
        raise validation.InputError(
            "`x` is served by tf.data service (kd.data.serve), which kd supports under "
            "one-device, mirrored and multi-worker strategies, not parameter-server training. "
            "Pass the parameter-server coordinator a dataset_fn instead."
        )
    if method == "predict" and source.mode != "exact":
        raise validation.InputError(
            f"`x` is served with `mode`={source.mode!r}: its rows arrive in the data workers' "
            "order, so `predict`'s outputs would not line up with the rows. Serve it with "
            "mode='exact' to predict."
        )
    return source


def _unserved(model, x, method):
    source = _served_source(model, x, method)
    return x if source is None else source.distributed


def evaluate(model, steps_for, x=None, y=None, *, batch_size=None, verbose="auto",
             sample_weight=None, steps=None, callbacks=None, return_dict=False, shards=None):
    """`Model.evaluate` for `model`; `shards` splits it over parameter-server workers."""
    x = _unserved(model, x, "evaluate")
    inputs.validate_inputs(model, x, y, sample_weight, method="evaluate",
                               batch_size=batch_size, steps=steps, verbose=verbose,
                               callbacks=callbacks, return_dict=return_dict)
    strategy = model.distribute_strategy
    if on_parameter_server(model):
        return parameter_server.evaluate(
            model, x, y, batch_size=batch_size, verbose=verbose, sample_weight=sample_weight,
            steps=steps, callbacks=callbacks, return_dict=return_dict, shards=shards,
        )
    if shards:
        raise validation.InputError(
            f"`shards`={shards!r}: sharded evaluation is for ParameterServerStrategy; "
            f"under {type(strategy).__name__} evaluation is already distributed over the "
            "replicas. Leave `shards` out."
        )
    return loop.evaluate(
        model, steps_for("test"), x, y, batch_size=batch_size, verbose=verbose,
        sample_weight=sample_weight, batches=steps, callbacks=callbacks,
        return_dict=return_dict,
    )


def predict(model, steps_for, x, *, batch_size=None, verbose="auto", steps=None, callbacks=None):
    """`Model.predict` for `model`: every row once, in input order."""
    x = _unserved(model, x, "predict")
    inputs.validate_inputs(model, x, method="predict", batch_size=batch_size, steps=steps,
                               verbose=verbose, callbacks=callbacks)
    if on_parameter_server(model):
        return parameter_server.predict(
            model, x, batch_size=batch_size, verbose=verbose, steps=steps, callbacks=callbacks
        )
    return loop.predict(
        model, steps_for("predict"), x, batch_size=batch_size, verbose=verbose,
        batches=steps, callbacks=callbacks,
    )


class ModelSteps:
    """A model's own steps: one `Step` per kind, built at its first use and kept.

    `kd.Model.fit/evaluate/predict` hand this to `front` (which hands its
    steps to the loop), and Keras's `make_train_function` and its siblings
    read it too, so every path gets the same `Step`: `steps_per_execution`
    steps per call, kept where Keras keeps it (`model.train_function`,
    `test_function`, `predict_function`; `compile` clears them). A
    `kd.TrainLoop` keeps its own steps (`steps_per_loop` per call).

    Before a `Step` is built, the model is readied for its first step of
    that kind: refused where kd cannot make it exact (`refusals`), then
    given the hooks its steps need (`hooks`).

    Args:
        model: A compiled kd model.
        kd_compute_loss: kd's own `compute_loss` (`DistributedModelMixin`'s;
            see `hooks.install_step_hooks`).

    Calling `steps(kind)` returns the kept `Step` of `kind` ("train",
    "test", "predict"), built first if there is none (or `force=True`).
    """

    _KEPT_AS = {"train": "train_function", "test": "test_function", "predict": "predict_function"}

    def __init__(self, model, *, kd_compute_loss):
        self.model = model
        self._kd_compute_loss = kd_compute_loss

    def __call__(self, kind, *, force=False):
        if kind not in self._KEPT_AS:
            raise ValueError(f"`kind`={kind!r}: expected one of {list(step_lib.KINDS)}.")
        attribute = self._KEPT_AS[kind]
        if getattr(self.model, attribute) is None or force:
            self._ready(kind)
            setattr(self.model, attribute,
                    step_lib.Step(self.model, kind, steps=int(self.model.steps_per_execution or 1)))
        return getattr(self.model, attribute)

    def _ready(self, kind):
        training = kind == "train"
        refusals.check_strategy(self.model, training=training)
        refusals.check_exactness(self.model, training=training)
        hooks.install_layer_hooks(self.model)
        hooks.install_step_hooks(self.model, kd_compute_loss=self._kd_compute_loss)
