"""The per-node agent: this node's tasks of a cluster a cluster manager started.

`launch_node` (and `keras-distrib launch` without `--workers`, under `srun`
or in a Kubernetes Job) reads the cluster from Slurm's or Kubernetes'
environment (see `keras_distrib.cluster.sources`) and starts this node's
tasks, one per node or one per GPU, with `launch`'s checks, restarts and
supervision (`keras_distrib.cluster.launcher`).
"""

import os
import socket

from keras_distrib.cluster import info as cluster_lib
from keras_distrib.cluster import launcher
from keras_distrib.cluster import requests
from keras_distrib.cluster import restarts
from keras_distrib.cluster import sources as cluster_sources
from keras_distrib.cluster import supervisor
from keras_distrib.cluster.launcher import LaunchError
from keras_distrib import validation

__all__ = [
    "launch_node",
    "node_tasks",
]


def _per_node_count(per_node, environ):
    if per_node == "gpu":
        gpus = supervisor.visible_gpus(environ)
        if not gpus:
            listed = environ.get("CUDA_VISIBLE_DEVICES")
            shown = ("nvidia-smi lists none" if listed is None else
                     f"CUDA_VISIBLE_DEVICES={listed!r} hides every GPU" if listed.strip() else
                     "CUDA_VISIBLE_DEVICES is empty")
            raise LaunchError(
                f"`per_node`='gpu': this node shows no GPU ({shown}), so there is no task to "
                "start. Use `--per-node N` for N CPU tasks, or request GPUs from the cluster manager "
                "(e.g. `#SBATCH --gpus-per-node=4`, or `nvidia.com/gpu` in the pod's limits)."
            )
        return len(gpus)
    if not validation.is_whole(per_node, 1):
        raise LaunchError(f"`per_node`={per_node!r}: expected a whole number >= 1, or 'gpu' "
                          "(one task per visible GPU).")
    return per_node


def node_tasks(per_node=1, ps=None, environ=None):
    """This node's share of the cluster: `(source, cluster spec, local task labels)`.

    The cluster manager (Slurm, Kubernetes) started one agent per node;
    each starts `per_node` tasks, so agent `a`'s task `j` has rank
    `a * per_node + j` and port `agent port + j`. `ps` (else `KD_PS`)
    parameter servers follow the chief, as in `cluster_sources.roles`.
    Under TF_CONFIG the agent runs the one task it names.

    Raises:
        LaunchError: no cluster manager is found, several agents share a
            node, `per_node` is invalid, or `ps` leaves no worker.
    """
    environ = dict(os.environ if environ is None else environ)
    count = _per_node_count(per_node, environ)
    if ps is not None and not validation.is_whole(ps, 0):
        raise LaunchError(f"`ps`={ps!r}: expected a whole number >= 0")
    if environ.get("TF_CONFIG", "").strip():
        info = cluster_lib.parse_tf_config(environ["TF_CONFIG"])
        if count != 1 or ps:
            raise LaunchError(
                "TF_CONFIG names one task, so the agent runs exactly that one: drop "
                "`--per-node`/`--ps`, or unset TF_CONFIG to read Slurm's or Kubernetes' variables."
            )
        if info.task_type is None:
            raise LaunchError("TF_CONFIG is empty: there is no task to run.")
        return "tf_config", {k: list(v) for k, v in info.cluster.items()}, [info.label]
    try:
        placement = cluster_sources.detect(environ)
    except cluster_lib.ClusterConfigError as error:
        raise LaunchError(str(error)) from None
    if placement is None or placement.source == "tpu":
        found = "a TPU pod, which TensorFlow drives from one process" if placement else "no cluster"
        raise LaunchError(
            f"`keras-distrib launch` without `--workers` is the per-node agent of a Slurm or "
            f"Kubernetes job, but this environment shows {found} (no `srun` task, no "
            "KD_NUM_PODS, no TF_CONFIG). Run `keras-distrib launch --workers N script.py` for a "
            "local cluster, or `python script.py` directly."
        )
    if placement.local_tasks > 1:
        raise LaunchError(
            f"{placement.local_tasks} agents run on this node; the agent starts the node's tasks "
            "itself, so run one per node: `srun --ntasks-per-node=1 keras-distrib launch "
            "--per-node N script.py` (or start the tasks with srun directly, without the agent)."
        )
    ps = placement.ps if ps is None else ps
    total = len(placement.addresses) * count
    if ps and total < ps + 2:
        raise LaunchError(
            f"`ps`={ps} leaves no worker among the {total} task(s) ({len(placement.addresses)} "
            f"node(s) x {count} per node); a parameter-server cluster needs a chief, the ps "
            "tasks and at least one worker."
        )
    layout = cluster_sources.roles(total, ps)
    hosts = [address.rpartition(":")[0] for address in placement.addresses for _ in range(count)]
    if placement.base_port is not None:
        # Distinct on every machine, also for several nodes on one host.
        machines = [machine for machine in placement.machines for _ in range(count)]
        ports = cluster_sources.task_ports(machines, placement.base_port, placement.reserved_ports)
    else:
        ports = [int(address.rpartition(":")[2]) + j
                 for address in placement.addresses for j in range(count)]
    spec, local = {}, []
    for rank, ((task_type, index), host, port) in enumerate(zip(layout, hosts, ports)):
        spec.setdefault(task_type, []).append(f"{host}:{port}")
        if rank // count == placement.rank:
            local.append(f"{task_type} {index}")
    return placement.source, spec, local


