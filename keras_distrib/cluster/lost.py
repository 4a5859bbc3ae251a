"""Which task a multi-worker job lost, read from TensorFlow's error text.

Text only: the launcher explains a failed task with it, and must not load
TensorFlow to do so (a launcher that ends after a failure would wait about
4 CPU seconds for the import). `keras_distrib.cluster.watchdog` re-exports
these names, and explains a training process's own error with them.
"""

import re

__all__ = ["ADVICE", "lost_task_message", "lost_tasks"]

_TASK_NAME = re.compile(r"/job:(\w+)/(?:replica:\d+/)?task:(\d+)")
# The failed op's own function and device, which TensorFlow puts first in its message.
_OWN_OP = re.compile(r"\{\{function_node [^}]*\}\}")
_LOST_WORDS = ("coordination service", "coordinationservice", "heartbeat", "unhealthy", "unavailable", "connection reset",
               "failed to connect", "socket closed")
ADVICE = ("Restart the job: keras-distrib launch --max-restarts K (or your cluster manager's "
          "restart) resumes training from its backup (kd.callbacks.BackupAndRestore or "
          "kd.CheckpointManager).")


def lost_tasks(text, own_label=None, service_task="worker 0"):
    """The tasks (`"worker 1"`) an error text says the cluster lost; [] if it is not such an error.

    TensorFlow's coordination service and collectives end every task within
    seconds when one dies or misses its heartbeats, naming it
    `/job:worker/replica:0/task:1`. When the task that hosts the
    coordination service (`service_task`: the chief, else worker 0) stops,
    the others' heartbeats to it time out, and the error names no task.
    The device in the failed op's name (`{{function_node ..._device_/job:worker/...}}`,
    where an eager collective such as a metric's read fails) is this task's
    own, never a lost one.

    Examples:
        >>> lost_tasks("The following tasks are unhealthy (stopped sending "
        ...            "heartbeats): /job:worker/replica:0/task:1", "worker 0")
        ['worker 1']
        >>> lost_tasks("{{function_node __wrapped__CollectiveReduceV2_device_/job:worker/replica:0/"
        ...            "task:1/device:CPU:0}} Collective ops is aborted by: Deadline Exceeded "
        ...            "RPC: /tensorflow.CoordinationService/Heartbeat", "worker 1")
        ['worker 0']
    """
    if not any(word in text.lower() for word in _LOST_WORDS):
        return []
    peers = _OWN_OP.sub("", text)
    names = [name for name in dict.fromkeys(f"{job} {index}" for job, index in _TASK_NAME.findall(peers))
             if name != own_label]
    if not names and "coordinationservice/heartbeat" in text.lower() and service_task != own_label:
        names = [service_task]
    return names


def service_task(task_types):
    """The task that hosts TensorFlow's coordination service: `"chief 0"`, else `"worker 0"`.

    `task_types` are the cluster's tasks' types (`"worker"`, `"chief"`, ...).

    Examples:
        >>> service_task(["worker", "worker", "chief", "evaluator"])
        'chief 0'
        >>> service_task(["worker", "ps"])
        'worker 0'
    """
    return "chief 0" if "chief" in set(task_types) else "worker 0"


def lost_task_message(lost, own_label):
    """kd's explanation of a task that ended because the cluster lost `lost`."""
    named = ", ".join(f"{task} (/job:{task.split()[0]}/task:{task.split()[1]})" for task in lost)
    return (f"{own_label} cannot go on: the cluster lost {named} (it died, or stopped "
            "answering: stopped, hung in native code, or its machine went away; TensorFlow's "
            f"error below names it). {ADVICE}")
