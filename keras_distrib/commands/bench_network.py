"""`keras-distrib bench --network`: steps per second over a link with latency.

On one machine the workers of a cluster talk over loopback, where an
all-reduce costs microseconds; on a cluster each one is a network round trip,
and a step pays one per collective it makes. This benchmark gives each worker
process a network namespace of its own, joins the namespaces by a link that
holds every packet `delay` ms (one way, so a round trip takes twice that, as
`tc netem` on each worker's interface does), and times kd `fit`, tf-keras
`fit` and TensorFlow's custom-loop tutorial on that link, with the same model
(the benchmark MLP) and global batch (64). `--model cnn_bn` times a CNN with
two BatchNormalization layers instead: kd's global statistics (its default,
exact), kd's `batch_norm="per_replica"`, Keras 3's `synchronized=True` (in
the tutorial's loop: Keras 3's `fit` of this model failed under
MultiWorkerMirroredStrategy)
and tf-keras (per-replica statistics); `--model contrastive` a dual encoder
with in-batch negatives: kd `fit` (the global batch gathered where rows meet)
and a loop gathering it by hand as SimCLR's code does. Steps per second count from the
end of an epoch's first step to the end of its last: what a long epoch
feels, without `fit`'s set-up and epoch end.

The link is one of two kinds:

- `veth`: a veth pair per worker to a bridge in a namespace of its own, with
  `tc qdisc ... netem delay` on the worker's end.
- `relay`: a TUN device in each worker's namespace; a thread of this process
  reads every packet, holds it `delay` ms and writes it to the TUN device of
  the namespace its destination address lives in. For kernels built without
  `sch_netem` (some VMs, this project's CI machine); its 0 ms row includes the relay's own forwarding.

`auto` (the default) takes veth where the kernel has netem, else the relay. The
delays change while the workers wait between timed epochs (the first worker
asks for each one), so the variants and delays take turns, repeat after
repeat, in one cluster per worker count: a machine that slows down affects all
of them alike. Only private addresses inside namespaces of this run are used;
no interface of the host is touched.

Everything a run makes is removed on success, error, timeout, SIGTERM, SIGINT
and SIGHUP: its processes (by process group, then every pid `ip netns pids`
still lists), its devices and its namespaces. A run ended by SIGKILL leaves
its namespaces (its workers die with it: `PR_SET_PDEATHSIG`); the next run
removes the namespaces of runs whose process is gone.
"""

import argparse
import contextlib
import fcntl
import heapq
import json
import os
import queue
import re
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

from keras_distrib import collectives
from keras_distrib.commands import bench
from keras_distrib.commands import bench_bandwidth
from keras_distrib.cluster import _guard
from keras_distrib.cluster import task_process
from keras_distrib import validation

__all__ = [
    "LINKS",
    "NetworkBenchError",
    "main",
    "problems",
    "run",
]

PREFIX = "kdbench"
SUBNET = "10.213.0"
WORKER_PORT = 12345
PROBE_PORT = 12346
LINKS = ("auto", "veth", "relay")
# Report name -> the variant of `keras_distrib.commands.bench` it times.
VARIANTS = {
    "kd_fit": "kd_fit_mirrored",
    "tf_keras_fit": "tf_keras_fit_mirrored",
    "tutorial_loop": "tutorial_loop_per_step",
}
RATIOS = {
    "kd_fit / tf_keras_fit": ("kd_fit", "tf_keras_fit"),
    "kd_fit / tutorial_loop": ("kd_fit", "tutorial_loop"),
}
MODELS = ("mlp", "cnn_bn", "contrastive", "mlp_buckets")
# --model cnn_bn: what BatchNormalization's statistics cost per step.
BN_VARIANTS = {
    "kd_fit": "kd_fit_mirrored",
    "kd_fit_bn_per_replica": "kd_fit_mirrored_bn_per_replica",
    "keras_sync_bn_loop": "tutorial_loop_sync_bn",
    "tf_keras_fit": "tf_keras_fit_mirrored",
}
BN_RATIOS = {
    "kd_fit / kd_fit_bn_per_replica": ("kd_fit", "kd_fit_bn_per_replica"),
    "kd_fit / keras_sync_bn_loop": ("kd_fit", "keras_sync_bn_loop"),
    "kd_fit / tf_keras_fit": ("kd_fit", "tf_keras_fit"),
}


# --model contrastive: in-batch negatives, kd gathering the global batch itself
# against a loop gathering it by hand (SimCLR's code; Keras 3's `fit` fails
# under MultiWorkerMirroredStrategy).
CONTRASTIVE_VARIANTS = {
    "kd_fit": "kd_fit_mirrored",
    "gathered_loop": "gathered_loop",
}
CONTRASTIVE_RATIOS = {
    "kd_fit / gathered_loop": ("kd_fit", "gathered_loop"),
}


