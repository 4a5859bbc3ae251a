"""tf.distribute strategy internals: multi-worker, parameter servers, collectives, the coordination service, eager dispatch.

Part of `keras_distrib._keras_compat`: only these modules touch `keras.src`,
`tensorflow.python` or private attributes of Keras/TensorFlow objects.
"""

import contextlib
import threading

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.distribute import collective_all_reduce_strategy
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import values as distribute_values
from tensorflow.python.distribute import input_lib
from tensorflow.python.distribute.coordinator import values as coordinator_values
from tensorflow.python.eager import context as tf_context
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import control_flow_util

from keras_distrib._keras_compat.data import dataset_sources
from keras_distrib._keras_compat.data import epoch_iterator
from keras_distrib._keras_compat.data import serialized_graph

__all__ = [
    "KeyExists",
    "KeyMissing",
    "PYTHON_OPS",
    "collective_key_base",
    "cpu_replicas_per_worker",
    "custom_gradients",
    "dataset_calls_python",
    "dataset_ops_used",
    "default_strategy",
    "eager_ops_as_kernels",
    "in_xla_context",
    "is_all_reduce",
    "is_multi_worker",
    "isolated_mirrored_strategy",
    "iterators_before_epoch",
    "key_value_delete",
    "key_value_get",
    "key_value_insert",
    "optimizer_strategy",
    "parameter_server_workers",
    "per_worker_iterator",
    "pulls_from_in_graph_iterator",
    "released_custom_gradients",
    "reshuffles_each_iteration",
    "sum_in_merge",
]


def in_xla_context():
    """Whether the graph being built is compiled by XLA (`jit_compile=True`)."""
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


# The op types through which a tf.data graph calls back into this Python
# process (tf.py_function, tf.numpy_function, Dataset.from_generator).
PYTHON_OPS = frozenset(("PyFunc", "PyFuncStateless", "EagerPyFunc", "GeneratorDataset"))

# The ops a distributed iterator opened inside a `tf.function` adds to its graph
# (`iter(distributed_dataset)` there: TensorFlow's multi-device iterator), and
# those that pull a batch from it.
_MULTI_DEVICE_ITERATOR_OPS = frozenset(("AnonymousMultiDeviceIterator", "AnonymousMultiDeviceIteratorV3",
                                        "MultiDeviceIterator", "MultiDeviceIteratorInit"))
_GET_NEXT_OPS = frozenset(("IteratorGetNext", "IteratorGetNextAsOptional", "IteratorGetNextSync"))


def pulls_from_in_graph_iterator():
    """Whether the graph being built takes its batch by `next()` on an iterator opened in-graph.

    True for a `tf.function` that calls `iter()` on a distributed dataset of
    several local devices and `next()` on it, unrolled or in a `tf.range`
    loop (the shapes that block TensorFlow's inter-op pool: see
    `kd.cluster.devices.inter_op_threads_needed`). False for AutoGraph's
    `for batch in distributed_dataset:` (its loop body takes no `next()`
    before the step: the batch comes in through the loop) and for an
    iterator opened in Python.
    """
    graph = tf.compat.v1.get_default_graph()
    in_loop = False
    while graph is not None:
        types = {op.type for op in graph.get_operations()}
        if types & _MULTI_DEVICE_ITERATOR_OPS:
            return not in_loop
        if types & _GET_NEXT_OPS:
            return True  # `next()` inside the loop body (or a nested function): not a for-in
        if type(graph).__name__ == "WhileBodyFuncGraph":
            in_loop = True
        graph = getattr(graph, "outer_graph", None)
    return False


def is_multi_worker(strategy):
    """Whether the strategy runs in multi-worker mode (several processes)."""
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
    return any(getattr(current, "_reshuffle_each_iteration", False) is True for current in dataset_sources(dataset))


def dataset_calls_python(dataset, op_types):
    """Whether a dataset's functions (map, flat_map, from_generator's) use any of `op_types`.

    Walks the dataset's inputs and the graphs of their functions, without
    serializing the dataset (which would copy every constant it holds, e.g.
    the arrays of `from_tensor_slices`).
    """
    for current in dataset_sources(dataset):
        for wrapper in current._functions():
            graphs = [wrapper.function.graph]
            while graphs:
                graph = graphs.pop()
                if any(op.type in op_types for op in graph.get_operations()):
                    return True
                graphs.extend(f.graph for f in graph._functions.values() if hasattr(f, "graph"))
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