def _check_local_ports(spec, local):
    """Refuses to start when a port of this node's tasks is taken, naming it."""
    taken = []
    for label in local:
        task_type, index = label.split()
        port = int(spec[task_type][int(index)].rpartition(":")[2])
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("", port))
            except OSError as error:
                taken.append(f"{port} ({label}: {error.strerror})")
    if taken:
        raise LaunchError(
            f"Port {', '.join(taken)} cannot be bound on this node: another job or process "
            "listens there (`ss -ltnp`). kd takes the ports Slurm reserved for the step "
            "(SLURM_STEP_RESV_PORTS, with MpiParams=ports=... in slurm.conf), else derives them "
            "from the job (SLURM_JOB_ID), unless `KD_PORT` fixes them: unset KD_PORT, or choose "
            "another first port."
        )


def launch_node(target, *, per_node=1, ps=None, args=(), max_restarts=0, timeout=None,
                log_dir=None, env=None, sink=print, grace_period=requests.DEFAULT_GRACE_PERIOD, verbose=False):
    """Runs this node's tasks of a cluster a cluster manager started; returns a `ClusterResult`.

    The per-node agent behind `keras-distrib launch` (without `--workers`)
    under `srun` or in a Kubernetes Job: see `node_tasks` for which tasks
    run here. Each task gets its TF_CONFIG and, with `per_node="gpu"`, its
    own GPU. Supervision is `launch`'s: prefixed logs, the first failure
    stops this node's tasks, `max_restarts` restarts them (on the same
    ports; the other nodes' agents restart theirs), and a SIGTERM (a
    preemption) is passed on with `grace_period` seconds to save.

    Raises:
        LaunchError: see `node_tasks`, and `launch`'s argument checks.

    Examples:
        >>> import keras_distrib as kd
        >>> from keras_distrib.cluster import node
        >>> node.launch_node("train.py", per_node="gpu")  # doctest: +SKIP
    """
    target, script = requests.script_target(target)
    requests.validate(1, 0, False, max_restarts, timeout, args=args, script=script, env=env,
                      log_dir=log_dir, sink=sink, verbose=verbose)
    requests.check_grace_period(grace_period)
    source, spec, local = node_tasks(per_node, ps, env)
    _check_local_ports(spec, local)
    sink = supervisor.whole_lines(sink)
    argv_for, values_dir = launcher.resolve_target(target, args)
    has_ps = bool(spec.get("ps"))
    sink(f"[launcher] {source} node: starting {', '.join(local)} of "
         f"{sum(len(v) for v in spec.values())} task(s)")
    return launcher.with_values(values_dir, lambda: restarts.run_attempts(
        lambda attempt: supervisor.run_tasks(
            launcher.task_specs(spec, argv_for, ps=has_ps, env=env, server_argv=launcher.SERVER_ARGV,
                                local=set(local), verbose=verbose),
            timeout=timeout, sink=sink, log_dir=log_dir, grace_period=grace_period),
        max_restarts=max_restarts, sink=sink, what="this node's tasks",
    ))
