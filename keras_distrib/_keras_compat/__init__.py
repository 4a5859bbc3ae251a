"""Every place where keras_distrib touches Keras or TensorFlow internals.

Nothing else in keras_distrib imports `keras.src` or `tensorflow.python`, or
reads a private (`_name`) attribute of a Keras or TensorFlow object;
`tests/test_keras_compat.py` checks that, and checks every name in
`PRIVATE_NAMES` against the installed Keras, so a Keras that changes one
fails loudly there, not silently in training.

What kd corrects here, at the narrowest point it can reach:

- Losses: `GlobalCompileLoss` replaces a kd model's `CompileLoss` and wraps
  each resolved loss so it returns the replica's share of the exact global
  mean (`GlobalReductionLoss`), and its trackers so they report the true
  global value (`GlobalShareMean`).
- The optimizer (instance by instance, kd models' optimizers only): kd
  all-reduces gradients before Keras unscales, accumulates and clips them;
  Keras's own all-reduce is skipped and its conditionals (accumulation, EMA
  overwrite) run in cross-replica context.
- Variables (kd models' variables only): Keras implements `assign_add(x)` as
  `assign(self + x)`. Under CentralStorageStrategy a metric variable is an
  `AggregatingVariable` that sums what every replica assigns (R * old +
  sum(x): counts that double every step); under ParameterServerStrategy
  workers read-modify-write the same variable concurrently and lose
  increments. `fix_variables` routes both to the variable's own atomic
  update, and makes partitioned weights readable as NumPy (saving).
- The forward pass: `add_loss` terms recorded per replica, batch
  normalization with exact global moments, random layers drawing for the
  global batch (their `call` replaced per layer).

Importing keras_distrib patches no Keras or TensorFlow class.
"""

import contextlib
import functools
import inspect
import warnings
import weakref

import keras
import numpy as np
import tensorflow as tf
from keras import tree
from tensorflow.python.distribute import collective_all_reduce_strategy
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import input_lib
from tensorflow.python.distribute.coordinator import values as coordinator_values
from tensorflow.python.distribute import device_util
from tensorflow.python.distribute import ps_values
from tensorflow.python.distribute import values as tf_values
from tensorflow.python.distribute import sharded_variable
from tensorflow.python.eager import context as tf_context
from tensorflow.python.ops import control_flow_util
from keras.src.backend.common import masking as keras_masking
from keras.src.backend.common.stateless_scope import in_stateless_scope as _in_stateless_scope
from keras.src.backend.common.symbolic_scope import in_symbolic_scope as _in_symbolic_scope
from keras.src.backend.tensorflow import random as keras_tf_random
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.callbacks import tensorboard as keras_tensorboard
from keras.src.losses import loss as keras_loss
from keras.src.models import functional as keras_functional
from keras.src.models import model as keras_model
from keras.src.trainers import compile_utils
from keras.src.trainers.data_adapters import array_data_adapter
from keras.src.trainers.data_adapters import array_slicing
from keras.src.utils import python_utils
from keras.src.utils import tracking


TESTED_KERAS = ((3, 12), (3, 15))
TESTED_TENSORFLOW = ((2, 20), (2, 21))


def _version_tuple(version):
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


KERAS_VERSION = _version_tuple(keras.__version__)
TENSORFLOW_VERSION = _version_tuple(tf.__version__)
if not TESTED_KERAS[0] <= KERAS_VERSION <= TESTED_KERAS[1]:
    warnings.warn(
        f"keras_distrib is tested with Keras {TESTED_KERAS[0]}..{TESTED_KERAS[1]}"
        f" and found Keras {keras.__version__}; run its compatibility tests "
        "(tests/test_keras_compat.py) before trusting exactness.",
        stacklevel=2,
    )