# --model mlp_buckets: the latency benchmark's MLP with kd's gradient buckets
# chosen ("auto": one all-reduce for this model), asked for as one all-reduce
# (kd before buckets), and forced into small buckets (2 collectives instead of 1).
BUCKETS_VARIANTS = {
    "kd_fit": "kd_fit_mirrored",
    "kd_fit_one": "kd_fit_mirrored_one_all_reduce",
    "kd_fit_buckets": "kd_fit_mirrored_buckets",
    "tutorial_loop": "tutorial_loop_per_step",
}
BUCKETS_RATIOS = {
    "kd_fit / kd_fit_one": ("kd_fit", "kd_fit_one"),
    "kd_fit_buckets / kd_fit_one": ("kd_fit_buckets", "kd_fit_one"),
    "kd_fit / tutorial_loop": ("kd_fit", "tutorial_loop"),
}


def _variants(model):
    """The report's variants and ratios for `model`."""
    return {"cnn_bn": (BN_VARIANTS, BN_RATIOS),
            "contrastive": (CONTRASTIVE_VARIANTS, CONTRASTIVE_RATIOS),
            "mlp_buckets": (BUCKETS_VARIANTS, BUCKETS_RATIOS)}.get(model, (VARIANTS, RATIOS))
# The relay's MTU: large, so a gradient all-reduce is a few packets.
RELAY_MTU = 65000
_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000


class NetworkBenchError(RuntimeError):
    """The network benchmark cannot run here, or a run failed (the message says which and why)."""


