"""`make_strategy`: one factory for every `tf.distribute` strategy we support.

Each kind validates its options up front and fails with a message that says
what hardware or configuration is missing, instead of TensorFlow's deep
stack traces (NCCL without GPUs, a TPU that is not there, a multi-worker
strategy without TF_CONFIG).
"""

import dataclasses
import os
import socket
import weakref

import tensorflow as tf

from keras_distrib import _keras_compat
from keras_distrib.cluster import info as cluster_lib
from keras_distrib import tf_logs
from keras_distrib import validation

__all__ = [
    "StrategyTraits",
    "check_collective_keys",
    "check_devices",
    "gpu_share",
    "make_strategy",
    "resolve_auto_kind",
    "traits",
]

KINDS = (
    "auto",
    "default",
    "one_device",
    "mirrored",
    "central_storage",
    "multi_worker",
    "parameter_server",
    "tpu",
)
CROSS_DEVICE_OPS = ("auto", "nccl", "hierarchical_copy", "reduce_to_one_device")
COMMUNICATIONS = ("auto", "ring", "nccl")

# Which options each kind accepts besides devices/communication/resolver.
_KIND_OPTIONS = {
    "auto": {"cross_device_ops", "num_packs", "tpu", "variable_partitioner"},
    "default": set(),
    "one_device": set(),
    "mirrored": {"cross_device_ops", "num_packs"},
    "central_storage": {"parameter_device"},
    "multi_worker": set(),
    "parameter_server": {"variable_partitioner"},
    "tpu": {"tpu"},
}


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(
            f"`{name}`={value!r} is not supported. Expected one of "
            f"{list(choices)}."
        )


def _local_devices(device_type):
    with tf_logs.hidden_notices():  # the first device query starts CUDA (see tf_logs)
        return [d.name for d in tf.config.list_logical_devices(device_type)]


def _canonical(device):
    """`(job, device_type, index)` of a device string or LogicalDevice; raises ValueError."""
    name = device.name if isinstance(device, tf.config.LogicalDevice) else device
    if not isinstance(name, str) or not name.strip():
        raise ValueError("not a device name")
    spec = tf.DeviceSpec.from_string(name)
    if spec.device_type is None:
        raise ValueError("names no device type (e.g. '/gpu:0' or '/cpu:0')")
    return spec.job, spec.device_type.upper(), spec.device_index


def check_devices(devices, argument="devices"):
    """Returns `devices` as a list of names, or raises naming every bad one.

    A device that does not exist would otherwise be accepted by TensorFlow,
    and the first training step would hang waiting for it. Devices of other
    jobs (`/job:worker/...`) cannot be checked here and are passed through.

    Raises:
        ValueError: `devices` is not a list, or lists devices that are
            malformed, repeated or absent (with the available ones).
    """
    if devices is None:
        return None
    if isinstance(devices, (str, tf.config.LogicalDevice)):
        shown = devices.name if isinstance(devices, tf.config.LogicalDevice) else devices
        raise ValueError(
            f"`{argument}`={devices!r} is a single device; pass a list, e.g. "
            f"`{argument}`=[{shown!r}]."
        )
    if not isinstance(devices, (list, tuple)) or not devices:
        raise ValueError(
            f"`{argument}`={devices!r}: expected a non-empty list of device names such as "
            "['/gpu:0', '/gpu:1'], or None for every local device."
        )
    names = [d.name if isinstance(d, tf.config.LogicalDevice) else d for d in devices]
    malformed, missing, seen, repeated = [], [], {}, []
    available = {}
    for name, device in zip(names, devices):
        try:
            job, device_type, index = _canonical(device)
        except (ValueError, TypeError) as error:
            malformed.append(f"{name!r} ({error})")
            continue
        key = (job or "localhost", device_type, index or 0)
        if key in seen:
            repeated.append(name)
        seen[key] = name
        if job not in (None, "localhost"):
            continue
        if device_type not in available:
            available[device_type] = {
                tf.DeviceSpec.from_string(d.name).device_index
                for d in tf.config.list_logical_devices(device_type)
            }
        if (index or 0) not in available[device_type]:
            missing.append(name)
    problems = []
    if malformed:
        problems.append(f"malformed device name(s) {', '.join(malformed)}")
    if repeated:
        problems.append(f"device(s) {repeated} listed more than once (each replica needs its own)")
    if missing:
        local = [d.name for d in tf.config.list_logical_devices()]
        problems.append(
            f"no such device(s) {missing} on this machine; available: {local}. Use "
            "kd.virtual_devices(n) (first thing in the process) for several CPU replicas, "
            f"or leave `{argument}` None to use every local device"
        )
    if problems:
        raise ValueError(f"`{argument}`={names!r}: " + "; ".join(problems) + ".")
    return names


