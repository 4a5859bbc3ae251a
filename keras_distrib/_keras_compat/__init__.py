"""Every place where keras_distrib touches Keras or TensorFlow internals.

Nothing outside this package imports `keras.src` or `tensorflow.python`, or
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
- TensorFlow's runtime, around kd's own calls only: a step call drops the
  gradients its trace registered for all-reduces, which would keep the
  step's graph alive for the life of the process
  (`released_custom_gradients`); the first-step check runs its eager ops
  as kernels, not as one-op functions (`eager_ops_as_kernels`).

Importing keras_distrib replaces nothing. `replacements` lists every
replacement with its scope: three for the whole process (Keras's
`Loss.__call__`, Keras's TensorFlow random functions, `tf.GradientTape.gradient`),
installed at a kd model's first step and inert outside a kd replica step;
the rest on objects of one kd model only.

The parts, one per thing adapted: `replacements` (the list, and the
process-wide ones), `losses` (compiled losses, trackers, metrics),
`trainer` (model and trainer internals), `data` (data adapters, epoch
iterators, datasets), `strategies` (tf.distribute
internals, the coordination service), `variables` (central storage,
parameter servers, partitions, seed state), `optimizer` (the gradient
pipeline), `layers` (the forward pass), `summaries` (TensorBoard) and
`versions` (the installed versions, for version checks). This
`__init__` keeps the version check and `PRIVATE_NAMES`, and re-exports what
the rest of kd uses (`_keras_compat.<name>`).

The floor of the layout. May import: no other kd module; every other part
may import it (`tests/test_layers.py`, `tests/test_layout.py`).
"""

import os
import warnings

import keras
import tensorflow as tf

from keras_distrib._keras_compat.versions import KERAS_VERSION  # noqa: F401
from keras_distrib._keras_compat.versions import TENSORFLOW_VERSION  # noqa: F401
from keras_distrib._keras_compat.versions import version_tuple

# The minor versions the whole suite passes on (first, last); pyproject.toml
# admits exactly these (tests/test_keras_compat.py checks that the two agree).
TESTED_KERAS = ((3, 13), (3, 15))
TESTED_TENSORFLOW = ((2, 20), (2, 21))
# Set to 1 to run on other versions anyway: kd then warns instead of refusing.
UNTESTED_VERSIONS_VARIABLE = "KD_UNTESTED_VERSIONS"


def _minor_range(tested):
    first, last = (".".join(map(str, version)) for version in tested)
    return first if first == last else f"{first} to {last}"


def _requirement(name, tested):
    first, last = tested
    return f"{name}>={first[0]}.{first[1]},<{last[0]}.{last[1] + 1}"


def check_versions(keras_version, tensorflow_version, environ=None):
    """Refuses Keras or TensorFlow versions outside the tested ranges.

    kd works around Keras and TensorFlow internals (this package), which
    change between minor versions: on an untested version training may
    fail, or worse, run and differ from one device. pyproject.toml keeps pip
    from installing such versions; this catches an environment pip did not
    check (a `keras-nightly`, `--no-deps`, a pinned image).

    Args:
        keras_version: Keras's version string (`keras.__version__`).
        tensorflow_version: TensorFlow's version string.
        environ: The environment (`os.environ` when `None`); with
            `KD_UNTESTED_VERSIONS=1` kd warns instead of refusing.

    Raises:
        ImportError: a version is outside its tested range; the message
            names the tested versions, the ones found and the fix.
    """
    environ = os.environ if environ is None else environ
    found = {"Keras": (keras_version, TESTED_KERAS), "TensorFlow": (tensorflow_version, TESTED_TENSORFLOW)}
    wrong = [f"{name} {version}" for name, (version, tested) in found.items()
             if not tested[0] <= version_tuple(version) <= tested[1]]
    if not wrong:
        return
    tested = " and ".join(f"{name} {_minor_range(tested)}" for name, (_, tested) in found.items())
    install = " ".join(f'"{_requirement(name.lower(), tested)}"' for name, (_, tested) in found.items())
    facts = f"keras_distrib is tested with {tested}, and found {' and '.join(wrong)}"
    if environ.get(UNTESTED_VERSIONS_VARIABLE, "").strip() == "1":
        warnings.warn(f"{facts}; running anyway ({UNTESTED_VERSIONS_VARIABLE}=1), without the "
                      "exactness the tests check there.", stacklevel=3)
        return
    raise ImportError(f"{facts}. Install the tested versions (pip install {install}), or set "
                      f"{UNTESTED_VERSIONS_VARIABLE}=1 to run anyway, unchecked.")