def _tool(name):
    """The path of `name`, also looked for in /usr/sbin and /sbin (not on every user's PATH)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def _command(argv, what):
    completed = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if completed.returncode != 0:
        raise NetworkBenchError(
            f"{what} failed (`{' '.join(argv)}`, exit {completed.returncode}): "
            f"{completed.stderr.strip() or completed.stdout.strip()}"
        )
    return completed.stdout


def _ip(*args):
    return _command([_tool("ip"), *args], "ip")


def _netem_missing():
    """Why `tc netem` cannot be used here (tried on a probe namespace's own loopback), or None."""
    if _tool("tc") is None:
        return "`tc` is missing: install iproute2 (`apt-get install iproute2`)"
    name = f"{PREFIX}-{os.getpid()}-probe"
    _ip("netns", "add", name)
    try:
        completed = subprocess.run(
            [_tool("ip"), "netns", "exec", name, _tool("tc"), "qdisc", "add", "dev", "lo", "root",
             "netem", "delay", "1ms"], capture_output=True, text=True, timeout=30)
    finally:
        subprocess.run([_tool("ip"), "netns", "del", name], capture_output=True, timeout=30)
    if completed.returncode == 0:
        return None
    return (f"the kernel has no netem qdisc (tc: {completed.stderr.strip() or completed.returncode}); "
            f"load it with `modprobe sch_netem` (Ubuntu: package linux-modules-extra-$(uname -r))")


def problems(link="auto", delays=(0, 1, 5)):
    """What stops the network benchmark here, and the link it would use.

    Args:
        link: `"auto"`, `"veth"` or `"relay"` (see the module docstring).
        delays: The one-way delays in ms it would run at.

    Returns:
        `(problems, link, note)`: messages, each naming what is missing and
        how to get it (empty when it can run); the link it resolved
        (`"veth"` or `"relay"`, None when it cannot run); and why `auto`
        took the relay (else None).
    """
    found = []
    if os.geteuid() != 0:
        found.append("it needs root (it makes network namespaces and devices): run it as root, "
                     "e.g. `sudo -E env PATH=$PATH keras-distrib bench --network`.")
    if _tool("ip") is None:
        found.append("`ip` is missing: install iproute2 (`apt-get install iproute2`).")
    if found:
        return found, None, None
    try:
        probe = f"{PREFIX}-{os.getpid()}-check"
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except NetworkBenchError as error:
        return [f"network namespaces do not work here ({error}); a container needs CAP_SYS_ADMIN "
                f"and CAP_NET_ADMIN (e.g. `docker run --cap-add SYS_ADMIN --cap-add NET_ADMIN`)."], None, None
    if link != "relay" and not any(delay > 0 for delay in delays):
        return [], "veth", None  # no delay: no qdisc needed
    why_not = None
    if link != "relay":
        why_not = _netem_missing()
        if why_not is None:
            return [], "veth", None
        if link == "veth":
            return [f"`--link veth` delays packets with tc netem, but {why_not}; or use `--link relay`."], None, None
    if not os.path.exists("/dev/net/tun"):
        return ["the relay link needs /dev/net/tun (a container needs `--device /dev/net/tun`)"
                + (f"; and the veth link cannot delay packets: {why_not}" if why_not else "") + "."], None, None
    note = f"netem is unavailable ({why_not}), so the link is the relay" if why_not else None
    return [], "relay", note


def _setns(name):
    """Moves the calling thread (only) into the network namespace `name`."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        _guard.setns_fd(fd, _guard.CLONE_NEWNET)
    except OSError as error:
        raise NetworkBenchError(f"setns into {name}: {os.strerror(error.errno)}") from None
    finally:
        os.close(fd)


def _in_namespace(name, make):
    """`make()` called in a thread that has joined namespace `name`.

    Sockets and TUN devices belong to the namespace they were made in,
    whichever thread uses them later; this process's own threads stay put.
    """
    outcome = {}

    def target():
        try:
            _setns(name)
            outcome["value"] = make()
        except BaseException as error:  # handed to the caller below
            outcome["error"] = error

    thread = threading.Thread(target=target, name=f"in-{name}", daemon=True)
    thread.start()
    thread.join(timeout=30)
    if "error" in outcome:
        raise outcome["error"]
    if "value" not in outcome:
        raise NetworkBenchError(f"setting up namespace {name} took more than 30 s")
    return outcome["value"]


def _open_tun(device):
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", device.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    os.set_blocking(fd, False)
    return fd


class _Relay:
    """Forwards IPv4 packets between TUN devices by destination address, each after `delay_ms`."""

    def __init__(self, fds_by_address):
        self._by_address = {socket.inet_aton(a): fd for a, fd in fds_by_address.items()}
        self._fds = list(self._by_address.values())
        self.delay_ms = 0.0
        self.rate_gbit = 0.0  # 0: no limit
        self._free_at = {}  # a sending device -> when its link is free again
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._forward, name="kdbench-relay", daemon=True)
        self._thread.start()

    def _forward(self):
        held = []  # (due time, sequence, fd, packet): a heap
        sequence = 0
        while not self._stop.is_set():
            now = time.monotonic()
            while held and held[0][0] <= now:
                _, _, fd, packet = heapq.heappop(held)
                try:
                    os.write(fd, packet)
                except OSError:
                    pass  # a full queue or a device going away: the packet is lost, as on a wire
            wait = min(0.1, held[0][0] - now) if held else 0.1
            ready, _, _ = select.select(self._fds, [], [], max(wait, 0.0))
            now = time.monotonic()
            for fd in ready:
                while True:
                    try:
                        packet = os.read(fd, RELAY_MTU + 64)
                    except OSError:  # nothing more to read (EAGAIN)
                        break
                    target = self._by_address.get(packet[16:20]) if packet[:1] and packet[0] >> 4 == 4 else None
                    if target is not None:
                        sequence += 1
                        heapq.heappush(held, (self._due(fd, len(packet), now), sequence, target, packet))

    def _due(self, source, size, now):
        """When a packet of `size` bytes from device `source` arrives: its sender's link
        sends one packet after another at `rate_gbit`, then the delay."""
        sent = now
        if self.rate_gbit > 0:
            sent = max(now, self._free_at.get(source, 0.0)) + size * 8 / (self.rate_gbit * 1e9)
            self._free_at[source] = sent
        return sent + self.delay_ms / 1000.0

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        for fd in self._fds:
            os.close(fd)
        self._fds = []


class _Testbed:
    """The namespaces, link and worker processes of one cluster; `close()` removes them all."""

    def __init__(self, workers, link):
        self.run_id = f"{PREFIX}-{os.getpid()}-{workers}w"
        self.link = link
        self.names = [f"{self.run_id}-{i}" for i in range(workers)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(workers)]
        self.bridge = f"{self.run_id}-br" if link == "veth" else None
        self.processes = []
        self.logs = []
        self._relay = None
        self._netem_on = False
        self.delay_ms = 0.0
        self.rate_gbit = 0.0
        self._made = []
        try:
            for name in self.names + ([self.bridge] if self.bridge else []):
                _ip("netns", "add", name)
                self._made.append(name)
                _ip("-n", name, "link", "set", "lo", "up")
            self._make_link()
        except BaseException:
            self.close()
            raise

    def _make_link(self):
        if self.link == "veth":
            _ip("-n", self.bridge, "link", "add", "kdbr", "type", "bridge")
            _ip("-n", self.bridge, "link", "set", "kdbr", "up")
            for i, (name, address) in enumerate(zip(self.names, self.addresses)):
                # Made inside the worker's namespace, its peer moved to the
                # bridge's: neither end ever appears among the host's devices.
                _ip("-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}",
                    "netns", self.bridge)
                _ip("-n", self.bridge, "link", "set", f"p{i}", "master", "kdbr", "up")
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
            return
        fds = {}
        try:
            for name, address in zip(self.names, self.addresses):
                fds[address] = _in_namespace(name, lambda: _open_tun("kdlink"))
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", "kdlink")
                _ip("-n", name, "link", "set", "kdlink", "mtu", str(RELAY_MTU), "up")
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        self._relay = _Relay(fds)

    def set_delay(self, delay_ms):
        """Every packet between workers now waits `delay_ms` (one way)."""
        self.delay_ms = float(delay_ms)
        if self._relay is not None:
            self._relay.delay_ms = float(delay_ms)
            return
        if delay_ms == 0 and not self._netem_on:
            return
        rate = ["rate", f"{self.rate_gbit}gbit", "limit", "100000"] if self.rate_gbit else []
        for name in self.names:
            _command([_tool("ip"), "netns", "exec", name, _tool("tc"), "qdisc", "replace", "dev", "eth0",
                      "root", "netem", "delay", f"{delay_ms}ms", *rate], "tc")
        self._netem_on = True

    def set_rate(self, rate_gbit):
        """Each worker now sends at most `rate_gbit` Gbit/s (0: no limit), as a NIC of that rate.

        veth: `tc tbf` on each worker's end (`netem ... rate` once a delay is
        set, netem being its root qdisc then); the relay paces each
        sender's packets itself.
        """
        self.rate_gbit = float(rate_gbit)
        if self._relay is not None:
            self._relay.rate_gbit = self.rate_gbit
            return
        for name in self.names:
            tc = [_tool("ip"), "netns", "exec", name, _tool("tc"), "qdisc"]
            if self._netem_on:
                _command(tc + ["replace", "dev", "eth0", "root", "netem", "delay", f"{self.delay_ms}ms"]
                         + (["rate", f"{self.rate_gbit}gbit", "limit", "100000"] if self.rate_gbit else []),
                         "tc")
            elif self.rate_gbit:
                # A burst of at least one timer tick's bytes (rate / HZ, HZ <= 1000) and one
                # 64 KB segment; a queue of 50 ms before packets are dropped.
                burst = max(int(self.rate_gbit * 1e9 / 8 / 250), 2**16 + 2**12)
                _command(tc + ["replace", "dev", "eth0", "root", "tbf", "rate", f"{self.rate_gbit}gbit",
                               "burst", str(burst), "latency", "50ms"], "tc")
            else:
                subprocess.run(tc + ["del", "dev", "eth0", "root"], capture_output=True, timeout=30)

    def throughput_gbit(self, megabytes=None):
        """Gbit/s of a bulk TCP transfer from the first worker's namespace to the second's.

        About half a second's worth at the set rate (16 MB without a limit).
        """
        size = int((megabytes or (min(16.0, self.rate_gbit * 1e3 / 8 / 2) if self.rate_gbit else 16.0)) * 1e6)
        with self._probe_connection(connect_timeout=30) as (client, server):
            for end in (client, server):
                end.settimeout(60)
            received = {"bytes": 0}

            def drain():
                while received["bytes"] < size:
                    chunk = server.recv(1 << 20)
                    if not chunk:
                        break
                    received["bytes"] += len(chunk)
                server.sendall(b"y")

            reader = threading.Thread(target=drain, name="kdbench-drain", daemon=True)
            started = time.perf_counter()
            reader.start()
            client.sendall(bytes(size))
            client.recv(1)
            seconds = time.perf_counter() - started
            reader.join(timeout=10)
        return size * 8 / seconds / 1e9

    def round_trip_ms(self, samples=5):
        """Median milliseconds of a 1-byte TCP round trip from the first worker's namespace to the second's."""
        with self._probe_connection(connect_timeout=10) as (client, server):
            for end in (client, server):
                end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                end.settimeout(10)
            times = []
            for _ in range(samples):
                started = time.perf_counter()
                client.sendall(b"x")
                server.recv(1)
                server.sendall(b"y")
                client.recv(1)
                times.append((time.perf_counter() - started) * 1000.0)
        return statistics.median(times)

    @contextlib.contextmanager
    def _probe_connection(self, connect_timeout):
        """A TCP connection from the first worker's namespace (client) to the second's (server), closed after."""
        listener = _in_namespace(self.names[1], lambda: socket.create_server((self.addresses[1], PROBE_PORT)))
        try:
            client = _in_namespace(
                self.names[0],
                lambda: socket.create_connection((self.addresses[1], PROBE_PORT), timeout=connect_timeout))
            listener.settimeout(connect_timeout)
            server, _ = listener.accept()
            with client, server:
                yield client, server
        finally:
            listener.close()

    def start(self, argv_for, env_for, log_dir):
        """Starts worker i as `argv_for(i)` in namespace i; the first one's stdout and stdin are pipes."""
        for i, name in enumerate(self.names):
            log_path = os.path.join(log_dir, f"worker{i}.log")
            self.logs.append(log_path)
            with open(log_path, "w") as log:
                argv = task_process.guarded([_tool("ip"), "netns", "exec", name, *argv_for(i)])
                self.processes.append(subprocess.Popen(
                    argv, env=env_for(i), start_new_session=True, text=True,
                    stdin=subprocess.PIPE if i == 0 else subprocess.DEVNULL,
                    stdout=subprocess.PIPE if i == 0 else log, stderr=log,
                ))

    def close(self):
        """Kills every process, stops the link and deletes the namespaces; safe to call twice."""
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)  # the guard and the worker
        for name in self._made:
            self._kill_inside(name)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
            for stream in (process.stdin, process.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        self.processes = []
        if self._relay is not None:
            self._relay.close()
            self._relay = None
        for name in reversed(self._made):
            subprocess.run([_tool("ip"), "netns", "del", name], capture_output=True, timeout=30)
        self._made = []

    @staticmethod
    def _kill_inside(name):
        listed = subprocess.run([_tool("ip"), "netns", "pids", name], capture_output=True, text=True,
                                timeout=30)
        for pid in listed.stdout.split():
            with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                os.kill(int(pid), signal.SIGKILL)


def _remove_stale():
    """Deletes the namespaces of earlier runs whose process is gone (a run ended by SIGKILL)."""
    listed = subprocess.run([_tool("ip"), "netns", "list"], capture_output=True, text=True, timeout=30)
    for line in listed.stdout.splitlines():
        match = re.match(rf"({PREFIX}-(\d+)-\S+)", line.strip())
        if match is None or os.path.exists(f"/proc/{match.group(2)}"):
            continue
        _Testbed._kill_inside(match.group(1))
        subprocess.run([_tool("ip"), "netns", "del", match.group(1)], capture_output=True, timeout=30)


class _Stopped(Exception):
    def __init__(self, signum):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def _signals_raise():
    """SIGTERM and SIGHUP raise `_Stopped` (SIGINT raises KeyboardInterrupt), so `finally` cleans up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise _Stopped(signum)

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _tail(path, lines=25):
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])
    return ""


def _one_cluster(workers, *, link, delays, steps, repeats, deadline, print_fn, model="mlp",
                 sweep=()):
    """Trains on `workers` workers at each delay; returns (timings, round trips, throughputs).

    `sweep`: extra worker arguments of the bandwidth sweep (`--rates`, `--gradient-mb`).
    """
    testbed = _Testbed(workers, link)
    try:
        spec = {"worker": [f"{address}:{WORKER_PORT}" for address in testbed.addresses]}
        base_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
        worker_argv = [sys.executable, "-m", "keras_distrib.commands.bench_network", "--worker",
                       "--steps", str(steps), "--repeats", str(repeats), "--model", model,
                       "--delays", ",".join(str(d) for d in delays), "--run-id", testbed.run_id, *sweep]
        with tempfile.TemporaryDirectory(prefix=f"{PREFIX}-") as log_dir:
            testbed.start(
                lambda i: worker_argv,
                lambda i: {**base_env, "TF_CONFIG": json.dumps(
                    {"cluster": spec, "task": {"type": "worker", "index": i}})},
                log_dir,
            )
            print_fn(f"{PREFIX}: {workers} workers started in namespaces {testbed.names[0]}.."
                     f"{testbed.names[-1]} (link: {link})")
            return _serve(testbed, deadline, print_fn)
    finally:
        testbed.close()


def _serve(testbed, deadline, print_fn):
    """Answers the first worker's delay requests until it prints its timings; shows its progress lines."""
    chief = testbed.processes[0]
    lines = queue.Queue()

    def read():
        for line in chief.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, name="kdbench-chief-out", daemon=True).start()
    round_trips, throughputs = {}, {}

    def failure(what):
        logs = "\n".join(f"--- worker {i} (last lines) ---\n{_tail(path)}" for i, path in enumerate(testbed.logs))
        return NetworkBenchError(f"{what}\n{logs}")

    while True:
        try:
            line = lines.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            line = ""
        if time.monotonic() >= deadline:
            raise failure("the network benchmark ran past its `--timeout`; everything was stopped.")
        crashed = [i for i, p in enumerate(testbed.processes) if p.poll() not in (None, 0)]
        if crashed:
            raise failure(f"worker(s) {crashed} exited with "
                          f"{[testbed.processes[i].returncode for i in crashed]}.")
        if line is None:
            raise failure("the first worker ended without printing its timings.")
        if line.startswith("DELAY "):
            delay = float(line.split()[1])
            testbed.set_delay(delay)
            # Measured at every change: on a loaded machine the relay
            # delivers late, and the report should show the link it was.
            round_trips.setdefault(delay, []).append(testbed.round_trip_ms())
            chief.stdin.write("OK\n")
            chief.stdin.flush()
        elif line.startswith("RATE "):
            rate = float(line.split()[1])
            testbed.set_rate(rate)
            throughputs.setdefault(f"{rate:g}", []).append(testbed.throughput_gbit())
            chief.stdin.write("OK\n")
            chief.stdin.flush()
        elif line.startswith(bench_bandwidth.PROGRESS + " "):
            print_fn(f"{PREFIX}: {line[len(bench_bandwidth.PROGRESS) + 1:].rstrip()}")
        elif line.startswith("TIMINGS "):
            timings = json.loads(line[len("TIMINGS "):])
            for process in testbed.processes:
                try:
                    process.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise failure("the workers did not exit after the first one printed its timings.") from None
            return timings, round_trips, throughputs


