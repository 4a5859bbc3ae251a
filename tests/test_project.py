"""tests/_project.py: the tests that read the project's files read only the project's.

A virtual environment, a build folder, notebook checkpoints or caches inside
the clone are not the project's: a venv's site-packages once failed
test_api's scan for paths outside the repository (werkzeug mentions a
"shared" folder).
"""

import os

from tests import _project

# What test_api's scan refuses, spelled apart so this file does not match it.
OFFENDING = "open('..{}shared/notes.md')\n".format("/")


def _write(root, relative, text="x\n"):
    path = os.path.join(root, *relative.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_environments_builds_checkpoints_and_caches_in_the_clone_are_left_out(tmp_path):
    root = str(tmp_path)
    own = ["README.md", "pyproject.toml", ".ci/run", ".gitignore", "keras_distrib/a.py",
           "keras_distrib/sub/b.py", "tests/test_a.py", "tutorials/t.ipynb", "docs/API.md",
           "tools/setup.sh", "environments.md"]
    for name in own:
        _write(root, name)
    foreign = [
        ".venv/pyvenv.cfg", ".venv/lib/python3.11/site-packages/werkzeug/debug.py",
        "venv/pyvenv.cfg", "venv/lib/site.py",  # a venv by any name
        "tests/env/pyvenv.cfg", "tests/env/bin/python",  # also deeper down
        "conda_env/conda-meta/history", "conda_env/lib/site.py",
        "build/lib/keras_distrib/a.py", "dist/keras_distrib-0.1.0.tar.gz",
        "keras_distrib.egg-info/PKG-INFO", "keras_distrib/__pycache__/a.cpython-311.pyc",
        "tutorials/.ipynb_checkpoints/t-checkpoint.ipynb", ".pytest_cache/v/cache/nodeids",
        ".git/config",
    ]
    for name in foreign:
        _write(root, name, OFFENDING)
    listed = _project.project_files(root=root)
    assert listed == sorted(os.path.join(root, *name.split("/")) for name in own)
    assert _project.project_files("keras_distrib", ".py", root=root) == [
        os.path.join(root, "keras_distrib", "a.py"), os.path.join(root, "keras_distrib", "sub", "b.py")]


def test_this_checkout_is_listed_by_git_or_the_same_rule():
    listed = _project.project_files()
    here = os.path.abspath(__file__)
    assert here in listed and os.path.join(_project.REPO, "pyproject.toml") in listed
    assert os.path.join(_project.PACKAGE, "__init__.py") in _project.project_files("keras_distrib", ".py")
    for path in listed:
        parts = os.path.relpath(path, _project.REPO).split(os.sep)
        assert not set(parts[:-1]) & {"site-packages", "__pycache__", ".ipynb_checkpoints", ".git"}, path