check_versions(keras.__version__, tf.__version__)

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
    ("keras.src.backend.tensorflow.trainer.TFEpochIterator", "_epoch_iterator", "attribute: the pass's generator, None before one"),
    ("keras.src.backend.tensorflow.trainer.TFEpochIterator", "_enumerate_iterator",
     "method(): the pass's generator, which opens the next epoch's iterator at its end; wrapped by kd"),
    ("keras.src.backend.tensorflow.trainer.TFEpochIterator", "_steps_seen",
     "attribute: steps of the pass so far (0 when it opens an iterator)"),
    ("tensorflow.python.distribute.input_lib.DistributedDataset", "_original_dataset", "attribute: the dataset before distribution"),
    ("tensorflow.python.distribute.input_lib.DistributedDataset", "_strategy", "attribute set in __init__"),
    ("tensorflow.python.distribute.input_lib.DistributedDataset", "_options", "attribute: its tf.distribute.InputOptions"),
    ("tensorflow.python.distribute.input_lib.DistributedDataset", "_cloned_datasets",
     "attribute: each input worker's dataset, which its distributed iterators read"),
    ("tensorflow.python.distribute.input_lib.DistributedDataset", "_input_workers",
     "attribute: InputWorkers, with .worker_devices"),
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
    ("keras.src.ops.function.Function", "_operations",
     "attribute: the layers and ops of the functional graph, in order (set in __init__)"),
    ("keras.src.ops.function.Function", "_inputs_struct",
     "attribute: the functional graph's inputs, as its call takes them (set in __init__)"),
    ("keras.src.ops.function.Function", "_nodes_by_depth",
     "attribute: the functional graph's calls (nodes) by depth from its outputs (set in __init__)"),
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
    ("tensorflow.python.distribute.mirrored_strategy.MirroredExtended", "_cross_device_ops",
     "attribute: the CrossDeviceOps its all-reduces use"),
    ("tensorflow.python.distribute.cross_device_ops.CollectiveAllReduce", "_launchers",
     "attribute: one CollectiveReplicaLauncher per local device, in replica order"),
    ("tensorflow.python.distribute.cross_device_ops.CollectiveAllReduce", "_lock",
     "attribute: the lock it builds its collectives under"),
    ("tensorflow.python.distribute.cross_device_utils.CollectiveReplicaLauncher", "all_reduce",
     "method(input_tensor, control_input=None, options=None): one collective op"),
    ("tensorflow.python.distribute.distribute_utils", "regroup",
     "function(values, wrap_class): per-device values as one distributed value"),
    ("tensorflow.python.distribute.values", "Mirrored", "class"),
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
    # The first-step check's eager ops run as kernels (strategies.eager_ops_as_kernels).
    ("tensorflow.python.eager.context.Context", "_handle", "attribute: the TFE_Context"),
    ("tensorflow.python.pywrap_tfe", "TFE_ContextSetRunEagerOpAsFunction", "builtin: (context handle, enable)"),
    # Step traces drop the gradients TensorFlow registers for their all-reduces
    # (strategies.released_custom_gradients).
    ("tensorflow.python.framework.ops", "_gradient_registry", "Registry: the process-wide op gradients"),
    ("tensorflow.python.framework.registry.Registry", "_registry",
     "attribute set in __init__: {name: {'type': function, 'location': ...}}, in registration order"),
    # TensorFlow 2.20 does not export it as tf.NoneTensorSpec.
    ("tensorflow.python.framework.none_tensor", "NoneTensorSpec", "class: an absent optional input's spec"),
    # A kd model's save wraps it (trainer.saved_config).
    ("keras.src.saving.saving_lib", "serialize_keras_object", "function(obj): the model's config.json"),
)