def run(*, workers=(2, 4), delays=(0, 1, 5), steps=40, repeats=5, link="auto", timeout=1800,
        json_path=None, print_fn=print, model="mlp", rates=(), gradient_mb=(4, 40), batch=None):
    """Runs the network benchmark and prints its table; returns the report.

    Args:
        workers: Worker counts; one cluster each.
        delays: One-way delays in ms (a round trip takes twice as long).
        steps: Training steps per timed epoch (global batch 64); steps/s
            count from the end of its first step to the end of its last.
        repeats: Timed epochs per variant and delay (after one warm-up epoch).
        link: `"auto"`, `"veth"` or `"relay"`.
        timeout: Seconds for the whole run; then everything is stopped.
        json_path: Also write the report here.
        print_fn: Where the table goes.
        model: `"mlp"` (kd, tf-keras, the tutorial loop), `"cnn_bn"`
            (BatchNormalization: kd global and per-replica, Keras 3
            SyncBN, tf-keras), `"contrastive"` (in-batch negatives: kd, and
            a loop gathering them by hand) or `"mlp_buckets"` (the mlp: kd
            `fit` with `gradient_buckets` "auto", "one" and
            `bench.SMALL_BUCKET_BYTES`, and the tutorial loop).
        rates: Link rates in Gbit/s (0: no limit): the bandwidth sweep
            (`bench_bandwidth`) instead of `model`, at the one delay given.
        gradient_mb: The sweep's gradient sizes in MB (an MLP of each size).
        batch: The sweep's global batch (default `bench_bandwidth.GLOBAL_BATCH`):
            larger for more compute per step.

    Returns:
        The report: `steps_per_second[workers][delay][variant]` holds the
        `median`, `min`, `max` and `runs`; `ratios[workers][delay]` the
        ratios of medians; `round_trip_ms[workers][delay]` the TCP round
        trip between two workers' namespaces, measured at each change of
        delay (`median`, `min`, `max`, `runs`); `collectives[workers][variant]`
        the collective ops per step in each kd variant's traced training
        step (`collectives.traced`).
        With `rates`: `bandwidth[workers]` holds the sweep's
        `steps_per_second`, `overlap` (compute alone, one all-reduce alone,
        each variant's step time and the share of min(compute, comm) it
        hides) and `ratios`, by `"<MB> MB @ <rate> Gbit/s"`, and
        `measured_gbit[rate]` the link's measured throughput.

    Raises:
        NetworkBenchError: It cannot run here (the message says what is
            missing and how to fix it), a worker failed, or `timeout` passed.

    Examples:
        >>> from keras_distrib.commands import bench_network
        >>> report = bench_network.run(workers=(2,), delays=(1,), steps=5,
        ...                            repeats=1)  # doctest: +SKIP
        >>> report["round_trip_ms"]["2"]["1"] >= 2.0  # doctest: +SKIP
        True
    """
    if rates and len(delays) != 1:
        raise NetworkBenchError(f"`rates`={list(rates)} sweeps one delay; got `delays`={list(delays)}. "
                                "Pass one delay (e.g. --delays 0) with --rates.")
    sweep = () if not rates else (
        "--rates", ",".join(f"{r:g}" for r in rates), "--gradient-mb", ",".join(f"{m:g}" for m in gradient_mb),
        "--batch", str(batch or bench_bandwidth.GLOBAL_BATCH))
    found, resolved, note = problems(link, delays)
    if rates:
        found += filter(None, [bench_bandwidth.memory_problem(gradient_mb, workers)])
    if found:
        raise NetworkBenchError("keras-distrib bench --network cannot run here:\n  - " + "\n  - ".join(found))
    if note:
        print_fn(f"{PREFIX}: {note}.")
    _remove_stale()
    deadline = time.monotonic() + timeout
    report = {
        "format": 1,
        "config": {"model": model, "workers": list(workers), "delays_ms": list(delays), "steps": steps,
                   "repeats": repeats, "global_batch": bench.GLOBAL_BATCH, "link": resolved, "link_note": note,
                   "cpus": os.cpu_count()},
        "steps_per_second": {}, "ratios": {}, "round_trip_ms": {},
    }
    if rates:
        report["config"].update(rates_gbit=list(rates), gradient_mb=list(gradient_mb),
                                gradient_bytes={f"{m:g}": bench_bandwidth.gradient_bytes(m) for m in gradient_mb},
                                global_batch=batch or bench_bandwidth.GLOBAL_BATCH, model="bandwidth_mlp")
        report["bandwidth"] = {}
    with _signals_raise():
        for count in workers:
            timings, round_trips, throughputs = _one_cluster(
                count, link=resolved, delays=delays, steps=steps, repeats=repeats, deadline=deadline,
                print_fn=print_fn, model=model, sweep=sweep)
            if rates:
                report["bandwidth"][str(count)] = bench_bandwidth.summarize(
                    timings, {rate: statistics.median(runs) for rate, runs in throughputs.items()})
                report["bandwidth"][str(count)]["measured_gbit"] = throughputs
                report["round_trip_ms"][str(count)] = round_trips
            else:
                report.setdefault("collectives", {})[str(count)] = {
                    name: traced for name, traced in timings.pop("collectives", {}).items() if traced}
                _summarize(report, count, delays, timings, round_trips)
    if rates:
        bench_bandwidth.print_table(report, print_fn)
    else:
        _print_table(report, print_fn)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)
    return report


