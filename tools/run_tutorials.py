"""Re-executes the tutorials in place, so that their committed outputs come from a real run.

Usage: python tools/run_tutorials.py [NAME ...]

Each notebook runs top to bottom with its own default parameters (the real
Fashion-MNIST loading code; offline it falls back to scikit-learn's digits,
and says so in its output), in a temporary working directory, so that the
checkpoints and backups it writes stay out of the repository. Notebooks whose
run fails are left unchanged, and the script exits 1.
"""

import argparse
import glob
import os
import sys
import tempfile
import time

import nbformat
from nbclient import NotebookClient

TUTORIALS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tutorials")


def run(path):
    """Executes the notebook at `path` and writes it back with its outputs."""
    notebook = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="kd-tutorial-") as workdir:
        NotebookClient(notebook, timeout=1800, kernel_name="python3",
                       resources={"metadata": {"path": workdir}}).execute()
    nbformat.write(notebook, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="tutorial names (default: all of tutorials/)")
    args = parser.parse_args(argv)
    paths = [os.path.join(TUTORIALS, f"{name}.ipynb") for name in args.names] or \
        sorted(glob.glob(os.path.join(TUTORIALS, "*.ipynb")))
    failed = []
    for path in paths:
        started = time.monotonic()
        try:
            run(path)
        except Exception as error:  # noqa: BLE001 - report every notebook, then fail
            failed.append(os.path.basename(path))
            print(f"FAILED {os.path.basename(path)}: {type(error).__name__}: {error}", flush=True)
            continue
        print(f"ran {os.path.basename(path)} in {time.monotonic() - started:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
