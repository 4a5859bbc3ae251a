"""`kd.local_cluster`: an in-process cluster of `tf.distribute.Server`s.

For trying parameter-server training in one process, as TensorFlow's guide
does: this process becomes the coordinator of worker and parameter-server
servers started on free localhost ports.
"""

import tensorflow as tf

from keras_distrib.cluster import ports
from keras_distrib import tf_logs
from keras_distrib import validation

__all__ = ["local_cluster"]

_LOCAL_SERVERS = []


def local_cluster(workers=2, ps=1, *, worker_threads=None):
    """Starts an in-process cluster of `tf.distribute.Server`s.

    For trying parameter-server training in one process, as TensorFlow's
    guide does: this process becomes the coordinator of `workers` worker and
    `ps` parameter servers on free localhost ports.

    Args:
        workers: Worker servers (>= 1).
        ps: Parameter servers (>= 1).
        worker_threads: Inter-op threads of each worker; the default leaves
            room for the coordinator's calls (fewer hang on 2 cores).

    Returns:
        A `tf.distribute.cluster_resolver.SimpleClusterResolver` to pass to
        `kd.make_strategy("parameter_server", cluster_resolver=...)`.

    Raises:
        LaunchError: invalid counts.

    Examples:
        >>> import keras_distrib as kd
        >>> resolver = kd.local_cluster(workers=2, ps=1)  # doctest: +SKIP
        >>> strategy = kd.make_strategy("parameter_server", cluster_resolver=resolver)  # doctest: +SKIP
    """
    if not validation.is_whole(workers, 1):
        raise ports.LaunchError(f"`workers`={workers!r}: expected a whole number >= 1")
    if not validation.is_whole(ps, 1):
        raise ports.LaunchError(f"`ps`={ps!r}: a parameter-server cluster needs at least 1 ps")
    if worker_threads is not None and (
        not validation.is_whole(worker_threads, 1)
    ):
        raise ports.LaunchError(
            f"`worker_threads`={worker_threads!r}: expected a whole number >= 1, or None for "
            "the default"
        )
    spec = tf.train.ClusterSpec(ports.cluster_spec(workers, ps=ps))
    worker_config = tf.compat.v1.ConfigProto()
    worker_config.inter_op_parallelism_threads = worker_threads or max(4, workers + 2)
    with tf_logs.hidden_notices():  # starting servers starts CUDA (see tf_logs)
        for task_type, count, config in (("worker", workers, worker_config), ("ps", ps, None)):
            for index in range(count):
                _LOCAL_SERVERS.append(
                    tf.distribute.Server(
                        spec, job_name=task_type, task_index=index, config=config,
                        protocol="grpc", start=True,
                    )
                )
    return tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")
