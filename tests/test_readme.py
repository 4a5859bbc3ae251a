"""The README's quick start runs as written."""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def quick_start():
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    match = re.search(r"^## Quick start\n+```python\n(.*?)^```", text, re.S | re.M)
    assert match, "README.md has no ```python block under '## Quick start'"
    return match.group(1)


@pytest.mark.cluster
def test_quick_start_runs(tmp_path):
    script = tmp_path / "quick_start.py"
    script.write_text(quick_start())
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TF_CONFIG", None)
    process = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    assert "Epoch 3/3" in process.stdout, process.stdout[-3000:]
