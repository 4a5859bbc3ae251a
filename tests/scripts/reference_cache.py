"""One-device reference runs, cached in $KD_REFERENCE_DIR across the test run's processes.

A reference is plain Keras on one device: the same in every process that
asks for it, whatever that process's device layout or strategy. Processes
that start together need the same references: one computes each, the others
wait for it (a file lock) rather than compute it again. Without
$KD_REFERENCE_DIR (a script run by hand) nothing is cached.
"""

import fcntl
import os
import pickle

__all__ = ["cached"]


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
