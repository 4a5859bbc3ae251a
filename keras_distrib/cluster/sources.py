"""Where the cluster comes from: TF_CONFIG, Slurm, Kubernetes, TPU pods.

`kd.cluster_info()` asks `detect()` which environment this process runs in
and gets back the tasks' addresses in rank order plus this task's rank; the
same script then runs unchanged on a laptop, under `srun`, or in a
Kubernetes Job. The environment variables each source reads:

Slurm (a task started by `srun`; the batch script itself is not a task):
    `SLURM_PROCID` (this task's rank), `SLURM_STEP_NUM_TASKS` (else
    `SLURM_NTASKS`), `SLURM_STEP_NODELIST` (else `SLURM_JOB_NODELIST`,
    `SLURM_NODELIST`; expanded with `scontrol show hostnames`, or kd's own
    parser where `scontrol` is missing), `SLURM_STEP_TASKS_PER_NODE` (else
    `SLURM_TASKS_PER_NODE`), `SLURM_DISTRIBUTION` (block, the default, or
    cyclic), and, to cross-check, `SLURM_LOCALID` and `SLURMD_NODENAME`.
    Addresses: each node's `NodeAddr` (`scontrol show node`; the node name
    where Slurm has none), resolved at once: a name that does not resolve is
    an error naming it, not a worker waiting forever. Ports: `KD_PORT` (the
    first port on each machine; the j-th task on a machine uses `KD_PORT +
    j`, counting the tasks of every node whose address resolves to that
    machine, so two Slurm nodes on one host get different ports), by
    default the ports Slurm reserved for the step (`SLURM_STEP_RESV_PORTS`,
    where slurm.conf sets `MpiParams=ports=...`: no two steps on a node get
    the same), else derived from `SLURM_JOB_ID` (8 ports per job).

Kubernetes (an Indexed Job, or a JobSet's replicated Job), opted in by
`KD_NUM_PODS`:
    `JOB_COMPLETION_INDEX` (set by Kubernetes: this pod's index),
    `KD_NUM_PODS` (the Job's `completions`), `KD_SERVICE` (the headless
    Service named in the pod template's `subdomain`; a JobSet's default
    subdomain, `JOBSET_NAME`, when unset), `HOSTNAME` (set by Kubernetes:
    `<job>-<index>`), `KD_PORT` (default 2222). Pod i is then
    `<job>-<i>.<service>:<port>`. `KD_HOSTS` (comma-separated `host:port`
    per pod) replaces the names when they do not follow that pattern.

Both: `KD_PS` (default 0) makes rank 0 the chief (a parameter-server
coordinator), ranks 1..KD_PS parameter servers and the rest workers.

TPU (`TPU_NAME`, `COLAB_TPU_ADDR` or `TPU_WORKER_HOSTNAMES`): TensorFlow
drives a TPU pod from one client process, so the cluster is that client;
`kd.make_strategy` resolves the TPU with `TPUClusterResolver`.

TensorFlow's `SlurmClusterResolver` is not used: it assigns ranks to hosts in
sorted name order (wrong for `n9,n10`, or a cyclic distribution), and on a
node without `nvidia-smi` it fails unless CUDA_VISIBLE_DEVICES is set.
"""

import dataclasses
import logging
import os
import re
import shutil
import subprocess

logger = logging.getLogger("keras_distrib")

__all__ = [
    "ClusterConfigError",
    "Placement",
    "detect",
    "expand_hostlist",
    "expand_tasks_per_node",
    "host_problem",
    "in_slurm_step",
    "kubernetes_placement",
    "resolve",
    "roles",
    "slurm_hostnames",
    "slurm_node_addresses",
    "slurm_placement",
    "slurm_reserved_ports",
    "task_ports",
    "tpu_placement",
]

# Every variable a source reads: `cluster_info()` caches on their values.
ENVIRONMENT = (
    "TF_CONFIG", "KD_PORT", "KD_PS",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_ID", "SLURM_STEPID",
    "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE", "SLURM_DISTRIBUTION", "SLURM_LOCALID", "SLURMD_NODENAME",
    "SLURM_JOB_ID", "PATH",
    "KD_NUM_PODS", "JOB_COMPLETION_INDEX", "KD_SERVICE", "KD_HOSTS", "JOBSET_NAME", "HOSTNAME",
    "TPU_NAME", "COLAB_TPU_ADDR", "TPU_WORKER_HOSTNAMES",
)
KUBERNETES_PORT = 2222
TPU_PORT = 8470


