"""A private network for one local cluster's tasks: a namespace nothing outside reaches.

A local launch runs every task of an attempt in one `PrivateNetwork`, made
and closed by `supervisor.run_tasks`; the request check
(`requests.check_private_network`) makes and closes one first, to find out
what this host allows: a namespace with a route out (slirp4netns), one
without (`NoRouteOut`: slirp4netns missing or failing), or none at all
(`NoNamespace`: the kernel or a policy refuses).
"""

import os
import select
import shutil
import subprocess
import sys
import tempfile

from keras_distrib.cluster import _guard

__all__ = [
    "ALLOW_NAMESPACES",
    "HOST_FROM_TASKS",
    "INSTALL_SLIRP",
    "NoNamespace",
    "NoRouteOut",
    "OPT_OUT",
    "PrivateNetwork",
    "SLIRP",
]


# How a private network's tasks reach the outside: a user-mode TCP/IP stack
# (Debian/Ubuntu/Fedora package `slirp4netns`) that connects on their behalf
# from this host's namespace and forwards nothing inward.
SLIRP = "slirp4netns"
# The gateway address through which the tasks reach this host itself (its
# loopback services included), in slirp4netns's default 10.0.2.0/24.
HOST_FROM_TASKS = "10.0.2.2"
# Seconds slirp4netns gets to configure the tasks' interface.
SLIRP_READY_SECONDS = 10.0
INSTALL_SLIRP = ("(Debian/Ubuntu: `apt-get install slirp4netns`; Fedora/RHEL: `dnf install "
                 "slirp4netns`; Arch: `pacman -S slirp4netns`)")
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
    """A namespace can be made but not given a route out: slirp4netns is missing or fails."""


class PrivateNetwork:
    """A network namespace for one local cluster's tasks: nothing outside reaches them.

    TensorFlow's gRPC server listens on every interface (`0.0.0.0` and
    `[::]`) whatever TF_CONFIG names, and its distributed runtime has no
    authentication: anyone who reaches a task's port runs TensorFlow ops as
    the training user. Inside this namespace the tasks reach each other on
    `localhost`, and no other host, user or network namespace reaches them.
    With `outbound` (the default), `slirp4netns` gives the namespace a
    user-mode route out: the tasks open connections to any address this
    host can reach (downloads, remote storage; this host itself is
    `HOST_FROM_TASKS`), and nothing is forwarded in; where this host's
    resolver listens on its own loopback (systemd-resolved), the namespace's
    /etc/resolv.conf names slirp4netns's forwarder instead (a mount
    namespace of its own). Needs root, or unprivileged user namespaces;
    `outbound` needs slirp4netns.

    Raises:
        NoNamespace: the namespace cannot be made (the message says what
            allows one, and how to opt out).
        NoRouteOut: `outbound`, and slirp4netns is missing or fails (the
            message says what to install, and how to opt out).
    """

    def __init__(self, outbound=True):
        self.slirp = None
        self._exit_fd = None
        slirp = shutil.which(SLIRP) or shutil.which(SLIRP, path="/usr/bin:/usr/sbin:/sbin")
        if outbound and slirp is None:
            raise NoRouteOut(
                f"`private_network`: kd runs a local launch's tasks in a network namespace of "
                f"their own (TensorFlow's servers have no authentication) and reaches the "
                f"outside through {SLIRP}, which is not installed here: install it {INSTALL_SLIRP}; "
                + OPT_OUT + ".", reason=f"{SLIRP} is not installed here")
        # This host's resolver on its own loopback cannot be reached from the
        # namespace: there /etc/resolv.conf names slirp4netns's, which forwards to it.
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
        if outbound:
            try:
                self._start_slirp(slirp)
            except NoRouteOut:
                self.close()
                raise
            except OSError as error:  # it would not start (not executable, say)
                self.close()
                raise NoRouteOut(f"`private_network`: {slirp} does not start ({error}): check "
                                 f"that {SLIRP} works here; " + OPT_OUT + ".",
                                 reason=f"{SLIRP} does not start") from None

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
            self.slirp = subprocess.Popen(command, pass_fds=(ready_write, exit_read),
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
            if self.slirp.poll() is None:
                self.slirp.kill()
            self.slirp.wait(timeout=10)
            error = self.slirp.stderr.read().strip().splitlines()
            tun_closed = "/dev/net/tun" in "".join(error)
            raise NoRouteOut(
                f"`private_network`: {SLIRP} could not give the tasks' namespace a route out ("
                + ("; ".join(error[-2:]) if error else
                   f"no answer in {SLIRP_READY_SECONDS:g}s" if self.slirp.returncode is None or ready is None
                   else f"exit code {self.slirp.returncode}")
                + ")." + (" /dev/net/tun is closed to this user: distributions make it mode "
                          "0666 (`chmod 0666 /dev/net/tun` as root);" if tun_closed
                          else f" Check that {SLIRP} works here;")
                + " " + OPT_OUT + ".",
                reason=f"{SLIRP} cannot open /dev/net/tun as this user" if tun_closed
                else f"{SLIRP} fails here: {error[0]}" if error else f"{SLIRP} fails here")

    @property
    def pid(self):
        """The holder process's pid: the tasks join `/proc/<pid>/ns/net`."""
        return self.holder.pid

    def close(self):
        """Ends slirp4netns and the holder; the namespace goes away with its last process."""
        if self.slirp is not None:
            if self.slirp.poll() is None:
                self.slirp.terminate()
            try:
                self.slirp.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.slirp.kill()
                self.slirp.wait(timeout=10)
            self.slirp.stderr.close()
            self.slirp = None
        if self._exit_fd is not None:
            os.close(self._exit_fd)
            self._exit_fd = None
        if self.holder.poll() is None:
            self.holder.kill()
        self.holder.wait(timeout=10)
        for stream in (self.holder.stdin, self.holder.stdout, self.holder.stderr):
            stream.close()


# slirp4netns's DNS forwarder, seen from the namespace.
SLIRP_DNS = "10.0.2.3"


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
                                  f"through slirp4netns", f"nameserver {SLIRP_DNS}"]) + "\n")
    os.chmod(stub, 0o644)
    return stub


def _read_with_timeout(fd, seconds):
    """Up to 16 bytes from pipe `fd`, or None if nothing came in `seconds` (b"" once closed)."""
    readable, _, _ = select.select([fd], [], [], seconds)
    return os.read(fd, 16) if readable else None
