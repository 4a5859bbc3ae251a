"""The public surface is the contract in ../shared/API.md, and it is documented.

- every `kd.<name>` API.md mentions exists;
- every module declares `__all__` (sorted, unique, resolvable);
- every public function and class, and every public method a class defines,
  has a docstring; the top-level names carry a runnable `Example`
  (pytest runs them with --doctest-modules).
"""

import importlib
import inspect
import os
import re

import pytest

import keras_distrib as kd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "keras_distrib")
API = os.path.join(os.path.dirname(REPO), "shared", "API.md")


def _modules():
    names = []
    for folder, _, files in os.walk(PACKAGE):
        for file in sorted(files):
            if not file.endswith(".py") or file.startswith("_"):
                continue
            relative = os.path.relpath(os.path.join(folder, file), REPO)[:-3]
            names.append(relative.replace(os.sep, "."))
    names += ["keras_distrib", "keras_distrib.callbacks"]
    return sorted(set(n for n in names if not n.endswith(".__init__")))


def _resolve(dotted):
    obj = kd
    for part in dotted.split(".")[1:]:
        if not hasattr(obj, part):
            raise AttributeError(f"{dotted}: `{part}` is missing")
        obj = getattr(obj, part)
    return obj


def test_every_name_api_md_mentions_exists():
    assert os.path.exists(API), (
        f"{API} not found: the contract lives in ../shared/API.md beside the repository"
    )
    with open(API) as f:
        text = f.read()
    names = sorted(set(re.findall(r"\bkd\.[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*", text)))
    assert len(names) >= 20, names
    missing = []
    for name in names:
        try:
            _resolve(name)
        except AttributeError as error:
            missing.append(str(error))
    assert not missing, missing


def test_error_types_are_exported():
    for name in ("CheckpointError", "ClusterConfigError", "LaunchError"):
        error = getattr(kd, name)
        assert issubclass(error, Exception) and name in kd.__all__


@pytest.mark.parametrize("module_name", _modules())
def test_module_declares_all(module_name):
    module = importlib.import_module(module_name)
    assert hasattr(module, "__all__"), f"{module_name} has no __all__"
    exported = list(module.__all__)
    assert exported == sorted(set(exported)), f"{module_name}.__all__ is not sorted and unique"
    for name in exported:
        assert hasattr(module, name), f"{module_name}.__all__ names a missing `{name}`"


def _undocumented(module_name):
    module = importlib.import_module(module_name)
    missing = []
    if not (module.__doc__ or "").strip():
        missing.append(module_name)
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.ismodule(obj) or not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        if not (inspect.getdoc(obj) or "").strip():
            missing.append(f"{module_name}.{name}")
        if inspect.isclass(obj) and obj.__module__ == module.__name__:
            for attribute, value in vars(obj).items():
                if attribute.startswith("_") or not callable(value):
                    continue
                if not (inspect.getdoc(value) or "").strip():
                    missing.append(f"{module_name}.{name}.{attribute}")
    return missing


@pytest.mark.parametrize("module_name", _modules())
def test_public_callables_have_docstrings(module_name):
    assert not _undocumented(module_name)


def test_top_level_names_have_examples():
    missing = []
    for name in kd.__all__:
        obj = getattr(kd, name)
        if inspect.ismodule(obj) or (inspect.isclass(obj) and issubclass(obj, Exception)):
            continue
        if "Example" not in (inspect.getdoc(obj) or ""):
            missing.append(name)
    assert not missing, f"top-level names without an Example: {missing}"
