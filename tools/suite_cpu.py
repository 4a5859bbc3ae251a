"""The CPU seconds of each test, every process it started counted: a pytest plugin, and its table.

The suite's cluster tests run their scripts in children forked by the
harness's warm interpreters (tests/_warm.py), and the launcher's tasks in
processes of their own sessions, so neither pytest's clock nor
`RUSAGE_CHILDREN` sees their CPU. This plugin gives each test a `cpuacct`
cgroup (cgroup v1, root) and moves the xdist worker and its warm
interpreters into it when the test starts: every process the test starts,
forked or launched, counts there, and what a test leaves running keeps
counting in its own. One JSON line per test goes to `$KD_SUITE_CPU_DIR`.

    mkdir -p /tmp/suite_cpu
    KD_SUITE_CPU_DIR=/tmp/suite_cpu PYTHONPATH=tools python -m pytest -q -p suite_cpu
    python tools/suite_cpu.py /tmp/suite_cpu

The second command prints a Markdown table of CPU and wall seconds by test
file, then the tests with the most CPU. With `--windows N` it prints instead
how busy the machine's cores were in each N seconds of the run (pytest's own
process samples `/proc/stat` every second into `machine.txt`) and the tests
that ran then, longest first: where the run left cores idle, and what held
them. Nothing here is timed against a bound: read the figures of one run, on
a machine whose load you know.
"""

import itertools
import json
import os
import sys
import time

__all__ = ["pytest_configure", "pytest_runtest_protocol", "pytest_unconfigure", "summarize", "windows"]

CGROUPS = "/sys/fs/cgroup/cpuacct"
_numbers = itertools.count()
_out = None
_made = []  # the cgroups this process made, removed at its end


def _group(name):
    """The cgroup `name` of this run (made at first use)."""
    path = os.path.join(CGROUPS, "kd_suite_cpu", os.environ["KD_SUITE_CPU_RUN"], name)
    if not os.path.isdir(path):
        os.makedirs(path)
        _made.append(path)
    return path


def _move(path, pids):
    for pid in pids:
        try:
            with open(os.path.join(path, "cgroup.procs"), "w") as procs:
                procs.write(str(pid))
        except OSError:  # gone already
            pass


def _warm_interpreters():
    """This process's children running tests/_warm.py."""
    mine, found = str(os.getpid()), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                parent = stat.read().rsplit(")", 1)[1].split()[1]
            if parent != mine:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as command:
                if b"_warm.py" in command.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _sample_machine(path):
    """Appends `time busy_jiffies all_jiffies` (all cores, from /proc/stat) to `path` every second."""
    with open(path, "a") as out:
        while True:
            with open("/proc/stat") as stat:
                values = [int(v) for v in stat.readline().split()[1:]]
            idle = values[3] + values[4]  # idle and iowait
            out.write(f"{time.time():.2f} {sum(values) - idle} {sum(values)}\n")
            out.flush()
            time.sleep(1)


def pytest_configure(config):
    if hasattr(config, "workerinput"):
        return  # an xdist worker; the run's own process samples the machine
    os.environ["KD_SUITE_CPU_RUN"] = str(os.getpid())  # the workers' cgroups' folder
    folder = os.environ.get("KD_SUITE_CPU_DIR")
    if folder and os.path.isdir(folder):
        import threading

        threading.Thread(target=_sample_machine, args=(os.path.join(folder, "machine.txt"),),
                         name="suite_cpu-machine", daemon=True).start()


def _hookwrapper(function):
    import pytest

    return pytest.hookimpl(hookwrapper=True)(function)


@_hookwrapper
def pytest_runtest_protocol(item, nextitem):
    global _out
    # The xdist worker's name from pytest's config, not the environment, which
    # a pytest that a test starts inherits.
    worker = getattr(item.config, "workerinput", {}).get("workerid", "main")
    if _out is None:
        folder = os.environ.get("KD_SUITE_CPU_DIR")
        if not folder or not os.path.isdir(folder) or not os.access(CGROUPS, os.W_OK):
            raise RuntimeError(
                f"suite_cpu needs `KD_SUITE_CPU_DIR` set to an existing folder (got {folder!r}) and "
                f"write access to {CGROUPS} (root, cgroup v1): see tools/suite_cpu.py")
        _out = open(os.path.join(folder, f"{worker}.jsonl"), "a")
    group = _group(f"{worker}_{next(_numbers)}")
    _move(group, [os.getpid(), *_warm_interpreters()])
    began, started = time.time(), time.monotonic()
    yield
    wall = time.monotonic() - started
    _move(_group(f"{worker}_between"), [os.getpid()])
    with open(os.path.join(group, "cpuacct.usage")) as usage:
        cpu = int(usage.read()) / 1e9
    _out.write(json.dumps({"test": item.nodeid, "cpu": cpu, "wall": wall, "began": began,
                               "worker": worker}) + "\n")
    _out.flush()


