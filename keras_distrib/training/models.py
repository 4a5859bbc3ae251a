"""`kd.Model`, `kd.Sequential` and `DistributedModelMixin`: the interface a user overrides or calls.

As Keras's `Trainer`, this module holds what a user calls (`compile`,
`fit`, `evaluate`, `predict`, `save`) and overrides (`train_step`,
`test_step`, `predict_step`, `compute_loss`); each step handles one
replica's batch and nothing else. The mechanics live below it: the
distributed wrapping (`strategy.run`, reductions, several steps per call) is
`keras_distrib.training.step`, the epochs, callbacks and resume are
`keras_distrib.training.loop`, both shared with `kd.TrainLoop` and
parameter-server training; the model's forward pass in a replica is
`model_call`, what kd installs on its layers, optimizers and metrics is
`hooks`, what its layers do on several replicas is `forward` and
`batch_norm`, what kd refuses to run is `refusals`, and what `save` writes
is `model_files`.
"""

import contextlib
import warnings

import keras
import tensorflow as tf
from keras import tree

from keras_distrib import _keras_compat
from keras_distrib.training import buckets
from keras_distrib.training import coupling
from keras_distrib.training import deferral
from keras_distrib.training import front
from keras_distrib.training import hooks
from keras_distrib.training import gradients
from keras_distrib.training import inputs
from keras_distrib.training import losses as kd_losses
from keras_distrib.training import loop
from keras_distrib.training import model_call
from keras_distrib.training import model_files
from keras_distrib.training import refusals
from keras_distrib.training import replica
from keras_distrib.training import logs as logs_lib
from keras_distrib import validation

__all__ = [
    "DistributedModelMixin",
    "FunctionalModel",
    "Model",
    "Sequential",
]

BATCH_NORM_MODES = ("global", "per_replica")
# What kd adds to `compile`, with its defaults (a compile config names those
# that differ).
OWN_COMPILE_DEFAULTS = {"batch_norm": "global", "rows_meet": "global", "gradient_buckets": "auto",
                        "first_step_check": True, "pss_evaluation_shards": 0}


