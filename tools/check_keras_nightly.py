"""Runs kd's tests against the newest keras-nightly (and tf-nightly), naming what breaks.

Usage: python tools/check_keras_nightly.py [--tensorflow {tested,nightly}] [--all]
       [--venv DIR] [--keep]

Creates a separate virtual environment (a temporary one unless `--venv`),
installs the newest `keras-nightly` next to the newest TensorFlow kd admits
(`--tensorflow tested`, the default) or next to the newest `tf-nightly`
(`--tensorflow nightly`), installs keras_distrib from this checkout without
its dependencies, and runs tests/test_keras_compat.py (every private Keras
and TensorFlow name kd relies on) and the exactness matrix's one-device and
mirrored paths there; `--all` runs every in-process test instead (the
KerasHub, tensorflow-text and tf-keras cases need releases built for one
TensorFlow, which a nightly has not: they are left out of the environment
and fail by name). It ends with a list of what breaks: each failing test
and the last line of its error. A failure here is a Keras or TensorFlow
change kd must follow before users upgrade. Not part of the default suite:
`python -m pytest -m nightly` runs the default check (network, about 10
minutes).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
import xml.etree.ElementTree as ElementTree

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import version_matrix  # noqa: E402  (the tested ranges and the report's counts)

REPO = version_matrix.REPO
TESTS = [
    "tests/test_keras_compat.py",
    "tests/test_exactness.py::test_feature_matches_one_device[one_device]",
    "tests/test_exactness.py::test_feature_matches_one_device[mirrored2]",
]
# The version-range test fails by design on a newer Keras; the rest must pass.
DESELECT = ["tests/test_keras_compat.py::test_versions_are_in_the_tested_range"]
PACKAGES = ["numpy", "portpicker", "pytest", "pytest-timeout", "pytest-xdist", "tensorboard"]
# Built against one TensorFlow release: none matches a nightly.
TENSORFLOW_BOUND = ("keras-hub", "tensorflow-text", "tf-keras", "keras-distrib")


def _run(argv, **kwargs):
    print("+ " + " ".join(argv), flush=True)
    return subprocess.run(argv, check=False, **kwargs).returncode


def _test_extra():
    """The test extra's requirements (docs and tutorials included), less the TensorFlow-bound ones."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    wanted = extras["docs"] + extras["tutorials"] + extras["test"]
    return [r for r in wanted if not r.startswith(TENSORFLOW_BOUND)]


def _tensorflow(choice):
    if choice == "nightly":
        return "tf-nightly"
    _, (major, minor) = version_matrix.tested_ranges()[1]
    return f"tensorflow-cpu=={major}.{minor}.*"


def what_breaks(junit):
    """One line per failing test: its id and the last line of its error."""
    lines = []
    for case in ElementTree.parse(junit).iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error"):
                text = (child.text or child.get("message") or "").strip().splitlines()
                errors = [line for line in text if line.startswith("E ")]
                last = (errors[-1] if errors else (text[-1] if text else "")).lstrip("E ").strip()
                lines.append(f"{case.get('classname')}::{case.get('name')}: {last[:200]}")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensorflow", choices=("tested", "nightly"), default="tested",
                        help="the newest TensorFlow kd admits (default), or tf-nightly")
    parser.add_argument("--all", action="store_true", help="every in-process test, not the compat subset")
    parser.add_argument("--venv", help="where to create the environment (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep a temporary environment")
    options = parser.parse_args(argv)
    venv = options.venv or tempfile.mkdtemp(prefix="kd_keras_nightly_")
    try:
        if _run([sys.executable, "-m", "venv", venv]) != 0:
            return 2
        python = os.path.join(venv, "bin", "python")
        packages = ["keras-nightly", _tensorflow(options.tensorflow), *PACKAGES]
        if options.all:
            packages += _test_extra()
        if _run([python, "-m", "pip", "install", "-q", "--upgrade", "--pre", *packages]) != 0:
            return 2
        # keras-nightly provides the `keras` module; a plain keras pulled in
        # by TensorFlow would shadow it.
        _run([python, "-m", "pip", "uninstall", "-q", "-y", "keras"])
        _run([python, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", "--pre",
              "keras-nightly"])
        if _run([python, "-m", "pip", "install", "-q", "--no-deps", "-e", REPO]) != 0:
            return 2
        _run([python, "-c", "import keras, tensorflow; "
              "print('keras', keras.__version__, 'tensorflow', tensorflow.__version__)"])
        junit = os.path.join(venv, "nightly.xml")
        selection = ["-m", version_matrix.MARKER] if options.all else ["-m", "not nightly", *TESTS]
        code = _run(
            [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
             *[f"--deselect={test}" for test in DESELECT], *selection],
            # A nightly is outside the tested versions, which kd refuses
            # unless told to run anyway.
            cwd=REPO, env={**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "2",
                           "KD_UNTESTED_VERSIONS": "1"},
        )
        if os.path.exists(junit):
            broken = what_breaks(junit)
            print(f"What breaks ({len(broken)}):" if broken else "Nothing breaks.")
            for line in broken:
                print("  " + line)
        return code
    finally:
        if not options.venv and not options.keep:
            shutil.rmtree(venv, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