def _gpu_required(what):
    if not tf.config.list_physical_devices("GPU"):
        raise ValueError(
            f"{what} needs GPUs, and this machine has none. On CPU use "
            "cross_device_ops='reduce_to_one_device' (or 'auto'), and "
            "communication='ring' (or 'auto')."
        )


def _cross_device_ops(choice, devices, num_packs):
    if not isinstance(choice, str):
        if isinstance(choice, tf.distribute.CrossDeviceOps):
            return choice
        raise ValueError(
            f"`cross_device_ops`={choice!r} must be one of "
            f"{list(CROSS_DEVICE_OPS)} or a tf.distribute.CrossDeviceOps."
        )
    _check_choice("cross_device_ops", choice, CROSS_DEVICE_OPS)
    if choice == "auto":
        return None
    if choice == "nccl":
        _gpu_required("`cross_device_ops`='nccl'")
        return tf.distribute.NcclAllReduce(num_packs=num_packs)
    if choice == "hierarchical_copy":
        _gpu_required("`cross_device_ops`='hierarchical_copy'")
        return tf.distribute.HierarchicalCopyAllReduce(num_packs=num_packs)
    reduce_to = devices[0] if devices else "/device:CPU:0"
    return tf.distribute.ReductionToOneDevice(reduce_to_device=reduce_to)


def _communication_options(communication):
    if isinstance(communication, tf.distribute.experimental.CommunicationOptions):
        return communication
    _check_choice("communication", communication, COMMUNICATIONS)
    if communication == "nccl":
        _gpu_required("`communication`='nccl'")
    implementation = tf.distribute.experimental.CommunicationImplementation[
        communication.upper()
    ]
    return tf.distribute.experimental.CommunicationOptions(
        implementation=implementation
    )


# The variables that tell TensorFlow's TPU resolver where a TPU is.
_TPU_VARIABLES = ("TPU_NAME", "COLAB_TPU_ADDR", "TPU_WORKER_HOSTNAMES")
# Seconds a TPU worker's address gets to accept a connection: TensorFlow
# itself waits for ever on an address that does not answer.
TPU_CONNECT_TIMEOUT = 20.0


def _tpu_present():
    # Physical devices: listing logical ones would initialize TensorFlow's
    # context, after which a multi-worker strategy can no longer be created.
    if tf.config.list_physical_devices("TPU"):
        return True
    return any(os.environ.get(v) for v in _TPU_VARIABLES)


def gpu_share(gpus, local_index, local_tasks):
    """Which of a node's `gpus` visible GPUs one of its `local_tasks` tasks uses.

    Slurm tasks that share a node see all of its GPUs unless Slurm binds
    them (`--gpus-per-task`); each task then takes its own contiguous share,
    as TensorFlow's SlurmClusterResolver does. Returns the GPU indices, or
    None to keep every visible GPU (one task on the node, no GPU, or fewer
    GPUs than tasks: Slurm already gave each task its own).

    Examples:
        >>> gpu_share(8, local_index=1, local_tasks=4)
        [2, 3]
    """
    if local_tasks <= 1 or gpus < local_tasks:
        return None
    share = gpus // local_tasks
    return list(range(local_index * share, (local_index + 1) * share))


def _claim_gpu_share(info):
    """Makes a Slurm task that shares its node use only its share of the GPUs."""
    if info.source != "slurm" or info.local_tasks <= 1 or os.environ.get("SLURM_GPUS_PER_TASK"):
        return
    gpus = tf.config.list_physical_devices("GPU")
    share = gpu_share(len(gpus), info.local_index, info.local_tasks)
    if share is None:
        return
    try:
        tf.config.set_visible_devices([gpus[i] for i in share], "GPU")
    except RuntimeError as error:
        raise ValueError(
            f"This Slurm task ({info.label}, task {info.local_index} of {info.local_tasks} on "
            f"its node) must use GPUs {share} of the node's {len(gpus)}, but TensorFlow has "
            f"already initialized every GPU ({error}). Call kd.make_strategy before anything "
            "else touches TensorFlow's devices, or bind GPUs with `srun --gpus-per-task`."
        ) from None


