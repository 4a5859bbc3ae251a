"""One-device reference runs, cached in $KD_REFERENCE_DIR across the test run's processes.

A reference is plain Keras on one device: the same in every process that
asks for it, whatever that process's device layout or strategy. Processes
that start together need the same references: one computes each, the others
wait for it (a file lock) rather than compute it again. A process that has
other work first takes the items whose reference waits for nobody
(`in_ready_order`), so processes that start together compute different
references at once instead of queueing for the same one. Without
$KD_REFERENCE_DIR (a script run by hand) nothing is cached.
"""

import fcntl
import os
import pickle

__all__ = ["cached", "in_ready_order", "ready"]


def cached(name, compute):
    """`compute()`'s value, stored under `name` for every process of the run."""
    folder = os.environ.get("KD_REFERENCE_DIR")
    if not folder:
        return compute()
    path = os.path.join(folder, f"{name}.pkl")
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(path):
            with open(path, "rb") as f:
                return pickle.load(f)
        value = compute()
        temp = f"{path}.{os.getpid()}.tmp"
        with open(temp, "wb") as f:
            pickle.dump(value, f)
        os.replace(temp, path)
    return value


def ready(name):
    """Whether `cached(name, ...)` would not wait for another process now: stored, or no one computing it."""
    folder = os.environ.get("KD_REFERENCE_DIR")
    if not folder:
        return True
    path = os.path.join(folder, f"{name}.pkl")
    if os.path.exists(path):
        return True
    with open(f"{path}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(lock, fcntl.LOCK_UN)
    return True


def in_ready_order(items, name_of):
    """`items`, the next one each time the first whose reference (`name_of(item)`) is `ready`.

    In their order where none waits; a process waits only when every item
    left waits. Not for workers that must take the items in one order
    together (their collectives would pair different steps).
    """
    left = list(items)
    while left:
        index = next((i for i, item in enumerate(left) if ready(name_of(item))), 0)
        yield left.pop(index)
