"""Preemption: every worker saves at the same agreed step, then exits to be restarted.

A cluster manager preempts a job by sending SIGTERM (Slurm before its
KillWait, Kubernetes before `terminationGracePeriodSeconds`), often to one
node first. kd handles SIGTERM and SIGUSR1 alike (`SIGNALS`): SIGUSR1 is the
early warning a Slurm job asks for before its time limit
(`#SBATCH --signal=USR1@120`); its default action would kill the process.

Workers of a multi-worker job must all save at the same step (a checkpoint
of different steps would not restore), and the agreement must
cost nothing while no preemption comes: kd, like TensorFlow's
`PreemptionCheckpointHandler`, agrees through the coordination service's
key-value store, from background threads, instead of a collective per step.

The protocol, for a `step` count that is the same on every worker (the
training chunks run so far; every chunk all-reduces, so workers are at
most one chunk apart):

1. A worker that gets the signal (or whose `watcher` fires) claims the
   leader key; only the first claim wins.
2. At its next `check(step)` the leader publishes `step + 1` and waits until
   every worker's watcher thread has acknowledged it. Any other worker is
   then at most at `step + 1` (chunk `step + 1` needs the leader).
3. Every worker saves when its step reaches the agreed one, and exits with
   `RESTART_EXIT_CODE` (42); `keras-distrib launch --max-restarts`, Slurm's
   requeue or a Kubernetes Job restarts it, and training resumes from the
   backup.

With `grace_period` > 0 (a long notice, as on some clouds) the workers save
at the first agreed step, keep training, and save again at a second agreed
step shortly before the grace period ends, then exit. A single process (one
device, mirrored, or a parameter-server coordinator, the only process that
runs the loop) decides alone and saves at the step the signal is seen.
"""

import itertools
import logging
import signal
import threading
import time

from keras_distrib import _keras_compat
from keras_distrib.cluster import info as cluster_lib
from keras_distrib.cluster import strategies
from keras_distrib import validation
from keras_distrib.cluster.failures import RESTART_EXIT_CODE
from keras_distrib.cluster.failures import SAVED_MESSAGE

logger = logging.getLogger("keras_distrib")

__all__ = [
    "EXIT",
    "PreemptionHandler",
    "RESTART_EXIT_CODE",
    "SAVE",
    "SIGNALS",
]

# The signals that mean "save and exit": a preemption (SIGTERM) and Slurm's
# early warning before a time limit (`--signal=USR1@<seconds>`).
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
SAVE = "save"  # save now and keep training (first save of a grace period)
EXIT = "exit"  # save now, then exit with RESTART_EXIT_CODE
_ACK_TIMEOUT = 60.0
_POLL_MS = 1000
_POLL_SECONDS = 0.5
# Handlers started in this process: every worker starts the same sequence
# (one per fit), so the count names the same handler on each.
_GENERATIONS = itertools.count()


def _check_seconds(name, value):
    if not validation.is_seconds(value, zero=True):
        raise ValueError(f"`{name}`={value!r}: expected a finite number of seconds >= 0.")
    return float(value)