def _configured_cpu_count():
    """Logical CPU devices set up by `virtual_devices`, without initializing TF."""
    with tf_logs.hidden_notices():
        physical = tf.config.list_physical_devices("CPU")
    config = tf.config.get_logical_device_configuration(physical[0]) if physical else None
    return len(config) if config else 1


def resolve_auto_kind(cluster_resolver=None):
    """The kind `"auto"` picks here, in the contract's order.

    The cluster is `kd.cluster_info()`'s: TF_CONFIG, Slurm, Kubernetes or a
    TPU pod, so the same script picks the right strategy everywhere.
    """
    if _tpu_present():
        return "tpu"
    info = cluster_lib.cluster_info()
    if info.task_type == "evaluator":
        # An evaluator is outside the training cluster: it uses its own devices.
        if len(tf.config.list_physical_devices("GPU")) > 1 or _configured_cpu_count() > 1:
            return "mirrored"
        return "one_device"
    if cluster_resolver is not None:
        spec = cluster_resolver.cluster_spec().as_dict()
        if spec.get("ps"):
            return "parameter_server"
        if sum(len(spec.get(t, ())) for t in ("chief", "worker")) > 1:
            return "multi_worker"
    if info.num_ps:
        return "parameter_server"
    if info.num_workers > 1:
        return "multi_worker"
    if len(_local_devices("GPU")) > 1 or len(_local_devices("CPU")) > 1:
        return "mirrored"
    return "one_device"


def _tpu_source(tpu):
    """What made kd look for a TPU, for an error: the `tpu` argument or the variables set."""
    if tpu is not None:
        return f"`tpu`={tpu!r}", "Pass `tpu=` the name or grpc:// address of a TPU this VM can reach."
    named = [v for v in _TPU_VARIABLES if os.environ.get(v)]
    if not named:
        return "the local TPU", "Check the TPU runtime on this VM (`tf.config.list_physical_devices('TPU')`)."
    shown = ", ".join(f"{v}={os.environ[v]!r}" for v in named)
    unset = " ".join(named)
    return (f"{shown} in the environment",
            f"On a machine without a TPU, unset it (`unset {unset}`), and kd uses CPUs or GPUs; on a "
            "Cloud TPU VM, set TPU_NAME to the TPU's name (or pass `tpu=` its name or grpc:// "
            "address) and check that this VM can reach it.")


def _tpu_error(tpu, what, error):
    source, fix = _tpu_source(tpu)
    lines = str(error).strip().splitlines()
    cause = type(error).__name__ + (f": {lines[0]}" if lines else "")
    return ValueError(f"kd looked for a TPU because of {source}, but {what} ({cause}). {fix}")


def _unreachable_tpu_worker(cluster_resolver):
    """(address, error) of the first TPU worker that does not accept a connection, or None."""
    try:
        workers = cluster_resolver.cluster_spec().as_dict().get("worker", [])
    except Exception:  # no spec to probe (a local TPU): TensorFlow connects itself
        return None
    for address in workers if isinstance(workers, list) else workers.values():
        host, _, port = str(address).rpartition(":")
        if not host or not port.isdigit():
            continue
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=TPU_CONNECT_TIMEOUT).close()
        except OSError as error:
            return address, error
    return None


def _make_tpu(tpu, cluster_resolver):
    if cluster_resolver is None:
        if not _tpu_present() and tpu is None:
            raise ValueError(
                "`kind`='tpu' but no TPU was found: no local TPU devices and "
                "neither TPU_NAME nor COLAB_TPU_ADDR is set. Pass "
                "`tpu='name-or-grpc-address'` (or a cluster_resolver) on a "
                "TPU host, or use kind='auto' to fall back to CPU/GPU."
            )
        try:
            cluster_resolver = tf.distribute.cluster_resolver.TPUClusterResolver(
                tpu=tpu or ""
            )
        except Exception as error:  # a URLError, an HTTP error, a ValueError: any means no TPU
            raise _tpu_error(tpu, "TensorFlow could not resolve it", error) from error
    unreachable = _unreachable_tpu_worker(cluster_resolver)
    if unreachable is not None:
        address, error = unreachable
        raise _tpu_error(tpu, f"its worker {address} does not accept a connection "
                              f"within {TPU_CONNECT_TIMEOUT:g} s", error) from error
    try:
        tf.config.experimental_connect_to_cluster(cluster_resolver)
        tf.tpu.experimental.initialize_tpu_system(cluster_resolver)
    except (tf.errors.OpError, ValueError, RuntimeError) as error:
        raise _tpu_error(tpu, "TensorFlow could not start the TPU system there", error) from error
    return tf.distribute.TPUStrategy(cluster_resolver)


