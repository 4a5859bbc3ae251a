"""What a signal to the launcher does: stop the cluster, the tasks given time to save.

A signal of `STOP_SIGNALS` (a preemption, `scancel`, Ctrl-C, Slurm's
warning before a time limit) raises `SystemExit` in the launcher's main
thread while the tasks run (`signals_stop_the_cluster`, `raise_from_now`),
so that `keras_distrib.cluster.supervisor`'s run unwinds and stops every
task; one that comes while the launch is being made ready is kept
(`keras_distrib._early_signals`) and acted on first. The tasks then get
SIGTERM and the grace period (`save_time` says how long, Slurm's KillWait
included).
"""

import contextlib
import os
import re
import signal
import subprocess
import threading

from keras_distrib import _early_signals

__all__ = [
    "STOP_SIGNALS",
    "ignore_stop_signals",
    "raise_from_now",
    "save_time",
    "signals_ignored",
    "signals_stop_the_cluster",
    "stop_raising",
    "stops_raise",
]

# Signals to the launcher that stop the cluster, the tasks getting SIGTERM and
# the grace period to save: SIGTERM (a preemption, `scancel`), SIGINT
# (Ctrl-C) and SIGUSR1 (Slurm's `--signal=USR1@<seconds>` before a time limit).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)


def _slurm_kill_wait():
    """Slurm's KillWait in seconds (SIGTERM to SIGKILL), or None where it cannot be read."""
    try:
        done = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                              timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"^KillWait\s*=\s*(\d+)", done.stdout, re.M)
    return int(match.group(1)) if match else None


def save_time(signum, grace):
    """What the tasks have to save: the grace period, or less where Slurm's SIGTERM kills sooner."""
    if signum == signal.SIGTERM and os.environ.get("SLURM_JOB_ID"):
        # Slurm's SIGTERM (scancel, the time limit) comes with SIGKILL KillWait seconds later.
        kill_wait = _slurm_kill_wait()
        if kill_wait is None:
            return (f"the tasks have until Slurm's SIGKILL to save and exit (KillWait seconds "
                    f"after its SIGTERM, 30 by default; --grace-period {grace:g}s)")
        return (f"the tasks have {min(grace, kill_wait):g}s to save and exit (Slurm's KillWait: "
                f"SIGKILL {kill_wait}s after its SIGTERM)")
    return f"the tasks have {grace:g}s to save and exit"


@contextlib.contextmanager
def signals_ignored():
    """Within: the stop signals are ignored (the tasks are being stopped; a second signal must wait)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def ignore_stop_signals():
    """After the run: the exit code is decided, a late signal must not change it.

    Under `srun --kill-on-bad-exit=1`, the first node's agent to exit 42
    makes Slurm send SIGTERM to the others, which are then exiting 42 too.
    """
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


# Whether a stop signal raises SystemExit now (main thread only; see signals_stop_the_cluster).
_raising = [False]


def raise_from_now():
    """From here a stop signal raises SystemExit; one kept before raises at once."""
    _raising[0] = True
    early = _early_signals.take()
    if early is not None:
        raise SystemExit(128 + early)


def stop_raising():
    """From here a stop signal is kept again, not raised (`raise_from_now` undone)."""
    _raising[0] = False


@contextlib.contextmanager
def stops_raise():
    """Within: a stop signal raises SystemExit, a kept one first (a restart's wait)."""
    try:
        raise_from_now()
        yield
    finally:
        stop_raising()


@contextlib.contextmanager
def signals_stop_the_cluster():
    """A signal of `STOP_SIGNALS` to the launcher unwinds it, so its `finally` stops every task.

    The tasks then get SIGTERM and the grace period to save (SIGUSR1 is
    Slurm's warning before a time limit, `--signal=USR1@<seconds>`). The
    signal raises only inside the run's `try` (`supervisor`'s `_Run.run`) (or `stops_raise`); one
    that comes before, while the launch is made ready (ports, task specs, a
    private network), is kept, and the run acts on it first: no task
    starts, and the result says what a signal while starting says.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        if _raising[0]:
            raise SystemExit(128 + signum)
        _early_signals.keep(signum)

    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


