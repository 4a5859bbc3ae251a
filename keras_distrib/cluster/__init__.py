"""Who this process is in the cluster, and where it may write.

`cluster_info()` reads TF_CONFIG when it is set, else the cluster manager's
environment (a Slurm step, a Kubernetes Indexed Job or JobSet, a TPU pod), so
a script needs no change between a laptop and a cluster. Every file writer in
kd asks `writer_directory` where to write, so the rule "only the chief's files
persist" lives in one place. Nothing here loads TensorFlow: the launcher and a
task that only asks who it is start in a fraction of a second.
"""

# The package also owns the devices and strategies (`devices`, `strategies`)
# and the processes of a run: `launcher` (with `ports`, its ports and locks,
# `requests`, the checks of a launch request, and `restarts`, the restart policy),
# `node` (the per-node agent) and `supervisor` (the run loop, with
# `task_process`, one task's process under `_guard`, `failures`, which task
# ended a run and why, `stop_signals`, and `network`, a private network
# namespace for the tasks), `_task_entry` (what a task runs), `inprocess`
# (`kd.local_cluster`),
# `watchdog` (a peer that stops answering) and `preemption` (an agreed stop).
# May import: the floor (`validation`, `tf_logs`, `files`,
# `_early_signals`, `keras_distrib._keras_compat`), never `training`,
# `checkpointing`, `testing` or `commands`: the processes of a run know
# nothing of models (tests/test_layout.py).

from keras_distrib.cluster.info import SOURCES
from keras_distrib.cluster.info import ClusterConfigError
from keras_distrib.cluster.info import ClusterInfo
from keras_distrib.cluster.info import chief_verbose
from keras_distrib.cluster.info import cluster_info
from keras_distrib.cluster.info import cluster_resolver
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
    "is_chief",
    "parse_tf_config",
    "writer_directory",
]
