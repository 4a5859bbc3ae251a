"""The documentation site's generated pages (an MkDocs hook) and its view of the public surface.

MkDocs runs this file as a hook (mkdocs.yml, `hooks:`), and mkdocstrings
loads `PublicNames` from it as a griffe extension. At every build it adds,
without writing into docs/:

- `reference/kd.md` and one page per public module, from the one list of the
  public surface: `keras_distrib._PUBLIC` (the top-level names, which are
  also `kd.__all__`) and each public module's `__all__`. mkdocstrings renders
  each name from its docstring, so the reference cannot drift from the code.
- `reference/cli.md`, from the `keras-distrib` command's own parsers (what
  `--help` prints).
- `tutorials/<name>.md`, from `tutorials/<name>.ipynb` with the outputs and
  figures committed in it (nothing is executed at build time), with the
  notebook itself to download.

In the hand-written pages, a code span that names a public object
(`kd.make_strategy`, `kd.data.shard_files(...)`) becomes a link to its
reference entry; one that names no public object stays as it is.

Everything here reads the package's source (`ast`), never imports it: the
build loads no TensorFlow.
"""

import argparse
import ast
import base64
import contextlib
import io
import json
import os
import re

import griffe
from mkdocs.structure.files import File

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "keras_distrib")
TUTORIALS = os.path.join(REPO, "tutorials")

# The top-level names by topic, found by the module that defines them; an
# exception or warning class goes under "Errors and warnings" wherever it lives.
# A name from a module not listed here stops the build (add its topic).
TOPICS = (
    ("Devices and strategies", ("keras_distrib.cluster.devices", "keras_distrib.cluster.strategies")),
    ("Who am I in the cluster", ("keras_distrib.cluster.info",)),
    ("Models", ("keras_distrib.training.models",)),
    ("Data", ("keras_distrib.training.data",)),
    ("Training loops", ("keras_distrib.training.train_loop", "keras_distrib.training.gradients")),
    ("Checkpoints and evaluation", ("keras_distrib.checkpointing.checkpoint",
                                    "keras_distrib.checkpointing.evaluator")),
    ("Saving and loading models", ("keras_distrib.training.saving",)),
    ("Launching a cluster", ("keras_distrib.cluster.launcher", "keras_distrib.cluster.inprocess")),
)
ERRORS = "Errors and warnings"


# The public surface, read from the source.


def _assigned(path, name):
    """The literal value assigned to `name` at the top of the module at `path`."""
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            if name == "__all__" and isinstance(node.value, ast.Call):  # sorted(_PUBLIC)
                return sorted(_assigned(path, "_PUBLIC"))
            return ast.literal_eval(node.value)
    raise ValueError(f"{os.path.relpath(path, REPO)} assigns no `{name}`")


def _source_path(module):
    """The file of a keras_distrib module (a package's `__init__.py`)."""
    base = os.path.join(REPO, *module.split("."))
    return os.path.join(base, "__init__.py") if os.path.isdir(base) else base + ".py"


def public_surface():
    """The public surface: `(top, modules)`.

    `top`: {name: (module, attribute)} as `keras_distrib._PUBLIC` lists it
    (attribute None: a public module). `modules`: {public module: its
    `__all__`}.
    """
    top = _assigned(os.path.join(PACKAGE, "__init__.py"), "_PUBLIC")
    modules = {module: _assigned(_source_path(module), "__all__")
               for module, attribute in top.values() if attribute is None}
    return top, modules


def public_names():
    """Every public dotted name as users write it (`kd.make_strategy`, `kd.data.shard_files`),
    mapped to the identifier of its reference entry (`keras_distrib.make_strategy`, ...)."""
    top, modules = public_surface()
    names = {}
    for name, (module, attribute) in top.items():
        names[f"kd.{name}"] = module if attribute is None else f"keras_distrib.{name}"
        for member in modules.get(module, ()) if attribute is None else ():
            names[f"kd.{name}.{member}"] = f"{module}.{member}"
    return names


