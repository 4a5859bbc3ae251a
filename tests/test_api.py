"""The public surface is one explicit list, and every name on it is documented.

The list: `keras_distrib._PUBLIC` (which is `kd.__all__`) and the `__all__` of
each public module it names. The API reference is generated from it and
rendered from the docstrings (tools/docs_site.py); tests/test_docs.py builds
the site and checks the rendered reference against the list, both ways. Here,
in this process:

- each public module imports its names one by one and holds nothing else
  public (no `import *`; a name outside `__all__` starts with `_`);
- every name on the list exists, and the docstring of each public function
  and class documents every argument (the site's strict build fails on one
  that documents an argument the signature lacks);
- the command-line reference shows every option of every command, and every
  `KD_*` variable the package reads is on the environment variables page;
- every module declares `__all__` (sorted, unique, resolvable), and every
  public function, class and method has a docstring; the top-level names
  carry a runnable `Example` (pytest runs them with --doctest-modules);
- no file of the project reads anything outside the repository.
"""

import ast
import importlib
import inspect
import os
import re
import sys
import types

import pytest

import keras_distrib as kd
from keras_distrib.commands import cli
from tests import _project

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "keras_distrib")
ENVIRONMENT_PAGE = os.path.join(REPO, "docs", "reference", "environment.md")
sys.path.insert(0, os.path.join(REPO, "tools"))
import docs_site  # noqa: E402  (tools/docs_site.py: the site's view of the surface)

sys.path.remove(os.path.join(REPO, "tools"))

PUBLIC_MODULES = sorted(name for name, (_, attribute) in kd._PUBLIC.items() if attribute is None)


def test_the_list_is_kd_all_and_the_site_reads_the_same_list():
    assert kd.__all__ == sorted(kd._PUBLIC)
    top, modules = docs_site.public_surface()  # read from the source, as the site reads it
    assert top == kd._PUBLIC
    for name in PUBLIC_MODULES:
        assert modules[kd._PUBLIC[name][0]] == list(getattr(kd, name).__all__), name


def test_every_public_name_exists():
    missing = []
    for name in kd.__all__:
        if getattr(kd, name, None) is None:
            missing.append(f"kd.{name}")
    for module in PUBLIC_MODULES:
        missing += [f"kd.{module}.{n}" for n in getattr(kd, module).__all__
                    if not hasattr(getattr(kd, module), n)]
    assert not missing, missing


def surface_problems(module, source=None):
    """What makes `module`'s public names differ from its `__all__`.

    A name without a leading `_` that is not in `__all__` (modules aside: the
    package's submodules and `os`-like imports are not names it offers;
    pytest's `pytest_*` hooks neither), a star import, or, with `source`, a
    re-exported name not imported on its own line.
    """
    exported = set(getattr(module, "__all__", ()))
    problems = [f"{module.__name__}.{name} is public but not in __all__"
                for name, value in vars(module).items()
                if not name.startswith("_") and name not in exported
                and not isinstance(value, types.ModuleType) and not name.startswith("pytest_")]
    if source is not None:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom):
                if any(alias.name == "*" for alias in node.names):
                    problems.append(f"{module.__name__} imports * from {node.module}")
                elif len(node.names) > 1 and {a.asname or a.name for a in node.names} & exported:
                    problems.append(f"{module.__name__} imports several names on one line "
                                    f"from {node.module}: one name per line")
    return problems


def _source(module):
    with open(module.__file__) as f:
        return f.read()


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_each_public_module_offers_exactly_its_all(name):
    module = getattr(kd, name)
    assert surface_problems(module, _source(module)) == []


def test_the_top_level_offers_exactly_its_all():
    assert surface_problems(kd) == []
    assert [name for name in dir(kd) if not name.startswith("_")
            and not isinstance(getattr(kd, name), types.ModuleType)] == \
        [name for name in kd.__all__ if not isinstance(getattr(kd, name), types.ModuleType)]


def test_a_made_up_export_is_found():
    # Contrast: a public module that offers one name more than its __all__,
    # and one that re-exports with a star or several names on a line.
    module = types.ModuleType("keras_distrib.made_up")
    module.__all__ = ["shard_files"]
    module.shard_files = kd.data.shard_files
    module.fit_epochs = lambda: None
    assert surface_problems(module) == ["keras_distrib.made_up.fit_epochs is public but not in __all__"]
    star = "from keras_distrib.training.data import *\n"
    several = "from keras_distrib.training.data import file_count, shard_files\n"
    assert surface_problems(module, star)[-1] == (
        "keras_distrib.made_up imports * from keras_distrib.training.data")
    assert "one name per line" in surface_problems(module, several)[-1]


