"""A user's machine: the README's first command and `keras-distrib test`, without the extras.

Usage: unshare --mount --propagation private [--user --map-root-user] \
           python tests/scripts/users_machine.py OUT [--no-namespaces] [--no-demo]
       python tests/scripts/users_machine.py --hide   (in such a mount namespace)

Run in a mount namespace of its own (as root, or as root of a user
namespace), where what it mounts is seen by nothing outside. It hides the
optional system components CI installs (slirp4netns and pasta, Chromium,
Slurm): /dev/null, which is not executable, is bind-mounted over each of them
wherever kd or a user would look (PATH and the system directories), so they
are absent as on a machine that never installed them.

With --no-namespaces it also makes network namespaces unavailable, for real:
inside a user namespace (`unshare --user`) the kernel's per-namespace limits
`/proc/sys/user/max_net_namespaces` and `max_user_namespaces` are set to 0, so
every unshare() kd tries is refused (ENOSPC), as a container's seccomp
profile or a kernel without unprivileged user namespaces refuses it
(EPERM). No switch in kd is involved.

Then it runs `keras-distrib launch --workers 2` of a script that prints a
line, `keras-distrib demo --quick --out OUT/demo` (not with --no-demo) and
`keras-distrib test`, one after the other, and prints `RESULT {json}`: what
was hidden, what is left, whether a network namespace can be made, and each
command's exit code, output, wall time and CPU time.

With --hide it only hides the components and prints what is left (`LEFT
[...]`): the commands that follow in the namespace (tests/test_reliability.py's
unprivileged user) run on the bare machine.
"""

import json
import os
import resource
import shutil
import subprocess
import sys
import time

COMPONENTS = ("slirp4netns", "pasta", "chromium", "chromium-browser", "google-chrome", "srun",
              "sbatch", "salloc", "scontrol", "squeue", "scancel", "slurmctld", "slurmd", "munged")
SYSTEM_DIRECTORIES = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
# The kernel's limits on namespaces made inside this user namespace.
LIMITS = ("/proc/sys/user/max_net_namespaces", "/proc/sys/user/max_user_namespaces")
COMMAND_TIMEOUT = 400


def _search_path():
    entries = os.environ.get("PATH", "").split(os.pathsep) + list(SYSTEM_DIRECTORIES)
    return os.pathsep.join(dict.fromkeys(e for e in entries if e))


def _found():
    return sorted({os.path.realpath(found) for name in COMPONENTS
                   if (found := shutil.which(name, path=_search_path()))})


def _hide():
    hidden = []
    for path in _found():
        subprocess.run(["mount", "--bind", "/dev/null", path], check=True)
        hidden.append(path)
    return hidden


def _namespaces_possible():
    return subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode == 0


def _run(argv):
    """The command's exit code and output, with its wall time and its processes' CPU time."""
    started, cpu = time.monotonic(), _children_cpu()
    process = subprocess.run([sys.executable, "-m", "keras_distrib", *argv], capture_output=True,
                             text=True, timeout=COMMAND_TIMEOUT)
    return {"argv": argv, "code": process.returncode, "output": process.stdout + process.stderr,
            "seconds": time.monotonic() - started, "cpu_seconds": _children_cpu() - cpu}


def _children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(out, no_namespaces, demo=True):
    if no_namespaces:
        for limit in LIMITS:
            with open(limit, "w") as f:
                f.write("0")
    hidden = _hide()
    report = {"hidden": hidden, "left": _found(), "namespaces": _namespaces_possible()}
    script = os.path.join(out, "hello.py")
    with open(script, "w") as f:
        f.write("print('hello from', __import__('os').environ['KD_TASK'])\n")
    report["launch"] = _run(["launch", "--workers", "2", script])
    if demo:
        report["demo"] = _run(["demo", "--quick", "--out", os.path.join(out, "demo")])
    report["test"] = _run(["test"])
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--hide"]:
        _hide()
        print("LEFT " + json.dumps(_found()), flush=True)
    else:
        main(sys.argv[1], "--no-namespaces" in sys.argv[2:], demo="--no-demo" not in sys.argv[2:])
