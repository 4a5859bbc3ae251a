"""Runs kd's compatibility tests and a parity subset against the newest keras-nightly.

Usage: python tools/check_keras_nightly.py [--venv DIR] [--keep]

Creates a separate virtual environment (a temporary one unless `--venv`),
installs the newest `keras-nightly` next to the TensorFlow version kd pins,
installs keras_distrib from this checkout without its dependencies, and runs
tests/test_keras_compat.py (every private Keras name kd relies on) and the
exactness matrix's one-device and mirrored paths there. A failure here is a
Keras change kd must follow before users upgrade. Not part of the default
suite: `python -m pytest -m nightly` runs it (network, about 10 minutes).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = [
    "tests/test_keras_compat.py",
    "tests/test_exactness.py::test_feature_matches_one_device[one_device]",
    "tests/test_exactness.py::test_feature_matches_one_device[mirrored2]",
]
# The version-range test fails by design on a newer Keras; the rest must pass.
DESELECT = ["tests/test_keras_compat.py::test_versions_are_in_the_tested_range"]
PACKAGES = [
    "keras-nightly", "tensorflow-cpu>=2.21,<2.22", "numpy", "portpicker", "pytest",
    "pytest-timeout", "tensorboard",
]


def _run(argv, **kwargs):
    print("+ " + " ".join(argv), flush=True)
    return subprocess.run(argv, check=False, **kwargs).returncode


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", help="where to create the environment (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep a temporary environment")
    options = parser.parse_args(argv)
    venv = options.venv or tempfile.mkdtemp(prefix="kd_keras_nightly_")
    try:
        if _run([sys.executable, "-m", "venv", venv]) != 0:
            return 2
        python = os.path.join(venv, "bin", "python")
        if _run([python, "-m", "pip", "install", "-q", "--upgrade", *PACKAGES]) != 0:
            return 2
        # keras-nightly provides the `keras` module; a plain keras pulled in
        # by TensorFlow would shadow it.
        _run([python, "-m", "pip", "uninstall", "-q", "-y", "keras"])
        _run([python, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", "keras-nightly"])
        if _run([python, "-m", "pip", "install", "-q", "--no-deps", "-e", REPO]) != 0:
            return 2
        _run([python, "-c", "import keras, tensorflow; print('keras', keras.__version__, 'tensorflow', tensorflow.__version__)"])
        deselect = [f"--deselect={test}" for test in DESELECT]
        return _run(
            [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not nightly",
             *deselect, *TESTS],
            # A nightly is outside the tested versions, which kd refuses
            # unless told to run anyway.
            cwd=REPO, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "KD_UNTESTED_VERSIONS": "1"},
        )
    finally:
        if not options.venv and not options.keep:
            shutil.rmtree(venv, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
