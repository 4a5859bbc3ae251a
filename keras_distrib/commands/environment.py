"""`keras-distrib env`: what a bug report needs, in one screen.

Versions (Python, Keras, TensorFlow, keras_distrib, NumPy), the platform,
the devices TensorFlow finds, where the cluster comes from (TF_CONFIG or
none) and which strategy `kd.make_strategy("auto")` would pick here. Nothing
is started: no device is split and no strategy is created.
"""

import os
import platform

__all__ = [
    "facts",
    "main",
]

# `ClusterInfo.source` as people write it.
_SOURCE_NAMES = {"tf_config": "TF_CONFIG", "slurm": "Slurm", "kubernetes": "Kubernetes", "tpu": "TPU"}

def facts():
    """The environment as a list of (name, value) pairs."""
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_distrib as kd
    from keras_distrib.cluster import info as cluster
    from keras_distrib.cluster import strategies
    from keras_distrib import tf_logs

    rows = [
        ("keras_distrib", f"{kd.__version__} ({os.path.dirname(os.path.abspath(kd.__file__))})"),
        ("python", f"{platform.python_version()} ({platform.python_implementation()})"),
        ("keras", f"{keras.__version__} (backend {keras.backend.backend()})"),
        ("tensorflow", tf.__version__),
        ("numpy", np.__version__),
        ("platform", f"{platform.system()} {platform.release()} {platform.machine()}, "
                     f"{os.cpu_count()} CPU cores"),
    ]
    with tf_logs.hidden_notices():
        found = {kind: tf.config.list_physical_devices(kind) for kind in ("CPU", "GPU", "TPU")}
    described = []
    for kind, devices in found.items():
        if devices:
            described.append(f"{len(devices)} {kind}")
    rows.append(("devices", ", ".join(described) or "none"))
    for index, gpu in enumerate(found["GPU"]):
        details = tf.config.experimental.get_device_details(gpu)
        rows.append((f"  GPU {index}", details.get("device_name", gpu.name)))
    try:
        info = cluster.cluster_info()
    except cluster.ClusterConfigError as error:
        rows.append(("cluster", f"TF_CONFIG is invalid: {str(error).splitlines()[0]}"))
        info = None
    if info is not None:
        source = _SOURCE_NAMES.get(info.source, info.source)
        if source is None:
            rows.append(("cluster", "none (no TF_CONFIG, Slurm step, Kubernetes Job or TPU): "
                                    "a single process"))
        else:
            counts = ", ".join(f"{len(addresses)} {task}" for task, addresses in info.cluster.items())
            rows.append(("cluster", f"{source}: {counts}; this process is {info.label or 'not a task'}"
                                    f"{' (chief)' if info.is_chief else ''}"))
    try:
        auto = strategies.resolve_auto_kind()
    except Exception as error:  # a bad TF_CONFIG already shows above
        auto = f"cannot tell ({type(error).__name__})"
    rows.append(("make_strategy('auto')", auto))
    for name in ("TF_CONFIG", "CUDA_VISIBLE_DEVICES", "TF_CPP_MIN_LOG_LEVEL", "KERAS_BACKEND"):
        value = os.environ.get(name)
        shown = "(unset)" if value is None else (value if len(value) < 80 else value[:77] + "...")
        if name == tf_logs.LEVEL_VARIABLE and tf_logs.set_by_command_line:
            shown += " (keras-distrib's default; set it yourself, or --verbose, to see TensorFlow's logs)"
        rows.append((f"${name}", shown))
    return rows


def main(print_fn=print):
    """Prints the environment; returns 0."""
    rows = facts()
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print_fn(f"{name:<{width}}  {value}")
    return 0