def _make_parameter_server(cluster_resolver, variable_partitioner):
    if cluster_resolver is None:
        info = cluster_lib.cluster_info()
        if not info.num_ps:
            raise ValueError(
                "`kind`='parameter_server' needs a cluster with 'ps' tasks: "
                "set TF_CONFIG (e.g. with `keras-distrib launch --ps 1`), "
                "KD_PS under Slurm or Kubernetes, pass a cluster_resolver, or "
                "use kd.local_cluster()."
            )
        _claim_gpu_share(info)
        cluster_resolver = (cluster_lib.cluster_resolver(info)
                            or tf.distribute.cluster_resolver.TFConfigClusterResolver())
    return tf.distribute.experimental.ParameterServerStrategy(
        cluster_resolver, variable_partitioner=variable_partitioner
    )


def _server_error(error, cluster_resolver):
    """TensorFlow's bare `Could not start gRPC server`, with the address that is taken."""
    if "Could not start gRPC server" not in str(error):
        return error
    try:
        if cluster_resolver is not None:
            spec = cluster_resolver.cluster_spec().as_dict()
            task_type, index = cluster_resolver.task_type, int(cluster_resolver.task_id)
        else:  # TensorFlow read TF_CONFIG itself
            info = cluster_lib.cluster_info()
            spec, task_type, index = info.cluster, info.task_type, info.task_index
        label, own = f"{task_type} {index}", spec[task_type][index]
    except (KeyError, IndexError, TypeError, ValueError, AttributeError,
            cluster_lib.ClusterConfigError):
        label, own = "this task", "its address in TF_CONFIG"
    return cluster_lib.ClusterConfigError(
        f"This task ({label}) could not listen on {own}: the port is taken (another job or "
        "process listens there; `ss -ltnp`), or the address is not this machine's. Under Slurm "
        "unset KD_PORT (kd then derives the ports from the job) or choose another; elsewhere "
        "give a free port in TF_CONFIG."
    )


