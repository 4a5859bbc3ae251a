"""Functions that tests run on launched clusters (importable by the tasks)."""

import os


def whoami(tag):
    from keras_distrib import cluster

    info = cluster.cluster_info()
    return {"tag": tag, "task": info.label, "chief": info.is_chief, "workers": info.num_workers, "pid": os.getpid()}
