"""An opt-in watchdog that names the worker a stalled training step waits for.

TensorFlow's coordination service ends a multi-worker job when a task dies
or stops answering its heartbeats, but a worker whose process stays healthy
while it hangs (a stuck data loader or file read between steps, a callback
that never returns) holds every other worker in the step's collective
forever, and nothing says which one. With `KD_WATCHDOG=<seconds>` in the
environment, each training process starts a thread that publishes its step
and a heartbeat to the coordination service's key-value store (no collective,
nothing on the training thread but an integer update per chunk of steps) and
reads the others'. When this process's step has not advanced for `seconds`,
it prints which worker is missing at which step, then exits with
`STALL_EXIT_CODE` so that the launcher stops the job (and restarts it with
`--max-restarts`; training resumes from the backup).

The first step traces, compiles and waits for every worker to do the same
(one loaded machine's worker can lag the others by far more than a step),
so until this process's first step has finished, the limit is
`FIRST_STEP_FACTOR` times `seconds`.

A process that runs alone (one device, or a parameter-server coordinator,
whose workers and ps tasks run no Python) reports that no step finished
within `seconds`, with the tasks it was waiting on.

Before the first step, the workers of a multi-worker job also compare their
batches' structure, dtypes and shapes (`batch_signature`) through the same
store, and stop with an error naming the workers whose input differs
(otherwise one fails alone, or the others wait for it in the collective).
"""

import itertools
import os
import sys
import threading
import time

from keras_distrib import _keras_compat
from keras_distrib.cluster import info as cluster_lib
from keras_distrib.cluster import strategies
from keras_distrib import validation
from keras_distrib.cluster.lost import ADVICE, lost_task_message, lost_tasks  # noqa: F401 - public here too
from keras_distrib.cluster.lost import service_task

__all__ = [
    "ADVICE",
    "ENV",
    "FIRST_STEP_FACTOR",
    "STALL_EXIT_CODE",
    "Watchdog",
    "batch_signature",
    "explain_lost_task",
    "from_environment",
    "lost_task_message",
    "lost_tasks",
]

ENV = "KD_WATCHDOG"
# The shortest stall `KD_WATCHDOG` may name: the first step traces and compiles.
MIN_SECONDS = 1.0
# Until the first step has finished (tracing, compiling, every worker
# arriving), a stall is named after this many times `KD_WATCHDOG`.
FIRST_STEP_FACTOR = 10
# EX_TEMPFAIL: a temporary failure, worth a restart.
STALL_EXIT_CODE = 75
_GENERATIONS = itertools.count()


def explain_lost_task(error, own_label):
    """`error` (a `tf.errors.OpError`) with kd's explanation first, or None if it is not a lost task."""
    info = cluster_lib.cluster_info()
    host = service_task(job for job, addresses in info.cluster.items() if addresses)
    lost = lost_tasks(getattr(error, "message", str(error)), own_label, host)
    if not lost:
        return None
    return type(error)(getattr(error, "node_def", None), getattr(error, "op", None),
                       lost_task_message(lost, own_label))