def make_strategy(
    kind="auto",
    *,
    devices=None,
    communication="auto",
    cluster_resolver=None,
    **options,
):
    """Creates a `tf.distribute.Strategy` of the given kind.

    `"auto"` picks a TPU if one is found, multi-worker if the cluster
    (`kd.cluster_info()`: TF_CONFIG, Slurm, Kubernetes) has several workers,
    parameter-server if it has `ps` tasks, mirrored if several GPUs (or
    virtual devices) exist, and one-device otherwise.

    Each `"mirrored"` strategy has collective keys of its own, so a process
    (a notebook) may make several; a kd model under a second plain
    `tf.distribute.MirroredStrategy()`, whose collectives would collide with
    the first one's, stops before its first step with an error saying to
    reuse the first (Keras 3 aborts in a collective with a shape mismatch).

    Args:
        kind: One of `"auto"`, `"default"`, `"one_device"`, `"mirrored"`,
            `"central_storage"`, `"multi_worker"`, `"parameter_server"`,
            `"tpu"`.
        devices: Devices to replicate on (mirrored, central storage,
            one-device: the single device). All local ones when `None`.
        communication: Multi-worker collectives: `"auto"`, `"ring"`,
            `"nccl"` or a `tf.distribute.experimental.CommunicationOptions`.
        cluster_resolver: A `tf.distribute.cluster_resolver.ClusterResolver`
            for multi-worker, parameter-server or TPU strategies; the
            cluster `kd.cluster_info()` finds when `None`.
        **options: Per kind: `cross_device_ops` (`"auto"`, `"nccl"`,
            `"hierarchical_copy"`, `"reduce_to_one_device"` or an instance)
            and `num_packs` for mirrored; `parameter_device` for central
            storage; `variable_partitioner` for parameter server; `tpu` (name
            or address) for TPU.

    Returns:
        A `tf.distribute.Strategy`.

    Raises:
        ValueError: unknown kind or option, or hardware the kind needs is
            missing.

    Examples:
        >>> import keras_distrib as kd
        >>> kd.make_strategy("one_device").num_replicas_in_sync
        1
    """
    if kind not in KINDS:
        raise ValueError(
            f"`kind`={kind!r} is not a strategy kind. Expected one of "
            f"{list(KINDS)}."
        )
    unknown = sorted(set(options) - _KIND_OPTIONS[kind])
    if unknown:
        raise ValueError(
            f"Option(s) {unknown} are not accepted by `kind`={kind!r}. "
            f"Accepted: {sorted(_KIND_OPTIONS[kind]) or 'none'}."
        )
    num_packs = options.get("num_packs", 1)
    if not validation.is_whole(num_packs, 1):
        raise ValueError(f"`num_packs`={num_packs!r} must be a whole number >= 1.")
    if kind not in ("multi_worker", "parameter_server", "tpu"):
        devices = check_devices(devices)
        if options.get("parameter_device") is not None:
            check_devices([options["parameter_device"]], "parameter_device")
    if kind == "auto":
        kind = resolve_auto_kind(cluster_resolver)
        options = {k: v for k, v in options.items() if k in _KIND_OPTIONS[kind]}

    if kind == "default":
        return tf.distribute.get_strategy()
    if kind == "one_device":
        if devices and len(devices) != 1:
            raise ValueError(
                f"`devices`={devices!r}: kind='one_device' takes exactly one "
                "device. Use kind='mirrored' for several."
            )
        device = devices[0] if devices else (
            (_local_devices("GPU") or _local_devices("CPU"))[0]
        )
        return tf.distribute.OneDeviceStrategy(device)
    if kind == "mirrored":
        cross_ops = _cross_device_ops(
            options.get("cross_device_ops", "auto"),
            devices,
            options.get("num_packs", 1),
        )
        if devices is None and not _local_devices("GPU"):
            devices = _local_devices("CPU")
        # Collective keys of its own: a second strategy in this process (a
        # notebook cell run again) must not meet the first one's collectives.
        return _keras_compat.isolated_mirrored_strategy(devices, cross_ops)
    if kind == "central_storage":
        if devices is None and not _local_devices("GPU"):
            devices = _local_devices("CPU")
        return tf.distribute.experimental.CentralStorageStrategy(
            compute_devices=devices,
            parameter_device=options.get("parameter_device"),
        )
    if kind == "multi_worker":
        if cluster_resolver is None:
            # Validates the cluster with a clear error; TF reads TF_CONFIG itself.
            info = cluster_lib.cluster_info()
            _claim_gpu_share(info)
            cluster_resolver = cluster_lib.cluster_resolver(info)
        if devices:
            raise ValueError(
                f"`devices`={devices!r}: kind='multi_worker' uses every local GPU, "
                "or every virtual CPU device (kd.virtual_devices); it takes no list."
            )
        with _keras_compat.cpu_replicas_per_worker(_configured_cpu_count()):
            try:
                return tf.distribute.MultiWorkerMirroredStrategy(
                    cluster_resolver=cluster_resolver,
                    communication_options=_communication_options(communication),
                )
            except tf.errors.UnknownError as error:
                raise _server_error(error, cluster_resolver) from error
    if kind == "parameter_server":
        return _make_parameter_server(
            cluster_resolver, options.get("variable_partitioner")
        )
    return _make_tpu(options.get("tpu"), cluster_resolver)


# The first MirroredStrategy whose collectives ran, for each key base.
_COLLECTIVE_OWNERS = {}


def check_collective_keys(strategy):
    """Refuses a second `tf.distribute.MirroredStrategy` that would reuse the first one's keys.

    TensorFlow caches each collective by its keys for the life of the
    process, and every `tf.distribute.MirroredStrategy` numbers its
    collectives from the same start: once one strategy's steps ran, another
    one's first all-reduce meets the cached shapes and aborts ("Shape
    mismatch in the collective instance"), and so does every collective
    after it, plain Keras's too. Strategies from `make_strategy("mirrored")`
    have keys of their own and never collide.

    Raises:
        RuntimeError: `strategy` is a second MirroredStrategy of several
            replicas with the same key base as one whose steps already ran.
    """
    base = _keras_compat.collective_key_base(strategy)
    if base is None or strategy.num_replicas_in_sync < 2:
        return
    owner = _COLLECTIVE_OWNERS.get(base)
    if owner is None:
        _COLLECTIVE_OWNERS[base] = weakref.ref(strategy)
        return
    if owner() is strategy:
        return
    raise RuntimeError(
        "This is the second tf.distribute.MirroredStrategy in this process to run steps, "
        "and TensorFlow numbers every MirroredStrategy's collectives from the same start: "
        "its first all-reduce would abort on the first strategy's cached shapes (\"Shape "
        "mismatch in the collective instance\"). Reuse the first strategy (create it once, "
        "e.g. in the notebook's first cell), or create each one with "
        "kd.make_strategy(\"mirrored\"), which gives every strategy collective keys of its own."
    )


