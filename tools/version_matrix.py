"""Runs kd's in-process tests on each Keras and TensorFlow minor version pyproject.toml admits.

Usage: python tools/version_matrix.py [--keras 3.13 3.14 ...] [--tensorflow 2.20 ...]
       [--cache DIR] [--table FILE] [-- extra pytest arguments]

One virtual environment per combination, kept under `--cache`
(~/.cache/kd-matrix by default, outside the checkout, so a second run only
tests), made the way a user installs kd next to the versions they have:
`pip install -e ".[test]" "keras==3.13.*" "tensorflow==2.20.*"`, so a
combination that pyproject.toml's pins (or those of the test extra:
tensorflow-text, tf-keras, keras-hub) cannot install beside that
TensorFlow fails at the install step, and the table says so. The tests of
this checkout then run there (`-m "not cluster"`, the in-process part: the
cluster tests start worker processes and take two thirds of the suite's
time), one combination at a time, and a Markdown table of the counts is
printed and written to `--table`. The versions default to the ranges
`keras_distrib._keras_compat` admits (TESTED_KERAS, TESTED_TENSORFLOW);
naming others runs them with KD_UNTESTED_VERSIONS=1 (kd refuses them
otherwise), which is how a new minor version is measured before it is
admitted. Each combination downloads TensorFlow (about 600 MB) once; pip's
cache serves the rest. Not part of the default suite, and not run by CI.
"""

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import time
import tomllib
import xml.etree.ElementTree as ElementTree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "kd-matrix")
MARKER = "not cluster and not nightly and not full"


def tested_ranges():
    """(TESTED_KERAS, TESTED_TENSORFLOW) read from the source, without importing kd."""
    path = os.path.join(REPO, "keras_distrib", "_keras_compat", "__init__.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            name = getattr(node.targets[0], "id", None)
            if name in ("TESTED_KERAS", "TESTED_TENSORFLOW"):
                found[name] = ast.literal_eval(node.value)
    return found["TESTED_KERAS"], found["TESTED_TENSORFLOW"]


def _minors(tested):
    (major, first), (_, last) = tested
    return [f"{major}.{minor}" for minor in range(first, last + 1)]


def _minor(text):
    if not re.fullmatch(r"\d+\.\d+", text):
        raise argparse.ArgumentTypeError(f"expected a minor version such as 3.14, received {text!r}")
    return text


def _run(argv, log, **kwargs):
    log.write("+ " + " ".join(argv) + "\n")
    log.flush()
    return subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=False, **kwargs).returncode