class PreemptionHandler:
    """Decides, at no cost per step, when every worker saves before a preemption.

    Call `start()` before training, `check(step)` after each chunk of steps
    (the same count on every worker), save when it says so, and `stop()` at
    the end. `check` reads flags that background threads set; the only
    network traffic happens after a signal.

    Args:
        grace_period: Seconds between the signal and the forced kill that
            training may use. 0 (default): save at the first agreed step and
            exit. More: save at the first agreed step, train on, and save
            again (then exit) shortly before the grace period ends.
        watcher: Optional `callable() -> bool`, polled every
            `poll_interval` seconds, True when termination is imminent
            (e.g. a cloud's maintenance notice): acts like the signal.
        signals: Signals that mean preemption (default `SIGNALS`: SIGTERM,
            and SIGUSR1 for Slurm's `--signal=USR1@<seconds>`). Handlers are
            installed only from the main thread, and restored by `stop()`.
        poll_interval: Seconds between `watcher` calls.
        strategy: The training strategy; a multi-worker one agrees through
            its coordination service, anything else decides alone.

    Examples:
        >>> import keras_distrib as kd
        >>> from keras_distrib.cluster import preemption
        >>> handler = preemption.PreemptionHandler()
        >>> handler.start()
        >>> handler.check(step=1) is None  # no signal: carry on
        True
        >>> handler.stop()
    """

    def __init__(self, *, grace_period=0.0, watcher=None, signals=SIGNALS,
                 poll_interval=1.0, strategy=None):
        self.grace_period = _check_seconds("grace_period", grace_period)
        self.poll_interval = _check_seconds("poll_interval", poll_interval)
        if watcher is not None and not callable(watcher):
            raise ValueError(f"`watcher`={watcher!r}: expected a callable returning True when "
                             "termination is imminent, or None.")
        self.watcher = watcher
        self.signals = tuple(signals)
        self.strategy = strategy
        self.reason = None  # what started the preemption, for messages
        self._signalled = threading.Event()
        self._stopping = threading.Event()
        self._threads = []
        self._previous = {}
        self._started = False

    # Lifecycle.

    def start(self):
        """Installs the signal handlers and starts the watcher threads."""
        if self._started:
            return
        self._started = True
        self._round = 0
        self._agreed = {}
        self._published = set()
        self._leader = False
        self._signal_time = None
        self._chunk_seconds = 0.0
        self._save_seconds = 0.0
        self._last_check = None
        info = cluster_lib.cluster_info()
        self._multi = (self.strategy is not None and strategies.traits(self.strategy).is_multi_worker
                       and info.num_workers > 1)
        self._workers = info.num_workers
        self._me = f"{info.task_type}-{info.task_index}"
        self._prefix = f"kd/preemption/{next(_GENERATIONS)}"
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                try:
                    self._previous[signum] = signal.signal(signum, self._on_signal)
                except (ValueError, OSError):
                    pass
        if self.watcher is not None:
            self._spawn(self._poll_watcher, "watcher")
        if self._multi:
            self._spawn(self._claim_when_signalled, "claim")
            self._spawn(self._watch_agreed_steps, "agreement")

    def stop(self):
        """Restores the signal handlers and stops the threads."""
        if not self._started:
            return
        self._started = False
        self._stopping.set()
        self._signalled.set()  # wakes the claiming thread
        for signum, handler in self._previous.items():
            try:
                signal.signal(signum, handler)
            except (ValueError, OSError, TypeError):
                pass
        self._previous = {}
        for thread in self._threads:
            thread.join(timeout=2 * _POLL_MS / 1000)
        self._threads = []
        if self.reason and self._round == 0:
            logger.warning("%s arrived as training ended; nothing to save.", self.reason)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc_info):
        self.stop()

    @property
    def preempted(self):
        """Whether a preemption signal (or the watcher) arrived."""
        return self.reason is not None

    # Signals, watcher, agreement threads.

    def _on_signal(self, signum, frame):
        # Only flags here: a signal handler must not block on the network.
        self._notice(signal.Signals(signum).name)

    def _notice(self, reason):
        if self.reason is None:
            self.reason = reason
            self._signal_time = time.monotonic()
            self._signalled.set()

    def _spawn(self, target, name):
        thread = threading.Thread(target=target, name=f"kd-preemption-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _poll_watcher(self):
        while not self._stopping.wait(self.poll_interval):
            try:
                if self.watcher():
                    self._notice("the termination watcher")
                    return
            except Exception as error:  # noqa: BLE001 - a user's watcher may raise anything
                logger.warning("The preemption watcher raised %r; it is no longer polled.", error)
                return

    def _claim_when_signalled(self):
        self._signalled.wait()
        if self._stopping.is_set():
            return
        try:
            _keras_compat.key_value_insert(f"{self._prefix}/leader", self._me)
        except _keras_compat.KeyExists:
            return  # another worker leads the agreement
        except Exception as error:  # noqa: BLE001 - the cluster may be going down
            logger.warning("Could not announce the preemption to the cluster: %s", error)
            return
        self._leader = True

    def _watch_agreed_steps(self):
        for round_ in (0, 1):
            # Short reads and a sleep, not one long blocking read: TensorFlow
            # holds the GIL while it waits for a key, which would stall the
            # training thread (measured: 2x wall time per step on 2 workers).
            while not self._stopping.wait(_POLL_SECONDS):
                try:
                    value = _keras_compat.key_value_get(f"{self._prefix}/step/{round_}", 1)
                except _keras_compat.KeyMissing:
                    continue
                except Exception:  # noqa: BLE001 - the service is gone (cluster ending)
                    return
                # Record before acknowledging: the leader resumes once every
                # worker acknowledged, and this worker must then know the step.
                self._agreed[round_] = int(value)
                try:
                    _keras_compat.key_value_insert(f"{self._prefix}/ack/{round_}/{self._me}", "1")
                except Exception:  # noqa: BLE001
                    return
                break
            if self.grace_period <= 0:
                return

    def _publish(self, round_, step):
        """The leader: publish the step to save at and wait until every worker has it."""
        _keras_compat.key_value_insert(f"{self._prefix}/step/{round_}", str(step))
        deadline = time.monotonic() + _ACK_TIMEOUT
        info = cluster_lib.cluster_info()
        peers = [f"{t}-{i}" for t in ("chief", "worker") for i in range(len(info.cluster.get(t, ())))]
        for peer in peers:
            while True:
                try:
                    _keras_compat.key_value_get(f"{self._prefix}/ack/{round_}/{peer}", _POLL_MS)
                    break
                except _keras_compat.KeyMissing:
                    if time.monotonic() > deadline:
                        logger.warning("%s did not acknowledge the preemption step in %gs.",
                                       peer, _ACK_TIMEOUT)
                        break
        logger.warning("Preemption (%s): every worker saves after step %d.", self.reason, step)

    # The per-chunk check.

    def saved(self, seconds):
        """Records how long a save took (the final save must fit in the grace period)."""
        self._save_seconds = max(self._save_seconds, seconds)

    def check(self, step):
        """After chunk `step` (counted alike on every worker): `SAVE`, `EXIT` or None.

        Costs reading a few flags unless a preemption is under way.
        """
        now = time.monotonic()
        if self._last_check is not None:
            # A running mean of the time per chunk, for the grace period's last call.
            self._chunk_seconds += 0.2 * ((now - self._last_check) - self._chunk_seconds)
        self._last_check = now
        if not self._started or (self.reason is None and not self._agreed):
            return None
        round_ = self._round
        leading = self._leader if self._multi else self.reason is not None
        if leading and round_ not in self._agreed and round_ not in self._published:
            if round_ == 1:
                # Train through the grace period; the final save must fit before it ends.
                margin = 6 * self._chunk_seconds + 2 * self._save_seconds + 1.0
                if now < self._signal_time + self.grace_period - margin:
                    return None
            self._published.add(round_)
            if self._multi:
                self._publish(round_, step + 1)
                self._agreed.setdefault(round_, step + 1)
            else:
                self._agreed[round_] = step
        agreed = self._agreed.get(round_)
        if agreed is None or step < agreed:
            return None
        self._round += 1
        return EXIT if self.grace_period <= 0 or round_ == 1 else SAVE

    def _wait_for_every_save(self):
        """Multi-worker: announce this worker's save and wait for every other worker's.

        No worker exits before the chief's backup is complete: under
        `srun --kill-on-bad-exit=1` the first task to exit 42 ends the
        others' processes.
        """
        try:
            _keras_compat.key_value_insert(f"{self._prefix}/saved/{self._me}", "1")
        except Exception as error:  # noqa: BLE001 - the cluster may be going down
            logger.warning("Could not announce this worker's backup: %s", error)
            return
        deadline = time.monotonic() + _ACK_TIMEOUT
        info = cluster_lib.cluster_info()
        peers = [f"{t}-{i}" for t in ("chief", "worker") for i in range(len(info.cluster.get(t, ())))]
        for peer in peers:
            while time.monotonic() < deadline:
                try:
                    _keras_compat.key_value_get(f"{self._prefix}/saved/{peer}", _POLL_MS)
                    break
                except _keras_compat.KeyMissing:
                    continue
                except Exception:  # noqa: BLE001 - the service is gone: nothing left to wait for
                    return

    def exit(self):
        """Exits the process with `RESTART_EXIT_CODE` (after the final save; every
        worker of a multi-worker cluster waits until all have saved)."""
        logger.warning("%s; exiting with code %d so that the job is restarted and resumes from "
                       "the backup.", SAVED_MESSAGE, RESTART_EXIT_CODE)
        if getattr(self, "_multi", False):
            self._wait_for_every_save()
        raise SystemExit(RESTART_EXIT_CODE)
