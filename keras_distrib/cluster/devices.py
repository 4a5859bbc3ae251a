"""Logical (virtual) devices: many replicas on one physical CPU or GPU.

TensorFlow fixes its device layout the first time anything touches a device,
so the split has to happen before the first tensor is created. That is the
one rule users trip over; `virtual_devices` turns the silent failure into an
error that says what to do.
"""

import os

import tensorflow as tf

from keras_distrib import tf_logs
from keras_distrib import validation

__all__ = [
    "inter_op_threads",
    "inter_op_threads_needed",
    "virtual_devices",
]

_DEVICE_TYPES = ("CPU", "GPU")


def virtual_devices(n, device_type="CPU", *, memory_limit_mb=1024):
    """Splits the first physical device of `device_type` into `n` logical ones.

    Multi-replica strategies need several devices; on a laptop or a CI box
    with one CPU, logical devices make `MirroredStrategy` and friends run for
    real (real all-reduces, real per-replica batches).

    Args:
        n: Number of logical devices, at least 1.
        device_type: `"CPU"` or `"GPU"`.
        memory_limit_mb: Memory of each logical GPU, in MiB (GPU only).

    Returns:
        The names of the logical devices, e.g. `["/device:CPU:0", ...]`.

    Raises:
        ValueError: `n` or `device_type` is invalid, or no such device exists.
        RuntimeError: TensorFlow already initialized its devices with another
            layout (call this first thing in the process, or start a new one).

    Examples:
        >>> import keras_distrib as kd
        >>> kd.virtual_devices(2)  # doctest: +SKIP
        ['/device:CPU:0', '/device:CPU:1']
    """
    if not validation.is_whole(n, 1):
        raise ValueError(
            f"`n`={n!r} is not a valid device count. Pass a whole number "
            "of logical devices, 1 or more."
        )
    device_type = str(device_type).upper()
    if device_type not in _DEVICE_TYPES:
        raise ValueError(
            f"`device_type`={device_type!r} is not supported. Expected one "
            f"of {_DEVICE_TYPES}."
        )
    with tf_logs.hidden_notices():  # the first device query starts CUDA (see tf_logs)
        physical = tf.config.list_physical_devices(device_type)
    if not physical:
        raise ValueError(
            f"`device_type`={device_type!r}: this machine has no physical "
            f"{device_type}. Use device_type='CPU' to simulate replicas."
        )
    if device_type == "CPU":
        config = [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
    else:
        config = [
            tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mb)
            for _ in range(n)
        ]
    current = tf.config.get_logical_device_configuration(physical[0])
    try:
        tf.config.set_logical_device_configuration(physical[0], config)
    except RuntimeError as error:
        existing = tf.config.list_logical_devices(device_type)
        if len(existing) == n and (current is None or len(current) == n):
            return [d.name for d in existing]
        raise RuntimeError(
            f"`virtual_devices({n}, {device_type!r})` was called after "
            f"TensorFlow initialized its devices ({len(existing)} logical "
            f"{device_type} device(s) exist now). Call kd.virtual_devices "
            "before creating any tensor, model or strategy, at the top of "
            "your script, or run this configuration in a fresh process."
        ) from error
    _ensure_inter_op_threads(n)
    # Listing logical devices would initialize TensorFlow's context, which a
    # MultiWorkerMirroredStrategy created next must still be able to configure.
    return [f"/device:{device_type}:{i}" for i in range(n)]


def inter_op_threads_needed(replicas):
    """Threads TensorFlow's inter-op pool needs for `replicas` local replicas' input.

    A distributed iterator opened inside a `tf.function` (MirroredStrategy)
    prefetches to each replica's device with an op that blocks a thread of
    the inter-op pool while it waits; with too few threads, the step's own
    ops never get one and the call never returns. Measured on 2 cores with
    a BatchNormalization model, 2 epochs per try: 2 replicas hung with 2
    threads, 3 with 3, 4 with 4, 8 with 5; none hung with 2 threads more
    than replicas.
    """
    return replicas + 2


def inter_op_threads():
    """The size of TensorFlow's inter-op pool: the configured number, else the usable CPUs."""
    configured = tf.config.threading.get_inter_op_parallelism_threads()
    return configured or len(os.sched_getaffinity(0))


def _ensure_inter_op_threads(replicas):
    """Grows TensorFlow's inter-op pool to `inter_op_threads_needed(replicas)`, if not configured.

    Only before TensorFlow starts (later, or with a size the user chose, it
    is left alone: kd's models then refuse the loop shape that would hang).
    """
    if tf.config.threading.get_inter_op_parallelism_threads():
        return
    needed = inter_op_threads_needed(replicas)
    if inter_op_threads() < needed:
        try:
            tf.config.threading.set_inter_op_parallelism_threads(needed)
        except RuntimeError:  # TensorFlow already started
            pass
