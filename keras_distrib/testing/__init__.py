"""Test your own model: parity with one device, and pytest fixtures for strategies.

`assert_parity(model_fn, data)` trains your model on one device and under
each strategy you name, from the same initial weights and on the same global
batches, compares the weights after every step, and on a mismatch raises an
`AssertionError` that names the first step and variable that differ, by how
much, and the likely cause (per-replica gradient clipping, unsynchronized
BatchNormalization, dropout or other randomness, a loss reduced per replica,
a plain `keras.Model` on an uneven batch). Comparing step by step is what
names the first step: after a few epochs every weight differs. Before it
blames a cause it tells round-off from a real difference: a float32
mismatch is trained again in float64, where an exact model matches to about
1e-12 and a real difference stays.

Where each strategy runs. A process holds one device layout and one
collective group, so:

- `"one_device"`, `"mirrored"` and `"central_storage"` run in this process,
  on logical CPU devices (`kd.virtual_devices`), which must be set up before
  TensorFlow starts its devices. As a pytest plugin this module does that
  at start-up (`--kd-devices N`, default 2); in a script, `assert_parity`
  does it if it still can.
- `"multi_worker"` (2 worker processes) and `"parameter_server"` (a fresh
  process holding a `kd.local_cluster`: connecting to a cluster makes every
  variable this process created before unreadable) run in other processes,
  started by `kd.launch`. There `model_fn` must be importable (a function
  at module level of a .py file) and `data` NumPy arrays.

Everything runs on CPUs: one device and several replicas then compute the
same float32 arithmetic, and a difference is a bug, not hardware.

As a pytest plugin (pytest is not a dependency of keras_distrib; the
fixtures exist when pytest runs): `pytest -p keras_distrib.testing`, or in a
`conftest.py`: `pytest_plugins = ["keras_distrib.testing"]`. It is not
registered to load by itself: it imports TensorFlow and splits the CPU, which
no unrelated test run should pay for. Fixtures:

- `kd_one_device`, `kd_mirrored`, `kd_central_storage`: a strategy in this
  process (2 replicas for the last two); `kd_strategy`: each of the three.
- `kd_multi_worker(fn, *args)`: runs `fn(strategy, *args)` in 2 worker
  processes under `MultiWorkerMirroredStrategy`; returns
  `{"worker 0": value, "worker 1": value}`.
- `kd_parameter_server(fn, *args)`: runs `fn(strategy, *args)` in a fresh
  coordinator process with an in-process cluster (1 worker, 1 ps by
  default); returns its value.
"""

# The package: `strategies` (where a run trains: `local_strategy`,
# `run_in_cluster`), `snapshots` (training with the weights after every
# step), `diagnosis` (comparing, and the likely causes), `parity`
# (`assert_parity`) and `plugin` (pytest's hooks and fixtures).
# May import: `training`, `checkpointing`, `cluster` and the floor, never
# `commands` (tests/test_layout.py).

from keras_distrib.testing.parity import assert_parity
from keras_distrib.testing.plugin import kd_central_storage
from keras_distrib.testing.plugin import kd_mirrored
from keras_distrib.testing.plugin import kd_multi_worker
from keras_distrib.testing.plugin import kd_one_device
from keras_distrib.testing.plugin import kd_parameter_server
from keras_distrib.testing.plugin import kd_strategy
from keras_distrib.testing.plugin import pytest_addoption  # noqa: F401 (pytest's hooks)
from keras_distrib.testing.plugin import pytest_configure  # noqa: F401
from keras_distrib.testing.strategies import IN_PROCESS
from keras_distrib.testing.strategies import STRATEGIES
from keras_distrib.testing.strategies import ClusterError
from keras_distrib.testing.strategies import local_strategy
from keras_distrib.testing.strategies import run_in_cluster

__all__ = [
    "ClusterError",
    "IN_PROCESS",
    "STRATEGIES",
    "assert_parity",
    "kd_central_storage",
    "kd_mirrored",
    "kd_multi_worker",
    "kd_one_device",
    "kd_parameter_server",
    "kd_strategy",
    "local_strategy",
    "run_in_cluster",
]