@dataclasses.dataclass(frozen=True)
class StrategyTraits:
    """What kd needs to know about a strategy, asked once.

    Every module compares these fields instead of asking `isinstance` (or a
    private attribute) again, so a question about the strategy has one
    answer in one place.

    Attributes:
        kind: One of `KINDS` except `"auto"`: `"default"`, `"one_device"`,
            `"mirrored"`, `"central_storage"`, `"multi_worker"`,
            `"parameter_server"` or `"tpu"`.
        replicas: Replicas in sync (1 under a parameter server: each
            worker's step runs alone).
        workers: Worker processes that train (the chief included).
    """

    kind: str
    replicas: int
    workers: int

    @property
    def is_parameter_server(self):
        """Steps are scheduled on remote workers by a coordinator."""
        return self.kind == "parameter_server"

    @property
    def is_multi_worker(self):
        """Several processes take part in each synchronous step."""
        return self.kind == "multi_worker" and self.workers > 1

    @property
    def is_tpu(self):
        return self.kind == "tpu"

    @property
    def is_central_storage(self):
        """Variables live on one device; replicas update AggregatingVariables."""
        return self.kind == "central_storage"

    @property
    def replica_threads(self):
        """Replica functions run in Python threads (one per local device)."""
        return self.kind in ("mirrored", "central_storage", "multi_worker")


_TRAITS = weakref.WeakKeyDictionary()


def _kind_of(strategy):
    for kind, cls in (
        ("parameter_server", tf.distribute.experimental.ParameterServerStrategy),
        ("tpu", tf.distribute.TPUStrategy),
        ("central_storage", tf.distribute.experimental.CentralStorageStrategy),
        ("multi_worker", tf.distribute.MultiWorkerMirroredStrategy),
        ("mirrored", tf.distribute.MirroredStrategy),
        ("one_device", tf.distribute.OneDeviceStrategy),
    ):
        if isinstance(strategy, cls):
            return kind
    if strategy is _keras_compat.default_strategy():
        return "default"
    raise TypeError(
        f"`strategy`={strategy!r} is not a strategy kd supports. Expected one of "
        f"tf.distribute's MirroredStrategy, MultiWorkerMirroredStrategy, "
        f"CentralStorageStrategy, ParameterServerStrategy, TPUStrategy, "
        f"OneDeviceStrategy or the default strategy (see kd.make_strategy)."
    )


def _workers_of(kind, strategy):
    if kind == "parameter_server":
        return _keras_compat.parameter_server_workers(strategy)
    if kind == "multi_worker" and _keras_compat.is_multi_worker(strategy):
        spec = strategy.cluster_resolver.cluster_spec()
        return sum(spec.num_tasks(job) for job in ("chief", "worker") if job in spec.jobs)
    return 1


def traits(strategy=None):
    """The `StrategyTraits` of `strategy` (the current strategy by default).

    Computed on first use and kept as long as the strategy lives.

    Args:
        strategy: A `tf.distribute.Strategy`, or None for
            `tf.distribute.get_strategy()`.

    Returns:
        A frozen `StrategyTraits`.

    Raises:
        TypeError: `strategy` is not a strategy kd supports.

    Examples:
        >>> import keras_distrib as kd
        >>> from keras_distrib.cluster import strategies
        >>> strategies.traits(kd.make_strategy("default")).kind
        'default'
    """
    strategy = tf.distribute.get_strategy() if strategy is None else strategy
    cached = _TRAITS.get(strategy) if isinstance(strategy, tf.distribute.Strategy) else None
    if cached is not None:
        return cached
    kind = _kind_of(strategy)
    replicas = 1 if kind == "parameter_server" else strategy.num_replicas_in_sync
    found = StrategyTraits(kind=kind, replicas=replicas, workers=_workers_of(kind, strategy))
    _TRAITS[strategy] = found
    return found
