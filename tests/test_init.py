import importlib
import os
import subprocess
import sys

import pytest

import keras_distrib as kd


def test_every_public_name_imports():
    module = importlib.import_module("keras_distrib")
    for name in kd.__all__:
        assert getattr(module, name) is not None, name


def test_all_is_sorted_and_unique():
    assert list(kd.__all__) == sorted(set(kd.__all__))


@pytest.mark.cluster
def test_kd_testing_loads_only_when_used():
    code = ("import sys, keras_distrib as kd; "
            "print('keras_distrib.testing' in sys.modules); "
            "kd.testing.assert_parity; print('keras_distrib.testing' in sys.modules)")
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "",
                                  "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))})
    assert process.stdout.split() == ["False", "True"], process.stdout + process.stderr[-2000:]


_LOADED = ("import sys, keras_distrib as kd\n"
           "def loaded():\n"
           "    return sorted({m.split('.')[0] for m in sys.modules} & {'tensorflow', 'keras'})\n"
           "import keras_distrib.commands.cli\n"
           "kd.cluster_info(); kd.is_chief(); kd.launch; kd.LaunchError; kd.ClusterInfo\n"
           "kd.cluster.parse_tf_config('{}')\n"
           "from types import SimpleNamespace\n"
           "from keras_distrib.cluster import failures, supervisor\n"
           "print('EXPLAINED', failures.lost_peer_message(SimpleNamespace(tail=['The following "
           "tasks are unhealthy (stopped sending heartbeats): /job:worker/replica:0/task:1']), "
           "'worker 0', 'worker 0'))\n"
           "print('LAUNCHER', loaded())\n"
           "kd.Model\n"
           "print('MODEL', loaded())\n")


@pytest.mark.cluster
def test_the_launcher_and_who_am_i_load_no_tensorflow():
    """Measured in a fresh interpreter: the modules loaded after each use."""
    process = subprocess.run([sys.executable, "-c", _LOADED], capture_output=True, text=True,
                             timeout=120, env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "",
                                  "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))})
    lines = dict(line.split(" ", 1) for line in process.stdout.splitlines() if " " in line)
    # A launcher explains a failed task (the cluster lost which peer) without them too.
    assert "the cluster lost worker 1 (/job:worker/task:1)" in lines.get("EXPLAINED", ""), process.stdout
    assert lines.get("LAUNCHER") == "[]", process.stdout + process.stderr[-2000:]
    # The contrast: the first name that needs them loads both.
    assert lines.get("MODEL") == "['keras', 'tensorflow']", process.stdout + process.stderr[-2000:]