class ClusterConfigError(ValueError):
    """TF_CONFIG (or a cluster manager's environment) is malformed; the message lists every problem."""


def _config_error(message):
    return ClusterConfigError(message)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Every task's address in rank order, and which one this process is.

    Attributes:
        source: `"slurm"`, `"kubernetes"` or `"tpu"`.
        addresses: `"host:port"` of every task, by rank.
        rank: This task's rank (index into `addresses`).
        local_index: This task's index among the tasks on its host.
        local_tasks: How many tasks share its host.
        ps: Parameter-server tasks (`KD_PS`).
        detail: What was read, for messages (`keras-distrib tf-config`).
        machines: The machine each task runs on, by rank (tasks on one
            machine need different ports); empty when the ports are given.
        base_port: The first port on each machine (see `task_ports`), or
            None when every address names its own port (`KD_HOSTS`).
        reserved_ports: The ports Slurm reserved for this step on every node
            (`SLURM_STEP_RESV_PORTS`), in order; the j-th task on a machine
            uses the j-th. Empty when the ports come from `base_port`.
    """

    source: str
    addresses: tuple
    rank: int
    local_index: int = 0
    local_tasks: int = 1
    ps: int = 0
    detail: str = ""
    machines: tuple = ()
    base_port: object = None
    reserved_ports: tuple = ()


def roles(count, ps=0):
    """`[(task_type, task_index), ...]` for `count` tasks in rank order.

    Without parameter servers every task is a worker (worker 0 is the
    chief). With `ps` of them, rank 0 is the chief (the coordinator), ranks
    1..ps are parameter servers and the rest are workers.

    Examples:
        >>> roles(4, ps=1)
        [('chief', 0), ('ps', 0), ('worker', 0), ('worker', 1)]
    """
    if not ps:
        return [("worker", i) for i in range(count)]
    return ([("chief", 0)] + [("ps", i) for i in range(ps)]
            + [("worker", i) for i in range(count - 1 - ps)])


# Host names: letters, digits, '-', '_' and '.' (RFC 1123, with Slurm's '_'), or
# an IP address; an IPv6 address in brackets.
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]")


def host_problem(host, where):
    """A message if `host` is not a host name or address, else None."""
    if isinstance(host, str) and _HOST.fullmatch(host):
        return None
    return (f"{where}: {host!r} is not a host name (letters, digits, '-', '_' and '.', e.g. "
            "'node01' or 'w-0.svc'), nor an IP address")


# Slurm.


def _split_outside_brackets(text):
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return parts


def expand_hostlist(hostlist):
    """Expands a Slurm host list, keeping its order.

    Raises:
        ClusterConfigError: the list is malformed (naming it).

    Examples:
        >>> expand_hostlist("n[9-10],gpu-a[01-02,7],login")
        ['n9', 'n10', 'gpu-a01', 'gpu-a02', 'gpu-a7', 'login']
    """
    hosts = []
    for part in _split_outside_brackets(hostlist.strip()):
        match = re.fullmatch(r"([^\[\],]+)(?:\[([0-9,\-]+)\])?([^\[\],]*)", part)
        if match is None:
            raise _config_error(
                f"The Slurm node list {hostlist!r} cannot be read at {part!r}. Expected e.g. "
                "'node[01-04],gpu7' (what `scontrol show hostnames` expands)."
            )
        prefix, ranges, suffix = match.groups()
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for item in ranges.split(","):
            low, _, high = item.partition("-")
            high = high or low
            if not low.isdigit() or not high.isdigit() or int(high) < int(low):
                raise _config_error(
                    f"The Slurm node list {hostlist!r} has a bad range {item!r} in {part!r}."
                )
            hosts.extend(f"{prefix}{i:0{len(low)}d}{suffix}" for i in range(int(low), int(high) + 1))
    return hosts


def slurm_hostnames(nodelist, environ=None):
    """The host names of a Slurm node list: `scontrol show hostnames`, else kd's parser."""
    environ = os.environ if environ is None else environ
    scontrol = shutil.which("scontrol", path=environ.get("PATH"))
    if scontrol:
        try:
            result = subprocess.run(
                [scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                timeout=30, env=dict(environ),
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            logger.warning("`scontrol show hostnames` failed (%s); kd expands the list itself.", error)
        else:
            hosts = result.stdout.split()
            if result.returncode == 0 and hosts:
                bad = [h for h in hosts if host_problem(h, "") is not None]
                if bad:
                    raise _config_error(
                        f"`scontrol show hostnames {nodelist}` gave {bad}, which are not host "
                        f"names: the node list {nodelist!r} is malformed. Check the job's "
                        "SLURM_*NODELIST (e.g. 'node[01-04]'), or write TF_CONFIG."
                    )
                return hosts
            logger.warning(
                "`scontrol show hostnames %s` exited with %s (%s); kd expands the list itself.",
                nodelist, result.returncode, result.stderr.strip()[:200],
            )
    return expand_hostlist(nodelist)


def expand_tasks_per_node(text):
    """Expands Slurm's tasks-per-node list.

    Examples:
        >>> expand_tasks_per_node("2(x3),1")
        [2, 2, 2, 1]
    """
    counts = []
    for part in text.strip().split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise _config_error(
                f"The Slurm tasks-per-node list {text!r} cannot be read at {part!r}. Expected "
                "e.g. '2(x3),1'."
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _whole(environ, name, minimum=0):
    value = environ.get(name)
    if value is None or not value.strip().lstrip("-").isdigit() or int(value) < minimum:
        raise _config_error(f"`{name}`={value!r}: expected a whole number >= {minimum}.")
    return int(value)


def _first(environ, *names):
    for name in names:
        if environ.get(name, "").strip():
            return name, environ[name].strip()
    return None, None


def _ps_count(environ):
    return _whole(environ, "KD_PS") if environ.get("KD_PS", "").strip() else 0


def _port(environ, default):
    if not environ.get("KD_PORT", "").strip():
        return default
    port = _whole(environ, "KD_PORT", 1)
    if port > 65535:
        raise _config_error(f"`KD_PORT`={port}: expected a port in 1..65535.")
    return port


def task_ports(machines, base, reserved=()):
    """Each task's port: `base` + its index among the tasks on the same machine.

    With `reserved` (the ports Slurm reserved for the step), the j-th task on
    a machine gets the j-th reserved port instead.

    Examples:
        >>> task_ports(["10.0.0.1", "10.0.0.1", "10.0.0.2"], 15000)
        [15000, 15001, 15000]
        >>> task_ports(["10.0.0.1", "10.0.0.1"], None, reserved=(12004, 12005))
        [12004, 12005]
    """
    seen, ports = {}, []
    for machine in machines:
        index = seen.get(machine, 0)
        if reserved and index >= len(reserved):
            raise _config_error(
                f"Slurm reserved {len(reserved)} port(s) for this step (`SLURM_STEP_RESV_PORTS`="
                f"{_port_ranges(reserved)}), but {index + 1} or more tasks run on one machine. "
                "Reserve one per task on a node: `srun --resv-ports=N` (N: the tasks per node).")
        ports.append(reserved[index] if reserved else base + index)
        seen[machine] = index + 1
    if ports and max(ports) > 65535:
        raise _config_error(
            f"The ports from {base} run past 65535 ({max(seen.values())} tasks on one machine); "
            "set `KD_PORT` lower."
        )
    return ports


RESOLVE_SECONDS = 10.0


def resolve(host, what, timeout=RESOLVE_SECONDS):
    """The IP address `host` resolves to, or a `ClusterConfigError` naming it within `timeout`."""
    import socket
    import threading

    result = {}

    def lookup():
        try:
            result["address"] = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0]
        except (OSError, UnicodeError) as error:
            result["error"] = error

    thread = threading.Thread(target=lookup, name="kd-resolve", daemon=True)
    thread.start()
    thread.join(timeout)
    if "address" in result:
        return result["address"]
    reason = result.get("error") or f"no answer in {timeout:g}s"
    raise _config_error(
        f"{what} {host!r} does not resolve ({reason}): the workers could not reach each other "
        "there. Check the name (`getent hosts " + host + "`), the nodes' DNS or /etc/hosts, or "
        "write TF_CONFIG with addresses that resolve."
    )


def slurm_node_addresses(hosts, environ=None):
    """Each node's `NodeAddr` from `scontrol show node` (the name itself where unknown)."""
    environ = os.environ if environ is None else environ
    scontrol = shutil.which("scontrol", path=environ.get("PATH"))
    found = {}
    if scontrol:
        try:
            result = subprocess.run(
                [scontrol, "show", "node", "--oneliner", ",".join(hosts)], capture_output=True,
                text=True, timeout=30, env=dict(environ),
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            logger.debug("`scontrol show node` failed (%s); using the node names.", error)
        else:
            for line in result.stdout.splitlines():
                name = re.search(r"(?:^|\s)NodeName=(\S+)", line)
                address = re.search(r"(?:^|\s)NodeAddr=(\S+)", line)
                if name and address and address.group(1) not in ("(null)", ""):
                    found[name.group(1)] = address.group(1)
    return [found.get(host, host) for host in hosts]


def _slurm_default_port(environ):
    # Without a reservation: per job, with room for 8 tasks per node below
    # 65536; jobs whose ids differ by a multiple of 6000 share these.
    job = environ.get("SLURM_JOB_ID", "0")
    return 15000 + (int(job) % 6000) * 8 if job.isdigit() else 15000


def _port_ranges(ports):
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in _runs(ports))


def _runs(ports):
    runs = []
    for port in ports:
        if runs and port == runs[-1][1] + 1:
            runs[-1][1] = port
        else:
            runs.append([port, port])
    return runs


def slurm_reserved_ports(environ):
    """The ports Slurm reserved for this job step, in order (empty: none).

    Slurm reserves them (`SLURM_STEP_RESV_PORTS`, e.g. `12000-12003`) where
    slurm.conf sets `MpiParams=ports=<first>-<last>`: the same ports on
    every node of the step, and no other step of the cluster gets them
    while it runs, so two jobs sharing a node cannot collide.

    Examples:
        >>> slurm_reserved_ports({"SLURM_STEP_RESV_PORTS": "12000-12002,12007"})
        (12000, 12001, 12002, 12007)
    """
    text = environ.get("SLURM_STEP_RESV_PORTS", "").strip()
    ports = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        if not first.strip().isdigit() or not (last.strip() or first).isdigit():
            raise _config_error(f"`SLURM_STEP_RESV_PORTS`={text!r}: expected port ranges "
                                "like 12000-12003 (Slurm sets it for the step).")
        ports.extend(range(int(first), int(last or first) + 1))
    return tuple(ports)


def _slurm_task_hosts(hosts, counts, distribution):
    """(host index, local index) of every rank."""
    if distribution.startswith("cyclic"):
        placed, remaining, node = [], list(counts), 0
        while len(placed) < sum(counts):
            if remaining[node]:
                placed.append((node, counts[node] - remaining[node]))
                remaining[node] -= 1
            node = (node + 1) % len(hosts)
        return placed
    return [(node, local) for node, count in enumerate(counts) for local in range(count)]


def _port_origin(fixed, reserved):
    if fixed:
        return "KD_PORT"
    if reserved:
        return f"Slurm's reservation SLURM_STEP_RESV_PORTS={_port_ranges(reserved)}"
    return ("SLURM_JOB_ID (not reserved: jobs whose ids differ by 6000 share them on a node; "
            "set MpiParams=ports=<first>-<last> in slurm.conf so that Slurm reserves them)")


def in_slurm_step(environ):
    """Whether this process is a task of an `srun` job step."""
    return bool(environ.get("SLURM_PROCID", "").strip()) and bool(
        environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_STEP_ID")
        or environ.get("SLURM_STEPID")
    )


def slurm_placement(environ):
    """This task's `Placement` from Slurm's variables (see the module docstring).

    Raises:
        ClusterConfigError: the variables disagree (naming each one).
    """
    problems = []
    rank = _whole(environ, "SLURM_PROCID")
    count_name, count = _first(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    nodes_name, nodelist = _first(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    per_node_name, per_node = _first(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if count_name is None:
        problems.append("neither `SLURM_STEP_NUM_TASKS` nor `SLURM_NTASKS` is set")
    if nodes_name is None:
        problems.append("no node list: none of `SLURM_STEP_NODELIST`, `SLURM_JOB_NODELIST`, "
                        "`SLURM_NODELIST` is set")
    if problems:
        raise _config_error("Slurm's environment is incomplete: " + "; ".join(problems) + ".")
    tasks = _whole(environ, count_name, 1)
    if rank >= tasks:
        raise _config_error(
            f"`SLURM_PROCID`={rank} is not below `{count_name}`={tasks}: ranks run 0..{tasks - 1}. "
            "The variables come from different job steps; start the script with `srun`."
        )
    hosts = slurm_hostnames(nodelist, environ)
    if per_node_name is None:
        if tasks % len(hosts):
            raise _config_error(
                f"`{count_name}`={tasks} tasks do not divide evenly over the {len(hosts)} nodes "
                f"of `{nodes_name}`={nodelist!r}, and `SLURM_STEP_TASKS_PER_NODE` is not set."
            )
        counts = [tasks // len(hosts)] * len(hosts)
    else:
        counts = expand_tasks_per_node(per_node)
    if len(counts) != len(hosts):
        problems.append(
            f"`{per_node_name}`={per_node!r} gives {len(counts)} node(s) but `{nodes_name}`="
            f"{nodelist!r} names {len(hosts)}"
        )
    elif sum(counts) != tasks:
        problems.append(f"`{per_node_name}`={per_node!r} adds up to {sum(counts)} tasks, not "
                        f"`{count_name}`={tasks}")
    distribution = environ.get("SLURM_DISTRIBUTION", "block").strip().lower() or "block"
    if not distribution.startswith(("block", "cyclic")):
        problems.append(
            f"`SLURM_DISTRIBUTION`={distribution!r}: kd places ranks for the block (default) and "
            "cyclic distributions only; run `srun --distribution=block`"
        )
    if problems:
        raise _config_error("Slurm's environment is inconsistent:\n  - " + "\n  - ".join(problems))
    placed = _slurm_task_hosts(hosts, counts, distribution)
    node, local = placed[rank]
    checks = (("SLURM_LOCALID", str(local)), ("SLURMD_NODENAME", hosts[node]))
    for name, expected in checks:
        actual = environ.get(name, "").strip()
        if actual and actual.split(".")[0] != expected.split(".")[0]:
            problems.append(f"`{name}`={actual!r}, but a {distribution.split(',')[0]} distribution "
                            f"puts rank {rank} at {expected!r}")
    if problems:
        raise _config_error(
            "kd cannot place this Slurm task:\n  - " + "\n  - ".join(problems)
            + "\nStart the tasks with `srun` (block or cyclic distribution), or write TF_CONFIG."
        )
    fixed = bool(environ.get("KD_PORT", "").strip())
    reserved = () if fixed else slurm_reserved_ports(environ)
    base = _port(environ, reserved[0] if reserved else _slurm_default_port(environ))
    node_addresses = slurm_node_addresses(hosts, environ)
    machines = [resolve(address, "The Slurm node" if address == host else
                        f"The address of Slurm node {host!r} (NodeAddr)")
                for host, address in zip(hosts, node_addresses)]
    ports = task_ports([machines[n] for n, _ in placed], base, reserved)
    addresses = tuple(f"{node_addresses[n]}:{port}" for (n, _), port in zip(placed, ports))
    return Placement(
        "slurm", addresses, rank, local_index=local, local_tasks=counts[node],
        ps=_ps_count(environ), machines=tuple(machines[n] for n, _ in placed), base_port=base,
        reserved_ports=reserved,
        detail=(f"SLURM_PROCID={rank} of {count_name}={tasks} on {len(hosts)} node(s) from "
                f"{nodes_name}={nodelist} ({per_node_name or 'even split'}, {distribution} "
                f"distribution), ports from {_port_origin(fixed, reserved)}"),
    )


# Kubernetes.


def _host_port_list(text, name, default_port):
    addresses, bad = [], []
    for item in (part.strip() for part in text.split(",")):
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, str(default_port)
        if (not host or host_problem(host, "") or not port.isdigit()
                or not 1 <= int(port) <= 65535):
            bad.append(item)
        else:
            addresses.append(f"{host}:{int(port)}")
    if bad:
        raise _config_error(f"`{name}` has entries that are not 'host:port': {bad}.")
    return addresses


def kubernetes_placement(environ):
    """This pod's `Placement` from an Indexed Job's variables (module docstring).

    Raises:
        ClusterConfigError: a variable is missing or they disagree (naming each).
    """
    pods = _whole(environ, "KD_NUM_PODS", 1)
    if not environ.get("JOB_COMPLETION_INDEX", "").strip():
        raise _config_error(
            f"`KD_NUM_PODS`={pods} is set but `JOB_COMPLETION_INDEX` is not: kd reads each pod's "
            "index from an Indexed Job (`completionMode: Indexed`, or a JobSet), where "
            "Kubernetes sets it."
        )
    index = _whole(environ, "JOB_COMPLETION_INDEX")
    if index >= pods:
        raise _config_error(
            f"`JOB_COMPLETION_INDEX`={index} is not below `KD_NUM_PODS`={pods}: set KD_NUM_PODS "
            "to the Job's `completions`."
        )
    port = _port(environ, KUBERNETES_PORT)
    if environ.get("KD_HOSTS", "").strip():
        addresses = _host_port_list(environ["KD_HOSTS"], "KD_HOSTS", port)
        if len(addresses) != pods:
            raise _config_error(
                f"`KD_HOSTS` lists {len(addresses)} pod(s) but `KD_NUM_PODS`={pods}."
            )
        detail = "KD_HOSTS"
    else:
        service_name, service = _first(environ, "KD_SERVICE", "JOBSET_NAME")
        hostname = environ.get("HOSTNAME", "").strip()
        suffix = f"-{index}"
        problems = []
        if service is None:
            problems.append(
                "`KD_SERVICE` is not set: give the headless Service's name (the pod template's "
                "`subdomain`)"
            )
        if not hostname.endswith(suffix) or len(hostname) == len(suffix):
            problems.append(
                f"`HOSTNAME`={hostname!r} does not end with '-{index}' (`JOB_COMPLETION_INDEX`), as "
                "an Indexed Job's pods do; list the pods in `KD_HOSTS` instead"
            )
        elif host_problem(service, ""):
            problems.append(host_problem(service, f"`{service_name}`") + "; give the headless "
                            "Service's name (the pod template's `subdomain`)")
        if not problems and host_problem(hostname, ""):
            problems.append(host_problem(hostname, "`HOSTNAME`"))
        if problems:
            raise _config_error("kd cannot name this Job's pods:\n  - " + "\n  - ".join(problems))
        prefix = hostname[: -len(suffix)]
        addresses = [f"{prefix}-{i}.{service}:{port}" for i in range(pods)]
        detail = f"{prefix}-<index>.{service} from HOSTNAME and {service_name}"
    # Pods' names resolve once the pods run, so they are not resolved here;
    # each pod is its own machine.
    machines = () if detail == "KD_HOSTS" else tuple(a.rpartition(":")[0] for a in addresses)
    return Placement(
        "kubernetes", tuple(addresses), index, ps=_ps_count(environ), machines=machines,
        base_port=None if detail == "KD_HOSTS" else port,
        detail=f"JOB_COMPLETION_INDEX={index} of KD_NUM_PODS={pods}; pods {detail}, port {port}",
    )


# TPU.


def tpu_placement(environ):
    """The TPU client's `Placement`: one process drives the pod's hosts."""
    hosts = [h.strip() for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    name_var, name = _first(environ, "TPU_NAME", "COLAB_TPU_ADDR")
    detail = f"{name_var}={name}" if name_var else f"TPU_WORKER_HOSTNAMES ({len(hosts)} host(s))"
    return Placement("tpu", tuple(f"{h}:{TPU_PORT}" for h in hosts), 0, detail=detail)


def detect(environ=None):
    """The `Placement` this environment describes, or None (TF_CONFIG or none).

    TF_CONFIG, when set, wins and is parsed by `kd.cluster_info` itself;
    then Slurm, Kubernetes (opted in by `KD_NUM_PODS`), and TPU.

    Raises:
        ClusterConfigError: a source's variables are incomplete or disagree.
    """
    environ = os.environ if environ is None else environ
    if environ.get("TF_CONFIG", "").strip():
        return None
    if in_slurm_step(environ):
        if environ.get("KD_NUM_PODS", "").strip():
            raise _config_error(
                f"This process is an `srun` task (SLURM_PROCID={environ.get('SLURM_PROCID')}) and "
                f"also has Kubernetes' `KD_NUM_PODS`={environ['KD_NUM_PODS']!r}: kd cannot tell "
                "which cluster it is in. Unset KD_NUM_PODS (on Slurm), or do not start the pod's "
                "command under srun (on Kubernetes)."
            )
        return slurm_placement(environ)
    if environ.get("SLURM_PROCID", "").strip() and environ.get("SLURM_NTASKS", "1").strip() not in ("", "1"):
        logger.warning(
            "SLURM_NTASKS=%s but this process is not an `srun` task (no SLURM_STEP_* variables): "
            "it trains alone. Start the script with `srun` to train on every task.",
            environ.get("SLURM_NTASKS"),
        )
    if environ.get("KD_NUM_PODS", "").strip():
        return kubernetes_placement(environ)
    if any(environ.get(v, "").strip() for v in ("TPU_NAME", "COLAB_TPU_ADDR", "TPU_WORKER_HOSTNAMES")):
        return tpu_placement(environ)
    return None