def _pins():
    """pyproject.toml's dependencies and extras: a change to them installs again."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    return {"dependencies": project["dependencies"], "extras": project["optional-dependencies"]}


def _install(venv, keras_minor, tensorflow_minor, log):
    """Creates the environment once; a marker file records a finished install and its pins.

    kd itself comes from the checkout the tests run in (PYTHONPATH), so an
    environment made from another checkout with the same pins serves.
    """
    python = os.path.join(venv, "bin", "python")
    requirements = [f"-e{REPO}[test]", f"keras=={keras_minor}.*", f"tensorflow=={tensorflow_minor}.*"]
    record = {"versions": requirements[1:], "pins": _pins()}
    done = os.path.join(venv, "kd-matrix-installed.json")
    if os.path.exists(done):
        with open(done) as f:
            if json.load(f) == record:
                return python, None
    if not os.path.exists(python) and _run([sys.executable, "-m", "venv", venv], log) != 0:
        return python, "the virtual environment could not be made"
    if _run([python, "-m", "pip", "install", "-q", *requirements], log) != 0:
        return python, "pip could not install kd's pins beside these versions (log)"
    with open(done, "w") as f:
        json.dump(record, f)
    return python, None


def _counts(junit):
    tree = ElementTree.parse(junit)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for case in tree.iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        counts[outcome] += 1
        if outcome == "failed":
            failures.append(f"{case.get('classname')}::{case.get('name')}")
    return counts, failures


def _versions(python):
    out = subprocess.run(
        [python, "-c", "import importlib.metadata as m; "
         "print(m.version('keras'), m.version('tensorflow'))"],
        capture_output=True, text=True, check=False,
    ).stdout.split()
    return out if len(out) == 2 else ["?", "?"]


def run_combination(cache, keras_minor, tensorflow_minor, admitted, pytest_args):
    """Installs (once) and tests one combination; returns its table row as a dict."""
    name = f"keras{keras_minor}-tf{tensorflow_minor}"
    venv = os.path.join(cache, name)
    os.makedirs(cache, exist_ok=True)
    log_path = os.path.join(cache, f"{name}.log")
    row = {"keras": keras_minor, "tensorflow": tensorflow_minor, "log": log_path}
    with open(log_path, "w") as log:
        started = time.monotonic()
        python, problem = _install(venv, keras_minor, tensorflow_minor, log)
        if problem:
            return {**row, "problem": problem}
        row["keras"], row["tensorflow"] = _versions(python)
        junit = os.path.join(cache, f"{name}.xml")
        env = {**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "2"}
        if not admitted:
            env["KD_UNTESTED_VERSIONS"] = "1"
        code = _run(
            [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", MARKER,
             f"--junitxml={junit}", *pytest_args],
            log, cwd=REPO, env=env,
        )
        row["seconds"] = round(time.monotonic() - started)
        if not os.path.exists(junit):
            return {**row, "problem": f"pytest exited {code} without a report (log)"}
        counts, failures = _counts(junit)
        return {**row, **counts, "failures": failures}


def table(rows):
    lines = ["| Keras | TensorFlow | passed | failed | skipped | note |", "|---|---|---|---|---|---|"]
    for row in rows:
        if "problem" in row:
            lines.append(f"| {row['keras']} | {row['tensorflow']} | | | | {row['problem']} |")
            continue
        note = ", ".join(failure.rsplit("::", 1)[-1] for failure in row["failures"][:4])
        if len(row["failures"]) > 4:
            note += f", and {len(row['failures']) - 4} more"
        lines.append(f"| {row['keras']} | {row['tensorflow']} | {row['passed']} | {row['failed']} "
                     f"| {row['skipped']} | {note} |")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    pytest_args = []
    if "--" in argv:
        argv, pytest_args = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    tested_keras, tested_tensorflow = tested_ranges()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keras", nargs="+", type=_minor, default=_minors(tested_keras),
                        help="Keras minor versions (default: the tested range)")
    parser.add_argument("--tensorflow", nargs="+", type=_minor, default=_minors(tested_tensorflow),
                        help="TensorFlow minor versions (default: the tested range)")
    parser.add_argument("--cache", default=DEFAULT_CACHE,
                        help=f"where the environments are kept (default: {DEFAULT_CACHE})")
    parser.add_argument("--table", help="also write the Markdown table here")
    options = parser.parse_args(argv)
    admitted_keras, admitted_tensorflow = set(_minors(tested_keras)), set(_minors(tested_tensorflow))
    rows = []
    for tensorflow_minor in options.tensorflow:
        for keras_minor in options.keras:
            admitted = keras_minor in admitted_keras and tensorflow_minor in admitted_tensorflow
            print(f"Keras {keras_minor}, TensorFlow {tensorflow_minor} ...", flush=True)
            row = run_combination(options.cache, keras_minor, tensorflow_minor, admitted, pytest_args)
            print(table([row]).splitlines()[-1], f"({row.get('seconds', '-')} s, log {row['log']})",
                  flush=True)
            rows.append(row)
    text = table(rows)
    print(text)
    if options.table:
        with open(options.table, "w") as f:
            f.write(text + "\n")
    complete = all("problem" not in row and row["failed"] == 0 for row in rows)
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
