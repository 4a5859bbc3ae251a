"""Tests that start processes carry `@pytest.mark.cluster`.

They are the slow part of the suite (a fresh interpreter per device layout,
worker clusters, launched scripts, notebooks' kernels); `-m "not cluster"`
runs the in-process rest in a fraction of the time. The marker cannot go
stale: a test without it that starts a process fails, naming the marker.
"""

import subprocess

import pytest


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
