"""Tests that start processes carry `@pytest.mark.cluster`.

They are the slow part of the suite (a fresh interpreter per device layout,
worker clusters, launched scripts, notebooks' kernels); `-m "not cluster"`
runs the in-process rest in a fraction of the time. The marker cannot go
stale: a test without it that starts a process fails, naming the marker.
"""

import os
import shutil
import subprocess
import sys
import tempfile

import pytest


def pytest_configure(config):
    # One cache of one-device reference runs (tests/_harness.py) for the whole
    # run: the xdist workers inherit this process's environment, so a
    # reference trained under one worker is not trained again under the other.
    if hasattr(config, "workerinput") or os.environ.get("KD_REFERENCE_DIR"):
        return
    config._kd_reference_dir = tempfile.mkdtemp(prefix="kd_reference_")
    os.environ["KD_REFERENCE_DIR"] = config._kd_reference_dir


def pytest_collection_modifyitems(config, items):
    # The tests that start processes first, the in-process ones (about a minute
    # in all) after: the two xdist workers hand out tests in this order, so the
    # run ends with short tests on both workers, not with one worker still in a
    # minutes-long cluster test while the other has nothing left to take.
    items.sort(key=lambda item: item.get_closest_marker("cluster") is None)


def pytest_unconfigure(config):
    folder = getattr(config, "_kd_reference_dir", None)
    if folder is not None:
        os.environ.pop("KD_REFERENCE_DIR", None)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def _processes_need_the_cluster_marker(request, monkeypatch):
    if request.node.get_closest_marker("cluster") is not None:
        return
    nodeid = request.node.nodeid

    def refuse(self, args, *unused_args, **unused_kwargs):
        raise AssertionError(
            f"{nodeid} starts a process ({args!r:.120}) but is not marked "
            f"`@pytest.mark.cluster`: add the marker, so that `-m \"not cluster\"` "
            f"keeps running only tests that stay in this process."
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    # The harness's warm interpreter forks without Popen: send its scripts to Popen.
    harness = sys.modules.get("tests._harness")
    if harness is not None:
        monkeypatch.setattr(harness._WARM, "serves", lambda env: False)