def _summarize(report, count, delays, timings, round_trips):
    speeds, ratios, trips = {}, {}, {}
    for delay in delays:
        key = f"{delay:g}"
        speeds[key] = {
            name: {"median": statistics.median(runs[key]), "min": min(runs[key]), "max": max(runs[key]),
                   "runs": runs[key]}
            for name, runs in timings.items()
        }
        ratios[key] = {name: speeds[key][a]["median"] / speeds[key][b]["median"]
                       for name, (a, b) in _variants(report["config"]["model"])[1].items()
                       if a in speeds[key] and b in speeds[key]}
        measured = round_trips.get(float(delay), [])
        trips[key] = measured and {"median": statistics.median(measured), "min": min(measured),
                                   "max": max(measured), "runs": measured}
    report["steps_per_second"][str(count)] = speeds
    report["ratios"][str(count)] = ratios
    report["round_trip_ms"][str(count)] = trips


def _print_table(report, print_fn):
    config = report["config"]
    variants, ratios = _variants(config["model"])
    print_fn(f"link={config['link']} model={config['model']} global_batch={config['global_batch']} steps={config['steps']} "
             f"repeats={config['repeats']} (steps/s: median (min-max))")
    header = f"{'workers':>7s} {'delay':>6s} {'RTT ms':>17s}"
    for name in variants:
        header += f" {name:>22s}"
    header += "".join(f" {name:>24s}" for name in ratios)
    print_fn(header)
    for count, by_delay in report["steps_per_second"].items():
        for delay, speeds in by_delay.items():
            trip = report["round_trip_ms"][count][delay]
            shown = f"{trip['median']:.2f} ({trip['min']:.1f}-{trip['max']:.1f})" if trip else "-"
            row = f"{count:>7s} {delay + ' ms':>6s} {shown:>17s}"
            for name in variants:
                cell = speeds.get(name)
                shown = ("(not installed)" if cell is None else
                         f"{cell['median']:.1f} ({cell['min']:.1f}-{cell['max']:.1f})")
                row += f" {shown:>22s}"
            for name in ratios:
                value = report["ratios"][count][delay].get(name)
                row += f" {'-' if value is None else format(value, '.2f'):>24s}"
            print_fn(row)
    for count, by_name in report.get("collectives", {}).items():
        for name, traced in by_name.items():
            print_fn(f"{count:>7s} workers, {name}: collective ops per step in the traced graph: "
                     f"{traced['step']} {traced['ops']}")


