"""`kd.Model`, `kd.Sequential` and `DistributedModelMixin`.

The steps below handle one replica's batch and nothing else; the distributed
wrapping (strategy.run, reductions, several steps per call) comes from
`keras_distrib.execution`, shared with `kd.TrainLoop`.
"""

import warnings

import keras
import tensorflow as tf
from keras.src import tree
from keras.src.models import functional as keras_functional
from keras.src.models import model as keras_model
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_distrib import _keras_compat
from keras_distrib import cluster
from keras_distrib import execution
from keras_distrib import losses as kd_losses
from keras_distrib import parameter_server


def batch_rows(x):
    """Rows in this replica's batch: the leading dimension of the first input."""
    for value in tree.flatten(x):
        if value is not None:
            return tf.shape(value)[0]
    raise ValueError(
        "The batch has no input tensor (`x` is empty or all None); "
        "kd models need at least one input to count rows."
    )


def _chief_progress(args, kwargs, position):
    """Progress bars on the chief only: `verbose` ("auto") becomes 0 elsewhere."""
    if len(args) > position:
        args = args[:position] + (cluster.chief_verbose(args[position]),) + args[position + 1:]
    else:
        kwargs["verbose"] = cluster.chief_verbose(kwargs.get("verbose", "auto"))
    return args, kwargs