# What the rest of kd uses, by part (imported after the version check).
from keras_distrib._keras_compat.losses import CompileLoss  # noqa: F401
from keras_distrib._keras_compat.losses import compile_loss_arguments  # noqa: F401
from keras_distrib._keras_compat.losses import compiled_loss  # noqa: F401
from keras_distrib._keras_compat.losses import compiled_loss_tracker_names  # noqa: F401
from keras_distrib._keras_compat.losses import compiled_losses  # noqa: F401
from keras_distrib._keras_compat.losses import compute_loss  # noqa: F401
from keras_distrib._keras_compat.losses import exit_summary_contexts  # noqa: F401
from keras_distrib._keras_compat.losses import loss_tracker  # noqa: F401
from keras_distrib._keras_compat.losses import mean_variables  # noqa: F401
from keras_distrib._keras_compat.losses import replace_compile_losses  # noqa: F401
from keras_distrib._keras_compat.losses import replace_mean_update  # noqa: F401
from keras_distrib._keras_compat.losses import replace_metric_result  # noqa: F401
from keras_distrib._keras_compat.losses import replace_metric_update  # noqa: F401
from keras_distrib._keras_compat.losses import set_compiled_loss  # noqa: F401
from keras_distrib._keras_compat.losses import set_loss_tracker  # noqa: F401
from keras_distrib._keras_compat.losses import squeeze_or_expand_to_same_rank  # noqa: F401
from keras_distrib._keras_compat.losses import sync_on_read_aggregation  # noqa: F401
from keras_distrib._keras_compat.losses import unscale_for_tracker  # noqa: F401
from keras_distrib._keras_compat.replacements import REPLACEMENTS  # noqa: F401
from keras_distrib._keras_compat.replacements import install_for_process  # noqa: F401
from keras_distrib._keras_compat.replacements import installed_for_process  # noqa: F401
from keras_distrib._keras_compat.replacements import replace_loss_object_call  # noqa: F401
from keras_distrib._keras_compat.replacements import replace_tape_gradient  # noqa: F401
from keras_distrib._keras_compat.trainer import Functional  # noqa: F401
from keras_distrib._keras_compat.trainer import ModelHooks  # noqa: F401
from keras_distrib._keras_compat.trainer import assert_compiled  # noqa: F401
from keras_distrib._keras_compat.trainer import call_has_training_arg  # noqa: F401
from keras_distrib._keras_compat.trainer import compile_metric_log_keys  # noqa: F401
from keras_distrib._keras_compat.trainer import compile_metric_names  # noqa: F401
from keras_distrib._keras_compat.trainer import created_strategy  # noqa: F401
from keras_distrib._keras_compat.trainer import flatten_metrics_in_order  # noqa: F401
from keras_distrib._keras_compat.trainer import functional_init  # noqa: F401
from keras_distrib._keras_compat.trainer import functional_init_arguments  # noqa: F401
from keras_distrib._keras_compat.trainer import has_own_operations  # noqa: F401
from keras_distrib._keras_compat.trainer import initial_epoch  # noqa: F401
from keras_distrib._keras_compat.trainer import make_functional  # noqa: F401
from keras_distrib._keras_compat.trainer import saved_config  # noqa: F401
from keras_distrib._keras_compat.trainer import saving_hook_found  # noqa: F401
from keras_distrib._keras_compat.trainer import set_initial_epoch  # noqa: F401
from keras_distrib._keras_compat.trainer import symbolic_build  # noqa: F401
from keras_distrib._keras_compat.data import agrees_on_batches  # noqa: F401
from keras_distrib._keras_compat.data import autoconvert_optionals  # noqa: F401
from keras_distrib._keras_compat.data import batches_from_arrays  # noqa: F401
from keras_distrib._keras_compat.data import concat_predictions  # noqa: F401
from keras_distrib._keras_compat.data import concat_replicas  # noqa: F401
from keras_distrib._keras_compat.data import concrete_functions  # noqa: F401
from keras_distrib._keras_compat.data import data_batch_size  # noqa: F401
from keras_distrib._keras_compat.data import dataset_element_spec  # noqa: F401
from keras_distrib._keras_compat.data import draw_order  # noqa: F401
from keras_distrib._keras_compat.data import end_pass  # noqa: F401
from keras_distrib._keras_compat.data import epoch_distributed_dataset  # noqa: F401
from keras_distrib._keras_compat.data import epoch_iterator  # noqa: F401
from keras_distrib._keras_compat.data import in_symbolic_scope  # noqa: F401
from keras_distrib._keras_compat.data import is_absent_input_spec  # noqa: F401
from keras_distrib._keras_compat.data import max_epochs  # noqa: F401
from keras_distrib._keras_compat.data import next_epoch_over  # noqa: F401
from keras_distrib._keras_compat.data import per_replica_specs  # noqa: F401
from keras_distrib._keras_compat.data import pipeline_batch_size  # noqa: F401
from keras_distrib._keras_compat.data import pythonify_logs  # noqa: F401
from keras_distrib._keras_compat.data import reads_data_service  # noqa: F401
from keras_distrib._keras_compat.data import redistributed  # noqa: F401
from keras_distrib._keras_compat.data import serialized_graph  # noqa: F401
from keras_distrib._keras_compat.data import set_epoch_batches  # noqa: F401
from keras_distrib._keras_compat.data import skip_batch_agreement  # noqa: F401
from keras_distrib._keras_compat.data import train_validation_split  # noqa: F401
from keras_distrib._keras_compat.strategies import PYTHON_OPS  # noqa: F401
from keras_distrib._keras_compat.strategies import KeyExists  # noqa: F401
from keras_distrib._keras_compat.strategies import KeyMissing  # noqa: F401
from keras_distrib._keras_compat.strategies import collective_key_base  # noqa: F401
from keras_distrib._keras_compat.strategies import cpu_replicas_per_worker  # noqa: F401
from keras_distrib._keras_compat.strategies import dataset_calls_python  # noqa: F401
from keras_distrib._keras_compat.strategies import dataset_ops_used  # noqa: F401
from keras_distrib._keras_compat.strategies import default_strategy  # noqa: F401
from keras_distrib._keras_compat.strategies import eager_ops_as_kernels  # noqa: F401
from keras_distrib._keras_compat.strategies import released_custom_gradients  # noqa: F401
from keras_distrib._keras_compat.strategies import in_xla_context  # noqa: F401
from keras_distrib._keras_compat.strategies import is_multi_worker  # noqa: F401
from keras_distrib._keras_compat.strategies import isolated_mirrored_strategy  # noqa: F401
from keras_distrib._keras_compat.strategies import iterators_before_epoch  # noqa: F401
from keras_distrib._keras_compat.strategies import key_value_delete  # noqa: F401
from keras_distrib._keras_compat.strategies import key_value_get  # noqa: F401
from keras_distrib._keras_compat.strategies import key_value_insert  # noqa: F401
from keras_distrib._keras_compat.strategies import optimizer_strategy  # noqa: F401
from keras_distrib._keras_compat.strategies import parameter_server_workers  # noqa: F401
from keras_distrib._keras_compat.strategies import per_worker_iterator  # noqa: F401
from keras_distrib._keras_compat.strategies import pulls_from_in_graph_iterator  # noqa: F401
from keras_distrib._keras_compat.strategies import reshuffles_each_iteration  # noqa: F401
from keras_distrib._keras_compat.strategies import sum_in_merge  # noqa: F401
from keras_distrib._keras_compat.variables import fix_variables  # noqa: F401
from keras_distrib._keras_compat.variables import model_variables  # noqa: F401
from keras_distrib._keras_compat.variables import optimizer_variables  # noqa: F401
from keras_distrib._keras_compat.variables import variable_copies  # noqa: F401
from keras_distrib._keras_compat.variables import replace_seed_next  # noqa: F401
from keras_distrib._keras_compat.variables import weight_partitions  # noqa: F401
from keras_distrib._keras_compat.variables import write_from_first_replica  # noqa: F401
from keras_distrib._keras_compat.variables import write_seed_state_from_last_replica  # noqa: F401
from keras_distrib._keras_compat.optimizer import apply_reduced  # noqa: F401
from keras_distrib._keras_compat.optimizer import base_optimizer  # noqa: F401
from keras_distrib._keras_compat.optimizer import has_gradient_pipeline  # noqa: F401
from keras_distrib._keras_compat.optimizer import install_gradient_pipeline  # noqa: F401
from keras_distrib._keras_compat.optimizer import replace_reduced_apply  # noqa: F401
from keras_distrib._keras_compat.optimizer import updated_variables  # noqa: F401
from keras_distrib._keras_compat.layers import flatten_layers  # noqa: F401
from keras_distrib._keras_compat.layers import get_keras_mask  # noqa: F401
from keras_distrib._keras_compat.layers import graph_calls  # noqa: F401
from keras_distrib._keras_compat.layers import is_sync_batch_norm  # noqa: F401
from keras_distrib._keras_compat.layers import keep_keras_logits  # noqa: F401
from keras_distrib._keras_compat.layers import owned_seed_generators  # noqa: F401
from keras_distrib._keras_compat.layers import record_add_loss  # noqa: F401
from keras_distrib._keras_compat.layers import replace_batch_norm_moments  # noqa: F401
from keras_distrib._keras_compat.layers import replace_call  # noqa: F401
from keras_distrib._keras_compat.layers import replace_variable_updates  # noqa: F401
from keras_distrib._keras_compat.layers import set_keras_mask  # noqa: F401
from keras_distrib._keras_compat.summaries import write_model_config  # noqa: F401