# Every private name kd relies on: (owner, name, what kd needs from it).
# tests/test_keras_compat.py resolves each one on the installed versions.
PRIVATE_NAMES = (
    ("keras.src.trainers.compile_utils.CompileLoss", "_user_loss", "attribute set in __init__"),
    ("keras.src.trainers.compile_utils.CompileLoss", "_user_loss_weights", "attribute set in __init__"),
    ("keras.src.trainers.compile_utils.CompileLoss", "_flat_losses", "list of Loss(path, loss, loss_weights, name)"),
    ("keras.src.trainers.compile_utils.CompileLoss", "_metrics", "list of per-output loss trackers"),
    ("keras.src.trainers.compile_utils.CompileMetrics", "metrics", "the flat list of compiled metrics"),
    ("keras.src.losses.loss", "squeeze_or_expand_to_same_rank", "function(x1, x2)"),
    ("keras.src.losses.loss", "unscale_loss_for_distribution", "function(value): value * R"),
    ("keras.src.backend.common.masking", "get_keras_mask", "function(x)"),
    ("keras.src.backend.common.masking", "set_keras_mask", "function(x, mask)"),
    ("keras.src.backend.common.symbolic_scope", "in_symbolic_scope", "function()"),
    ("keras.src.backend.tensorflow.trainer", "TFEpochIterator", "class: (begin, end, iterator) chunks"),
    ("keras.src.backend.tensorflow.trainer.TFEpochIterator", "_distributed_dataset", "attribute set in __init__"),
    ("keras.src.backend.tensorflow.trainer.TFEpochIterator", "_num_batches", "attribute: steps per epoch, None until the data ends"),
    ("keras.src.backend.tensorflow.trainer.TFEpochIterator", "_get_iterator", "method(): what a fresh epoch iterates"),
    ("keras.src.backend.tensorflow.trainer.TFEpochIterator", "_current_iterator", "attribute: the open iterator, None before an epoch"),
    ("tensorflow.python.distribute.input_lib.DistributedDataset", "_original_dataset", "attribute: the dataset before distribution"),
    ("tensorflow.python.distribute.input_lib.DistributedDataset", "_strategy", "attribute set in __init__"),
    ("tensorflow.python.distribute.input_lib.DistributedDataset", "_options", "attribute: its tf.distribute.InputOptions"),
    ("tensorflow.python.distribute.input_lib.DistributedDataset", "_enable_get_next_as_optional",
     "attribute: whether its iterators agree across workers at each batch"),
    ("tensorflow.python.distribute.input_lib.DistributedDatasetsFromFunction", "_enable_get_next_as_optional",
     "attribute: whether its iterators agree across workers at each batch"),
    ("keras.src.backend.tensorflow.trainer", "reduce_per_replica", "function(values, strategy, reduction)"),
    ("keras.src.backend.tensorflow.trainer", "potentially_ragged_concat", "function(tensors)"),
    ("keras.src.backend.tensorflow.trainer", "convert_to_np_if_not_ragged", "function(x)"),
    ("keras.src.trainers.data_adapters.array_slicing", "train_validation_split", "function(arrays, validation_split)"),
    ("keras.src.trainers.data_adapters.array_data_adapter", "ArrayDataAdapter", "class: Keras's adapter of in-memory arrays"),
    ("keras.src.utils.python_utils", "pythonify_logs", "function(logs)"),
    ("keras.src.utils.tracking", "no_automatic_dependency_tracking", "decorator"),
    ("keras.src.models.functional", "Functional", "class"),
    ("keras.src.models.model", "functional_init_arguments", "function(args, kwargs)"),
    ("keras.src.backend.tensorflow.random", "normal", "function(shape, seed), replaced (kd steps lay draws out)"),
    ("keras.src.backend.tensorflow.random", "uniform", "function(shape, seed), replaced"),
    ("keras.src.backend.tensorflow.random", "truncated_normal", "function(shape, seed), replaced"),
    ("keras.src.backend.tensorflow.random", "randint", "function(shape, seed), replaced"),
    ("keras.src.backend.tensorflow.random", "dropout", "function(inputs, rate, noise_shape, seed), replaced"),
    ("keras.src.backend.tensorflow.random", "categorical", "function(logits, num_samples, seed), replaced"),
    ("keras.metrics.Mean", "total", "variable set in __init__"),
    ("keras.metrics.Mean", "count", "variable set in __init__"),
    ("keras.Model", "_compile_loss", "attribute set by compile"),
    ("keras.Model", "_loss_tracker", "attribute set by compile"),
    ("keras.Model", "_compute_loss", "method(x, y, y_pred, sample_weight, training)"),
    ("keras.Model", "_aggregate_additional_loss", "method(loss), overridden by kd"),
    ("keras.Model", "_symbolic_build", "method(iterator=None, data_batch=None)"),
    ("keras.Model", "_maybe_symbolic_build", "method(iterator=None, data_batch=None), overridden by kd"),
    ("keras.Model", "_assert_compile_called", "method(method_name)"),
    ("keras.Model", "_call_has_training_arg", "attribute"),
    ("keras.Model", "_distribute_strategy", "attribute: the strategy at creation, or None"),
    ("keras.Model", "_initial_epoch", "attribute Keras's BackupAndRestore sets"),
    ("keras.Model", "_flatten_metrics_in_order", "method(logs)"),
    ("keras.Model", "_flatten_layers", "method(include_self, recursive)"),
    ("keras.layers.BatchNormalization", "_moments", "method(inputs, mask), replaced per layer"),
    ("keras.layers.BatchNormalization", "_reduction_axes", "attribute set in build"),
    ("keras.optimizers.Optimizer", "_distribution_strategy", "attribute (TF backend)"),
    ("keras.optimizers.Optimizer", "_all_reduce_sum_gradients", "method(grads_and_vars), replaced per optimizer"),
    ("keras.optimizers.Optimizer", "_backend_apply_gradients", "method(grads, trainable_variables), replaced per optimizer"),
    ("keras.optimizers.Optimizer", "_backend_update_step", "method(grads, trainable_variables, learning_rate)"),
    ("keras.optimizers.Optimizer", "_backend_increment_gradient_accumulators", "method(grads, acc_grads)"),
    ("keras.optimizers.Optimizer", "_backend_reset_gradient_accumulators", "method()"),
    ("keras.optimizers.Optimizer", "_clip_gradients", "method(grads)"),
    ("keras.optimizers.Optimizer", "_apply_weight_decay", "method(variables)"),
    ("keras.optimizers.Optimizer", "_update_model_variables_moving_average", "method(trainable_variables)"),
    ("keras.optimizers.Optimizer", "_overwrite_model_variables_with_average_value", "method(trainable_variables)"),
    ("keras.optimizers.Optimizer", "_get_variable_index", "method(variable)"),
    ("keras.optimizers.Optimizer", "_iterations", "attribute: the raw step counter"),
    ("keras.optimizers.Optimizer", "_accumulated_gradients", "attribute set by build"),
    ("keras.optimizers.Optimizer", "_trainable_variables", "attribute set by build"),
    ("keras.Variable", "_value", "attribute: the backend (tf) variable"),
    ("tensorflow.python.distribute.values", "SyncOnReadVariable", "class"),
    ("tensorflow.python.distribute.device_util", "current", "function(): the current device or None"),
    ("tensorflow.python.distribute.distribute_lib.StrategyExtendedV2", "_default_device", "attribute: a device or None"),
    ("keras.callbacks.TensorBoard", "_prev_summary_state", "attribute: stack of (writer, step) contexts"),
    ("tensorflow.python.distribute.ps_values", "AggregatingVariable", "class"),
    ("tensorflow.python.distribute.ps_values", "CachingVariable", "class"),
    ("tensorflow.python.distribute.ps_values.AggregatingVariable", "get", "method(): the one variable it wraps"),
    ("tensorflow.python.distribute.sharded_variable", "ShardedVariable", "class"),
    ("tensorflow.python.distribute.distribute_lib", "_get_default_strategy", "function()"),
    ("keras.src.callbacks.tensorboard", "keras_model_summary", "function(name, data, step)"),
    ("keras.callbacks.TensorBoard", "_train_writer", "property: the train summary writer"),
    ("tf.distribute.MirroredStrategy", "_collective_key_base", "class attribute: base of its collective keys"),
    ("tensorflow.python.distribute.mirrored_strategy.MirroredExtended", "_cross_device_ops",
     "attribute: the cross-device ops given, or None"),
    ("tensorflow.python.distribute.mirrored_strategy.MirroredExtended", "_inferred_cross_device_ops",
     "attribute: the cross-device ops inferred from the devices"),
    ("tensorflow.python.distribute.cross_device_ops", "CollectiveAllReduce", "class"),
    ("tf.distribute.experimental.coordinator.ClusterCoordinator", "_cluster", "attribute: its workers"),
    ("tensorflow.python.distribute.coordinator.cluster_coordinator.Worker", "create_resource", "method(function, args=None, kwargs=None)"),
    ("tensorflow.python.distribute.coordinator.values.RemoteValueImpl", "_type_spec", "attribute set for resources"),
    ("tensorflow.python.distribute.input_lib", "get_iterator_spec_from_dataset", "function(strategy, dataset)"),
    ("tensorflow.python.distribute.parameter_server_strategy_v2.ParameterServerStrategyV2Extended",
     "_num_workers", "attribute set in __init__"),
    ("tensorflow.python.distribute.coordinator.values", "PerWorkerDistributedIterator", "class(values)"),
    ("tensorflow.python.distribute.collective_all_reduce_strategy.CollectiveAllReduceExtended",
     "_initialize_local_devices", "method(cluster_resolver, worker_device)"),
    ("tf.distribute.StrategyExtended", "_in_multi_worker_mode", "method()"),
    ("tensorflow.python.ops.control_flow_util", "GraphOrParentsInXlaContext", "function(graph)"),
    ("tensorflow.python.distribute.values.PerReplicaSpec", "_value_specs", "attribute: the replicas' element specs"),
    ("tf.data.Dataset", "_as_serialized_graph", "method()"),
    ("tensorflow.python.eager.polymorphic_function.polymorphic_function.Function",
     "_list_all_concrete_functions", "method(): every ConcreteFunction traced"),
    ("tf.data.Dataset", "_inputs", "method(): the input datasets"),
    ("tensorflow.python.data.ops.shuffle_op._ShuffleDataset", "_reshuffle_each_iteration",
     "attribute set in __init__: whether each iterator draws a new order"),
    ("tf.data.Dataset", "_functions", "method(): StructuredFunctionWrappers (.function.graph)"),
    # The coordination service's key-value store (no public API): preemption
    # agreement and the watchdog's heartbeats.
    ("tensorflow.python.eager.context", "context", "function(): the eager Context"),
    ("tensorflow.python.eager.context.Context", "set_config_key_value", "method(key, value)"),
    ("tensorflow.python.eager.context.Context", "get_config_key_value", "method(key, timeout_in_ms=0)"),
    ("tensorflow.python.eager.context.Context", "delete_config_key_value", "method(key)"),
)


