"""The public surface is documented in docs/API.md, and that page stays true.

- every `kd.<name>` docs/API.md mentions exists, and every public name (the
  top level and the public modules' `__all__`) is there;
- every argument of a public function or class is named in its section;
- every command-line option and every `KD_*` variable the package reads is listed;
- no file of the project reads anything outside the repository;
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
from keras_distrib.commands import cli
from tests import _project

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "keras_distrib")
API = os.path.join(REPO, "docs", "API.md")
# The modules whose `__all__` is part of the public surface (kd.<module>.<name>).
PUBLIC_MODULES = ("callbacks", "cluster", "data", "gradients", "losses", "testing")
DOTTED = re.compile(r"\bkd\.[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


def _api_text():
    with open(API) as f:
        return f.read()


def _modules():
    names = []
    for path in _project.project_files("keras_distrib", ".py"):
        if not os.path.basename(path).startswith("_"):
            names.append(os.path.relpath(path, REPO)[:-3].replace(os.sep, "."))
    names += ["keras_distrib", "keras_distrib.callbacks"]
    return sorted(set(n for n in names if not n.endswith(".__init__")))


def _resolve(dotted):
    obj = kd
    for part in dotted.split(".")[1:]:
        if not hasattr(obj, part):
            raise AttributeError(f"{dotted}: `{part}` is missing")
        obj = getattr(obj, part)
    return obj


def _public_names():
    names = [f"kd.{name}" for name in kd.__all__]
    for module in PUBLIC_MODULES:
        names += [f"kd.{module}.{name}" for name in getattr(kd, module).__all__]
    return sorted(names)


def test_every_name_the_api_reference_mentions_exists():
    names = sorted(set(DOTTED.findall(_api_text())))
    assert len(names) >= 40, names
    missing = []
    for name in names:
        try:
            _resolve(name)
        except AttributeError as error:
            missing.append(str(error))
    assert not missing, f"docs/API.md names what kd does not have: {missing}"


def test_every_public_name_is_in_the_api_reference():
    documented = set(DOTTED.findall(_api_text()))
    missing = [name for name in _public_names() if name not in documented]
    assert not missing, f"public names missing from docs/API.md: {missing}"


def _section(text, name):
    """The text under the heading or list item that introduces `name`."""
    lines = text.splitlines()
    pattern = re.compile(r"^(#+ |- )`" + re.escape(name) + r"[(`]")
    for start, line in enumerate(lines):
        if pattern.match(line):
            end = start + 1
            while end < len(lines) and not re.match(r"^(#+ |- `kd\.)", lines[end]):
                end += 1
            return "\n".join(lines[start:end])
    return None


def _parameters(obj):
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    return [p.name for p in signature.parameters.values()
            if p.name not in ("self", "request") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def test_every_argument_is_named_in_its_section():
    text = _api_text()
    problems = []
    checked = set()
    for name in _public_names():
        obj = _resolve(name)
        if not callable(obj) or (inspect.isclass(obj) and issubclass(obj, Exception)):
            continue
        # A name re-exported by a module (kd.data.distribute_dataset) is
        # documented once, under whichever of its names introduces it.
        sections = [_section(text, other) for other in _public_names()
                    if _resolve(other) is obj]
        sections = [section for section in sections if section is not None]
        if id(obj) in checked:
            continue
        checked.add(id(obj))
        if inspect.isclass(obj) and obj.__init__ is object.__init__:
            continue
        # A class documented by its behaviour (kd.Model) names no constructor arguments.
        parameters = [p for p in _parameters(obj) if not (inspect.isclass(obj) and
                      issubclass(obj, kd.DistributedModelMixin) and p in ("args", "kwargs"))]
        if not sections:
            problems.append(f"{name}: no heading or list item introduces it")
            continue
        section = "\n".join(sections)
        absent = [p for p in parameters if not re.search(r"\b" + re.escape(p) + r"\b", section)]
        if absent:
            problems.append(f"{name}: arguments {absent} not named in its section")
    assert not problems, "\n".join(problems)


def _help(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    return capsys.readouterr().out


def test_every_command_line_option_is_listed(capsys):
    text = _api_text()
    commands = {"demo", "launch", "tf-config", "test", "env", "bench"}
    assert commands <= set(re.findall(r"keras-distrib (\w[\w-]*)", text))
    missing = []
    for command in sorted(commands):
        help_text = _help(command, capsys)
        assert "usage:" in help_text, (command, help_text)
        line = next(l for l in text.splitlines() if l.startswith(f"- `keras-distrib {command}"))
        for option in sorted(set(re.findall(r"(--[a-z][a-z-]+)", help_text)) - {"--help"}):
            if option not in line:
                missing.append(f"keras-distrib {command} {option}")
    assert not missing, f"options missing from docs/API.md's command line section: {missing}"


def test_every_kd_environment_variable_is_listed():
    read = set()
    for path in _project.project_files("keras_distrib", ".py"):
        with open(path) as f:
            read |= set(re.findall(r"\b(KD_[A-Z][A-Z_]*)\b", f.read()))
    assert "KD_WATCHDOG" in read
    missing = sorted(v for v in read if f"`{v}" not in _api_text())
    assert not missing, f"environment variables missing from docs/API.md: {missing}"


# Ways a file could reach beside the repository: the steering folder by name,
# or the parent of the repository's root computed from a test's own path.
OUTSIDE = re.compile(r"\.\./shared|[\'\"]shared[\'\"]\s*,|dirname\(\s*REPO\s*\)|REPO\s*,\s*[\'\"]\.\.[\'\"]")


def test_nothing_reads_outside_the_repository():
    this_file = os.path.abspath(__file__)
    offenders = []
    for path in _project.project_files():
        if os.path.abspath(path) == this_file or not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{os.path.relpath(path, REPO)}:{number}: {line.strip()}")
    assert not offenders, offenders


def test_the_outside_pattern_catches_what_it_is_for():
    # Contrast: the check above can fail.
    parent, folder = "..", "shared"  # spelled apart so this file does not match itself
    for line in (f'API = os.path.join(os.path.dirname(REPO), "{folder}", "API.md")',
                 f"open('{parent}/{folder}/API.md')", f'os.path.join(REPO, "{parent}", "x")'):
        assert OUTSIDE.search(line), line
    assert not OUTSIDE.search('os.path.join(REPO, "docs", "API.md")')


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
