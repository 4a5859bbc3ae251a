"""Stop signals that reach `keras-distrib` while it starts, kept for the launcher.

Starting takes a moment (the launcher loads no TensorFlow; the commands that
do take seconds). Slurm's warning before a time limit (`--signal=USR1@<s>`)
or a preemption's SIGTERM arriving then would kill the command outright (exit 138 or 143: the recipe reruns it, the job ends at its
time limit). On kd's command line only, this records such a signal instead;
the launcher acts on it as soon as it can (`take`): no task started, so it
exits 42 for a restart. Standard library only: it runs before TensorFlow loads.
"""

import signal
import threading

# The signals the launcher turns into a stop of the cluster (stop_signals.STOP_SIGNALS).
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
_received = []


def _record(signum, frame):
    keep(signum)


def keep(signum):
    """Keeps `signum` for the launcher's next `take`."""
    _received.append(signum)


def install():
    """Records `SIGNALS` from now on (the main thread of kd's command line only)."""
    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            if signal.getsignal(signum) is signal.SIG_DFL:
                signal.signal(signum, _record)


def take():
    """The first signal recorded since `install` (then forgotten), or None."""
    return _received.pop(0) if _received else None