# ---------------------------------------------------------------------------
# Losses and loss trackers.

def squeeze_or_expand_to_same_rank(x1, x2):
    """Keras's rank alignment of losses and weights (as `Loss.__call__` does it)."""
    return keras_loss.squeeze_or_expand_to_same_rank(x1, x2)


CompileLoss = compile_utils.CompileLoss


def replace_compile_losses(compile_loss, wrap_loss, make_tracker):
    """After `CompileLoss.build`: wraps each loss and replaces each per-output tracker.

    `wrap_loss(loss)` returns the loss to use; `make_tracker(name)` the
    tracker for a per-output `<name>_loss`.
    """
    compile_loss._flat_losses = [
        entry._replace(loss=wrap_loss(entry.loss)) for entry in compile_loss._flat_losses
    ]
    trackers = [make_tracker(metric.name) for metric in compile_loss._metrics]
    compile_loss._metrics.clear()
    compile_loss._metrics.extend(trackers)


def sync_on_read_aggregation(variable):
    """The `tf.VariableAggregation` of a Keras variable stored on-read per replica, else None.

    Keras metric variables are (`synchronization=ON_READ`): each replica adds
    to its own copy, and a read in cross-replica context aggregates them.
    """
    inner = getattr(variable, "_value", None)
    if not isinstance(inner, tf_values.SyncOnReadVariable):
        return None
    return inner.aggregation


def backend_variable(variable):
    """The TensorFlow variable behind a Keras variable (distributed under a strategy)."""
    return variable._value


def default_reduce_destination(strategy):
    """Where `strategy.reduce` puts its result: the current device, else the default one."""
    return device_util.current() or strategy.extended._default_device or "/device:CPU:0"


def compiled_losses(compile_loss):
    """The loss objects of a built `CompileLoss`, one per output (None before it is built)."""
    if not compile_loss.built:
        return None
    return [entry.loss for entry in compile_loss._flat_losses]


def compiled_loss(model):
    """The model's `CompileLoss` (None before compile or without a loss)."""
    return getattr(model, "_compile_loss", None)


def compile_loss_arguments(compile_loss):
    """What `compile` gave a `CompileLoss`: (loss, loss_weights, output_names)."""
    return compile_loss._user_loss, compile_loss._user_loss_weights, compile_loss.output_names


@tracking.no_automatic_dependency_tracking
def set_compiled_loss(model, compile_loss):
    model._compile_loss = compile_loss


def loss_tracker(model):
    """The model's `loss` tracker (None before compile)."""
    return getattr(model, "_loss_tracker", None)


@tracking.no_automatic_dependency_tracking
def set_loss_tracker(model, tracker):
    model._loss_tracker = tracker


def exit_summary_contexts(callback, ignore):
    """Exits every summary-writer context a Keras TensorBoard callback has entered.

    Keras's TensorBoard keeps them on a stack (`_prev_summary_state`) while
    it writes; errors of the types in `ignore` are passed over.
    """
    while getattr(callback, "_prev_summary_state", None):
        writer_context, step_context = callback._prev_summary_state.pop()
        for part in (step_context, writer_context):
            try:
                part.__exit__(None, None, None)
            except ignore:
                pass


def unscale_for_tracker(share):
    """The value Keras's trackers expect: the replica loss times R."""
    return keras_loss.unscale_loss_for_distribution(share)


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


def replace_tape_gradient(judge):
    """Makes `tf.GradientTape.gradient` call `judge(target)` first (idempotent).

    Not a Keras internal: TensorFlow's public tape, wrapped here with kd's
    other replacements. `judge` returns at once outside a kd step.
    """
    current = tf.GradientTape.gradient
    if getattr(current, "replaced_by_kd", False):
        return

    @functools.wraps(current)
    def gradient(self, target, sources, *args, **kwargs):
        judge(target)
        return current(self, target, sources, *args, **kwargs)

    gradient.replaced_by_kd = True
    tf.GradientTape.gradient = gradient


# Keras's TensorFlow random functions kd lays out over the global batch:
# name -> whether the first argument is a shape (else an input tensor).
RANDOM_DRAWS = {"normal": True, "uniform": True, "truncated_normal": True, "randint": True,
                "dropout": False, "categorical": False}


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


def _replace_on_instance(owner, name, make):
    """Sets `owner.<name>` to `make(owner, owner.<name>)` on the instance, once."""
    if getattr(vars(owner).get(name), "replaced_by_kd", False):
        return
    replacement = make(owner, getattr(owner, name))
    replacement.replaced_by_kd = True
    object.__setattr__(owner, name, replacement)


def replace_metric_result(metric, make_result):
    """Makes `metric.result()` call `make_result(metric, keras_result)` (idempotent)."""
    _replace_on_instance(metric, "result", make_result)


def replace_mean_update(metric, make_update):
    """Makes a `keras.metrics.Mean`'s `update_state` call `make_update(metric, keras_update)`.

    Only metrics whose `update_state` is Mean's own (trackers fed values, not
    `MeanMetricWrapper`s fed `y_true, y_pred`). Idempotent.
    """
    if type(metric).update_state is keras.metrics.Mean.update_state:
        _replace_on_instance(metric, "update_state", make_update)


def mean_variables(metric):
    """A `keras.metrics.Mean`'s (total, count) variables."""
    return metric.total, metric.count


