"""kd.testing as a pytest plugin: the `--kd-devices` option, the CPU split, the fixtures.

The hooks and fixtures are names of `keras_distrib.testing` (pytest reads
them from the module it loads as a plugin).
"""

import sys

from keras_distrib.cluster import devices
from keras_distrib.testing.strategies import IN_PROCESS
from keras_distrib.testing.strategies import local_strategy
from keras_distrib.testing.strategies import run_in_cluster

__all__ = [
    "kd_central_storage",
    "kd_mirrored",
    "kd_multi_worker",
    "kd_one_device",
    "kd_parameter_server",
    "kd_strategy",
    "pytest_addoption",
    "pytest_configure",
]

_DEFAULT_DEVICES = 2


def _fixture(**options):
    """`pytest.fixture(**options)` when pytest runs; the plain function otherwise."""
    pytest = sys.modules.get("pytest")
    if pytest is None:
        return lambda function: function
    return pytest.fixture(**options)


def pytest_addoption(parser):
    """Adds `--kd-devices N` (and the `kd_devices` ini setting): the logical CPU devices to split into."""
    group = parser.getgroup("keras_distrib")
    group.addoption(
        "--kd-devices", type=int, default=None,
        help=f"logical CPU devices keras_distrib.testing splits the CPU into (default {_DEFAULT_DEVICES})",
    )
    parser.addini("kd_devices", f"logical CPU devices for kd.testing (default {_DEFAULT_DEVICES})",
                  default=str(_DEFAULT_DEVICES))


def _requested_devices(config):
    try:
        option = config.getoption("kd_devices")
    except ValueError:  # loaded from a conftest.py below the root: no options
        option = None
    if option is not None:
        return option
    try:
        return int(config.getini("kd_devices"))
    except (ValueError, TypeError):
        return _DEFAULT_DEVICES


def pytest_configure(config):
    """Splits the CPU into logical devices before any test touches TensorFlow."""
    import pytest

    count = _requested_devices(config)
    if count < 1:
        raise pytest.UsageError(f"--kd-devices={count}: expected 1 or more logical CPU devices.")
    if count > 1:
        try:
            devices.virtual_devices(count)
        except RuntimeError as error:
            raise pytest.UsageError(
                f"keras_distrib.testing could not split the CPU into {count} devices: {error} "
                "(Something created a tensor before the plugin loaded: load it with `-p "
                "keras_distrib.testing`, or pass --kd-devices 1 to keep one device.)"
            ) from None


@_fixture()
def kd_one_device():
    """A `OneDeviceStrategy` on the first CPU."""
    return local_strategy("one_device")


@_fixture()
def kd_mirrored():
    """A `MirroredStrategy` on 2 logical CPU devices."""
    return local_strategy("mirrored")


@_fixture()
def kd_central_storage():
    """A `CentralStorageStrategy` on 2 logical CPU devices."""
    return local_strategy("central_storage")


@_fixture(params=IN_PROCESS)
def kd_strategy(request):
    """Each in-process strategy in turn: one device, mirrored, central storage.

    Args:
        request: pytest's fixture request (its `param` is the strategy's name).
    """
    return local_strategy(request.param)


@_fixture()
def kd_multi_worker():
    """`run(fn, *args)`: `fn(strategy, *args)` on 2 worker processes; {task: value}."""
    return lambda fn, *args, **options: run_in_cluster(fn, *args, kind="multi_worker", **options)


@_fixture()
def kd_parameter_server():
    """`run(fn, *args)`: `fn(strategy, *args)` in a coordinator process with its own cluster."""
    return lambda fn, *args, workers=1, **options: run_in_cluster(
        fn, *args, kind="parameter_server", workers=workers, **options
    )