def pytest_unconfigure(config):
    """This process back in the root cgroup, and the cgroups it made removed where nothing runs in
    them (what a test left running keeps its own until it ends)."""
    if not _made:
        return
    _move(CGROUPS, [os.getpid()])
    for path in reversed(_made):
        try:
            os.rmdir(path)
        except OSError:  # processes still in it
            pass
    for folder in (os.path.dirname(_made[0]), os.path.dirname(os.path.dirname(_made[0]))):
        try:
            os.rmdir(folder)  # the run's, then the tool's: when empty
        except OSError:
            pass


def summarize(folder, most=15):
    """The Markdown table of the plugin's lines in `folder`."""
    tests = _tests(folder)
    files = {}
    for test in tests:
        cpu, wall = files.get(test["test"].split("::")[0], (0.0, 0.0))
        files[test["test"].split("::")[0]] = (cpu + test["cpu"], wall + test["wall"])
    rows = ["| test file | CPU s | wall s (its tests' sum) |", "|---|---:|---:|"]
    rows += [f"| {name} | {cpu:.0f} | {wall:.0f} |"
             for name, (cpu, wall) in sorted(files.items(), key=lambda item: -item[1][0])]
    rows.append(f"| **{len(tests)} tests** | **{sum(t['cpu'] for t in tests):.0f}** | "
                f"{sum(t['wall'] for t in tests):.0f} |")
    rows += ["", "| test | CPU s | wall s |", "|---|---:|---:|"]
    rows += [f"| {t['test']} | {t['cpu']:.1f} | {t['wall']:.1f} |"
             for t in sorted(tests, key=lambda t: -t["cpu"])[:most]]
    return "\n".join(rows)


def _tests(folder):
    tests = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".jsonl"):
            with open(os.path.join(folder, name)) as lines:
                tests += [json.loads(line) for line in lines]
    return tests


def windows(folder, seconds=30, shown=4):
    """The Markdown table of the cores' busy share per `seconds` of the run, and the tests then."""
    tests = [t for t in _tests(folder) if "began" in t]
    with open(os.path.join(folder, "machine.txt")) as lines:
        samples = [tuple(float(v) for v in line.split()) for line in lines]
    cores = os.cpu_count()
    start = min(t["began"] for t in tests)
    end = max(t["began"] + t["wall"] for t in tests)
    busy, idle = {}, 0.0
    for (t0, busy0, all0), (t1, busy1, all1) in zip(samples, samples[1:]):
        if start <= t0 and t1 <= end and all1 > all0:
            share = (busy1 - busy0) / (all1 - all0)
            busy.setdefault(int((t0 - start) // seconds), []).append(share)
            idle += (1 - share) * cores * (t1 - t0)
    rows = [f"| from (s) | cores busy (of {cores}) | the longest tests running then |", "|---:|---:|---|"]
    for index in sorted(busy):
        share = sum(busy[index]) / len(busy[index])
        low, high = start + index * seconds, start + (index + 1) * seconds
        running = sorted((t for t in tests if t["began"] < high and t["began"] + t["wall"] > low),
                         key=lambda t: -t["wall"])[:shown]
        names = "; ".join(f"{t['test'].split('::')[-1][:60]} ({t['cpu'] / max(t['wall'], 1e-9):.2f} "
                          "CPU s/s)" for t in running)
        rows.append(f"| {index * seconds} | {share * cores:.2f} | {names} |")
    rows.append(f"\n{end - start:.0f} s from the first test's start to the last one's end; the "
                f"cores stood idle {idle:.0f} core-seconds of it.")
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[2] == "--windows":
        print(windows(sys.argv[1], int(sys.argv[3])))
    else:
        print(summarize(sys.argv[1]))