def compute_loss(model, **kwargs):
    """Keras's `_compute_loss` (compute_loss with its backward-compatible arguments)."""
    return model._compute_loss(**kwargs)


# ---------------------------------------------------------------------------
# Model internals.

Functional = keras_functional.Functional


def functional_init_arguments(args, kwargs):
    return keras_model.functional_init_arguments(args, kwargs)


def make_functional(cls, kd_model, kd_functional):
    """Makes the user's class `cls` functional, as `keras.Model.__init__` does.

    Keras's "subclass a functional model" pattern
    (`super().__init__(inputs=..., outputs=...)` in a subclass's `__init__`)
    rewrites the bases of every class between `cls` and `keras.Model`,
    putting `Functional` in place of `keras.Model`. Done on a kd model, that
    rewrite would reach `kd.Model` itself, and every later `kd.Model`
    subclass would become functional. Here the rewrite stops at kd's class:
    `kd_model` is replaced by `kd_functional` (its fixed functional
    subclass) in the user's classes, and kd's classes are left untouched.
    """

    def inject(klass):
        if klass is kd_model:
            return kd_functional
        if klass is keras.Model:
            return keras_functional.Functional
        if (klass is object or not issubclass(klass, keras.Model)
                or issubclass(klass, keras_functional.Functional)
                or klass.__module__.startswith("keras_distrib.")):
            return klass
        bases = tuple(inject(base) for base in klass.__bases__)
        if bases != klass.__bases__:
            klass.__bases__ = bases
        return klass

    inject(cls)


def functional_init(model, args, kwargs):
    """`keras.Model.__init__` for functional arguments, on an already functional class."""
    keras_functional.Functional.__init__(model, *args, **kwargs)


class ModelHooks:
    """The private Keras methods kd models override, forwarding to kd's own.

    `keras_distrib.training.models.DistributedModelMixin` inherits this, so the
    overrides of private names live here.
    """

    def _aggregate_additional_loss(self, loss):
        return self.additional_loss_share(loss)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        return self.build_from_data(iterator=iterator, data_batch=data_batch)


def symbolic_build(model, data_batch):
    """Builds the model, its compiled losses and metrics from a batch or spec."""
    model._symbolic_build(data_batch=data_batch)


def assert_compiled(model, method):
    model._assert_compile_called(method)


def created_strategy(model):
    """The strategy `model` was created under, or None (the default one)."""
    return model._distribute_strategy


def call_has_training_arg(model):
    return model._call_has_training_arg


def initial_epoch(model):
    """The epoch Keras's own BackupAndRestore restored (`model._initial_epoch`)."""
    return getattr(model, "_initial_epoch", None)


def set_initial_epoch(model, epoch):
    model._initial_epoch = epoch


def flatten_metrics_in_order(model, logs):
    return model._flatten_metrics_in_order(logs)


def compile_metric_names(metric):
    """Log keys a compiled-metrics container produces (its metrics' names)."""
    if isinstance(metric, compile_utils.CompileMetrics):
        return {sub.name for sub in metric.metrics}
    return set()


def compile_metric_log_keys(metric):
    """The log keys a built compiled-metrics container reports (e.g. `out_mae`), or None.

    Keras names them when it reports them (output prefixes, de-duplication),
    so they are read from a result of the container's current state.
    """
    if isinstance(metric, compile_utils.CompileMetrics) and metric.built:
        return set(metric.result())
    return None


# ---------------------------------------------------------------------------
# Data and loops.


def epoch_iterator(**kwargs):
    """Keras's epoch iterator for TensorFlow (its data adapters, chunking)."""
    return keras_tf_trainer.TFEpochIterator(**kwargs)


def skip_batch_agreement(epoch_iterator):
    """Makes the iterators of an epoch iterator's distributed dataset fetch without agreeing.

    Across workers, TensorFlow's distributed iterator all-reduces at every
    batch whether any worker still has one (to hand empty batches to those
    that ran out). Where every worker holds the same known number of
    batches, one per replica, none runs out first: the caller checks that.
    """
    epoch_iterator._distributed_dataset._enable_get_next_as_optional = False


def batches_from_arrays(epoch_iterator):
    """Whether Keras made an epoch iterator's dataset from in-memory arrays (`ArrayDataAdapter`).

    Such a dataset is sharded across workers by data: TensorFlow splits every
    global batch into one batch per replica (empty ones included), so every
    worker holds as many batches as the global dataset, one per replica.
    """
    return isinstance(getattr(epoch_iterator, "data_adapter", None),
                      array_data_adapter.ArrayDataAdapter)


def agrees_on_batches(iterator):
    """Whether a distributed iterator all-reduces "any batch left?" at each fetch."""
    return getattr(iterator, "_enable_get_next_as_optional", True) is not False


def set_epoch_batches(epoch_iterator, count):
    """Makes a Keras epoch iterator run `count` steps per epoch (None: until the data ends).

    Unlike `steps_per_epoch`, a fresh iterator over the data still starts
    every epoch; the count survives `reset()`.
    """
    reset = type(epoch_iterator).reset.__get__(epoch_iterator)

    def counted_reset():
        reset()
        epoch_iterator._num_batches = count

    object.__setattr__(epoch_iterator, "reset", counted_reset)
    epoch_iterator._num_batches = count
def data_batch_size(epoch_iterator):
    """The global batch size of a Keras epoch iterator's data, or None where not known.

    A `tf.data` pipeline whose batches have no static size (`filter`, a
    last batch kept) is read through its transformations to its `batch`.
    """
    adapter = getattr(epoch_iterator, "data_adapter", None)
    try:
        size = getattr(adapter, "batch_size", None)
    except Exception:  # noqa: BLE001 - an adapter may not know it
        return None
    if size is None and isinstance(getattr(adapter, "_dataset", None), tf.data.Dataset):
        size = pipeline_batch_size(adapter._dataset)
    return int(size) if isinstance(size, int) and size > 0 else None


# Transformations after which a `batch` further up no longer sets the rows per element.
_REBATCHING = ("Unbatch", "Rebatch", "FlatMap", "Interleave", "Window", "GroupBy", "Bucket",
               "Scan", "Choose", "Sample", "Zip", "Concatenate")


def pipeline_batch_size(dataset):
    """The `batch_size` of the `batch` that makes `dataset`'s elements, or None.

    Walks the pipeline from its end through transformations that keep each
    element's rows (map, filter, prefetch, cache, take, skip, shuffle,
    repeat...). TensorFlow's private `_input_dataset` / `_batch_size`.
    """
    while isinstance(dataset, tf.data.Dataset):
        name = type(dataset).__name__
        if any(word in name for word in _REBATCHING):
            return None
        if "Batch" in name and hasattr(dataset, "_batch_size"):
            value = tf.get_static_value(dataset._batch_size)
            return int(value) if value is not None and int(value) > 0 else None
        dataset = getattr(dataset, "_input_dataset", None)
    return None