def from_environment(strategy=None, environ=None):
    """A `Watchdog` if `KD_WATCHDOG` is set (seconds), else None.

    Raises:
        ValueError: `KD_WATCHDOG` is not a number of seconds >= `MIN_SECONDS`.

    Examples:
        >>> from keras_distrib.cluster import watchdog
        >>> watchdog.from_environment(environ={}) is None
        True
        >>> watchdog.from_environment(environ={"KD_WATCHDOG": "30"}).seconds
        30.0
    """
    environ = os.environ if environ is None else environ
    value = environ.get(ENV, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = None
    if seconds is None or not MIN_SECONDS <= seconds < float("inf"):
        raise ValueError(
            f"`{ENV}`={value!r}: expected the seconds a training step may take before the "
            f"watchdog reports a stall (a number >= {MIN_SECONDS:g}, e.g. {ENV}=120; less would "
            "stop a healthy job while its first step compiles). Unset it to turn the watchdog off."
        )
    return Watchdog(seconds, strategy=strategy)


def batch_signature(element_spec):
    """A worker's batches in one line: structure, then each tensor's dtype and shape.

    The batch dimension is left out (the last batch of an epoch may be
    shorter). Equal on every worker of a well-fed job.
    """
    import tensorflow as tf

    structure = tf.nest.map_structure(lambda _: "*", element_spec)
    leaves = []
    for spec in tf.nest.flatten(element_spec, expand_composites=True):
        shape = spec.shape.as_list()[1:] if spec.shape.rank else "?"
        leaves.append(f"{spec.dtype.name}{shape}")
    return f"{structure!r} " + ", ".join(leaves)


class Watchdog:
    """Reports (and ends the process) when training stops making progress.

    Args:
        seconds: How long this process's step may stay the same
            (`FIRST_STEP_FACTOR` times as long before the first step
            has finished).
        strategy: The training strategy; a multi-worker one shares
            heartbeats through its coordination service.
        exit_on_stall: After the report, end the process with
            `STALL_EXIT_CODE` (its training thread is stuck and cannot
            raise); False only reports (once).
        sink: Where the report goes (default: stderr and the kd logger).

    Examples:
        >>> from keras_distrib.cluster.watchdog import Watchdog
        >>> with Watchdog(60) as watch:
        ...     watch.step(epoch=0, batch=3)
    """

    def __init__(self, seconds, *, strategy=None, exit_on_stall=True, sink=None):
        if not validation.is_seconds(seconds):
            raise ValueError(f"`seconds`={seconds!r}: expected a number of seconds > 0.")
        self.seconds = float(seconds)
        self.strategy = strategy
        self.exit_on_stall = exit_on_stall
        self.sink = sink or _report
        self.interval = max(0.2, min(5.0, self.seconds / 5))
        self._count = 0
        self._entered = 0
        self._where = (0, -1)
        self._stopping = threading.Event()
        self._thread = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc_info):
        self.stop()

    @property
    def steps_seen(self):
        """How many times `step` was called (chunks of steps finished)."""
        return self._count

    def entering(self):
        """Records that the training thread is about to run the next step(s)."""
        self._entered = self._count + 1

    def step(self, epoch, batch):
        """Records that training finished batch index `batch` of `epoch` (training thread)."""
        self._where = (epoch, batch)
        self._count += 1

    def check_batches(self, element_spec, timeout=60.0):
        """Checks that every worker feeds batches of the same structure, dtypes and shapes.

        Called once, before the first step: a worker whose input differs
        would otherwise fail alone (or hang the others in the step's
        collective). Raises ValueError naming the workers that differ.
        """
        if not self._multi:
            return
        mine = batch_signature(element_spec)
        _keras_compat.key_value_insert(f"{self._prefix}/batches/{self._me.replace(' ', '-')}", mine)
        deadline = time.monotonic() + timeout
        differ = []
        for task in self._others:
            while True:
                try:
                    theirs = _keras_compat.key_value_get(f"{self._prefix}/batches/{task.replace(' ', '-')}", 100)
                    break
                except _keras_compat.KeyMissing:
                    if time.monotonic() > deadline:
                        theirs = None
                        break
            if theirs is not None and theirs != mine:
                differ.append(f"  {task}: {theirs}")
        if differ:
            raise ValueError(
                f"kd watchdog ({ENV}): the workers' batches differ, so their steps cannot match.\n"
                f"  {self._me}: {mine}\n" + "\n".join(differ) + "\n"
                "Every worker must feed batches of the same structure, dtypes and shapes (the batch "
                "dimension aside): check the input pipeline (dataset_fn, files, preprocessing) of "
                "the workers named.")

    def start(self):
        """Starts the heartbeat thread."""
        info = cluster_lib.cluster_info()
        self._multi = (self.strategy is not None and strategies.traits(self.strategy).is_multi_worker
                       and info.num_workers > 1)
        self._me = info.label
        self._tasks = [f"{t} {i}" for t in ("chief", "worker") for i in range(len(info.cluster.get(t, ())))]
        self._others = [t for t in self._tasks if t != self._me]
        self._servers = [f"{t} {i}" for t in ("ps", "worker") for i in range(len(info.cluster.get(t, ())))
                         if info.num_ps]
        self._prefix = f"kd/watchdog/{next(_GENERATIONS)}"
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="kd-watchdog", daemon=True)
        self._thread.start()

    def stop(self):
        """Stops the thread (training ended)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)
            self._thread = None

    def _key(self, task):
        return f"{self._prefix}/{task.replace(' ', '-')}"

    def _run(self):
        beat = 0
        seen = {}  # task -> (count, entered, epoch, batch, beat, time the beat last changed)
        my_count, my_since = self._count, time.monotonic()
        while not self._stopping.wait(self.interval):
            now = time.monotonic()
            beat += 1
            count, entered, (epoch, batch) = self._count, self._entered, self._where
            if count != my_count:
                my_count, my_since = count, now
            if self._multi:
                try:
                    # Keys are written once: replace by delete + insert. Short
                    # reads only (TensorFlow holds the GIL while it waits).
                    _keras_compat.key_value_delete(self._key(self._me))
                    _keras_compat.key_value_insert(self._key(self._me), f"{count} {entered} {epoch} {batch} {beat}")
                    for task in self._others:
                        try:
                            value = _keras_compat.key_value_get(self._key(task), 1)
                        except _keras_compat.KeyMissing:
                            continue
                        state = tuple(int(v) for v in value.split())
                        old = seen.get(task)
                        changed = old is None or old[4] != state[4]
                        seen[task] = state + ((now if changed else old[5]),)
                except Exception:  # noqa: BLE001 - the coordination service is gone: the job is ending
                    return
            limit = self.seconds if my_count else FIRST_STEP_FACTOR * self.seconds
            if now - my_since < limit:
                continue
            self.sink(self._describe(now - my_since, count, entered, epoch, batch, seen, now))
            if self.exit_on_stall:
                if (count, entered) < max([state[:2] for state in seen.values()] or [(count, entered)]):
                    # The stuck worker waits a little: the report of the workers
                    # waiting for it (which name it) comes first.
                    time.sleep(2 * self.interval)
                sys.stderr.flush()
                os._exit(STALL_EXIT_CODE)
            return

    def _describe(self, stalled, count, entered, epoch, batch, seen, now):
        where = f"epoch {epoch}, batch {batch}" if batch >= 0 else f"the start of epoch {epoch}"
        lines = [f"kd watchdog ({ENV}={self.seconds:g}): {self._me} has made no progress for "
                 f"{stalled:.0f}s; its last finished step: {where} (step {count} of this run)."]
        if self._multi:
            silent = [t for t in self._others if t not in seen or now - seen[t][5] >= self.seconds]
            behind = [t for t in self._others if t in seen and t not in silent
                      and (seen[t][0], seen[t][1]) < (count, entered)]
            for task in silent:
                last = seen.get(task)
                at = (f"last heard at epoch {last[2]}, batch {last[3]} (step {last[0]})" if last
                      else "never heard from")
                lines.append(f"  {task} is missing: no heartbeat for {self.seconds:g}s, {at}. Its "
                             "process is stopped, hung in native code, or gone.")
            for task in behind:
                e, b = seen[task][2:4]
                lines.append(f"  {task} is missing at step {seen[task][0] + 1}: its process is alive but "
                             f"still at epoch {e}, batch {b} (step {seen[task][0]}) - a callback, a "
                             "data loader or a save between steps is stuck there.")
            if (count, entered) < max([seen[t][:2] for t in seen] or [(count, entered)]):
                lines.append(f"  {self._me} itself is behind the others: it is the one stuck.")
            if not silent and not behind and all(seen.get(t, (count,))[0] == count for t in self._others) \
                    and (count, entered) >= max([seen[t][:2] for t in seen] or [(count, entered)]):
                lines.append(f"  Every worker is inside step {count + 1}: a collective, or an input "
                             "pipeline inside the step, is waiting on a worker.")
        elif self._servers:
            lines.append("  The parameter-server cluster's steps stopped finishing: one of "
                         + ", ".join(self._servers) + " is stopped, hung or unreachable.")
        lines.append("  What to do: " + ADVICE)
        return "\n".join(lines)


def _report(message):
    print(message, file=sys.stderr, flush=True)