class DistributedModelMixin(_keras_compat.ModelHooks):
    """Exact global-batch training for any `keras.Model` subclass.

    Put it first in the bases: `class MyModel(kd.DistributedModelMixin,
    keras.Model)`, or with a library's model class:
    `class MyTask(kd.DistributedModelMixin, keras_hub.models.BertTextClassifier)`
    keeps the task's constructor, compile defaults and `generate`. The model
    then behaves as `kd.Model` does (see there): each step scales the loss by
    the exact global example count, counts regularization and `add_loss`
    once across replicas, and reports global loss and metrics; the optimizer
    all-reduces gradients before it unscales, accumulates and clips them, as
    one device would.

    A `train_step` you write as Keras's guide "Customizing what happens in
    fit()" writes it (`self(x, training=True)`, `self.compute_loss(...)`,
    `self.optimizer.apply_gradients(...)`) stays exact: kd opens each
    replica's batch around it, and the rest is one device's too:

    - `compute_loss` returns this replica's share of the global loss; a Keras
      loss object called in the step (`self.loss_fn(y, y_pred)`) returns a
      share as well.
    - A loss of plain ops with no share computed in the step (no
      `compute_loss`, loss object or `kd.losses` call) is read from its graph
      at `tape.gradient`: a sum over rows is summed over replicas as it is;
      one in which the rows of the batch meet (a maximum over rows, the root
      of a mean, in-batch negatives, `arange(batch_size)` labels), and one
      through an op kd's table does not read (a `tf.while_loop` over rows),
      is computed on the global batch (kd gathers the tensors it starts
      from and traces the step again), or refused naming the op where kd
      cannot gather them; a mean over the replica's rows (and terms of the
      weights) is weighted by n_r / N before the all-reduce.
    - What the step returns: a metric's `result()` (recognised by identity,
      nested `compile_metrics` included) is the metric's global value; a
      loss share is summed over replicas; another scalar is weighted by
      n_r / N (`kd.losses.row_weighted`); the rest is averaged over
      replicas. A `keras.metrics.Mean` tracker fed a scalar adds one
      device's value once per step.
    - `keras.random` draws shaped by the batch are drawn for the global
      batch and each replica keeps its rows (`shuffle` along the rows is
      where rows meet, as above); a draw whose leading dimension
      is not a multiple of the replica's rows, and TensorFlow's stateful
      random ops (`tf.random.normal`, `tf.random.Generator`), are refused at
      the first step on several replicas, naming the op.
    - Every Keras optimizer held as an attribute (a GAN's two) gets kd's
      gradient pipeline at the first step; plain `keras.Sequential` and
      `keras.Model` sub-models get a padded row on an empty replica; a model
      without `call` (a GAN) is built lazily.

    To reload a saved subclass, register it
    (`@keras.saving.register_keras_serializable()`) or pass
    `custom_objects={"MyTask": MyTask}` to `keras.saving.load_model`; `save`
    warns when neither would find it.

    Examples:
        >>> import keras, tensorflow as tf, keras_distrib as kd
        >>> class Regressor(kd.DistributedModelMixin, keras.Model):
        ...     def train_step(self, data):
        ...         x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        ...         with tf.GradientTape() as tape:
        ...             loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        ...         grads = tape.gradient(loss, self.trainable_variables)
        ...         self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        ...         return self.compute_metrics(x, y, self(x), sample_weight=None)
        >>> inputs = keras.Input((3,))
        >>> model = Regressor(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
    """

    def compile(self, *args, pss_evaluation_shards=0, batch_norm="global", rows_meet="global",
                gradient_buckets="auto", first_step_check=True, **kwargs):
        """`keras.Model.compile`, then kd's exact losses, trackers and gradient pipeline.

        Called outside any strategy scope, it runs in the scope of the
        strategy the model was created in, so the loss and metric trackers
        are that strategy's variables (as in tf-keras).

        `pss_evaluation_shards` (parameter-server training only): split
        evaluation over the workers in that many shards ("auto": 4 per
        worker), instead of evaluating on the coordinator; both are exact.

        `batch_norm`: `"global"` (default): every BatchNormalization
        normalizes over the global batch on several replicas, as one device
        does; `"per_replica"`: layers without `synchronized=True` normalize
        each replica's rows separately (Keras's behaviour: no all-reduce in
        the forward pass, but not what one device computes).

        `rows_meet`: `"global"` (default): where the rows of a batch meet
        (in-batch negatives, labels from the batch size, a layer reading
        statistics of the batch, a loss mining the batch), kd computes on the
        global batch gathered from every replica, as one device does
        (`keras_distrib.training.coupling`); `"per_replica"`: each replica
        sees only its own rows (Keras's behaviour).

        `gradient_buckets`: how the replicas' gradients are summed.
        `"auto"` (default): in buckets of 25 MiB, each started as the
        backward pass produces it, when the step spans several workers and
        the gradient holds at least two buckets; else one all-reduce after
        the backward pass (`keras_distrib.training.buckets`). `"one"`: one
        all-reduce always; a whole number: buckets of that many bytes. Every
        choice sums the same elements: the model is the same.

        `first_step_check`: `True` (default): on several replicas, the first
        training step of each step function kd traces is compared with one
        device's step on the same global batch (loss, logs and global
        gradient) and refused, with nothing trained, where they differ beyond
        round-off (`keras_distrib.training.first_step`; docs: "The first-step
        check"); `False`: no check.
        """
        buckets.check_setting(gradient_buckets)
        if not isinstance(first_step_check, bool):
            raise ValueError(
                f"`first_step_check`={first_step_check!r}: expected True or False. True compares "
                "the first distributed training step with one device's and refuses a difference; "
                "False trains without the check."
            )
        if rows_meet not in coupling.MODES:
            raise ValueError(
                f"`rows_meet`={rows_meet!r}: expected one of {list(coupling.MODES)}. \"global\" "
                "computes where the rows of a batch meet on the global batch (exact); "
                "\"per_replica\" on each replica's rows."
            )
        if batch_norm not in BATCH_NORM_MODES:
            raise ValueError(
                f"`batch_norm`={batch_norm!r}: expected one of {list(BATCH_NORM_MODES)}. "
                "\"global\" computes BatchNormalization statistics over the global batch "
                "(exact); \"per_replica\" over each replica's rows."
            )
        self.pss_evaluation_shards = pss_evaluation_shards
        self.batch_norm = batch_norm
        self.rows_meet = rows_meet
        self.gradient_buckets = gradient_buckets
        self.first_step_check = first_step_check
        # Called outside any scope, compile runs in the model's strategy (as
        # tf-keras does): Keras creates the loss tracker here, and a tracker
        # made outside the scope is a plain variable on one device.
        scope = contextlib.nullcontext() if tf.distribute.has_strategy() else self.distribute_strategy.scope()
        with scope:
            for name in ("metrics", "weighted_metrics"):
                if kwargs.get(name) is not None:
                    kwargs[name] = tree.map_structure(hooks.metric_in_scope, kwargs[name])
            super().compile(*args, **kwargs)
            kd_losses.install_global_losses(self)
            gradients.install(self.optimizer)
            # Not the metrics yet: a subclass's compile may create them after this returns.
            hooks.install_layer_hooks(self, variables=False)

    def get_compile_config(self):
        """The arguments `compile` was called with, serialized (saved in `.keras` files).

        kd's own arguments are kept when not their defaults, so a reloaded
        model compiles as the saved one was (e.g. `batch_norm="per_replica"`).
        """
        config = super().get_compile_config()
        if config is None:
            return config
        own = {name: getattr(self, name, default) for name, default in OWN_COMPILE_DEFAULTS.items()}
        return {**config, **{name: value for name, value in own.items()
                             if value != OWN_COMPILE_DEFAULTS[name]}}

    def compile_from_config(self, config):
        """Compiles from `get_compile_config()`'s output, as `keras.saving.load_model` does.

        Keras skips this for models that override `compile` (kd does), so a
        `.keras` file would reload uncompiled, without its optimizer state.
        Here it compiles through kd's `compile` and builds the optimizer on
        the variables it updates, so the saved optimizer variables load into
        it. A subclass with a `compile` of its own loads uncompiled, with
        Keras's warning, as with Keras.
        """
        if not config:
            return
        if type(self).compile is not DistributedModelMixin.compile:
            # The subclass's own compile (e.g. a GAN's compile(d_optimizer,
            # g_optimizer, loss_fn)) cannot take these arguments: Keras warns
            # and loads the model uncompiled; so does this.
            return super().compile_from_config(config)
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built and self.optimizer is not None:
            with self.distribute_strategy.scope():
                self.optimizer.build(_keras_compat.optimizer_variables(self))

    # Whether the replica writes (`hooks.install_replica_writes`) are installed on built layers
    # (read by `model_call`).
    _kd_replica_writes = False
    # The forward pass compiled with XLA and what its outputs are to the rows (`model_call`).
    _kd_xla_function = None

    def replica_batch(self, x):
        """Context for one replica's batch (row counts for loss scaling).

        kd's step already opens it around `train_step`/`test_step`; inside,
        this returns the open batch.
        """
        return replica.replica_batch(replica.batch_rows(x))

    def additional_loss_share(self, loss):
        """This replica's share of an `add_loss` or regularization term.

        Keras divides these terms by R. kd reads what the term is from its
        graph and takes `scaling.replica_share` of it (`losses.add_loss_share`): a sum over the
        batch's rows (`add_loss(c * tf.reduce_sum(x))`) whole, since the
        replicas' sums add up to one device's; a mean over rows (activity
        regularizers) and a term of the weights alone by n_r / N, exact on
        uneven batches; a term computed on the global batch (a layer whose
        rows meet) 1/R of it. A term kd cannot split (an op it cannot read,
        outside a layer kd computes on the global batch) is refused, naming
        the op. Replicas without rows contribute nothing.
        """
        return kd_losses.add_loss_share(loss)

    @property
    def losses(self):
        # Within a step, the add_loss terms this replica's forward pass
        # recorded, and the weight penalties (`model_call.losses`); else Keras's own list.
        in_replica = model_call.losses(self)
        return super().losses if in_replica is None else in_replica

    # Called in users' `tf.function`s: it runs as written, as Keras's own call
    # does (see `kd.losses`), not rewritten by AutoGraph at every trace.
    @tf.autograph.experimental.do_not_convert
    def __call__(self, *args, **kwargs):
        # In a replica, the forward pass as one device computes it for the
        # global batch (`model_call`); elsewhere Keras's own call.
        return model_call.call(self, super().__call__, args, kwargs)

    def _call_model(self, x, training):
        if _keras_compat.call_has_training_arg(self):
            return self(x, training=training)
        return self(x)

    @logs_lib.metrics_only
    @tf.autograph.experimental.do_not_convert
    def train_step(self, data):
        """One replica's training step: forward, loss share, gradients, update, metrics."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with self.replica_batch(x) as batch:
            batch.own_step.deferred = deferral.defers_scaling(
                self, training=True, kd_compute_loss=DistributedModelMixin.compute_loss)
            with tf.GradientTape() as tape:
                y_pred = self._call_model(x, training=True)
                loss = _keras_compat.compute_loss(
                    self, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
                )
                kd_losses.track_loss(self, loss)
                if self.optimizer is not None:
                    loss = self.optimizer.scale_loss(loss)
            # The metrics update before the weights (they read y_pred only), so
            # their states travel in the gradient all-reduce: the step's logs
            # cost no collective of their own (gradients.all_reduce). Not for
            # an override that may update metrics after this returns.
            logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            if logs_lib.reports_only_metrics(self, "train"):
                batch.own_step.metric_variables = list(self.metrics_variables)
            if self.trainable_weights:
                variables = _keras_compat.optimizer_variables(self)
                grads = tape.gradient(loss, variables)
                if gradients.overrides_apply_gradients(self.optimizer):
                    # Keras's own step calls `apply_gradients`: an optimizer
                    # that overrides it gets it called, and kd's pipeline
                    # all-reduces inside its `apply` (hooks.install_step_hooks).
                    self.optimizer.apply_gradients(zip(grads, variables))
                else:
                    # The step's one all-reduce: the replicas' gradients summed,
                    # with the scaling rule's correction (training/scaling.py)
                    # and the metric states riding along. Then Keras's optimizer
                    # updates as on one device, with no reduction of its own.
                    grads = gradients.all_reduce(grads, variables)
                    gradients.apply_reduced(self.optimizer, grads, variables)
            else:
                warnings.warn("The model does not have any trainable weights.")
            batch.own_step.metric_variables = None
            return logs

    @logs_lib.metrics_only
    @tf.autograph.experimental.do_not_convert
    def test_step(self, data):
        """One replica's evaluation step: forward, loss share, metrics."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with self.replica_batch(x) as batch:
            batch.own_step.deferred = deferral.defers_scaling(
                self, training=False, kd_compute_loss=DistributedModelMixin.compute_loss)
            y_pred = self._call_model(x, training=False)
            loss = _keras_compat.compute_loss(
                self, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
            )
            kd_losses.track_loss(self, loss)
            return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    @tf.autograph.experimental.do_not_convert
    def predict_step(self, data):
        """One replica's prediction step: the forward pass."""
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        return self._call_model(x, training=False)

    # The compiled steps (Keras's names; each is a `keras_distrib.training.step.Step`).

    @tf.autograph.experimental.do_not_convert
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        """`keras.Model.compute_loss`: in a kd step, this replica's share of the global loss.

        The shares of all replicas sum to the loss one device computes for
        the global batch; kd records the value as a share, so a tracker fed
        it (`tracker.update_state(loss)`) and a step returning it log one
        device's value.
        """
        return replica.mark_share(super().compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training))

    def _own_steps(self):
        """The model's own compiled steps (`front.ModelSteps`), kept in Keras's attributes."""
        return front.ModelSteps(self, kd_compute_loss=DistributedModelMixin.compute_loss)

    def make_train_function(self, force=False):
        """The compiled training `Step` (`steps_per_execution` steps per call)."""
        return self._own_steps()("train", force=force)

    def make_test_function(self, force=False):
        """The compiled evaluation `Step`."""
        return self._own_steps()("test", force=force)

    def make_predict_function(self, force=False):
        """The compiled prediction `Step`."""
        return self._own_steps()("predict", force=force)

    # fit, evaluate and predict go through kd's front door (keras_distrib.training.front)
    # with the model's own steps; the loop (keras_distrib.training.loop) runs them.

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
            sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
            validation_batch_size=None, validation_freq=1):
        """`keras.Model.fit`, exact under any strategy (kd's loop, shared with `kd.TrainLoop`)."""
        _keras_compat.assert_compiled(self, "fit")
        refusals.check_strategy(self, training=True)
        return front.fit(self, self._own_steps(), inputs.FitRequest(
            x=x, y=y, batch_size=batch_size, epochs=epochs, verbose=verbose, callbacks=callbacks,
            validation_split=validation_split, validation_data=validation_data, shuffle=shuffle,
            class_weight=class_weight, sample_weight=sample_weight, initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
            validation_batch_size=validation_batch_size, validation_freq=validation_freq,
        ))

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
                 steps=None, callbacks=None, return_dict=False, **kwargs):
        """`keras.Model.evaluate`, exact under any strategy."""
        _keras_compat.assert_compiled(self, "evaluate")
        refusals.check_strategy(self)
        kwargs.pop("_use_cached_eval_dataset", None)
        shards = kwargs.pop("shards", None)
        if kwargs:
            raise validation.InputError(
                "Invalid `evaluate` arguments:\n  - "
                + ", ".join(f"`{name}`" for name in sorted(kwargs))
                + " not recognized; `evaluate` takes x, y, batch_size, verbose, sample_weight, "
                "steps, callbacks, return_dict (and shards under a ParameterServerStrategy)"
            )
        return front.evaluate(
            self, self._own_steps(), x, y, batch_size=batch_size, verbose=verbose,
            sample_weight=sample_weight, steps=steps, callbacks=callbacks,
            return_dict=return_dict, shards=shards,
        )

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """`keras.Model.predict`: every row once, in input order, under any strategy.

        Works on a model that was never compiled (inference), as Keras's.
        """
        refusals.check_strategy(self)
        return front.predict(self, self._own_steps(), x, batch_size=batch_size, verbose=verbose,
                             steps=steps, callbacks=callbacks)

    def predict_on_batch(self, x):
        """`keras.Model.predict_on_batch`: `x` as one batch, every row once, in order.

        Under a strategy the batch is split over the replicas as `predict`
        splits a batch (plain Keras gives every replica the whole batch and
        returns each row once per replica).
        """
        rows = inputs.static_rows(x)
        if rows is None:
            raise ValueError(
                f"`x` ({type(x).__name__}) has no leading batch dimension to predict on; "
                "pass an array, a tensor, or a list/dict of them."
            )
        return self.predict(x, batch_size=max(rows, 1), verbose=0)

    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        """`keras.Model.save`: a `.keras` file plain Keras loads too; `.h5` reloads as kd's class.

        A functional or Sequential kd model's `.keras` file loads where kd is
        not installed, as Keras's `Functional` / `Sequential` with the same
        weights, predictions and compiled optimizer; where kd's model
        classes are loaded, `keras.saving.load_model` gives the kd model
        back, and `kd.load_model` also kd's own compile arguments
        (`batch_norm`, ...). A subclass of your own needs its class to
        load, as in plain Keras.

        Keras's legacy HDF5 format records the class by its bare Python name
        (`Sequential`, `FunctionalModel`), which `load_model` resolves to
        Keras's own class (a kd model would silently lose its exact steps) or
        not at all. Here the file names the class by its registered name
        (`keras_distrib>Sequential`), which `load_model` resolves to kd's.

        A subclass of your own (or of a KerasHub task) reloads only if
        registered (`@keras.saving.register_keras_serializable()`) or passed
        as `custom_objects`; saving one that is neither warns
        (`model_files.unregistered_class_warning`).
        """
        keras_classes = {keras.saving.get_registered_name(FunctionalModel): _keras_compat.Functional,
                         keras.saving.get_registered_name(Sequential): keras.Sequential}
        return model_files.save(self, super().save, filepath, overwrite=overwrite, zipped=zipped,
                                keras_classes=keras_classes, own_compile_names=tuple(OWN_COMPILE_DEFAULTS),
                                **kwargs)

    def build_from_data(self, iterator=None, data_batch=None):
        """Builds every variable from an epoch iterator's spec, or a batch.

        Never reads a batch from `iterator`: that would consume the user's
        data (or reorder a reshuffling dataset).
        """
        if iterator is not None and data_batch is None:
            loop.build(self, iterator)
        else:
            loop.build_model(self, data_batch)