def dataset_element_spec(epoch_iterator):
    """The element spec of a Keras TFEpochIterator's dataset, without iterating.

    Opening an iterator would consume (and for a reshuffling dataset,
    reorder) the user's data; building the model needs only shapes.
    """
    return epoch_iterator._distributed_dataset.element_spec


def epoch_distributed_dataset(epoch_iterator):
    """The distributed dataset a Keras TFEpochIterator iterates, or None for other sources."""
    if not isinstance(epoch_iterator, keras_tf_trainer.TFEpochIterator):
        return None
    return epoch_iterator._distributed_dataset


def redistributed(distributed, transform):
    """`distributed`'s dataset changed by `transform`, distributed the same way; or None.

    For a dataset `experimental_distribute_dataset` made (not one from a
    `dataset_fn`): the same strategy and `tf.distribute.InputOptions`, over
    `transform(dataset)`, the batched dataset before it was split. The
    default strategy distributes a dataset as it is: `transform(dataset)`.
    """
    if isinstance(distributed, tf.data.Dataset):  # the default strategy's, not split
        return transform(distributed)
    if type(distributed) is not input_lib.DistributedDataset:
        return None
    dataset = getattr(distributed, "_original_dataset", None)
    if dataset is None:
        return None
    return distributed._strategy.experimental_distribute_dataset(
        transform(dataset), options=distributed._options)


def next_epoch_over(epoch_iterator, distributed):
    """Makes a Keras TFEpochIterator's next fresh iterator come from `distributed`.

    Once: later epochs iterate its own distributed dataset again. Returns
    False (nothing changed) where the epoch goes on from an iterator already
    open (`steps_per_epoch` over an earlier epoch's iterator).
    """
    if epoch_iterator._current_iterator is not None:
        return False

    def once():
        del epoch_iterator._get_iterator  # back to the class's method
        return distributed

    object.__setattr__(epoch_iterator, "_get_iterator", once)
    return True


def per_replica_specs(spec):
    """The per-replica element specs of a distributed element spec, or None."""
    return getattr(spec, "_value_specs", None)


def autoconvert_optionals(data):
    """Keras feeds `tf.experimental.Optional` for absent parts; map to None."""
    return tree.map_structure(
        lambda x: None if isinstance(x, tf.experimental.Optional) else x, data
    )


def concat_replicas(outputs, strategy):
    """Per-replica outputs concatenated in replica (input) order, over workers too."""
    return keras_tf_trainer.reduce_per_replica(outputs, strategy, reduction="concat")


def concat_predictions(batches):
    """Keras's `predict` result from each call's outputs, in order.

    NumPy arrays, or a RaggedTensor (or SparseTensor) where the outputs are
    ragged, or their shapes differ from batch to batch, as Keras returns.
    """
    first = batches[0]
    lists = tree.map_structure(lambda _: [], first)
    for batch in batches:
        tree.map_structure_up_to(first, lambda parts, value: parts.append(value), lists, batch)
    joined = tree.map_structure_up_to(first, keras_tf_trainer.potentially_ragged_concat, lists)
    return tree.map_structure(keras_tf_trainer.convert_to_np_if_not_ragged, joined)


def pythonify_logs(logs):
    return python_utils.pythonify_logs(logs)


def train_validation_split(arrays, validation_split):
    return array_slicing.train_validation_split(arrays, validation_split=validation_split)


def max_epochs():
    return keras.config.max_epochs()


def in_symbolic_scope():
    return _in_symbolic_scope()


def serialized_graph(dataset):
    """A dataset's serialized GraphDef (to count the files it reads)."""
    return dataset._as_serialized_graph()


def concrete_functions(function):
    """Every `ConcreteFunction` a `tf.function` has traced (to count its ops)."""
    return list(function._list_all_concrete_functions())


# ---------------------------------------------------------------------------
# Strategies.


def in_xla_context():
    """Whether the graph being built is compiled by XLA (`jit_compile=True`)."""
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def is_multi_worker(strategy):
    extended = strategy.extended
    return bool(getattr(extended, "_in_multi_worker_mode", lambda: False)())


def per_worker_iterator(coordinator, dataset_for_worker):
    """A parameter-server iterator whose worker i reads `dataset_for_worker(i)`.

    `ClusterCoordinator.create_per_worker_dataset` runs one function on every
    worker, so each worker's `dataset_fn(input_context)` would see the same
    default context; here each worker gets its own function (and so its own
    input pipeline id). Workers that restart rebuild their iterator.
    """
    iterators = []
    for index, worker in enumerate(coordinator._cluster.workers):
        dataset_fn = tf.function(lambda index=index: dataset_for_worker(index)).get_concrete_function()
        remote = worker.create_resource(lambda dataset_fn=dataset_fn: iter(dataset_fn()))
        remote._type_spec = input_lib.get_iterator_spec_from_dataset(
            coordinator.strategy, dataset_fn.structured_outputs
        )
        iterators.append(remote)
    return coordinator_values.PerWorkerDistributedIterator(tuple(iterators))


class KeyExists(Exception):
    """The coordination service already holds the key (keys are written once)."""


class KeyMissing(Exception):
    """The key did not appear within the timeout."""


def key_value_insert(key, value):
    """Writes `key` in the coordination service's store (multi-worker jobs).

    Raises:
        KeyExists: the key was already written (by any task).
    """
    try:
        tf_context.context().set_config_key_value(key, value)
    except tf.errors.AlreadyExistsError:
        raise KeyExists(key) from None


def key_value_get(key, timeout_ms):
    """Reads `key`, waiting up to `timeout_ms` (> 0) for it to be written.

    Raises:
        KeyMissing: not written within the timeout.
    """
    try:
        return tf_context.context().get_config_key_value(key, int(max(1, timeout_ms)))
    except (tf.errors.DeadlineExceededError, tf.errors.NotFoundError):
        raise KeyMissing(key) from None


def key_value_delete(key):
    """Deletes `key` (and keys under it) from the store; absent keys are ignored."""
    tf_context.context().delete_config_key_value(key)


def parameter_server_workers(strategy):
    """The number of workers of a ParameterServerStrategy's cluster."""
    return strategy.extended._num_workers


def dataset_ops_used(dataset):
    """The op types in a dataset's graph (its functions included)."""
    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(serialized_graph(dataset).numpy())
    ops = {node.op for node in graph.node}
    for function in graph.library.function:
        ops.update(node.op for node in function.node_def)
    return ops


