"""The restart policy: when a failed run starts again, and after how long.

A failed attempt restarts (on fresh ports, by whoever runs it: `launcher`,
`node`) up to `max_restarts` times. One that failed by its own doing
soon after its start backs off, 1 s, 2 s, 4 s ... at most 60 s; one ended
from outside (a kill, a preemption's save, a lost peer) restarts at once.
Under elastic training (`launch(min_workers=...)`), the worker an attempt's
failure is pinned on (`lost_worker`) is the one left out.
"""

import signal
import time

from keras_distrib.cluster import failures
from keras_distrib.cluster import lost as lost_lib
from keras_distrib.cluster import stop_signals

__all__ = [
    "MAX_RESTARTS",
    "RESTART_BACKOFF",
    "RESTART_BACKOFF_MAX",
    "failed_on_its_own",
    "lost_worker",
    "run_attempts",
]

# Restarts wait RESTART_BACKOFF * 2**(n-1) seconds (at most RESTART_BACKOFF_MAX)
# after the n-th attempt in a row that failed on its own (`failed_on_its_own`)
# within RESTART_BACKOFF_MAX; a longer attempt, or one ended from outside,
# restarts at once.
RESTART_BACKOFF = 1.0
RESTART_BACKOFF_MAX = 60.0
MAX_RESTARTS = 1000


def run_attempts(run, *, max_restarts, sink, what):
    """Runs `run(attempt)` until it succeeds, is signalled, or restarts run out; the last result.

    An attempt that failed on its own soon after its start (`failed_on_its_own`)
    would fail again at once: the next waits (`RESTART_BACKOFF`, doubling).
    `what` names the restarted thing in the line each restart says to `sink`.
    """
    attempt, quick = 0, 0
    while True:
        started = time.monotonic()
        with stop_signals.signals_stop_the_cluster():
            result = run(attempt)
        result.restarts = attempt
        if result.returncode == 0 or result.signalled or attempt >= max_restarts:
            return result
        attempt += 1
        # A failure soon after the start would fail again at once: back off.
        quick = (quick + 1 if time.monotonic() - started < RESTART_BACKOFF_MAX
                 and failed_on_its_own(result) else 0)
        wait = min(RESTART_BACKOFF * 2 ** (quick - 1), RESTART_BACKOFF_MAX) if quick else 0.0
        sink(f"[launcher] restarting {what} ({attempt}/{max_restarts})"
             + (f" in {wait:g}s" if wait else ""))
        with stop_signals.signals_stop_the_cluster():
            try:
                with stop_signals.stops_raise():
                    time.sleep(wait)
            except SystemExit as stop:
                result.signalled = True
                result.returncode = stop.code
                return result


def failed_on_its_own(result):
    """Whether an attempt failed by a task's own doing (a crash loop backs off), not from outside.

    From outside: the failing task was killed by a signal sent to it (SIGKILL,
    SIGTERM, SIGINT, SIGHUP), stayed stopped, lost its guard, saved for a
    restart (exit 42), or said the cluster lost a peer. A restart then meets
    no error of its own: it goes at once (a chaos soak of faults every 20-60 s
    waited 1, 2, 4 ... 60 s after each, 243 s of the 357 s lost).
    """
    failed = result.failed
    if result.timed_out or failed is None:
        return True
    if (failed.returncode in (failures.RESTART_EXIT_CODE, -signal.SIGKILL, -signal.SIGTERM,
                              -signal.SIGINT, -signal.SIGHUP)
            or failed.stop_fault or failed.guard_fault):
        return False
    return not lost_lib.lost_tasks("\n".join(failed.tail), failed.label,
                                   lost_lib.service_task(t.task_type for t in result.tasks))


def lost_worker(result):
    """The worker a failed attempt is pinned on (`TaskResult`), or None.

    A worker that exited with an error (or was killed) and was the first
    task to fail; not a preemption's save (exit 42), a timeout or a stop.
    """
    failed = result.failed
    if (result.returncode == 0 or result.signalled or result.timed_out or failed is None
            or failed.task_type != "worker" or failed.returncode == failures.RESTART_EXIT_CODE):
        return None
    return failed