class PublicNames(griffe.Extension):
    """Gives griffe's `keras_distrib` the names `_PUBLIC` loads lazily (PEP 562).

    The package's `__getattr__` is invisible to static analysis; as aliases,
    `keras_distrib.Model` and the rest render under the names users write.
    """

    def on_package(self, *, pkg, **kwargs):
        if pkg.name != "keras_distrib":
            return
        top, _ = public_surface()
        for name, (module, attribute) in top.items():
            if attribute is not None:
                pkg.set_member(name, griffe.Alias(name, f"{module}.{attribute}", parent=pkg))
        pkg.exports = sorted(top)


# The reference pages.


def _topic(name, module, attribute):
    if attribute.endswith(("Error", "Warning")):
        return ERRORS
    for title, modules in TOPICS:
        if module in modules:
            return title
    raise ValueError(f"kd.{name} comes from {module}, which no topic of tools/docs_site.py's "
                     "TOPICS lists: add it there, so the reference shows it under a topic.")


def _first_line(module):
    with open(_source_path(module)) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def reference_pages():
    """{path under docs/: markdown} for the API reference's generated pages."""
    top, modules = public_surface()
    sections = {title: [] for title, _ in TOPICS}
    sections[ERRORS] = []
    for name, (module, attribute) in top.items():
        if attribute is not None:
            sections[_topic(name, module, attribute)].append(name)
    lines = [
        "# kd",
        "",
        "`import keras_distrib as kd`. The names on this page and the modules listed at its end "
        "are kd's public surface, generated from `keras_distrib._PUBLIC` (which is also "
        "`kd.__all__`) and each public module's `__all__`; anything else is internal and may "
        "change. Importing `keras_distrib` loads neither TensorFlow nor Keras: each name loads "
        "its module at first use.",
        "",
    ]
    for title, names in sections.items():
        if not names:
            continue
        lines += [f"## {title}", ""]
        for name in names:
            lines += [f"::: keras_distrib.{name}", "    options:", f'      heading: "kd.{name}"',
                      "      heading_level: 3", ""]
    lines += ["## Modules", ""]
    for name, (module, attribute) in top.items():
        if attribute is None:
            lines.append(f"- [`kd.{name}`]({name}.md): {_first_line(module)}")
    pages = {"reference/kd.md": "\n".join(lines) + "\n"}
    for name, (module, attribute) in top.items():
        if attribute is None:
            pages[f"reference/{name}.md"] = (
                f"# kd.{name}\n\n`import keras_distrib as kd`, then `kd.{name}.<name>`; "
                f"or `from {module} import <name>`. Its public names are its `__all__`: "
                f"{', '.join(f'`{member}`' for member in modules[module])}.\n\n"
                f"::: {module}\n    options:\n      show_root_heading: false\n"
            )
    return pages


# The command line.


