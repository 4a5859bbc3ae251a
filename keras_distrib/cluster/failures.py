"""How a run's end is named: exit codes, the task whose end ended the others, and why.

When a task fails, its peers fail within moments (their collectives lose
it); the launcher names the one that caused it (`first_cause`), reports how
it ended, a crash with its faulthandler trace, and what its end means
(`failure_report`): a configuration error a rerun would meet again (exit
`CONFIG_EXIT_CODE`), a guard or a stop, a signal from outside, a lost peer.
After a stop signal to the launcher, `stopped_code` says whether the run
asks for a restart (`RESTART_EXIT_CODE`, the tasks saved) or ends.
"""

import re
import signal
import time

from keras_distrib.cluster import lost as lost_lib

__all__ = [
    "CONFIG_EXIT_CODE",
    "CRASH_SIGNALS",
    "RESTART_EXIT_CODE",
    "SAVED_MESSAGE",
    "exit_code",
    "failure_report",
    "first_cause",
    "lost_peer_message",
    "ps_lost_message",
    "stopped_code",
]

# What a task exits with after saving a backup on preemption: restart me.
# (TensorFlow's PreemptionCheckpointHandler exits with 42 outside Google's
# platforms too.) `keras_distrib.cluster.preemption` uses the same value.
RESTART_EXIT_CODE = 42
# What a task logs once its backup is written, just before it exits 42; the
# launcher reads it when the task is killed on its way out.
SAVED_MESSAGE = "Backed up for the preemption"
# What the launcher exits with when a task stopped on a configuration error
# that a rerun would meet again (the recipe's loop then does not rerun it).
CONFIG_EXIT_CODE = 2
# The errors of kd (last words of a task's traceback) that mean exactly that:
# the backup directory is another live run's, the backup is another run's, or
# its files are not the ones kd wrote.
_CONFIG_ERROR = re.compile(r"(Error|Exception): .*(is in use by another run: |does not match this "
                           r"run: |does not record what defines its run|fails its manifest check|"
                           r"does not belong to this directory's run: |left over from run )")
# What a connection or a name lookup to the outside says in a network
# namespace without a route out: no route (ENETUNREACH), no resolver
# (getaddrinfo's EAI_AGAIN / EAI_NONAME, curl's and TensorFlow's file
# systems' wording).
_NETWORK_ERROR = re.compile(r"Network is unreachable|Temporary failure in name resolution|Name or "
                            r"service not known|No address associated with hostname|Could(n't| "
                            r"not) resolve host|Failed to resolve|Errno 101\b")
# How long the launcher waits, once a task failed, for others that end with
# it, to name the one that ended first (`first_cause`).
SETTLE_SECONDS = 0.5
# Signals that mean the task crashed in native code, and what each is. Python's
# faulthandler (PYTHONFAULTHANDLER, which the launcher sets) prints the
# task's Python stacks on each, starting with "Fatal Python error: ...".
CRASH_SIGNALS = {
    signal.SIGSEGV: "a segmentation fault: native code (TensorFlow, a library, an extension) "
                    "read or wrote memory it does not own",
    signal.SIGBUS: "a bus error: native code touched memory that has no backing (often a "
                   "memory-mapped file truncated under it, or /dev/shm full)",
    signal.SIGABRT: "an abort: native code stopped the process on a failed check (its message "
                    "is usually among the last lines)",
    signal.SIGILL: "an illegal instruction: native code built for another CPU (e.g. a "
                   "TensorFlow wheel using AVX instructions this CPU lacks), or a corrupt binary",
    signal.SIGFPE: "an arithmetic fault in native code (an integer division by zero)",
}
# Exit codes of a task ended by a stop signal before it handled it.
_STOPPED_CODES = tuple(code for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGKILL)
                       for code in (-sig, 128 + sig))