def _worker_main(options):
    """One worker: every variant at every delay, in turns; the first worker asks for each delay."""
    import keras_distrib as kd

    strategy = kd.make_strategy("multi_worker")
    first = json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0
    if options.rates:
        return _sweep_worker(options, strategy, first)
    step_ends = []
    variants, _ = _variants(options.model)
    kind = "mlp" if options.model == "mlp_buckets" else options.model
    built = bench.runners(kind, options.steps, strategy, only=set(variants.values()),
                          on_step_end=lambda: step_ends.append(time.perf_counter()))
    names = [name for name, variant in variants.items() if variant in built]

    def ask_for(delay):
        if first:
            print(f"DELAY {delay:g}", flush=True)
            if sys.stdin.readline().strip() != "OK":
                raise SystemExit("the benchmark process went away")

    ask_for(0)
    for name in names:  # warm-up: trace and compile every variant
        built[variants[name]]()
    timings = {name: {f"{delay:g}": [] for delay in options.delays} for name in names}
    for repeat in range(options.repeats):
        for delay in options.delays:
            ask_for(delay)
            # Each variant goes first in turn: none always follows the delay change.
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                # From the end of the first step to the end of the last: the
                # steps alone, without `fit`'s set-up and epoch end.
                step_ends.clear()
                built[variants[name]]()
                speed = (len(step_ends) - 1) / (step_ends[-1] - step_ends[0])
                timings[name][f"{delay:g}"].append(speed)
    # Collective ops per step in each kd variant's traced training step.
    timings["collectives"] = {name: collectives.traced(built[variants[name]].model).get("train")
                              for name in names if hasattr(built[variants[name]], "model")}
    if first:
        print("TIMINGS " + json.dumps(timings), flush=True)
    return 0


