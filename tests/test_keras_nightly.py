"""kd against the newest keras-nightly and tf-nightly, in separate environments (opt-in).

Run with `python -m pytest -m nightly`: it needs the package index and takes
about 10 minutes per TensorFlow, so the default suite (`-m "not nightly"`)
leaves it out. A failure lists what breaks (tools/check_keras_nightly.py).
"""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.cluster
@pytest.mark.nightly
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("tensorflow", ["tested", "nightly"])
def test_compat_and_parity_on_keras_nightly(tensorflow):
    process = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "check_keras_nightly.py"), "--tensorflow", tensorflow],
        capture_output=True, text=True, timeout=3500,
    )
    assert process.returncode == 0, process.stdout[-6000:] + process.stderr[-3000:]