def stopped_code(signalled, results):
    """The run's exit code after stop signal `signalled - 128` to the launcher, from the tasks' `results`.

    `RESTART_EXIT_CODE` when a task saved for a restart, or when Slurm's
    warning (SIGUSR1) ended tasks that had not handled it yet; else
    `signalled` (128 + the signal).
    """
    codes = [r.returncode for r in results]
    # A task that saved may still be killed on its way out (Slurm ends the
    # step once another node's task exited 42): its last words count.
    saved = RESTART_EXIT_CODE in codes or any(_said_saved(r) for r in results)
    # A task the warning signal ended before it could handle it (still
    # starting: no backup callback yet) lost nothing a restart would not
    # redo: ask for the restart, not a failure. A SIGTERM is a stop
    # (scancel, `kill`): 128 + 15 unless a task saved.
    stopped = [c for c in codes if c in (0, None) or c in _STOPPED_CODES]
    restart = signalled - 128 == signal.SIGUSR1 and len(stopped) == len(codes)
    return RESTART_EXIT_CODE if saved or restart else signalled


def failure_report(result, results, *, no_route_out=None):
    """`(exit code, the launcher's lines)` for the failed task's `result` among all `results`.

    `no_route_out`: the tasks ran without a route out, and this is how to
    give them one; said when the task's last lines show a network error.
    """
    code = result.returncode if result.returncode is not None else 1
    code = code if code > 0 else 128 - code  # killed by a signal
    lines = _how_it_ended(result)
    if result.returncode == 1 and any(_CONFIG_ERROR.search(line) for line in result.tail):
        code = CONFIG_EXIT_CODE
        lines.append(f"[launcher] {result.label} stopped on a configuration error that a rerun would "
                     f"meet again (see above): exit {CONFIG_EXIT_CODE}.")
    if result.guard_fault:
        lines.append(f"[launcher] {result.label} failed because {result.guard_fault}. kd's guard "
                     "ends a task's processes when the task or the launcher ends; stop the launcher "
                     "or the task, not the guard.")
    elif result.stop_fault:
        lines.append(f"[launcher] {result.label} failed because {result.stop_fault}. {lost_lib.ADVICE}")
    elif result.returncode is not None and result.returncode < 0:
        lines.append(f"[launcher] {_signal_explanation(result.label, -result.returncode)} "
                     f"{lost_lib.ADVICE}")
    explanation = lost_peer_message(
        result, result.label, lost_lib.service_task(r.task_type for r in results))
    if explanation:
        lines.append(explanation)
    elif no_route_out and any(_NETWORK_ERROR.search(line) for line in result.tail):
        lines.append(f"[launcher] {result.label} failed on a network error, and {no_route_out}")
    return code, lines


def _said_saved(result):
    return any(SAVED_MESSAGE in line for line in result.tail[-5:])


def lost_peer_message(result, own_label, service_task):
    """kd's explanation when a task ended because the cluster lost another task, else None."""
    lost = lost_lib.lost_tasks("\n".join(result.tail), own_label, service_task)
    return f"[launcher] {lost_lib.lost_task_message(lost, own_label)}" if lost else None


def ps_lost_message(task, code):
    """What the launcher says when a parameter server exits: the run cannot go on."""
    return (f"[launcher] {task.label} server exited with code {code}: the parameter servers "
            "hold the model's variables, so training cannot go on without it. Restart the "
            "job (--max-restarts; training resumes from its backup).")


# How a task ends when something outside kills it (the kernel out of memory,
# a scheduler, a person): its peers then fail because it is gone.
_KILLED_FROM_OUTSIDE = (-signal.SIGKILL, -signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP)
# A crash ends its peers the same way: it is the cause, not they. Not SIGABRT:
# TensorFlow aborts a task whose peer was lost (its coordination agent's check).
_CRASHED = tuple(-signum for signum in CRASH_SIGNALS if signum != signal.SIGABRT)