@keras.saving.register_keras_serializable(package="keras_distrib")
class Model(DistributedModelMixin, keras.Model):
    """A `keras.Model` (functional or subclassed) with exact distributed steps.

    Its `train_step`, `test_step` and `predict_step` scale the loss by the
    exact global example count, scale regularization once across replicas
    and report the true global loss and metrics. `fit`, `evaluate` and
    `predict` take Keras's arguments and work under every strategy
    (`kd.make_strategy`), multi-worker and parameter server included, with
    `steps_per_execution=k` and `jit_compile=True` on several replicas;
    `predict` and `predict_on_batch` return every row once, in input order.
    `fit` on no data raises `kd.EmptyDataError` (a `ValueError`, naming `x`);
    NaN or inf in the data gives a `kd.NonFiniteDataWarning` (Keras trains on
    it, and so does kd). Python-fed batches (`PyDataset`, generators,
    `from_generator`) are copied before TensorFlow sees them, so they train
    exactly and your arrays are never written.

    `compile` takes Keras's arguments and kd's own:
    `batch_norm="per_replica"` (layers without `synchronized=True` normalize
    each replica's rows: no all-reduce in the forward pass, not exact),
    `rows_meet="per_replica"` (see `DistributedModelMixin.compile`),
    `first_step_check=False` (no comparison of the first training step with
    one device's, which kd otherwise makes on several replicas, refusing a
    difference beyond round-off before anything is trained) and, under
    parameter-server training, `pss_evaluation_shards=k` (evaluate on the
    workers in `k` shards; `"auto"`: 4 per worker). Called outside any
    strategy scope, `compile` runs in the scope of the strategy the model was
    created in.

    On several replicas the model is the model of one device:

    - every `BatchNormalization` normalizes over the global batch (one
      all-reduce per layer in the forward pass and one in the backward pass,
      gathering each replica's count, mean and squared deviations, merged
      exactly);
    - random layers (Dropout, GaussianNoise, GaussianDropout, SpatialDropout,
      `Random*` augmentation), and `keras.random` draws shaped by the batch
      in a layer of your own, draw for the global batch and keep each
      replica's rows; MixUp and CutMix, which mix the rows, run on the global
      batch; an RNN layer with dropout is refused at the first step, naming
      it;
    - a layer kd does not trust by its class (one's own, another library's)
      is read at the first trace: where its rows meet, or it passes an op
      kd cannot read, it runs on the global batch;
    - a layer's non-trainable variable updated in `call` with
      `assign_add`/`assign_sub` of data adds the sum over replicas (a
      constant is added once); `assign` is refused at the first step,
      naming the layer and the variable.

    Everything else is Keras's own code, called as Keras calls it (saving
    formats, argument checks, ragged outputs, inference on a model never
    compiled): see the guide "A drop-in keras.Model". A `.keras` file of a kd
    model reloads compiled, with its optimizer's state, as the kd model
    where kd's classes are registered: they register themselves when kd's
    model classes load (any use of `kd.Model`, `kd.Sequential`,
    `kd.DistributedModelMixin` or `kd.load_model`; `import keras_distrib`
    alone loads no TensorFlow and registers nothing). Where kd is not
    installed, plain Keras loads a functional or Sequential kd model's file
    as Keras's `Functional` / `Sequential` (see `save`).
    `kd.Model(inputs, outputs)` returns kd's functional class, a subclass of
    `kd.Model` and of Keras's `Functional`.

    Args:
        *args: As `keras.Model`: `inputs` and `outputs` for a functional
            model, nothing (or your own arguments) for a subclass.
        **kwargs: As `keras.Model` (`name`, `trainable`, ...).

    Examples:
        >>> import keras, keras_distrib as kd
        >>> inputs = keras.Input((3,))
        >>> model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
    """

    def __new__(cls, *args, **kwargs):
        # keras.Model turns itself into a Functional by rewriting the class
        # bases; we hand out a fixed functional subclass instead, so kd.Model
        # stays usable for subclassing after a functional model was built.
        if cls is Model and _keras_compat.functional_init_arguments(args, kwargs):
            return keras.Model.__new__(FunctionalModel)
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, *args, **kwargs):
        # A subclass calling `super().__init__(inputs=..., outputs=...)`
        # becomes functional as with Keras, but through FunctionalModel:
        # kd.Model's own bases never change.
        if not _keras_compat.functional_init_arguments(args, kwargs):
            super().__init__(*args, **kwargs)
            return
        if not isinstance(self, _keras_compat.Functional):
            _keras_compat.make_functional(type(self), Model, FunctionalModel)
        _keras_compat.functional_init(self, args, kwargs)


@keras.saving.register_keras_serializable(package="keras_distrib")
class FunctionalModel(Model, _keras_compat.Functional):
    """What `kd.Model(inputs, outputs)` returns: a functional `kd.Model`."""


@keras.saving.register_keras_serializable(package="keras_distrib")
class Sequential(DistributedModelMixin, keras.Sequential):
    """A `keras.Sequential` with exact distributed steps (as `kd.Model`).

    Its arguments are `keras.Sequential`'s: `layers` (in order), `trainable`,
    `name`.

    Examples:
        >>> import keras, keras_distrib as kd
        >>> model = kd.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse")
    """


# Keras's legacy `.h5` format names a model's class by its bare Python name;
# kd's functional class has a name of its own, so a saved file resolves to it.
keras.saving.get_custom_objects().setdefault("FunctionalModel", FunctionalModel)
