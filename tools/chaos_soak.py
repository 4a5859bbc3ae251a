"""A chaos soak: train on a local cluster while killing a random task every 20-60 s.

Usage: PYTHONPATH=. python tools/chaos_soak.py [--minutes 10] [--epochs 60] [--workers 2] [--faults ...]
                                               [--seed 0] [--report soak.json]

1. An uninterrupted run: `kd.launch` of `--workers` workers training a float64
   MLP with Dropout (fit, BackupAndRestore every 25 steps) to the end; its
   final weights and its wall time are the reference.
2. The soak: the same launch (`max_restarts` 1000, explicit ports, so the
   launcher holds port locks) while, for `--minutes`, every 20-60 s one
   fault of `--faults` strikes: a random task gets SIGKILL, SIGTERM or
   SIGSTOP; or (COPY) the newest backup is replaced by a copy of itself
   (`cp -r`, new inodes and times) and a task is SIGKILLed, so the restart
   resumes from the copy; or (DISKFULL, root) the backup's volume, a 64 MiB
   tmpfs of the soak's own, is filled for 15-30 s; or (NETCUT, root) the
   tasks' network namespace loses its loopback link for 10-20 s, then gets
   it back. The launcher restarts the cluster after each failure and
   training resumes from its backup. After the minutes, the run finishes
   undisturbed.
3. The checks: the soak's final weights against the reference (largest
   |a - b| / (1 + |a|); float64, so an exact resume gives ~1e-12); no
   process left (every pid seen under the launcher, and any process holding
   one of its task tokens); no port lock left; the launcher's file
   descriptors after the run against before; nothing left in the run's
   TMPDIR, and the backup directory kd created removed; time lost per fault
   ((soak wall time - uninterrupted wall time) / faults) and, per fault,
   the time from the fault until training passed the step it had reached.

Every process it starts runs in its own session and is killed by group at
the end, whatever happens. The report is printed and, with `--report`,
written as JSON.
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
ROWS, FEATURES, BATCH, SAVE_EVERY = 2048, 64, 64, 25
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM, "SIGSTOP": signal.SIGSTOP}
# Faults that are not a signal: a backup replaced by its copy, a full disk, a cut network.
ROOT_FAULTS = ("DISKFULL", "NETCUT")
FAULTS = (*SIGNALS, "COPY", *ROOT_FAULTS)
VOLUME_SIZE = "64m"
NO_PROGRESS_LIMIT = 300.0  # seconds without a step: the soak calls it a hang and stops


# The training task (`--train EPOCHS BACKUP OUT`).


def train(epochs, backup, out):
    import keras_distrib as kd

    strategy = kd.make_strategy("multi_worker")
    import keras
    import numpy as np

    keras.config.set_floatx("float64")
    keras.utils.set_random_seed(7)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES))
    y = rng.integers(0, 10, size=ROWS)
    with strategy.scope():
        model = kd.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(256, activation="relu"),
                               keras.layers.Dropout(0.1), keras.layers.Dense(256, activation="relu"),
                               keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Progress(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            if step % 10 == 0 and kd.is_chief():
                print(f"PROGRESS {step}", flush=True)

    model.fit(x, y, batch_size=BATCH, epochs=int(epochs), verbose=0, shuffle=False,
              callbacks=[kd.callbacks.BackupAndRestore(backup, save_freq=SAVE_EVERY), Progress()])
    if kd.is_chief():
        np.savez(out + ".tmp.npz", *model.get_weights())
        os.replace(out + ".tmp.npz", out)
        print("TRAINED", flush=True)


# The launcher (`--launch JSON`): kd.launch, with its file descriptors counted.


def launcher(config):
    import keras_distrib as kd

    config = json.loads(config)
    fds = lambda: sorted(os.listdir("/proc/self/fd"))  # noqa: E731
    before = fds()
    result = kd.launch(HERE, workers=config["workers"],
                       args=["--train", config["epochs"], config["backup"], config["out"]],
                       max_restarts=1000, ports=config["ports"], timeout=None)
    after = fds()
    print(f"LAUNCHER fds before {len(before)} after {len(after)} restarts {result.restarts} "
          f"returncode {result.returncode}", flush=True)
    return result.returncode


# The soak.


def _ticks(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[19]), fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def _tree():
    """{pid: (start ticks, state, parent)} of every process."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = _ticks(int(name))
            if info:
                found[int(name)] = info
    return found


def _descendants(root, tree):
    children = {}
    for pid, (_, _, parent) in tree.items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            found.append(pid)
            todo.append(pid)
    return found


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _task_label(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"KD_TASK="):
                    return item[8:].decode()
    except OSError:
        pass
    return "?"