@tf.autograph.experimental.do_not_convert  # merge_call would convert it in a user's loop
def sum_in_merge(strategy, per_replica):
    """The sum of a dense `per_replica` value, in a `merge_call`'s function (each replica gets its own).

    Where the strategy reduces with collective ops (in-process mirrored on
    CPUs, kd's default, and multi-worker), one collective op per replica,
    built by each device's own launcher, in replica order, as TensorFlow's
    `CollectiveAllReduce` builds them in the same place (`merge_call`, on
    one thread) but without packing one tensor into a buffer (reshape,
    shape, concat, split, reshape again per replica and call: about 40% of
    a BatchNormalization's statistics traced at the first step). The
    collectives keep TensorFlow's order: the same launchers, their instance
    keys and ordering tokens, built where TensorFlow builds its own.
    Elsewhere (another cross-device reduction, a value not on the
    launchers' devices): `batch_reduce_to`, as `ReplicaContext.all_reduce`.
    """
    values = strategy.experimental_local_results(per_replica)
    ops = getattr(strategy.extended, "_cross_device_ops", None)
    launchers = getattr(ops, "_launchers", None)
    if (isinstance(ops, cross_device_ops_lib.CollectiveAllReduce) and launchers is not None
            and len(launchers) == len(values) and values[0].dtype.is_floating
            and not isinstance(values[0], tf.IndexedSlices)):
        with ops._lock:
            sums = tuple(launcher.all_reduce(value) for launcher, value in zip(launchers, values))
        return distribute_utils.regroup(sums, wrap_class=distribute_values.Mirrored)
    return strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, [(per_replica, per_replica)])[0]


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


_kernels_lock = threading.Lock()
_kernels_depth = 0


@contextlib.contextmanager
def eager_ops_as_kernels():
    """Within it, an eager op runs its kernel, not a function of that one op.

    TensorFlow runs every eager op as a function holding only that op
    (`run_eager_op_as_function`, always on). The first run of each op
    signature then instantiates a function: 2 to 5 ms of CPU on a 2-core
    machine, where the kernel alone takes 0.1 to 0.8 ms. Ops compute the
    same values either way. The switch belongs to the eager context, so it
    holds for every thread while it is on. kd uses it around the first-step
    check, whose one-device step runs a few dozen op signatures once while
    the training thread waits. Nested uses turn the wrapping back on when
    the outermost one ends. `tests/test_keras_compat.py` checks that no
    function is made inside it and that one is made outside it.
    """
    global _kernels_depth
    handle = tf_context.context()._handle
    with _kernels_lock:
        _kernels_depth += 1
        if _kernels_depth == 1:
            pywrap_tfe.TFE_ContextSetRunEagerOpAsFunction(handle, False)
    try:
        yield
    finally:
        with _kernels_lock:
            _kernels_depth -= 1
            if _kernels_depth == 0:
                pywrap_tfe.TFE_ContextSetRunEagerOpAsFunction(handle, True)


def _custom_gradient_owner(registered):
    """`(module, qualified name)` of the function a `tf.custom_gradient`'s registered gradient calls.

    In graph mode `tf.custom_gradient` registers `internal_grad_fn`, which
    calls `tape_grad_fn`, which calls the user's `grad_fn`. None for any
    other registered function.
    """
    function = registered
    for name in ("tape_grad_fn", "grad_fn"):
        code = getattr(function, "__code__", None)
        if code is None or name not in code.co_freevars:
            return None
        function = function.__closure__[code.co_freevars.index(name)].cell_contents
    return getattr(function, "__module__", None) or "", getattr(function, "__qualname__", "")


def custom_gradients(names=None):
    """`{name: (module, qualified name)}` of the `tf.custom_gradient`s in TensorFlow's gradient
    registry, among `names` (default: every entry): whose `grad_fn` each one calls."""
    registry = tf_ops._gradient_registry._registry
    found = {}
    for name in list(registry) if names is None else names:
        if name.startswith("CustomGradient-"):
            owner = _custom_gradient_owner(registry[name]["type"])
            if owner is not None:
                found[name] = owner
    return found


def is_all_reduce(owner):
    """Whether a `custom_gradients` owner is the gradient `ReplicaContext.all_reduce` traces."""
    module, name = owner
    return (module == "tensorflow.python.distribute.distribute_lib"
            and name.startswith("ReplicaContextBase.all_reduce."))


def _released(owner):
    return owner[0].startswith("keras_distrib.") or is_all_reduce(owner)


@contextlib.contextmanager
def released_custom_gradients():
    """Drops, at its end, the gradients that traces inside it registered for TF's all-reduce and kd.

    In graph mode `tf.custom_gradient` registers its gradient function in
    TensorFlow's process-wide gradient registry under a new name, and nothing
    ever removes it. `ReplicaContext.all_reduce` wraps every collective it
    traces in one, and the function holds the traced tensors: each step
    function traced under a strategy (its graph, tens of thousands of
    Python objects) then lives as long as the process, plain Keras's too,
    and every full garbage collection walks it again. A step function's
    gradients are built while it is traced (the tape records the same
    functions), and nothing differentiates a compiled step afterwards, so
    kd drops the entries its step traces made, for TensorFlow's all-reduce
    and kd's own custom gradients only. A user's `tf.custom_gradient` is
    kept. Cheap where nothing was traced: two lengths compared.
    `tests/test_keras_compat.py` checks what is dropped and what is kept.
    """
    registry = tf_ops._gradient_registry._registry
    count = len(registry)
    try:
        yield
    finally:
        if len(registry) > count:
            for name, owner in custom_gradients(list(registry)[count:]).items():
                if _released(owner):
                    registry.pop(name, None)