def iterators_before_epoch(epoch_iterator, epochs):
    """How many iterators a Keras epoch iterator opens over its data in `epochs` epochs.

    Keras opens one at the start of each epoch and, when it knows the
    epoch's batch count, one more as an epoch ends (for the next epoch,
    which opens its own anyway): 2 per epoch. A dataset that reshuffles
    each iteration draws a new order for each, so the k-th epoch trains on
    its 2k-th order. None with `steps_per_epoch` (epochs go on from an
    iterator already open, or open one when the data runs out).
    """
    if epoch_iterator.steps_per_epoch is not None:
        return None
    return epochs * (2 if epoch_iterator._num_batches else 1)


def reshuffles_each_iteration(dataset):
    """Whether `dataset` (or a dataset it reads) shuffles anew each time it is iterated.

    For a distributed dataset, its dataset before distribution; None where
    that cannot be told (a `dataset_fn`'s datasets).
    """
    if not isinstance(dataset, tf.data.Dataset):
        dataset = getattr(dataset, "_original_dataset", None)
        if not isinstance(dataset, tf.data.Dataset):
            return None
    pending, seen = [dataset], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if getattr(current, "_reshuffle_each_iteration", False) is True:
            return True
        pending.extend(current._inputs())
    return False


def dataset_calls_python(dataset, op_types):
    """Whether a dataset's functions (map, flat_map, from_generator's) use any of `op_types`.

    Walks the dataset's inputs and the graphs of their functions, without
    serializing the dataset (which would copy every constant it holds, e.g.
    the arrays of `from_tensor_slices`).
    """
    pending, seen = [dataset], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for wrapper in current._functions():
            graphs = [wrapper.function.graph]
            while graphs:
                graph = graphs.pop()
                if any(op.type in op_types for op in graph.get_operations()):
                    return True
                graphs.extend(f.graph for f in graph._functions.values() if hasattr(f, "graph"))
        pending.extend(current._inputs())
    return False


def default_strategy():
    """TensorFlow's default (no-op) strategy, even inside another's scope."""
    return distribute_lib._get_default_strategy()


_COLLECTIVE_KEY_BASES = iter(range(100_000, 2**30, 100_000))


def isolated_mirrored_strategy(devices, cross_device_ops=None):
    """A `MirroredStrategy` whose collectives no other strategy here can collide with.

    TensorFlow caches each collective's parameters (shape included) by
    group and instance key for the life of the process, and every
    MirroredStrategy numbers its collectives from the same start: a second
    strategy's all-reduce then meets the first one's cached shape and fails
    ("Shape mismatch in the collective instance"), and every collective
    after it. TensorFlow's own tests give each strategy a key base of its
    own (strategy_combinations.py); so does this, on a subclass, so
    MirroredStrategy itself is untouched.
    """
    isolated = type("MirroredStrategy", (tf.distribute.MirroredStrategy,),
                    {"_collective_key_base": next(_COLLECTIVE_KEY_BASES)})
    return isolated(devices=devices, cross_device_ops=cross_device_ops)


def collective_key_base(strategy):
    """The base of a `MirroredStrategy`'s collective keys; None if it runs no collectives.

    Only a MirroredStrategy whose replicas all-reduce with collective ops
    (`tf.distribute` picks them for CPUs and for GPUs without NCCL) has
    keys that can collide; one reducing to one device or with NCCL has none.
    """
    if not isinstance(strategy, tf.distribute.MirroredStrategy):
        return None
    extended = strategy.extended
    ops = extended._cross_device_ops or getattr(extended, "_inferred_cross_device_ops", None)
    if not isinstance(ops, cross_device_ops_lib.CollectiveAllReduce):
        return None
    return strategy._collective_key_base


def optimizer_strategy(optimizer, default):
    """The strategy an optimizer was created under (TF backend), or `default`."""
    return getattr(optimizer, "_distribution_strategy", default)


@contextlib.contextmanager
def cpu_replicas_per_worker(count):
    """Lets MultiWorkerMirroredStrategy use `count` logical CPUs per worker.

    TensorFlow gives a multi-worker strategy one replica per worker on CPU
    (it only counts GPUs and TPUs); with virtual CPU devices we want one per
    device, as on a multi-GPU worker. The local-device lookup is swapped
    only while the strategy is constructed.
    """
    extended = collective_all_reduce_strategy.CollectiveAllReduceExtended
    original = extended._initialize_local_devices

    def local_devices(self, cluster_resolver, worker_device):
        devices, device_type = original(self, cluster_resolver, worker_device)
        if device_type != "CPU" or count <= 1:
            return devices, device_type
        return tuple(f"{worker_device}/device:CPU:{i}" for i in range(count)), "CPU"

    extended._initialize_local_devices = local_devices
    try:
        yield
    finally:
        extended._initialize_local_devices = original


# ---------------------------------------------------------------------------
# Variables under central storage and parameter servers (kd models' only).

_PS_VARIABLES = (ps_values.AggregatingVariable, ps_values.CachingVariable)


def _delegating(variable, inner, name):
    keras_method = getattr(type(variable), name).__get__(variable)

    def method(value):
        if _in_stateless_scope():
            return keras_method(value)
        return getattr(inner, name)(tf.cast(value, inner.dtype))

    method.__name__ = name
    return method


def _sharded_readable(inner, name):
    def method(*args, **kwargs):
        # A partitioned weight reads as the concatenation of its shards.
        value = tf.convert_to_tensor(inner).numpy()
        return np.asarray(value, *args[:1]) if name == "__array__" else value

    method.__name__ = name
    return method




def fix_variables(variables):
    """Atomic `assign_add`/`assign_sub` and NumPy reads for `variables`.

    Applied to a kd model's variables (weights, metrics, optimizer) only;
    see the module docstring. Idempotent.
    """
    for variable in variables:
        inner = getattr(variable, "_value", None)
        fixed = vars(variable)  # the instance's own overrides, if any
        if isinstance(inner, _PS_VARIABLES) and "assign_add" not in fixed:
            for name in ("assign_add", "assign_sub"):
                object.__setattr__(variable, name, _delegating(variable, inner, name))
        elif isinstance(inner, sharded_variable.ShardedVariable) and "numpy" not in fixed:
            for name in ("numpy", "__array__"):
                object.__setattr__(variable, name, _sharded_readable(inner, name))
            serialize, restore = _sharded_checkpointing(inner)
            object.__setattr__(variable, "_serialize_to_tensors", serialize)
            object.__setattr__(variable, "_restore_from_tensors", restore)


