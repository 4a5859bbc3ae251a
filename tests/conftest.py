"""Tests that start processes carry `@pytest.mark.cluster`.

They are the slow part of the suite (a fresh interpreter per device layout,
worker clusters, launched scripts, notebooks' kernels); `-m "not cluster"`
runs the in-process rest in a fraction of the time. The marker cannot go
stale: a test without it that starts a process fails, naming the marker.
"""

import os
import shutil
import subprocess
import tempfile

import pytest

from keras_distrib import tf_logs


def _runs_tests(config):
    """Whether this process collects and runs tests: not the xdist controller, which hands them out."""
    return (hasattr(config, "workerinput") or config.getoption("dist", "no") == "no"
            or config.getoption("collectonly"))


def pytest_configure(config):
    # kd loads TensorFlow at first use; a process that runs tests loads it
    # here, once, notices hidden. Its import runs `uname -p` (Python's
    # `platform`), which the check below would otherwise count against
    # whichever test needs it first.
    if _runs_tests(config):
        tf_logs.import_tensorflow()
    if hasattr(config, "workerinput"):
        return  # an xdist worker: the environment below is inherited
    # Every process the run starts keeps its temporary files in one folder,
    # removed at the end: TensorFlow's autograph sources (left behind by a
    # killed process), folders that scripts and notebooks make with mkdtemp,
    # a killed worker's scratch space. The run then leaves nothing in the
    # temporary directory. This process keeps the usual one, so pytest's
    # tmp_path folders stay where pytest keeps them after a failure.
    tempfile.gettempdir()
    config._kd_tmpdir_before = os.environ.get("TMPDIR")
    config._kd_run_dir = tempfile.mkdtemp(prefix="kd_tests_")
    os.environ["TMPDIR"] = config._kd_run_dir
    # One cache of one-device reference runs (tests/_harness.py) for the whole
    # run: a reference trained under one xdist worker is not trained again
    # under the other.
    if not os.environ.get("KD_REFERENCE_DIR"):
        os.environ["KD_REFERENCE_DIR"] = os.path.join(config._kd_run_dir, "references")
        os.mkdir(os.environ["KD_REFERENCE_DIR"])


def pytest_collection_modifyitems(config, items):
    # The tests that start processes first, the in-process ones (about a minute
    # in all) after: the xdist workers hand out tests in this order, so the
    # run ends with short tests on every worker, not with one worker still in a
    # minutes-long cluster test while the others have nothing left to take.
    # The longest (marked `long`) go first of all, for the same reason.
    items.sort(key=lambda item: (item.get_closest_marker("cluster") is None,
                                 item.get_closest_marker("long") is None))


def pytest_unconfigure(config):
    folder = getattr(config, "_kd_run_dir", None)
    if folder is not None:
        if os.environ.get("KD_REFERENCE_DIR", "").startswith(folder):
            os.environ.pop("KD_REFERENCE_DIR")
        if config._kd_tmpdir_before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = config._kd_tmpdir_before
        shutil.rmtree(folder, ignore_errors=True)


# The id of the running test while it has no cluster marker: set while it is
# set up (module and session fixtures it asks for included) and while it runs.
# Not at teardown: the last test of a module or run also finalizes fixtures it
# does not own (the Slurm cluster's `scancel`).
UNMARKED_VARIABLE = "KD_TESTS_UNMARKED"


def _hold_unmarked(item):
    unmarked = item.get_closest_marker("cluster") is None
    if unmarked:
        os.environ[UNMARKED_VARIABLE] = item.nodeid  # tests/_harness.py then skips its warm path
    try:
        yield
    finally:
        os.environ.pop(UNMARKED_VARIABLE, None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _hold_unmarked(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _hold_unmarked(item)


_popen_init = subprocess.Popen.__init__


def _refuse_unmarked(self, args, *more_args, **kwargs):
    nodeid = os.environ.get(UNMARKED_VARIABLE)
    if nodeid is not None:
        raise AssertionError(
            f"{nodeid} starts a process ({args!r:.120}) but is not marked "
            f"`@pytest.mark.cluster`: add the marker, so that `-m \"not cluster\"` "
            f"keeps running only tests that stay in this process."
        )
    _popen_init(self, args, *more_args, **kwargs)


subprocess.Popen.__init__ = _refuse_unmarked
