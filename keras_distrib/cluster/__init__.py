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

from keras_distrib.cluster import info as _implementation
from keras_distrib.cluster.info import *  # noqa: F401,F403  (the names of its __all__)

__all__ = _implementation.__all__