def _sharded_checkpointing(inner):
    """A partitioned Keras weight's checkpoint: one entry per shard.

    Keras's variable writes `{"VARIABLE_VALUE": value}`, which TensorFlow
    cannot save for a `ShardedVariable` (no device: the first backup of a
    parameter-server run with a `variable_partitioner` failed). Each shard
    is written under its own key, on its parameter server; a backup restores
    into the same partitioning only (`BackupAndRestore` records it and
    refuses another by name: the optimizer's state is per shard too).
    """
    keys = [f"VARIABLE_VALUE_part_{i}" for i in range(len(inner.variables))]

    def serialize():
        return {key: shard.read_value() for key, shard in zip(keys, inner.variables)}

    def restore(restored_tensors):
        return tf.group([shard.assign(restored_tensors[key])
                         for key, shard in zip(keys, inner.variables)])

    return serialize, restore


def weight_partitions(model):
    """`{weight index: rows of each part}` for the weights a `variable_partitioner` split.

    Keyed by the weight's index in `model.weights` (paths carry the model's
    own name, which another process may number otherwise).
    """
    parts = {}
    for index, weight in enumerate(model.weights):
        inner = getattr(weight, "_value", None)
        if isinstance(inner, sharded_variable.ShardedVariable):
            parts[str(index)] = [int(shard.shape[0]) for shard in inner.variables]
    return parts


def write_from_first_replica(variables):
    """Central storage: replica 0's `assign` to `variables` updates the one copy.

    Under CentralStorageStrategy a variable created without an aggregation
    (Keras's default; BatchNormalization's moving statistics) is an
    `AggregatingVariable` that TensorFlow refuses to update in a replica
    ("You must specify an aggregation method"). Its moving statistics are
    the same on every replica when kd computes the moments over the global
    batch (synchronized BatchNormalization), so replica 0 writes them and the
    others skip the write: what MirroredStrategy's saved (first) copy holds.
    No `merge_call`, so it also runs inside kd's compiled multi-step loops.
    Other variables and strategies are left alone. Idempotent.
    """
    _write_from_one_replica(variables, last=False)


def replace_seed_next(generator, make_next):
    """Makes `generator.next` call `make_next(generator, keras_next)` (idempotent)."""
    _replace_on_instance(generator, "next", make_next)


def write_seed_state_from_last_replica(generator, before_write=None):
    """Central storage: a `SeedGenerator`'s state is written by the last replica.

    Every replica draws from the same state (kd lays the draws out over the
    global batch) and computes the same next state; the one copy must keep
    the state every replica read until all have read it. Replicas are traced
    in order and TensorFlow runs the updates of a resource in the order they
    were created, so the last replica's write comes after every replica's
    read (kd's steps read a state once per step and count their draws, see
    `replace_seed_next`). `before_write(variable)`, if given, runs (at
    trace time) before each replica's write. Idempotent.
    """
    _write_from_one_replica([generator.state], last=True, before_write=before_write)


def _write_from_one_replica(variables, *, last, before_write=None):
    for variable in variables:
        inner = getattr(variable, "_value", None)
        if not isinstance(inner, ps_values.AggregatingVariable) or "assign" in vars(variable):
            continue
        if inner.aggregation != tf.VariableAggregation.NONE:
            continue
        object.__setattr__(variable, "assign", _one_replica_assign(variable, inner, last, before_write))


def _one_replica_assign(variable, inner, last, before_write):
    keras_assign = type(variable).assign.__get__(variable)

    def assign(value):
        context = tf.distribute.get_replica_context()
        if _in_stateless_scope() or context is None or context.num_replicas_in_sync == 1:
            return keras_assign(value)
        if before_write is not None:
            before_write(variable)
        stored = inner.get()
        value = tf.cast(value, stored.dtype)
        writer = context.num_replicas_in_sync - 1 if last else 0
        writes = tf.equal(context.replica_id_in_sync_group, writer)
        tf.cond(writes, lambda: stored.assign(value).op, tf.no_op)
        return value

    assign.__name__ = "assign"
    return assign


