"""The cluster: who this process is, its devices and strategy, and the processes of a run.

Owns "who am I" (`info`: TF_CONFIG, Slurm, Kubernetes, TPU; `sources`: the
cluster managers read), the devices and strategies (`devices`,
`strategies`), and the processes: `launcher` and `supervisor` (with `_guard`
and `_task_entry`, one task's process), `inprocess` (`kd.local_cluster`),
`watchdog` (a peer that stops answering) and `preemption` (an agreed stop).

May import: the floor (`validation`, `tf_logs`, `files`, `_early_signals`,
`keras_distrib._keras_compat`). Never `training`, `checkpointing`, `testing`
or `commands`: the processes of a run know nothing of models
(`tests/test_layout.py`).

This package is also the public path `kd.cluster` (docs/API.md): it re-exports
the names of `info`.
"""

from keras_distrib.cluster.info import SOURCES
from keras_distrib.cluster.info import ClusterConfigError
from keras_distrib.cluster.info import ClusterInfo
from keras_distrib.cluster.info import chief_verbose
from keras_distrib.cluster.info import cluster_info
from keras_distrib.cluster.info import cluster_resolver
from keras_distrib.cluster.info import from_placement
from keras_distrib.cluster.info import is_chief
from keras_distrib.cluster.info import parse_tf_config
from keras_distrib.cluster.info import writer_directory

__all__ = [
    "ClusterConfigError",
    "ClusterInfo",
    "SOURCES",
    "chief_verbose",
    "cluster_info",
    "cluster_resolver",
    "from_placement",
    "is_chief",
    "parse_tf_config",
    "writer_directory",
]
