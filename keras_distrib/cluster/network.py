"""A private network for one local cluster's tasks: a namespace nothing outside reaches.

A local launch runs every task of an attempt in one `PrivateNetwork`, made
and closed by `supervisor.run_tasks`; the request check
(`requests.check_private_network`) makes and closes one first, to find out
what this host allows: a namespace with a route out (slirp4netns, else
pasta), one without (`NoRouteOut`: neither installed, or both failing), or
none at all (`NoNamespace`: the kernel or a policy refuses).
"""

import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

from keras_distrib.cluster import _guard

__all__ = [
    "ALLOW_NAMESPACES",
    "HOST_FROM_TASKS",
    "INSTALL_SLIRP",
    "NoNamespace",
    "NoRouteOut",
    "OPT_OUT",
    "PASTA",
    "PrivateNetwork",
    "SLIRP",
    "routes_out",
]


# How a private network's tasks reach the outside: a user-mode TCP/IP stack
# that connects on their behalf from this host's namespace and forwards
# nothing inward. slirp4netns (package `slirp4netns`) where installed: it
# says when it is ready and ends with this process by itself; else pasta
# (package `passt`), kept to the same addresses and told to forward no port.
SLIRP = "slirp4netns"
PASTA = "pasta"
# The gateway address through which the tasks reach this host itself (its
# loopback services included), in slirp4netns's default 10.0.2.0/24; the
# tasks' own address in it, and the DNS forwarder's.
HOST_FROM_TASKS = "10.0.2.2"
TASKS_ADDRESS = "10.0.2.100"
SLIRP_DNS = "10.0.2.3"
# Seconds the route out gets to configure the tasks' interface.
SLIRP_READY_SECONDS = 10.0
INSTALL_SLIRP = ("(Debian/Ubuntu: `apt-get install slirp4netns`, or `apt-get install passt` for "
                 "pasta; Fedora/RHEL: `dnf install slirp4netns`; Arch: `pacman -S slirp4netns`)")
OPT_OUT = ("or launch with `private_network=\"offline\"` (`--network offline`: private, no "
           "outside network) or `private_network=False` (`--network open`: the tasks' ports "
           "open to this host's network, firewall them)")
# What makes a network namespace possible where the kernel or a policy refuses one.
ALLOW_NAMESPACES = ("run as root, or allow unprivileged user namespaces (sysctl "
                    "kernel.unprivileged_userns_clone=1; on Ubuntu 24.04 and later also "
                    "kernel.apparmor_restrict_unprivileged_userns=0; a container needs a seccomp "
                    "profile that admits unshare)")


class _Refused(OSError):
    """A private network this host does not give; `reason` says why in a few words, without advice."""

    def __init__(self, message, *, reason):
        super().__init__(message)
        self.reason = reason


class NoNamespace(_Refused):
    """No network namespace can be made here: the kernel or a policy refuses one (`reason`: its refusal)."""


class NoRouteOut(_Refused):
    """A namespace can be made but not given a route out: slirp4netns and pasta are missing or fail.

    `fix` says what gives the tasks a route out here ("install ...", "open ...", "check ...").
    """

    def __init__(self, message, *, reason, fix):
        super().__init__(message, reason=reason)
        self.fix = fix