def model_variables(model):
    """Every variable of a kd model: weights, metrics, optimizer (and shards)."""
    found = list(model.variables) + list(model.metrics_variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        found += list(optimizer.variables)
        base = base_optimizer(optimizer)
        if base is not optimizer:
            found += list(base.variables)
    return found


_SHARD_VARIABLES = weakref.WeakKeyDictionary()


def optimizer_variables(model):
    """The variables the optimizer updates: shards for partitioned weights.

    Under ParameterServerStrategy with a `variable_partitioner`, a Keras
    weight wraps a `ShardedVariable` (its parts live on different parameter
    servers). Neither the tape nor the Keras optimizer can update it whole,
    so each shard gets its own Keras variable: gradients and optimizer slots
    are per shard, on the shard's parameter server. The model still reads
    the whole weight (the concatenation of the same shards).
    """
    wrappers = _SHARD_VARIABLES.setdefault(model, {})
    result = []
    for variable in model.trainable_weights:
        inner = getattr(variable, "_value", None)
        if not isinstance(inner, sharded_variable.ShardedVariable):
            result.append(variable)
            continue
        if id(variable) not in wrappers:
            wrappers[id(variable)] = [
                keras.Variable(shard, trainable=True, name=f"{variable.name}_shard_{i}")
                for i, shard in enumerate(inner.variables)
            ]
        result.extend(wrappers[id(variable)])
    return result


# ---------------------------------------------------------------------------
# The optimizer's gradient pipeline (see keras_distrib/training/gradients.py).
#
# Keras's TF optimizer all-reduces inside `_backend_update_step`, after it
# has unscaled, accumulated and clipped each replica's partial gradient.
# kd all-reduces first (in `apply`), so these hooks make the optimizer skip
# its own reduction, and run the conditionals of `_backend_apply_gradients`
# (accumulation, EMA overwrite) in cross-replica context, where TensorFlow
# allows a `merge_call` inside a branch. Both are set on the optimizer
# instance only: other optimizers keep Keras's behaviour.

_PIPELINE_OPTIMIZERS = weakref.WeakSet()
_REPLICA_THREAD_STRATEGIES = (
    tf.distribute.MirroredStrategy,
    tf.distribute.MultiWorkerMirroredStrategy,
    tf.distribute.experimental.CentralStorageStrategy,
)


def base_optimizer(optimizer):
    """The optimizer that applies updates (a LossScaleOptimizer's inner one)."""
    return getattr(optimizer, "inner_optimizer", None) or optimizer


def has_gradient_pipeline(optimizer):
    return optimizer in _PIPELINE_OPTIMIZERS


def install_gradient_pipeline(optimizer, aggregate, prepare):
    """Makes `optimizer.apply` call `aggregate(grads)` before anything else.

    `prepare(optimizer, trainable_variables)` runs first (kd builds an
    unbuilt optimizer there); `aggregate` all-reduces the replicas'
    gradients; after it every replica holds the global gradient, and the
    optimizer's own reduction is skipped.
    """
    if optimizer in _PIPELINE_OPTIMIZERS:
        return
    outer_apply = optimizer.apply

    def apply(grads, trainable_variables=None):
        prepare(optimizer, trainable_variables)
        return outer_apply(aggregate(list(grads)), trainable_variables)

    object.__setattr__(optimizer, "apply", apply)
    base = base_optimizer(optimizer)
    object.__setattr__(base, "_all_reduce_sum_gradients", lambda grads_and_vars: list(grads_and_vars))
    backend_apply = base._backend_apply_gradients

    def backend_apply_gradients(grads, trainable_variables):
        if not _needs_cross_replica_conditionals(base):
            return backend_apply(grads, trainable_variables)
        context = tf.distribute.get_replica_context()
        context.merge_call(
            lambda distribution, grads: _apply_in_cross_replica(
                base, distribution, grads, trainable_variables
            ),
            args=(grads,),
        )

    object.__setattr__(base, "_backend_apply_gradients", backend_apply_gradients)
    object.__setattr__(base, "assign", _first_replica_optimizer_assign(base.assign))
    _PIPELINE_OPTIMIZERS.add(optimizer)


def _first_replica_optimizer_assign(optimizer_assign):
    """`optimizer.assign` that writes central-storage state from replica 0.

    Keras's optimizer assigns some state in each replica (Nadam's
    momentum-cache product, before its cross-replica update), to a variable
    without an aggregation: under CentralStorageStrategy TensorFlow refuses
    that ("You must specify an aggregation method"). Every replica computes
    the same value from the same all-reduced state, so replica 0 writes it,
    as `write_from_first_replica` does for BatchNormalization.
    """

    def assign(variable, value):
        inner = getattr(variable, "_value", None)
        context = tf.distribute.get_replica_context()
        if (
            not isinstance(inner, ps_values.AggregatingVariable)
            or inner.aggregation != tf.VariableAggregation.NONE
            or context is None
            or context.num_replicas_in_sync == 1
        ):
            return optimizer_assign(variable, value)
        stored = inner.get()
        value = tf.cast(value, stored.dtype)
        first = tf.equal(context.replica_id_in_sync_group, 0)
        tf.cond(first, lambda: stored.assign(value).op, tf.no_op)

    assign.__name__ = "assign"
    return assign


def _needs_cross_replica_conditionals(optimizer):
    if tf.distribute.get_replica_context() is None or not tf.distribute.has_strategy():
        return False
    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        return False
    if not isinstance(tf.distribute.get_strategy(), _REPLICA_THREAD_STRATEGIES):
        return False
    return bool(optimizer.gradient_accumulation_steps) or bool(
        optimizer.use_ema and optimizer.ema_overwrite_frequency
    )


def _apply_in_cross_replica(optimizer, distribution, grads, variables):
    """Keras's `_backend_apply_gradients`, its `cond`s in cross-replica context.

    Every replica holds the same (all-reduced) gradient, so each branch runs
    the same replica function on every replica, as one device would run it.
    """

    def on_replicas(function):
        return lambda: distribution.extended.call_for_each_replica(function, args=(grads,))

    def update(step_grads):
        step_grads = optimizer._clip_gradients(step_grads)
        optimizer._apply_weight_decay(variables)
        optimizer._backend_update_step(step_grads, variables, optimizer.learning_rate)

    steps = optimizer.gradient_accumulation_steps
    if steps:
        accumulators = [
            optimizer._accumulated_gradients[optimizer._get_variable_index(v)] for v in variables
        ]

        def update_with_accumulated(step_grads):
            update([(g + a) / steps for g, a in zip(step_grads, accumulators)])
            optimizer._backend_reset_gradient_accumulators()

        def accumulate(step_grads):
            optimizer._backend_increment_gradient_accumulators(step_grads, accumulators)

        is_update_step = tf.equal((optimizer._iterations + 1) % steps, 0)
        tf.cond(is_update_step, on_replicas(update_with_accumulated), on_replicas(accumulate))
    else:
        on_replicas(update)()
    if optimizer.use_ema:
        trainable = optimizer._trainable_variables
        on_replicas(lambda _: optimizer._update_model_variables_moving_average(trainable))()
        if optimizer.ema_overwrite_frequency:
            overwrite = tf.equal((optimizer.iterations + 1) % optimizer.ema_overwrite_frequency, 0)
            tf.cond(
                overwrite,
                on_replicas(lambda _: optimizer._overwrite_model_variables_with_average_value(trainable)),
                lambda: None,
            )


# ---------------------------------------------------------------------------
# Per-replica forward-pass bookkeeping (see keras_distrib/training/models.py).

_LOSS_RECORDING_LAYERS = weakref.WeakSet()
_BATCH_NORM_LAYERS = weakref.WeakSet()


def flatten_layers(model):
    """Every layer of `model`, nested ones included (the model first)."""
    return model._flatten_layers(include_self=True, recursive=True)


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
    """Makes a BatchNormalization use `moments(layer, x, mask, original)`.

    `original` is Keras's `_moments`; `layer_axes(layer)` gives the axes.
    """
    if layer in _BATCH_NORM_LAYERS:
        return
    original = layer._moments
    object.__setattr__(
        layer, "_moments", lambda inputs, mask: moments(layer, inputs, mask, original)
    )
    _BATCH_NORM_LAYERS.add(layer)


def batch_norm_axes(layer):
    """The axes a BatchNormalization layer reduces over (all but its channels)."""
    return list(layer._reduction_axes)


def get_keras_mask(tensor):
    return keras_masking.get_keras_mask(tensor)


def set_keras_mask(tensor, mask):
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


# ---------------------------------------------------------------------------
# TensorBoard's model graphs.

# The class names Keras's TensorBoard callback writes a `keras` summary for.
_KERAS_GRAPH_CLASSES = ("Functional", "Sequential")


def write_model_config(callback, model):
    """Writes the `keras` summary (TensorBoard's conceptual graph) Keras skips for `model`.

    Keras writes it only for models whose class is named `Functional` or
    `Sequential`; kd's functional class is `FunctionalModel`, and a user's
    subclass of a functional model has a name of its own. Any functional or
    sequential model whose config lists its layers gets it here; Keras's
    own ones already have it.
    """
    if type(model).__name__ in _KERAS_GRAPH_CLASSES:
        return False
    if not isinstance(model, (keras_functional.Functional, keras.Sequential)):
        return False
    try:
        layers = "layers" in model.get_config()
    except Exception:  # noqa: BLE001 - a model without a config has no conceptual graph
        return False
    if not layers:
        return False
    with callback._train_writer.as_default():
        return keras_tensorboard.keras_model_summary("keras", model, step=0)