# Docstrings: every argument documented.

_ARGS = re.compile(r"^(Args|Arguments|Attributes):\s*$")


def documented_arguments(obj):
    """`(parameters, documented)`: the argument names of a function or class
    (its constructor's), and those its docstring's `Args:` (or a dataclass's
    `Attributes:`) section names, as Google-style docstrings write them."""
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        parameters = []
    names = [p.name for p in parameters if p.name not in ("self", "cls")]
    documented, indent = set(), None
    for line in (inspect.getdoc(obj) or "").splitlines():
        if _ARGS.match(line):
            indent = ""
            continue
        if indent is None:
            continue
        if line and not line.startswith(" "):  # the next section
            indent = None
            continue
        item = re.match(r"^( +)\**([A-Za-z_][A-Za-z0-9_]*)( \(.*\))?:", line)
        if item and (not indent or len(item.group(1)) == len(indent)):
            indent = item.group(1)
            documented.add(item.group(2))
    return names, documented


def _public_callables():
    found = {}
    for dotted in docs_site.public_names():
        obj = kd
        for part in dotted.split(".")[1:]:
            obj = getattr(obj, part)
        if inspect.isfunction(obj) or (inspect.isclass(obj) and not issubclass(obj, Exception | Warning)):
            found[dotted] = obj
    return found


def test_every_argument_of_a_public_name_is_documented():
    problems = []
    for dotted, obj in sorted(_public_callables().items()):
        names, documented = documented_arguments(obj)
        if inspect.isclass(obj) and not getattr(obj.__init__, "__module__", "").startswith("keras_distrib"):
            continue  # Keras's constructor (kd.Sequential), or none: documented where it is defined
        if issubclass(obj, kd.DistributedModelMixin) if inspect.isclass(obj) else False:
            if obj is kd.DistributedModelMixin:
                continue  # a mixin: your class's constructor is yours
        missing = [n for n in names if n not in documented]
        if missing:
            problems.append(f"{dotted}: arguments {missing} not in its docstring's Args")
    assert not problems, "\n".join(problems)


def test_a_missing_argument_would_be_found():
    # Contrast: a function whose docstring forgets an argument.
    def f(a, *, b=1, **options):
        """Does f.

        Args:
            a: The a.
                More about a.
            **options: The rest.

        Returns:
            Nothing.
        """

    assert documented_arguments(f) == (["a", "b", "options"], {"a", "options"})


@pytest.mark.parametrize("command", ["demo", "launch", "tf-config", "test", "env", "bench",
                                     "bench --network"])
def test_every_command_line_option_is_on_the_reference_page(command, capsys):
    page = docs_site.cli_page()
    argv = command.split() + ["--help"]
    with pytest.raises(SystemExit):
        cli.main(argv)
    help_text = capsys.readouterr().out
    assert "usage:" in help_text, (command, help_text)
    section = page.split(f"## `keras-distrib {command}`\n", 1)
    assert len(section) == 2, f"no section for keras-distrib {command}"
    section = section[1].split("\n## ", 1)[0]
    options = sorted(set(re.findall(r"(--[a-z][a-z-]+)", help_text)) - {"--help"})
    assert [option for option in options if option not in section] == []


def test_every_kd_environment_variable_is_listed():
    read = set()
    for path in _project.project_files("keras_distrib", ".py"):
        with open(path) as f:
            read |= set(re.findall(r"\b(KD_[A-Z][A-Z_]*)\b", f.read()))
    assert "KD_WATCHDOG" in read
    with open(ENVIRONMENT_PAGE) as f:
        page = f.read()
    missing = sorted(v for v in read if f"`{v}" not in page)
    assert not missing, f"environment variables missing from docs/reference/environment.md: {missing}"


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
    for name in ("CheckpointError", "ClusterConfigError", "DamagedCheckpointError", "EmptyDataError",
                 "LaunchError"):
        error = getattr(kd, name)
        assert issubclass(error, Exception) and name in kd.__all__
    assert issubclass(kd.NonFiniteDataWarning, UserWarning)


def _modules():
    names = []
    for path in _project.project_files("keras_distrib", ".py"):
        if not os.path.basename(path).startswith("_"):
            names.append(os.path.relpath(path, REPO)[:-3].replace(os.sep, "."))
    names += ["keras_distrib", "keras_distrib.callbacks"]
    return sorted(set(n for n in names if not n.endswith(".__init__")))


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
        if inspect.ismodule(obj) or (inspect.isclass(obj) and issubclass(obj, Warning | Exception)):
            continue
        if "Example" not in (inspect.getdoc(obj) or ""):
            missing.append(name)
    assert not missing, f"top-level names without an Example: {missing}"
