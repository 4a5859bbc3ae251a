"""A real Slurm cluster on this machine for the tests: munge, a controller and two nodes.

Slurm and munge come from the system's packages (`tools/setup_slurm.sh`
installs them). Everything runs on loopback with its own ports, its own
munge socket and key, and its state under one temporary directory: two
`slurmd -N kdn<i>` share this host as nodes kdn1 and kdn2 (Debian's build
runs several slurmd on one host when each has its own `Port` and spool).
Every job runs with `KD_SLURM_TEST=<directory>` in its environment, so the
processes a test left behind are found (`leftovers`) and ended by pid.
"""

import fcntl
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import portpicker

from keras_distrib.cluster import ports

NODES = ("kdn1", "kdn2")
DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol", "squeue", "scancel")
MARKER = "KD_SLURM_TEST"
# A requeued job waits for its credential's lifetime + 1 s before it starts
# again (120 s by default); 10 s keeps the requeue tests short.
CRED_EXPIRE = 10
# Ports Slurm reserves for job steps (MpiParams=ports): a block per cluster,
# so that clusters of parallel test sessions on this host never share one.
PORT_BLOCK = 64
_BLOCKS = range(20000, 30000 - PORT_BLOCK, PORT_BLOCK)


def _hold_port_block():
    """(first port, lock fd) of a free block no other test cluster here holds."""
    folder = os.path.join("/tmp", f"kd-slurm-test-ports-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    for first in random.sample(list(_BLOCKS), len(_BLOCKS)):
        fd = os.open(os.path.join(folder, f"{first}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        if all(ports.port_is_free(port) for port in range(first, first + PORT_BLOCK)):
            return first, fd
        os.close(fd)
    raise RuntimeError(f"no free block of {PORT_BLOCK} ports in 20000-29999 for Slurm's MpiParams")

_CONF = """\
ClusterName=kdtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.sock,cred_expire={cred_expire}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
MpiParams=ports={resv_first}-{resv_last}
MailProg=/bin/true
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=10
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
{nodes}
PartitionName=debug Nodes={node_list} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def missing_commands():
    """The Slurm and munge commands that are not installed (empty: all are)."""
    paths = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [name for name in DAEMONS if shutil.which(name, path=paths) is None]


def _which(name):
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def _pid_environ_has(pid, needle):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read().split(b"\0")
    except OSError:
        return False


class Cluster:
    """Starts munged, slurmctld and a slurmd per node; `stop()` ends all of them by pid."""

    def __init__(self, root):
        self.root = str(root)
        self.processes = {}
        self._port_lock = None
        self.conf = os.path.join(self.root, "slurm.conf")
        # The daemons' environment; commands (and so jobs) get the marker too.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        self.env.update(SLURM_CONF=self.conf)
        self.env.pop("TF_CONFIG", None)

    # Life cycle.

    def start(self, timeout=60):
        for sub in ("munge", "state", "log", *(f"spool/{n}" for n in NODES)):
            os.makedirs(os.path.join(self.root, sub), exist_ok=True)
        os.chmod(self.root, 0o755)
        os.chmod(os.path.join(self.root, "munge"), 0o700)
        key = os.path.join(self.root, "munge", "munge.key")
        subprocess.run([_which("mungekey"), "--create", "--keyfile", key, "--bits", "1024", "--force"],
                       check=True, capture_output=True, timeout=30)
        os.chmod(key, 0o400)
        ports = [portpicker.pick_unused_port() for _ in range(2 + len(NODES))]
        resv_first, self._port_lock = _hold_port_block()
        nodes = "\n".join(
            f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=2 "
            "State=UNKNOWN" for name, port in zip(NODES, ports[2:]))
        with open(self.conf, "w") as f:
            f.write(_CONF.format(root=self.root, ctld_port=ports[0], slurmd_port=ports[1],
                                 cred_expire=CRED_EXPIRE, nodes=nodes, node_list=",".join(NODES),
                                 resv_first=resv_first, resv_last=resv_first + PORT_BLOCK - 1))
        munge = os.path.join(self.root, "munge")
        self._daemon("munged", [_which("munged"), "--foreground", "--force",
                                f"--socket={munge}/munge.sock", f"--key-file={key}",
                                f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/seed",
                                f"--log-file={self.root}/log/munged.log"])
        self._wait(lambda: os.path.exists(f"{munge}/munge.sock"), 10, "munged's socket")
        self._daemon("slurmctld", [_which("slurmctld"), "-D", "-f", self.conf])
        for name in NODES:
            self._daemon(f"slurmd {name}", [_which("slurmd"), "-D", "-f", self.conf, "-N", name])
        self._wait(self._nodes_idle, timeout, "both nodes idle (sinfo)")
        return self

    def _daemon(self, label, argv):
        log = open(os.path.join(self.root, "log", label.replace(" ", ".") + ".out"), "w")
        self.processes[label] = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def _wait(self, ready, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [label for label, p in self.processes.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}:\n" + self.logs())
            if ready():
                return
            time.sleep(0.3)
        raise RuntimeError(f"no {what} after {timeout}s:\n" + self.logs())

    def _nodes_idle(self):
        result = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
        states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
        return all(states.get(name, "").rstrip("*") == "idle" for name in NODES)

    def logs(self, lines=30):
        text = []
        for name in sorted(os.listdir(os.path.join(self.root, "log"))):
            with open(os.path.join(self.root, "log", name), errors="replace") as f:
                tail = f.read().splitlines()[-lines:]
            text.append(f"--- {name}\n" + "\n".join(tail))
        return "\n".join(text)

    def stop(self):
        """Cancels every job, ends what they left and the daemons, each by pid."""
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "--user", "root"], check=False)
            deadline = time.monotonic() + 30
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.5)
        self.kill_leftovers()
        for label in reversed(list(self.processes)):
            process = self.processes[label]
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=15)
        self.kill_leftovers()
        if self._port_lock is not None:
            os.close(self._port_lock)
            self._port_lock = None

    # Using it.

    def run(self, argv, check=True, timeout=60, **env):
        """Runs a Slurm command (`sbatch`, `srun`, ...) against this cluster."""
        env = {**self.env, MARKER: self.root, **{k: str(v) for k, v in env.items()}}
        result = subprocess.run([_which(argv[0]), *argv[1:]], env=env,
                                capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited with {result.returncode}:\n"
                               f"{result.stdout}{result.stderr}")
        return result

    def sbatch(self, script, *options, **env):
        """Submits `script` (a path); returns the job id."""
        result = self.run(["sbatch", "--parsable", *options, script], **env)
        return result.stdout.strip().split(";")[0]

    def jobs(self):
        """Ids of the jobs still pending or running."""
        result = self.run(["squeue", "-h", "-o", "%i"], check=False)
        return result.stdout.split()

    def state(self, job):
        """The job's state (`COMPLETED`, `FAILED`, `PENDING`, ...) and exit code `code:signal`."""
        result = self.run(["scontrol", "show", "job", "--oneliner", job], check=False)
        fields = dict(item.split("=", 1) for item in result.stdout.split() if "=" in item)
        return fields.get("JobState"), fields.get("ExitCode"), int(fields.get("Restarts", 0))

    def wait(self, job, timeout, until=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                         "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE")):
        """Waits until the job reaches a state of `until`; returns `state()`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state(job)
            if state[0] in until:
                return state
            time.sleep(0.5)
        raise AssertionError(f"job {job} still {self.state(job)} after {timeout}s\n" + self.logs())

    def lose_node(self, name):
        """Takes node `name` away for good, as a failed machine: its slurmd stops answering
        (SIGSTOP), every process of a job on it is killed, and the node is marked DOWN (what
        slurmctld does itself after `SlurmdTimeout`). `restore_node` brings it back."""
        os.kill(self.processes[f"slurmd {name}"].pid, signal.SIGSTOP)
        needle = f"SLURMD_NODENAME={name}".encode()
        for pid in self.leftovers():
            if _pid_environ_has(pid, needle):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.run(["scontrol", "update", f"NodeName={name}", "State=DOWN", "Reason=lost by a test"])

    def restore_node(self, name, timeout=60):
        """Node `name` back in service after `lose_node` (idle, like the others)."""
        os.kill(self.processes[f"slurmd {name}"].pid, signal.SIGCONT)
        self.run(["scontrol", "update", f"NodeName={name}", "State=RESUME"], check=False)
        self._wait(self._nodes_idle, timeout, f"node {name} back in service")

    def leftovers(self):
        """Pids of processes started by this cluster's jobs that still run."""
        needle = f"{MARKER}={self.root}".encode()
        own = {os.getpid(), *(p.pid for p in self.processes.values())}
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in own]
        return [pid for pid in pids if _pid_environ_has(pid, needle) and not _zombie(pid)]

    def kill_leftovers(self):
        for pid in self.leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):  # it ended while we looked (ENOENT, ESRCH, or an empty read)
        return True


if __name__ == "__main__":  # a manual check: python -m tests._slurm
    import tempfile

    cluster = Cluster(tempfile.mkdtemp(prefix="kd_slurm_")).start()
    try:
        print(cluster.run(["srun", "-N2", "-n2", "hostname"]).stdout, file=sys.stderr)
    finally:
        cluster.stop()
