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

    _early.install()  # a stop signal while TensorFlow loads is kept for the launcher
_tf_logs.import_tensorflow()

# The layout (docs/API.md, "How it works"): `cluster` (who am I, devices,
# strategies, processes) < `checkpointing` < `training` < `testing` <
# `commands`, over the floor (`_keras_compat`, `validation`, `files`, ...).
# `callbacks`, `data`, `gradients`, `losses`, `loop` and `models` are the
# public paths of modules in `training` (re-exports); `cluster` is the package.
from keras_distrib import callbacks
from keras_distrib import cluster
from keras_distrib import data
from keras_distrib import gradients
from keras_distrib import loop
from keras_distrib import losses
from keras_distrib import models
from keras_distrib.checkpointing.checkpoint import CheckpointError
from keras_distrib.checkpointing.checkpoint import CheckpointManager
from keras_distrib.checkpointing.evaluator import SidecarEvaluator
from keras_distrib.cluster.devices import virtual_devices
from keras_distrib.cluster.info import ClusterConfigError
from keras_distrib.cluster.info import ClusterInfo
from keras_distrib.cluster.info import cluster_info
from keras_distrib.cluster.info import is_chief
from keras_distrib.cluster.inprocess import local_cluster
from keras_distrib.cluster.launcher import LaunchError
from keras_distrib.cluster.launcher import launch
from keras_distrib.cluster.strategies import make_strategy
from keras_distrib.training.data import describe_input
from keras_distrib.training.data import distribute_dataset
from keras_distrib.training.data import replay_epochs
from keras_distrib.training.gradients import exact_optimizer
from keras_distrib.training.models import DistributedModelMixin
from keras_distrib.training.models import Model
from keras_distrib.training.models import Sequential
from keras_distrib.training.train_loop import TrainLoop

__version__ = "0.1.0"


def __getattr__(name):
    # `kd.testing` (pytest fixtures, subprocess harness) loads on first use:
    # training code never pays for it.
    if name == "testing":
        import importlib

        return importlib.import_module("keras_distrib.testing")
    raise AttributeError(f"module 'keras_distrib' has no attribute {name!r}")

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "ClusterConfigError",
    "ClusterInfo",
    "DistributedModelMixin",
    "LaunchError",
    "Model",
    "Sequential",
    "SidecarEvaluator",
    "TrainLoop",
    "callbacks",
    "cluster",
    "cluster_info",
    "data",
    "describe_input",
    "distribute_dataset",
    "exact_optimizer",
    "gradients",
    "is_chief",
    "launch",
    "local_cluster",
    "losses",
    "make_strategy",
    "replay_epochs",
    "testing",
    "virtual_devices",
]