def _tasks(launcher_pid):
    """Pids of the launch's task processes now (each the child of its guard)."""
    tree = _tree()
    tasks = []
    for pid in _descendants(launcher_pid, tree):
        parent = tree[pid][2]
        if "_guard.py" in _cmdline(parent) and "_guard.py" not in _cmdline(pid):
            tasks.append(pid)
    return tasks


def _free_ports(count):
    import socket

    ports = []
    while len(ports) < count:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in ports:
            ports.append(port)
    return ports


class Run:
    """One launch in a subprocess: its output lines with their times, its processes seen."""

    def __init__(self, workers, epochs, folder, name, volume=False):
        self.folder = os.path.join(folder, name)
        os.makedirs(self.folder)
        self.tmp = os.path.join(self.folder, "tmp")
        os.makedirs(self.tmp)
        self.volume = None
        if volume:  # a small disk of its own for the backup, to fill (DISKFULL)
            self.volume = os.path.join(self.folder, "volume")
            os.makedirs(self.volume)
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={VOLUME_SIZE}", "tmpfs", self.volume],
                           check=True)
        self.backup = os.path.join(self.volume or self.folder, "backup")  # kd creates it
        self.out = os.path.join(self.folder, "weights.npz")
        self.ports = _free_ports(workers)
        config = dict(workers=workers, epochs=str(epochs), backup=self.backup, out=self.out,
                      ports=self.ports)
        env = dict(os.environ, TMPDIR=self.tmp, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.started = time.monotonic()
        self.process = subprocess.Popen([sys.executable, "-u", HERE, "--launch", json.dumps(config)],
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)
        self.lines = []  # (seconds since start, line)
        self.seen = {}  # pid -> start ticks, of every process seen under the launcher
        self.tokens = set()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _read(self):
        log = open(os.path.join(self.folder, "launch.log"), "w")
        for line in self.process.stdout:
            line = line.rstrip("\n")
            self.lines.append((time.monotonic() - self.started, line))
            log.write(f"{self.lines[-1][0]:9.2f} {line}\n")
            log.flush()
        log.close()

    def _watch(self):
        while self.process.poll() is None:
            tree = _tree()
            for pid in _descendants(self.process.pid, tree):
                self.seen.setdefault(pid, tree[pid][0])
            time.sleep(0.5)

    def progress(self):
        """[(seconds, step)] of the chief's PROGRESS lines."""
        return [(t, int(line.rsplit(" ", 1)[1])) for t, line in self.lines
                if line.endswith(tuple("0123456789")) and "] PROGRESS " in line]

    def wait(self, timeout):
        try:
            self.process.wait(timeout=timeout)
        finally:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._reader.join(timeout=30)
        self._watcher.join(timeout=30)
        self.seconds = time.monotonic() - self.started
        return self.process.returncode

    def unmount(self):
        if self.volume is not None:
            subprocess.run(["umount", "-l", self.volume], check=False)
            self.volume = None


def _still_alive(seen):
    left = []
    for pid, ticks in seen.items():
        info = _ticks(pid)
        if info and info[0] == ticks and info[1] != "Z":
            left.append(f"{pid} ({_cmdline(pid)[:80]})")
    return left


def _token_holders(launcher_pid):
    needle = f"KD_TASK_TOKEN={launcher_pid}-".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if any(item.startswith(needle) for item in f.read().split(b"\0")):
                    found.append(int(name))
        except OSError:
            continue
    return found


def _chaos(run, minutes, rng, faults, stop, kinds):
    deadline = run.started + 60 * minutes
    while not stop.is_set():
        wait = rng.uniform(20, 60)
        if time.monotonic() + wait > deadline or stop.wait(wait):
            return
        tasks = _tasks(run.process.pid)
        if not tasks:
            continue  # the cluster is restarting
        pid = rng.choice(tasks)
        name = rng.choice(sorted(kinds))
        label = _task_label(pid)
        steps = run.progress()
        fault = {"at": time.monotonic() - run.started, "signal": name, "task": label,
                 "pid": pid, "step": steps[-1][1] if steps else 0}
        try:
            detail = _strike(run, name, pid, rng, stop)
        except (ProcessLookupError, FileNotFoundError) as error:  # it ended, or kd pruned the backup
            print(f"[soak] {name} skipped ({error})", flush=True)
            continue
        if detail is None:
            continue
        fault["detail"] = detail
        faults.append(fault)
        print(f"[soak] {fault['at']:7.1f}s {name} -> {label} (pid {pid}) at step "
              f"{fault['step']}: {detail}", flush=True)


def _strike(run, name, pid, rng, stop):
    """Does fault `name` to the run (task `pid`); returns what it did, or None if it could not."""
    if name in SIGNALS:
        os.kill(pid, SIGNALS[name])
        return "signalled"
    if name == "COPY":
        return _replace_newest_backup(run.backup, pid)
    if name == "DISKFULL":
        return _fill(run.volume, rng.uniform(15, 30), stop)
    return _cut_network(pid, rng.uniform(10, 20), stop)


def _replace_newest_backup(backup, pid):
    """Replaces the newest ckpt-N by a copy of itself, then SIGKILLs task `pid` (the restart resumes from it)."""
    names = sorted((n for n in os.listdir(backup) if re.fullmatch(r"ckpt-\d+", n)), key=lambda n: int(n[5:]))
    if not names:
        return None
    path = os.path.join(backup, names[-1])
    copy, aside = os.path.join(backup, ".soak-copy"), os.path.join(backup, ".soak-aside")
    try:
        shutil.copytree(path, copy, copy_function=shutil.copyfile)
        os.rename(path, aside)
        os.rename(copy, path)
    finally:
        for left in (copy, aside):
            shutil.rmtree(left, ignore_errors=True)
    os.kill(pid, signal.SIGKILL)
    return f"{names[-1]} replaced by its copy, then SIGKILL"


def _fill(volume, seconds, stop):
    """Fills `volume` (the backup's tmpfs) for `seconds`, then frees it."""
    filler = os.path.join(volume, ".soak-filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            try:
                os.write(fd, b"x" * (1 << 20))
            except OSError:
                break
        stop.wait(seconds)
    finally:
        os.close(fd)
        os.remove(filler)
    return f"disk full for {seconds:.0f}s"


def _cut_network(pid, seconds, stop):
    """Takes the loopback link of task `pid`'s network namespace down for `seconds`, then up."""
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)  # holds the namespace while it is down
    namespace = f"--net=/proc/{os.getpid()}/fd/{fd}"
    try:
        down = subprocess.run(["nsenter", namespace, "ip", "link", "set", "lo", "down"],
                              capture_output=True, text=True, timeout=30)
        if down.returncode != 0:
            print(f"[soak] NETCUT failed: {down.stderr.strip()}", flush=True)
            return None
        stop.wait(seconds)
        subprocess.run(["nsenter", namespace, "ip", "link", "set", "lo", "up"],
                       capture_output=True, text=True, timeout=30)
    finally:
        os.close(fd)
    return f"loopback down for {seconds:.0f}s"


def _hang_guard(run, stop):
    """Stops the run if no step was logged for NO_PROGRESS_LIMIT seconds (a hang)."""
    while not stop.wait(5):
        steps = run.progress()
        last = steps[-1][0] if steps else 0.0
        if time.monotonic() - run.started - last > NO_PROGRESS_LIMIT:
            print(f"[soak] no step for {NO_PROGRESS_LIMIT:g}s: a hang; stopping", flush=True)
            run.hung = True
            os.killpg(run.process.pid, signal.SIGKILL)
            return


def _recoveries(run, faults):
    """Per fault: seconds from the fault until the restarted cluster passed the step it had reached.

    None when no restart followed it (the task had already finished, say).
    """
    steps = run.progress()
    restarts = [t for t, line in run.lines if line.startswith("[launcher] restarting the cluster")]
    for fault in faults:
        restart = next((t for t in restarts if t > fault["at"]), None)
        following = next((f["at"] for f in faults if f["at"] > fault["at"]), float("inf"))
        back = None
        if restart is not None and restart < following:
            back = next((t for t, step in steps if t > restart and step > fault["step"]), None)
        fault["recovered_after"] = None if back is None else round(back - fault["at"], 1)


def _weights_diff(a, b):
    import numpy as np

    with np.load(a) as x, np.load(b) as y:
        return max(float(np.max(np.abs(x[k] - y[k]) / (1 + np.abs(x[k])))) for k in x.files)


def _launcher_line(run):
    line = next((line for _, line in run.lines if line.startswith("LAUNCHER ")), "")
    numbers = [int(n) for n in re.findall(r"-?\d+", line)]
    return dict(zip(("fds_before", "fds_after", "restarts", "returncode"), numbers))


def _leftovers(run):
    from keras_distrib.cluster import ports as ports_lib

    tempfile.tempdir = run.tmp  # the launch's TMPDIR: its lock directory is there
    try:
        return _leftovers_in(run, ports_lib)
    finally:
        tempfile.tempdir = None


def _leftovers_in(run, ports_lib):
    locks = [os.path.join(ports_lib.lock_directory(), f"kd-port-{p}.lock") for p in run.ports]
    # kd's per-user lock directory (`$TMPDIR/kd-locks-<uid>`) stays by design; what is in it may not.
    lock_folder = ports_lib.lock_directory()
    left_tmp = []
    for root, dirs, names in os.walk(run.tmp):
        left_tmp += [os.path.join(root, n) for n in dirs + names
                     if os.path.join(root, n) != lock_folder]
    return {
        "processes": _still_alive(run.seen),
        "token_holders": _token_holders(run.process.pid),
        "port_locks": [p for p in locks if os.path.lexists(p)],
        "tmp_files": left_tmp,
        "backup_dir_left": os.path.exists(run.backup),
    }


def soak(options):
    rng = random.Random(options.seed)
    folder = tempfile.mkdtemp(prefix="kd-chaos-soak-")
    report = {"minutes": options.minutes, "epochs": options.epochs, "workers": options.workers,
              "seed": options.seed, "folder": folder}
    print(f"[soak] uninterrupted run ({options.workers} workers, {options.epochs} epochs)", flush=True)
    clean = Run(options.workers, options.epochs, folder, "uninterrupted")
    code = clean.wait(timeout=3600)
    report["uninterrupted"] = {"seconds": round(clean.seconds, 1), "returncode": code,
                               "launcher": _launcher_line(clean), "left": _leftovers(clean)}
    print(f"[soak] uninterrupted: exit {code} in {clean.seconds:.0f}s", flush=True)
    if code != 0:
        print("\n".join(line for _, line in clean.lines[-40:]))
        raise SystemExit("the uninterrupted run failed")
    print(f"[soak] chaos run: a fault every 20-60 s for {options.minutes:g} minutes", flush=True)
    kinds = [k for k in options.faults.split(",") if k]
    if os.getuid() != 0:
        kinds = [k for k in kinds if k not in ROOT_FAULTS]  # a mount and another namespace: root's
    report["fault_kinds"] = kinds
    run = Run(options.workers, options.epochs, folder, "soak", volume="DISKFULL" in kinds)
    run.hung = False
    faults, stop = [], threading.Event()
    threads = [threading.Thread(target=_chaos, args=(run, options.minutes, rng, faults, stop, kinds),
                                daemon=True),
               threading.Thread(target=_hang_guard, args=(run, stop), daemon=True)]
    for thread in threads:
        thread.start()
    try:
        code = run.wait(timeout=3600 + 60 * options.minutes)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=70)
        left_on_volume = sorted(os.listdir(run.volume)) if run.volume else []
        run.unmount()
    _recoveries(run, faults)
    launched = _launcher_line(run)
    report["soak"] = {"seconds": round(run.seconds, 1), "returncode": code, "hung": run.hung,
                      "launcher": launched, "faults": faults, "left": _leftovers(run)}
    report["soak"]["left"]["on_backup_volume"] = left_on_volume
    report["faults"] = {name: sum(f["signal"] == name for f in faults) for name in FAULTS}
    report["faults"]["total"] = len(faults)
    report["restarts"] = launched.get("restarts")
    if code == 0 and os.path.exists(run.out):
        report["weights_max_relative_difference"] = _weights_diff(clean.out, run.out)
    lost = (run.seconds - clean.seconds) / len(faults) if faults else None
    report["seconds_lost_per_fault"] = None if lost is None else round(lost, 1)
    recovered = [f["recovered_after"] for f in faults if f["recovered_after"] is not None]
    if recovered:
        report["recovery_seconds"] = {"median": statistics.median(recovered), "max": max(recovered)}
        for name in FAULTS:
            own = [f["recovered_after"] for f in faults if f["signal"] == name and f["recovered_after"] is not None]
            if own:
                report["recovery_seconds"][name] = statistics.median(own)
    return report


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--train"]:
        return train(*argv[1:])
    if argv[:1] == ["--launch"]:
        return launcher(argv[1])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", default=None)
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help=f"comma-separated, of {', '.join(FAULTS)} (DISKFULL and NETCUT as root)")
    parser.add_argument("--keep", action="store_true", help="keep the run's folder (logs, weights)")
    options = parser.parse_args(argv)

    def stop(signum, frame):
        # The runs' `finally` blocks kill their launchers' process groups.
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, stop)
    report = soak(options)
    text = json.dumps(report, indent=1)
    print(text)
    if options.report:
        with open(options.report, "w") as f:
            f.write(text)
    if not options.keep:
        shutil.rmtree(report["folder"], ignore_errors=True)
    soak_part = report["soak"]
    ok = (soak_part["returncode"] == 0 and not soak_part["hung"]
          and report.get("weights_max_relative_difference", 1) <= 1e-9
          and not any(soak_part["left"][k] for k in ("processes", "token_holders", "port_locks", "tmp_files"))
          and not soak_part["left"]["backup_dir_left"] and not soak_part["left"]["on_backup_volume"]
          and soak_part["launcher"].get("fds_before") == soak_part["launcher"].get("fds_after"))
    print(f"[soak] {'PASSED' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
