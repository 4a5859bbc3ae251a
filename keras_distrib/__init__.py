"""keras_distrib: exact, easy tf.distribute training for Keras 3.

The same global batches give the same model, whatever the strategy, the
number of replicas or workers, and whether you call `fit` or a custom loop.
"""

import os as _os

_os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from keras_distrib import tf_logs as _tf_logs  # noqa: E402  (imports no TensorFlow)

# TensorFlow's start-up notices are hidden unless TF_CPP_MIN_LOG_LEVEL asks
# for them; kd's command line also sets the level its subprocesses inherit.
_tf_logs.configure_command_line()
if _tf_logs.is_command_line():
    from keras_distrib import _early_signals as _early  # noqa: E402

    _early.install()  # a stop signal while kd starts is kept for the launcher

# The layout (docs/development/layout.md): `cluster` (who am I, devices,
# strategies, processes) < `checkpointing` < `training` < `testing` <
# `commands`, over the floor (`_keras_compat`, `validation`, `files`, ...).
#
# The public surface is this map and the `__all__` of the public modules it
# names (`callbacks`, `cluster`, `collectives`, `data`, `gradients`,
# `losses`, `testing`), each of which imports its names one by one. The API
# reference (docs/reference/) is generated from them, and tests/test_api.py
# checks the built reference against them, both ways. Every other module is
# internal.
#
# Each public name loads its module at first use (PEP 562): importing the
# package loads neither TensorFlow nor Keras, so the launcher, the command
# line and a task that only asks who it is start in a fraction of a second
# instead of the seconds TensorFlow takes. The first name that needs
# TensorFlow imports it with its start-up notices hidden.
# {name: (module, attribute)}; attribute None: the module itself.
_PUBLIC = {
    "CheckpointError": ("keras_distrib.checkpointing.checkpoint", "CheckpointError"),
    "CheckpointManager": ("keras_distrib.checkpointing.checkpoint", "CheckpointManager"),
    "ClusterConfigError": ("keras_distrib.cluster.info", "ClusterConfigError"),
    "ClusterInfo": ("keras_distrib.cluster.info", "ClusterInfo"),
    "DamagedCheckpointError": ("keras_distrib.checkpointing.checkpoint", "DamagedCheckpointError"),
    "DistributedModelMixin": ("keras_distrib.training.models", "DistributedModelMixin"),
    "EmptyDataError": ("keras_distrib.training.loop", "EmptyDataError"),
    "LaunchError": ("keras_distrib.cluster.launcher", "LaunchError"),
    "Model": ("keras_distrib.training.models", "Model"),
    "NonFiniteDataWarning": ("keras_distrib.validation", "NonFiniteDataWarning"),
    "Sequential": ("keras_distrib.training.models", "Sequential"),
    "SidecarEvaluator": ("keras_distrib.checkpointing.evaluator", "SidecarEvaluator"),
    "TrainLoop": ("keras_distrib.training.train_loop", "TrainLoop"),
    "callbacks": ("keras_distrib.callbacks", None),
    "cluster": ("keras_distrib.cluster", None),
    "cluster_info": ("keras_distrib.cluster.info", "cluster_info"),
    "collectives": ("keras_distrib.collectives", None),
    "data": ("keras_distrib.data", None),
    "describe_input": ("keras_distrib.training.data", "describe_input"),
    "distribute_dataset": ("keras_distrib.training.data", "distribute_dataset"),
    "exact_optimizer": ("keras_distrib.training.gradients", "exact_optimizer"),
    "gradients": ("keras_distrib.gradients", None),
    "is_chief": ("keras_distrib.cluster.info", "is_chief"),
    "launch": ("keras_distrib.cluster.launcher", "launch"),
    "load_model": ("keras_distrib.training.saving", "load_model"),
    "local_cluster": ("keras_distrib.cluster.inprocess", "local_cluster"),
    "losses": ("keras_distrib.losses", None),
    "make_strategy": ("keras_distrib.cluster.strategies", "make_strategy"),
    "replay_epochs": ("keras_distrib.training.data", "replay_epochs"),
    "save_for_keras": ("keras_distrib.training.saving", "save_for_keras"),
    "testing": ("keras_distrib.testing", None),
    "virtual_devices": ("keras_distrib.cluster.devices", "virtual_devices"),
}
# The modules above that load no TensorFlow (tests/test_init.py checks it).
_WITHOUT_TENSORFLOW = ("keras_distrib.cluster", "keras_distrib.cluster.info",
                       "keras_distrib.cluster.launcher", "keras_distrib.validation")

__all__ = sorted(_PUBLIC)

__version__ = "0.1.0"


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'keras_distrib' has no attribute {name!r}")
    import importlib

    module_name, attribute = _PUBLIC[name]
    if module_name not in _WITHOUT_TENSORFLOW:
        _tf_logs.import_tensorflow()
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # later uses find it without this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))