def _sweep_worker(options, strategy, first):
    """One worker of the bandwidth sweep; the first asks for the delay, then each rate."""

    def ask(what, value):
        if first:
            print(f"{what} {value:g}", flush=True)
            if sys.stdin.readline().strip() != "OK":
                raise SystemExit("the benchmark process went away")

    ask("DELAY", options.delays[0])
    workers = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
    timings = bench_bandwidth.worker_loop(
        sizes=options.gradient_mb, rates=options.rates, steps=options.steps, repeats=options.repeats,
        strategy=strategy, workers=workers, ask_for_rate=lambda rate: ask("RATE", rate), first=first,
        batch=options.batch)
    if first:
        print("TIMINGS " + json.dumps(timings), flush=True)
    return 0


def _numbers(kind, minimum):
    def parse(text):
        try:
            values = tuple(kind(part) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
        bad = [v for v in values if v < minimum]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"expected numbers >= {minimum:g}, got {text!r}")
        return values

    return parse


def build_parser():
    """The arguments of `keras-distrib bench --network`."""
    parser = argparse.ArgumentParser(
        prog="keras-distrib bench --network",
        description="Steps/s of kd fit, tf-keras fit and TensorFlow's custom-loop tutorial, with worker "
        "processes in network namespaces joined by a link with added latency (needs root and "
        "`ip`, from iproute2; refused with exit 2, naming what is missing, otherwise). Medians "
        "and min-max over --repeats epochs, the measured TCP round trip, and the ratios "
        "kd/tf-keras and kd/tutorial. Uses private addresses (10.213.0.x) inside its own "
        "namespaces only, and removes its processes, devices and namespaces on success, error, "
        "--timeout, SIGINT, SIGTERM and SIGHUP (exit 128+signal), and those a run killed by "
        "SIGKILL left.")
    parser.add_argument("--workers", type=_numbers(int, 2), default=(2, 4),
                        help="worker counts, comma-separated (default 2,4)")
    parser.add_argument("--delays", type=_numbers(float, 0), default=None,
                        help="one-way delays in ms, comma-separated (default 0,1,5; with --rates 0; a round "
                        "trip is twice)")
    parser.add_argument("--steps", type=int, default=40,
                        help="steps per timed epoch (default 40; timed from the first step's end to the last's)")
    parser.add_argument("--repeats", type=int, default=5, help="timed epochs per variant and delay (default 5)")
    parser.add_argument("--link", choices=LINKS, default="auto",
                        help="veth (veth pairs, a bridge, tc netem), relay (TUN devices and a delaying relay "
                        "in this process) or auto: veth where the kernel has netem (default)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run (default 1800)")
    parser.add_argument("--model", choices=MODELS, default="mlp",
                        help="mlp (kd, tf-keras, the tutorial loop; default), cnn_bn (a CNN with "
                        "BatchNormalization: kd global and per-replica statistics, Keras 3 SyncBN, tf-keras), "
                        "contrastive (a dual encoder with in-batch negatives: kd, and a loop gathering "
                        "the global batch by hand) or mlp_buckets (the mlp: kd's gradient_buckets \"auto\", "
                        "\"one\" and forced into 2 small buckets, and the tutorial loop)")
    parser.add_argument("--rates", type=_numbers(float, 0), default=(),
                        help="link rates in Gbit/s, comma-separated (0: no limit): the bandwidth sweep "
                        "instead of --model (kd with and without gradient buckets, Keras 3 in the tutorial "
                        "loop, tf-keras, one worker's compute alone, one all-reduce alone), at one --delays "
                        "value (e.g. --delays 0)")
    parser.add_argument("--gradient-mb", type=_numbers(float, 0.001), default=(4, 40),
                        help="the bandwidth sweep's gradient sizes in MB, comma-separated (default 4,40; "
                        "an MLP of 3 square layers per size)")
    parser.add_argument("--batch", type=int, default=None,
                        help=f"the bandwidth sweep's global batch (default {bench_bandwidth.GLOBAL_BATCH}; "
                        "larger: more compute per step)")
    parser.add_argument("--json", default=None, help="also write the report here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    # Marks the worker processes of one run (tests look for leftovers by it).
    parser.add_argument("--run-id", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv=None):
    """Runs `keras-distrib bench --network ARGS`; returns the exit code."""
    parser = build_parser()
    options = parser.parse_args(argv)
    bad = [f"`--{name}`={getattr(options, name)} must be >= {least}"
           for name, least in (("steps", 2), ("repeats", 1)) if getattr(options, name) < least]
    uneven = [w for w in options.workers if options.batch is not None and options.batch % w]
    if options.batch is not None and (options.batch < 1 or uneven):
        bad.append(f"`--batch`={options.batch} must be a positive multiple of every worker count "
                   f"({', '.join(map(str, options.workers))})")
    if options.timeout <= 0:
        bad.append(f"`--timeout`={options.timeout} must be > 0")
    if options.json is not None:
        bad += filter(None, [validation.output_path_problem("--json", options.json)])
    if bad:
        parser.error("; ".join(bad))
    if options.delays is None:
        options.delays = (0,) if options.rates else (0, 1, 5)
    if options.worker:
        return _worker_main(options)
    try:
        run(workers=options.workers, delays=options.delays, steps=options.steps,
            repeats=options.repeats, link=options.link, timeout=options.timeout, json_path=options.json,
            model=options.model, rates=options.rates, gradient_mb=options.gradient_mb, batch=options.batch)
    except NetworkBenchError as error:
        print(f"keras-distrib bench --network: {error}", file=sys.stderr)
        return 2
    except _Stopped as stopped:
        print(f"keras-distrib bench --network: {stopped}; everything it started was removed.",
              file=sys.stderr)
        return 128 + stopped.signum
    return 0


if __name__ == "__main__":
    sys.exit(main())