def first_cause(watched, seen, stopped_followers=()):
    """The failed task to report, once `seen` failed: the one whose end ended the others.

    A task's death ends its peers within moments (their collectives fail),
    and the order the launcher sees their exits in is not always the order
    they died in (a killed task's end can reach it after its peers'). So it
    waits up to `SETTLE_SECONDS` for the others to end, then names a task
    that saved for a restart (exit 42: the others are saving the same
    step), else one that crashed (SIGSEGV, SIGBUS, SIGILL, SIGFPE) or
    was killed from outside (SIGKILL, SIGTERM, SIGINT, SIGHUP),
    else one whose last lines do not say the cluster lost a peer (a survivor's
    collective or heartbeat error names the task it lost), then one that
    such lines name, else the first it saw fail, in task order.
    """
    deadline = time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < deadline and any(t.process.poll() is None for t in watched):
        time.sleep(0.05)

    def code(task):
        return exit_code(task, stopped_followers)

    failures = [t for t in watched if code(t) not in (None, 0)]
    host = lost_lib.service_task(t.task_type for t in watched)
    read_by = time.monotonic() + 1.0  # their output, read to its end: a second at most in all
    lost_by = {}
    for task in failures:
        words = task.last_words(timeout=max(0.0, read_by - time.monotonic()))
        lost_by[task.label] = lost_lib.lost_tasks("\n".join(words), task.label, host)
    named_lost = {name for names in lost_by.values() for name in names}
    # min() keeps the first of equals: task order.
    return min(failures, key=lambda t: (code(t) != RESTART_EXIT_CODE,
                                        code(t) not in _KILLED_FROM_OUTSIDE + _CRASHED,
                                        bool(lost_by[t.label]), t.label not in named_lost,
                                        t not in seen))


def exit_code(task, stopped_followers=()):
    """The task's exit code (None while it runs).

    A follower the launcher stopped ended as asked (0), whether its own
    handler ran (exit 0) or the SIGTERM came as it was already on its way
    out, after its handler was gone (-15).
    """
    ended = task.process.poll()
    return 0 if task in stopped_followers and ended == -signal.SIGTERM else ended


def _signal_name(signum):
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _how_it_ended(result):
    """The launcher's lines about the failed task: how it ended, its last lines, a crash's trace."""
    label, code = result.label, result.returncode
    signum = -code if isinstance(code, int) and code < 0 else None
    if signum in CRASH_SIGNALS:
        lines = [f"[launcher] {label} crashed: {_signal_name(signum)} (signal {signum}, "
                 f"{CRASH_SIGNALS[signum]}); stopped the others. Last lines:"]
    else:
        lines = [f"[launcher] {label} exited with code {code}; stopped the others. Last lines:"]
    lines += [f"[launcher]   {line}" for line in result.tail]
    if result.crash_trace:
        lines.append(f"[launcher] {label}'s faulthandler trace (its Python threads when it "
                     "stopped, most recent call first):")
        lines += [f"[launcher]   {line}" for line in result.crash_trace]
    elif signum in CRASH_SIGNALS:
        lines.append(f"[launcher] {label} printed no faulthandler trace (it ran with "
                     "PYTHONFAULTHANDLER unset or empty, or crashed before Python started).")
    return lines


def _signal_explanation(label, signum):
    """Why a task a signal ended may have ended (a crash is told by `_how_it_ended`)."""
    if signum in CRASH_SIGNALS:
        return (f"{label} crashed in native code ({_signal_name(signum)}): its Python stacks "
                "above show where; a rerun from the backup may pass if the crash is rare.")
    if signum == signal.SIGKILL:
        return (f"{label} was killed by signal 9 (SIGKILL: out of memory (the kernel's OOM "
                "killer; `dmesg` says so), a preemption without grace, or by hand).")
    if signum == signal.SIGTERM:
        return (f"{label} was killed by signal 15 (SIGTERM: a stop request, from `kill`, a "
                "cluster manager or a preemption, that ended it before it could save; kd's "
                "BackupAndRestore saves and exits 42 on SIGTERM once training has begun).")
    return (f"{label} was killed by signal {signum} ({_signal_name(signum)}: sent by another "
            "process or by hand).")