class DistributedModelMixin:
    """Exact global-batch training for any `keras.Model` subclass.

    Put it first in the bases: `class MyModel(kd.DistributedModelMixin,
    keras.Model)`. Each step scales the loss by the exact global example
    count (all-reduced every step), counts regularization and `add_loss`
    once across replicas, and reports global loss and metrics. A subclass
    that overrides `train_step` can call `self.replica_batch(x)` and
    `self.compute_loss(...)` to keep the same arithmetic (see the tutorials).
    """

    def compile(self, *args, **kwargs):
        super().compile(*args, **kwargs)
        _keras_compat.install_global_losses(self)

    def replica_batch(self, x):
        """Context for one replica's batch (row counts for loss scaling)."""
        return kd_losses.replica_batch(batch_rows(x))

    def _aggregate_additional_loss(self, loss):
        # Keras divides add_loss / regularization terms by R; we weight them
        # by n_r / N instead, which also keeps batch-mean penalties exact.
        if not loss.dtype.is_floating:
            loss = tf.cast(loss, keras.backend.floatx())
        batch = kd_losses.current_batch()
        if batch is None:
            return tf.reduce_sum(loss) / _keras_compat.num_replicas()
        total = tf.reduce_sum(loss)
        fraction = tf.cast(batch.fraction, total.dtype)
        return tf.where(batch.local_rows > 0, total * fraction, tf.zeros_like(total))

    @property
    def losses(self):
        # Under MirroredStrategy the replicas trace in turns on shared layer
        # objects, switching at every all-reduce; a layer's add_loss list is
        # overwritten by the next replica's call before the loss reads it.
        # The forward pass therefore snapshots the losses into the replica's
        # own (thread-local) batch context, and the loss reads them there.
        batch = kd_losses.current_batch()
        if batch is not None and getattr(batch, "owner", None) is self:
            return list(batch.model_losses)
        return super().losses

    def _forward(self, x, training):
        if self._call_has_training_arg:
            outputs = self(x, training=training)
        else:
            outputs = self(x)
        return outputs, super().losses

    def _call_model(self, x, training):
        if getattr(self, "_kd_xla_forward", False):
            y_pred, model_losses = self._xla_forward(x, training)
        else:
            y_pred, model_losses = self._forward(x, training)
        batch = kd_losses.current_batch()
        if batch is not None:
            batch.owner, batch.model_losses = self, list(model_losses)
        return y_pred

    def _xla_forward(self, x, training):
        # Set by kd.execution when XLA cannot compile the whole step (several
        # CPU replicas): the forward pass (and its gradient) is compiled on
        # each replica's device, the all-reduces stay outside.
        forward = getattr(self, "_kd_xla_forward_fn", None)
        if forward is None:
            forward = execution.on_replica_device(
                tf.function(self._forward, jit_compile=True, reduce_retracing=True)
            )
            self._kd_xla_forward_fn = forward
        return forward(x, training)

    def _track_loss(self, share):
        if self._loss_tracker is not None:
            self._loss_tracker.update_state(_keras_compat.unscale_for_tracker(share))

    def train_step(self, data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        with self.replica_batch(x):
            with tf.GradientTape() as tape:
                y_pred = self._call_model(x, training=True)
                loss = self._compute_loss(
                    x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
                )
                self._track_loss(loss)
                if self.optimizer is not None:
                    loss = self.optimizer.scale_loss(loss)
            if self.trainable_weights:
                variables = _keras_compat.optimizer_variables(self)
                gradients = tape.gradient(loss, variables)
                self.optimizer.apply_gradients(zip(gradients, variables))
            else:
                warnings.warn("The model does not have any trainable weights.")
            return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def test_step(self, data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        with self.replica_batch(x):
            y_pred = self._call_model(x, training=False)
            loss = self._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
            )
            self._track_loss(loss)
            return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def predict_step(self, data):
        x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(data)
        return self._call_model(x, training=False)

    def _check_strategy(self):
        """Refuses to run under a strategy the model was not created in."""
        if not tf.distribute.has_strategy():
            return
        active = tf.distribute.get_strategy()
        if self._distribute_strategy is not active:
            built_in = type(self._distribute_strategy).__name__ if self._distribute_strategy else "no strategy"
            raise ValueError(
                f"This model was created under {built_in}, but is used inside "
                f"`{type(active).__name__}.scope()`. Its variables are not "
                "distributed, so training would silently ignore the strategy. "
                "Create (and compile) the model inside `with strategy.scope():`."
            )

    def fit(self, *args, **kwargs):
        args, kwargs = _chief_progress(args, kwargs, position=4)
        if parameter_server.is_parameter_server(self.distribute_strategy):
            return parameter_server.fit(self, *args, **kwargs)
        return super().fit(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        args, kwargs = _chief_progress(args, kwargs, position=3)
        if parameter_server.is_parameter_server(self.distribute_strategy):
            return parameter_server.evaluate(self, *args, **kwargs)
        return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        args, kwargs = _chief_progress(args, kwargs, position=2)
        if parameter_server.is_parameter_server(self.distribute_strategy):
            return parameter_server.predict(self, *args, **kwargs)
        return super().predict(*args, **kwargs)

    def make_train_function(self, force=False):
        self._check_strategy()
        if self.train_function is not None and not force:
            return self.train_function
        self.train_function = execution.make_step_function(self, self.train_step)
        return self.train_function

    def make_test_function(self, force=False):
        self._check_strategy()
        if self.test_function is not None and not force:
            return self.test_function
        self.test_function = execution.make_step_function(self, self.test_step)
        return self.test_function

    def make_predict_function(self, force=False):
        self._check_strategy()
        if self.predict_function is not None and not force:
            return self.predict_function
        self.predict_function = execution.make_predict_function(self)
        return self.predict_function

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Unlike Keras, build also without a strategy: BackupAndRestore must
        # find every metric and optimizer variable before the first step.
        if iterator is not None:
            for _, _, it in iterator:
                data_batch = _keras_compat.first_local_batch(
                    self.distribute_strategy, next(it)
                )
                break
        with self.distribute_strategy.scope():
            self._symbolic_build(data_batch=data_batch)


@keras.saving.register_keras_serializable(package="keras_distrib")
class Model(DistributedModelMixin, keras.Model):
    """A `keras.Model` (functional or subclassed) with exact distributed steps.

    Example:
        >>> import keras, keras_distrib as kd
        >>> inputs = keras.Input((3,))
        >>> model = kd.Model(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
    """

    def __new__(cls, *args, **kwargs):
        # keras.Model turns itself into a Functional by rewriting the class
        # bases; we hand out a fixed functional subclass instead, so kd.Model
        # stays usable for subclassing after a functional model was built.
        if cls is Model and keras_model.functional_init_arguments(args, kwargs):
            return keras.Model.__new__(FunctionalModel)
        return super().__new__(cls, *args, **kwargs)


@keras.saving.register_keras_serializable(package="keras_distrib")
class FunctionalModel(Model, keras_functional.Functional):
    """What `kd.Model(inputs, outputs)` returns: a functional `kd.Model`."""


@keras.saving.register_keras_serializable(package="keras_distrib")
class Sequential(DistributedModelMixin, keras.Sequential):
    """A `keras.Sequential` with exact distributed steps."""
