"""The project's own files, for the tests that read them.

A checkout often holds more than the project: a virtual environment
(`python -m venv .venv`), a build folder, notebook checkpoints, caches. The
tests that scan the project's sources must see the same files wherever the
clone lives and whatever it holds. So they read what git tracks, plus the
files git would add (new, not ignored) outside Python environments; without
git (an unpacked source archive) a walk of the tree that leaves out the
folders that are never the project's.

Git is asked once, when this module is imported (as the tests are
collected), so no test starts a process for it.
"""

import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "keras_distrib")

# Folders that are never the project's, whatever git says of them.
_FOREIGN = {"__pycache__", ".ipynb_checkpoints", ".pytest_cache", ".git", "node_modules",
            "build", "dist"}


def _environment(folder):
    """Whether `folder` holds a Python environment (a venv, a conda environment)."""
    return (os.path.exists(os.path.join(folder, "pyvenv.cfg"))
            or os.path.isdir(os.path.join(folder, "conda-meta")))


def _foreign(root, relative, cache):
    """Whether file `relative` ('/'-separated, in `root`) lies in a folder that is not the project's."""
    parts = relative.split("/")[:-1]
    for depth in range(1, len(parts) + 1):
        folder = "/".join(parts[:depth])
        if folder not in cache:
            name = parts[depth - 1]
            cache[folder] = (name in _FOREIGN or name.endswith(".egg-info")
                             or _environment(os.path.join(root, folder)))
        if cache[folder]:
            return True
    return False


def _git_files(root):
    """Tracked files and the new files git would add, relative to `root`; None without git."""

    def listed(*options):
        result = subprocess.run(["git", "ls-files", "-z", *options], cwd=root, capture_output=True,
                                timeout=60, check=True)
        return [name for name in result.stdout.decode("utf-8", "surrogateescape").split("\0") if name]

    try:
        tracked = listed("--cached")
        new = listed("--others", "--exclude-standard")
    except (OSError, subprocess.SubprocessError):
        return None
    cache = {}
    return tracked + [name for name in new if not _foreign(root, name, cache)]


def walked_files(root):
    """The files under `root` outside the folders that are never the project's ('/'-separated)."""
    cache = {}
    found = []
    for folder, dirs, files in os.walk(root):
        relative = os.path.relpath(folder, root).replace(os.sep, "/")
        prefix = "" if relative == "." else relative + "/"
        dirs[:] = sorted(d for d in dirs if not _foreign(root, f"{prefix}{d}/file", cache))
        found += [prefix + name for name in sorted(files)]
    return found


_LISTED = _git_files(REPO)


def project_files(under=None, suffix=None, *, root=None):
    """Absolute paths of the project's existing files, sorted.

    Args:
        under: Only files in this folder of the project (e.g. "keras_distrib").
        suffix: Only files whose name ends with it (e.g. ".py").
        root: Another tree to list by the walk's rule (tests of this module);
            this repository when `None`.
    """
    if root is None:
        root, names = REPO, _LISTED if _LISTED is not None else walked_files(REPO)
    else:
        names = walked_files(root)
    prefix = None if under is None else under.rstrip("/") + "/"
    found = set()
    for name in names:
        if prefix is not None and not name.startswith(prefix):
            continue
        if suffix is not None and not name.endswith(suffix):
            continue
        path = os.path.join(root, *name.split("/"))
        if os.path.isfile(path):
            found.add(path)
    return sorted(found)