class PrivateNetwork:
    """A network namespace for one local cluster's tasks: nothing outside reaches them.

    TensorFlow's gRPC server listens on every interface (`0.0.0.0` and
    `[::]`) whatever TF_CONFIG names, and its distributed runtime has no
    authentication: anyone who reaches a task's port runs TensorFlow ops as
    the training user. Inside this namespace the tasks reach each other on
    `localhost`, and no other host, user or network namespace reaches them.
    With `outbound` (the default), slirp4netns (else pasta) gives the
    namespace a user-mode route out: the tasks open connections to any
    address this host can reach (downloads, remote storage; this host itself
    is `HOST_FROM_TASKS`), and nothing is forwarded in; where this host's
    resolver listens on its own loopback (systemd-resolved), the namespace's
    /etc/resolv.conf names the route's forwarder instead (a mount namespace
    of its own). Needs root, or unprivileged user namespaces; `outbound`
    needs slirp4netns or pasta. `route_out` names the one that gives it.

    Raises:
        NoNamespace: the namespace cannot be made (the message says what
            allows one, and how to opt out).
        NoRouteOut: `outbound`, and neither slirp4netns nor pasta is
            installed, or each one installed fails (the message says what
            to install, or the first one's failure, and how to opt out).
    """

    def __init__(self, outbound=True):
        self.router = None
        self.route_out = None
        self._exit_fd = None
        routes = routes_out() if outbound else []
        if outbound and not routes:
            raise NoRouteOut(
                f"`private_network`: kd runs a local launch's tasks in a network namespace of "
                f"their own (TensorFlow's servers have no authentication) and reaches the "
                f"outside through {SLIRP} or {PASTA}, neither of which is installed here: install "
                f"one {INSTALL_SLIRP}; " + OPT_OUT + ".",
                reason=f"neither {SLIRP} nor {PASTA} is installed here",
                fix=f"install {SLIRP} or {PASTA} {INSTALL_SLIRP}")
        # This host's resolver on its own loopback cannot be reached from the
        # namespace: there /etc/resolv.conf names the route out's, which forwards to it.
        stub = _stub_resolv_conf() if outbound else None
        try:
            self.holder = subprocess.Popen(
                [sys.executable, "-I", "-S", _guard.__file__, "--hold-netns", *([stub] if stub else [])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            ready = self.holder.stdout.readline().strip()
        finally:
            if stub:
                os.remove(stub)  # mounted by now (or never): the namespace keeps its copy
        if ready != "READY":
            error = self.holder.stderr.read().strip().splitlines()
            self.close()
            refusal = error[-1].removeprefix("OSError: ") if error else "no reason given"
            raise NoNamespace(
                "`private_network`: could not create a network namespace for the tasks ("
                + refusal + "): " + ALLOW_NAMESPACES + "; or launch with `private_network=False` "
                "(`--network open`: the tasks' ports open to this host's network, firewall "
                "them).", reason=f"this machine makes no network namespace ({refusal})")
        failures = []
        for name, path in routes:
            try:
                (self._start_slirp if name == SLIRP else self._start_pasta)(path)
                self.route_out = name
                return
            except NoRouteOut as error:
                failures.append(error)
            except OSError as error:  # it would not start (not executable, say)
                failures.append(NoRouteOut(f"`private_network`: {path} does not start ({error}): "
                                           f"check that {name} works here; " + OPT_OUT + ".",
                                           reason=f"{name} does not start",
                                           fix=f"check that {name} works here"))
            self._end_router()
        if failures:
            self.close()
            raise failures[0]

    def _start_slirp(self, slirp):
        own = os.stat("/proc/self/ns/user").st_ino
        userns = f"/proc/{self.holder.pid}/ns/user"
        command = [slirp, "--configure", "--mtu=65520"]
        if os.stat(userns).st_ino != own:  # an unprivileged user's namespace: join its owner
            command.append(f"--userns-path={userns}")
        ready_read, ready_write = os.pipe()
        exit_read, self._exit_fd = os.pipe()
        command += [f"--ready-fd={ready_write}", f"--exit-fd={exit_read}", str(self.holder.pid), "tap0"]
        try:
            # --exit-fd: slirp4netns ends when this process does (its end of the pipe closes).
            self.router = subprocess.Popen(command, pass_fds=(ready_write, exit_read),
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True)
        finally:
            os.close(ready_write)
            os.close(exit_read)
        try:
            ready = _read_with_timeout(ready_read, SLIRP_READY_SECONDS)
        finally:
            os.close(ready_read)
        if ready != b"1":
            if self.router.poll() is None:
                self.router.kill()
            self.router.wait(timeout=10)
            error = self.router.stderr.read().strip().splitlines()
            raise _failed(SLIRP, error, None if ready is None else self.router.returncode)

    def _start_pasta(self, pasta):
        own = os.stat("/proc/self/ns/user").st_ino
        userns = f"/proc/{self.holder.pid}/ns/user"
        # pasta drops its privileges before it joins the namespace: it gets
        # the namespaces as descriptors this process opened.
        fds = [os.open(f"/proc/{self.holder.pid}/ns/net", os.O_RDONLY)]
        namespaces = ["--netns", f"/proc/self/fd/{fds[0]}"]
        if os.stat(userns).st_ino != own:  # an unprivileged user's namespace: join its owner
            fds.append(os.open(userns, os.O_RDONLY))
            namespaces = ["--userns", f"/proc/self/fd/{fds[1]}", *namespaces]
        # Root's pasta would become `nobody`, who may not enter root's namespace.
        runas = ["--runas", f"{os.getuid()}:{os.getgid()}"] if os.getuid() == 0 else []
        # No port forwarded either way (pasta's default forwards every port
        # the tasks bind to this host); IPv4 only, as slirp4netns; this
        # host's loopback is the gateway, as slirp4netns's.
        command = [pasta, "--config-net", "--foreground", "--quiet", "--ipv4-only",
                   "--tcp-ports", "none", "--udp-ports", "none", "--tcp-ns", "none",
                   "--udp-ns", "none", "--address", TASKS_ADDRESS, "--netmask", "24",
                   "--gateway", HOST_FROM_TASKS, "--dns-forward", SLIRP_DNS, "--ns-ifname", "tap0",
                   "--mtu", "65520", *runas, *namespaces]
        # A file, not a pipe: pasta may go on writing while the tasks run.
        log = tempfile.TemporaryFile(mode="w+")
        try:
            self.router = subprocess.Popen(
                [sys.executable, "-I", "-S", _guard.__file__, "--die-with-parent", str(os.getpid()),
                 *command], pass_fds=fds, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=log, text=True)
        finally:
            for fd in fds:
                os.close(fd)
        self.router.stderr = log
        # Ready once pasta has given the interface its route: packets sent
        # from then on wait in the device until pasta reads them.
        deadline = time.monotonic() + SLIRP_READY_SECONDS
        while not _has_default_route(self.holder.pid):
            if self.router.poll() is not None or time.monotonic() > deadline:
                silent = self.router.poll() is None
                if silent:
                    self.router.kill()
                self.router.wait(timeout=10)
                log.seek(0)
                error = [line for line in log.read().strip().splitlines()
                         if "to syslog" not in line]  # its logger's own complaint
                raise _failed(PASTA, error, None if silent else self.router.returncode)
            time.sleep(0.005)

    @property
    def pid(self):
        """The holder process's pid: the tasks join `/proc/<pid>/ns/net`."""
        return self.holder.pid

    def close(self):
        """Ends the route out and the holder; the namespace goes away with its last process."""
        self._end_router()
        if self.holder.poll() is None:
            self.holder.kill()
        self.holder.wait(timeout=10)
        for stream in (self.holder.stdin, self.holder.stdout, self.holder.stderr):
            stream.close()

    def _end_router(self):
        if self.router is not None:
            if self.router.poll() is None:
                self.router.terminate()
            try:
                self.router.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait(timeout=10)
            self.router.stderr.close()
            self.router = None
        if self._exit_fd is not None:
            os.close(self._exit_fd)
            self._exit_fd = None


def routes_out():
    """`(name, path)` of slirp4netns and pasta, those installed, in kd's order."""
    found = []
    for name in (SLIRP, PASTA):
        path = shutil.which(name) or shutil.which(name, path="/usr/bin:/usr/sbin:/sbin")
        if path:
            found.append((name, path))
    return found


def _failed(name, error, returncode):
    """The `NoRouteOut` for route out `name` that did not come up: its last `error` lines,
    else its exit code (None: it gave no answer in time)."""
    # slirp4netns names the device; pasta says "Failed to open tun socket in namespace".
    tun_closed = any("/dev/net/tun" in line or "open tun" in line for line in error)
    return NoRouteOut(
        f"`private_network`: {name} could not give the tasks' namespace a route out ("
        + ("; ".join(error[-2:]) if error else f"no answer in {SLIRP_READY_SECONDS:g}s"
           if returncode is None else f"exit code {returncode}")
        + ")." + (" /dev/net/tun is closed to this user: distributions make it mode "
                  "0666 (`chmod 0666 /dev/net/tun` as root);" if tun_closed
                  else f" Check that {name} works here;")
        + " " + OPT_OUT + ".",
        reason=f"{name} cannot open /dev/net/tun as this user" if tun_closed
        else f"{name} fails here: {error[0]}" if error else f"{name} fails here",
        fix="open /dev/net/tun to this user (distributions make it mode 0666: `chmod 0666 "
        "/dev/net/tun` as root)" if tun_closed else f"check that {name} works here")


def _has_default_route(pid):
    """Whether process `pid`'s network namespace has an IPv4 default route."""
    try:
        with open(f"/proc/{pid}/net/route") as f:
            return any(line.split()[1:2] == ["00000000"] for line in f.read().splitlines()[1:])
    except OSError:
        return False


def _stub_resolv_conf(path=_guard.RESOLV_CONF):
    """A private copy of /etc/resolv.conf naming `SLIRP_DNS`, if every nameserver it names is loopback.

    Returns its path, or None when the host's resolvers are reachable from the
    namespace as they are (or there is no /etc/resolv.conf).
    """
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    servers = [line.split()[1] for line in lines if line.split()[:1] == ["nameserver"]
               and len(line.split()) > 1]
    if not servers or not all(s.startswith("127.") or s == "::1" for s in servers):
        return None
    kept = [line for line in lines if line.split()[:1] != ["nameserver"]]
    handle, stub = tempfile.mkstemp(prefix="kd-resolv-", suffix=".conf")
    with os.fdopen(handle, "w") as f:
        f.write("\n".join(kept + [f"# kd: {', '.join(servers)} on this host's loopback, reached "
                                  f"through the route out", f"nameserver {SLIRP_DNS}"]) + "\n")
    os.chmod(stub, 0o644)
    return stub


def _read_with_timeout(fd, seconds):
    """Up to 16 bytes from pipe `fd`, or None if nothing came in `seconds` (b"" once closed)."""
    readable, _, _ = select.select([fd], [], [], seconds)
    return os.read(fd, 16) if readable else None