def _help(parse, argv):
    """What a parser prints for `argv` (`--help`), without exiting."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        parse(argv)
    return out.getvalue().rstrip()


def cli_page():
    """The command line's reference: each command's description and `--help`."""
    import sys

    sys.path.insert(0, REPO)  # this checkout's package, whatever is installed
    try:
        from keras_distrib.commands import bench, bench_first_step, bench_network, cli
    finally:
        sys.path.remove(REPO)
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    lines = ["# Command line", "", cli.__doc__.split("\n\n")[0].replace("\n", " "), "",
             "`keras-distrib COMMAND --help` prints the same text as below; "
             "`python -m keras_distrib` is the same command.", ""]
    for name, sub in commands.choices.items():
        if name == "bench":
            texts = [("keras-distrib bench", _help(bench.main, ["--help"])),
                     ("keras-distrib bench --network", _help(bench_network.main, ["--help"])),
                     ("keras-distrib bench --first-step", _help(bench_first_step.main, ["--help"]))]
        else:
            texts = [(f"keras-distrib {name}", sub.format_help().rstrip())]
        for title, text in texts:
            lines += [f"## `{title}`", "", "```text", text, "```", ""]
    return "\n".join(lines)


# The tutorials.

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]|\x1b\][^\x07]*\x07")


def _text(value):
    return "".join(value) if isinstance(value, list) else value


def _fence(text, language="text"):
    ticks = "````" if "```" in text else "```"
    return f"{ticks}{language}\n{text.rstrip()}\n{ticks}"


def _keep_last_progress(text):
    """A progress bar redrawn with carriage returns, as a terminal leaves it."""
    return "\n".join(line.rsplit("\r", 1)[-1] if "\r" in line.rstrip("\r") else line.rstrip("\r")
                     for line in text.split("\n"))


def notebook_page(path, name):
    """`(markdown, {file name: bytes})` for a notebook: its cells and committed outputs."""
    with open(path) as f:
        notebook = json.load(f)
    note = (f"[Download the notebook]({name}.ipynb). `tests/test_tutorials.py` runs it in the "
            "test suite; the outputs below are those committed with it.")
    parts, images = [], {}
    for index, cell in enumerate(notebook["cells"]):
        source = _text(cell.get("source", "")).strip()
        if cell["cell_type"] == "markdown":
            parts.append(source)
            if note and source.startswith("# "):  # under the title
                parts.append(note)
                note = None
            continue
        if cell["cell_type"] != "code" or not source:
            continue
        parts.append(_fence(source, "python"))
        streams = []

        def flush():
            if streams:
                parts.append(_fence(_keep_last_progress(_ANSI.sub("", "".join(streams)))))
                streams.clear()

        for number, output in enumerate(cell.get("outputs", [])):
            kind = output.get("output_type")
            if kind == "stream":
                streams.append(_text(output.get("text", "")))
                continue
            flush()
            data = output.get("data", {})
            if kind == "error":
                parts.append(_fence(_ANSI.sub("", "\n".join(output.get("traceback", [])))))
            elif "image/png" in data:
                file = f"{name}_files/cell{index}_{number}.png"
                images[file] = base64.b64decode(_text(data["image/png"]))
                alt = _text(data.get("text/plain", "figure")).strip("<>").replace("\n", " ")
                parts.append(f"![{alt}]({file})")
            elif "text/html" in data:
                parts.append(_text(data["text/html"]))
            elif "text/plain" in data:
                parts.append(_fence(_ANSI.sub("", _text(data["text/plain"]))))
        flush()
    if note:
        parts.insert(0, note)
    return "\n\n".join(parts) + "\n", images


def tutorial_names():
    return sorted(file[:-6] for file in os.listdir(TUTORIALS) if file.endswith(".ipynb"))


# Links from hand-written pages into the reference.

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_SPAN = re.compile(r"(?<![\[`])`(kd(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(\([^`]*\))?`(?![\]`])")


def link_public_names(markdown, names):
    """Turns each code span naming a public object into a link to its reference entry."""

    def link(match):
        target = names.get(match.group(1))
        return f"[{match.group(0)}][{target}]" if target else match.group(0)

    pieces, last = [], 0
    for fence in _FENCE.finditer(markdown):
        pieces += [_SPAN.sub(link, markdown[last:fence.start()]), fence.group(0)]
        last = fence.end()
    pieces.append(_SPAN.sub(link, markdown[last:]))
    return "".join(pieces)


# MkDocs events.


def on_files(files, config, **kwargs):
    def add(path, content):
        files.append(File.generated(config, path, content=content))

    for path, text in reference_pages().items():
        add(path, text)
    add("reference/cli.md", cli_page())
    for name in tutorial_names():
        path = os.path.join(TUTORIALS, f"{name}.ipynb")
        markdown, images = notebook_page(path, name)
        add(f"tutorials/{name}.md", markdown)
        for file, data in images.items():
            add(f"tutorials/{file}", data)
        with open(path, "rb") as f:
            add(f"tutorials/{name}.ipynb", f.read())
    return files


_names = None


def on_page_markdown(markdown, page, **kwargs):
    global _names
    if _names is None:
        _names = public_names()
    return link_public_names(markdown, _names)
