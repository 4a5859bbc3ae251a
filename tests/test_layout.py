"""The package layout shows the architecture, and its imports point one way.

keras_distrib is split by concern (docs/development/layout.md):

    commands  >  testing  >  training  >  checkpointing  >  cluster  >  floor

`floor` is `_keras_compat` (Keras/TensorFlow internals) and the small modules
that import no other kd module (`validation`, `files`, `tf_logs`, `report`,
`_early_signals`). `public` is the package's front (`keras_distrib/__init__`)
and the public module paths that re-export `training` (`keras_distrib.data`,
`keras_distrib.losses`, ...): users and the commands import it, no part of
the machinery does. Every import counts, those inside functions too.
"""

import ast
import os

from tests import _project

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "keras_distrib")

FLOOR_MODULES = ("validation", "files", "tf_logs", "report", "_early_signals")
PUBLIC_MODULES = ("callbacks", "collectives", "data", "gradients", "losses")
SUBPACKAGES = ("_keras_compat", "cluster", "checkpointing", "training", "testing", "commands")

# Which parts each part may import (besides itself).
ALLOWED = {
    "compat": set(),
    "floor": set(),
    "cluster": {"floor", "compat"},
    "checkpointing": {"cluster", "floor", "compat"},
    "training": {"checkpointing", "cluster", "floor", "compat"},
    "testing": {"training", "checkpointing", "cluster", "floor", "compat"},
    "public": {"training", "checkpointing", "cluster", "floor", "compat"},
    "commands": {"public", "testing", "training", "checkpointing", "cluster", "floor", "compat"},
}


def part_of(module):
    """The part of the layout a dotted module name belongs to."""
    names = module.split(".")
    if names[0] != "keras_distrib":
        raise ValueError(f"not a keras_distrib module: {module}")
    if len(names) == 1:
        return "public"
    first = names[1]
    if first == "_keras_compat":
        return "compat"
    if first in ("cluster", "checkpointing", "training", "commands"):
        return first
    if first == "__main__":
        return "commands"
    if first == "testing":
        return "testing"
    if first in FLOOR_MODULES:
        return "floor"
    if first in PUBLIC_MODULES:
        return "public"
    raise ValueError(f"{module} is in no part of the layout: add it to tests/test_layout.py")


def imported(source, module, is_package, known):
    """The keras_distrib modules `source` (the text of `module`) imports, relative imports resolved.

    `from a import b` counts `a.b` where that is a module in `known`, else `a`.
    """
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            for alias in node.names:
                found.add(f"{name}.{alias.name}" if f"{name}.{alias.name}" in known else name)
    return {name for name in found if name == "keras_distrib" or name.startswith("keras_distrib.")}


def violations(modules):
    """`importer -> imported (part -> part)` for every import the layout does not allow.

    `modules`: {dotted module name: (source text, is a package's __init__)}.
    """
    found = []
    for module, (source, is_package) in sorted(modules.items()):
        own = part_of(module)
        for name in sorted(imported(source, module, is_package, modules)):
            other = part_of(name)
            if other != own and other not in ALLOWED[own]:
                found.append(f"{module} -> {name} ({own} -> {other})")
    return found


def package_modules():
    """{dotted name: (source, is_package)} for every module of keras_distrib."""
    found = {}
    for path in _project.project_files("keras_distrib", ".py"):
        name = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
        is_package = name.endswith(".__init__")
        if is_package:
            name = name[: -len(".__init__")]
        with open(path) as f:
            found[name] = (f.read(), is_package)
    return found


def test_the_allowed_directions_have_no_circle():
    order = ["compat", "floor", "cluster", "checkpointing", "training", "testing", "public",
             "commands"]
    for position, part in enumerate(order):
        assert ALLOWED[part] <= set(order[:position]), part


def test_every_module_is_in_a_part_of_the_layout():
    modules = package_modules()
    assert len(modules) > 50
    parts = {module: part_of(module) for module in modules}
    for part in ("compat", "cluster", "checkpointing", "training", "testing", "commands"):
        assert list(parts.values()).count(part) >= 2, part
    for subpackage in SUBPACKAGES:
        assert f"keras_distrib.{subpackage}" in modules, subpackage


def test_imports_follow_the_layout():
    assert violations(package_modules()) == []


def test_each_subpackage_says_what_it_owns_and_may_import():
    # In its docstring, or in a comment where the docstring is a public page (`kd.cluster`).
    for subpackage in SUBPACKAGES:
        with open(os.path.join(PACKAGE, subpackage, "__init__.py")) as f:
            source = f.read()
        doc = ast.get_docstring(ast.parse(source)) or ""
        comments = " ".join(line.strip("# ") for line in source.splitlines() if line.startswith("#"))
        assert any("May import" in text or "imports no" in text
                   for text in (doc, comments)), subpackage


def test_a_wrong_way_import_would_be_found():
    # Contrast, on sources written here (the package is not touched): the cluster
    # importing training, a function-level import from the floor, and a relative one.
    modules = {
        "keras_distrib.cluster": ("", True),
        "keras_distrib.cluster.launcher": ("from keras_distrib.training import loop\n", False),
        "keras_distrib.training": ("", True),
        "keras_distrib.training.loop": ("from keras_distrib.cluster import launcher\n", False),
        "keras_distrib.validation": ("def f():\n    import keras_distrib.cluster.launcher\n", False),
        "keras_distrib.checkpointing": ("", True),
        "keras_distrib.checkpointing.checkpoint": ("from ..commands import cli\n", False),
        "keras_distrib.commands": ("", True),
        "keras_distrib.commands.cli": ("import keras_distrib as kd\n", False),
    }
    assert violations(modules) == [
        "keras_distrib.checkpointing.checkpoint -> keras_distrib.commands.cli (checkpointing -> commands)",
        "keras_distrib.cluster.launcher -> keras_distrib.training.loop (cluster -> training)",
        "keras_distrib.validation -> keras_distrib.cluster.launcher (floor -> cluster)",
    ]


# Inside `training/`, bottom to top (training/__init__.py states the same
# order): a module may import only the modules before it.
TRAINING_ORDER = (
    "penalties", "replica", "scaling", "coupling", "losses", "logs", "batch_norm", "draws", "forward", "deferral", "buckets", "gradients", "hooks",
    "collectives", "first_step", "step", "refusals", "data", "served", "inputs", "loop", "parameter_server", "front", "model_call", "model_files", "models", "saving",
    "callbacks", "train_loop",
)


def _training_module(name):
    """`name`'s module directly under `keras_distrib.training` (`callbacks` for its parts), or None."""
    prefix = "keras_distrib.training."
    if not name.startswith(prefix):
        return None
    own = name[len(prefix):].split(".")[0]
    if own not in TRAINING_ORDER:
        raise ValueError(f"{name} has no place in TRAINING_ORDER: add it to tests/test_layout.py")
    return own


def order_violations(modules):
    """`importer -> imported (what the importer may import)` for every import inside
    `training/` that does not point down `TRAINING_ORDER`."""
    rank = {name: position for position, name in enumerate(TRAINING_ORDER)}
    found = []
    for module, (source, is_package) in sorted(modules.items()):
        own = _training_module(module)
        if own is None:
            continue
        for name in sorted(imported(source, module, is_package, modules)):
            other = _training_module(name)
            if other is not None and other != own and rank[other] > rank[own]:
                below = ", ".join(TRAINING_ORDER[:rank[own]]) or "none"
                found.append(f"{module} -> {name} ({own} may import only: {below})")
    return found


def test_every_training_module_has_its_place_in_the_order():
    modules = package_modules()
    inside = {_training_module(m) for m in modules} - {None}
    assert inside == set(TRAINING_ORDER)


def test_imports_inside_training_point_down():
    assert order_violations(package_modules()) == []


def test_training_states_its_order():
    with open(os.path.join(PACKAGE, "training", "__init__.py")) as f:
        doc = ast.get_docstring(ast.parse(f.read()))
    positions = [doc.index(f"`{name}`") for name in TRAINING_ORDER]
    assert positions == sorted(positions)


def test_a_wrong_way_import_inside_training_would_be_found():
    # Contrast, on sources written here: the gradients importing the step (as
    # they did), a replica's batch doing the scaling arithmetic again (it
    # lives in `scaling`, above it), and a function-level import of the model
    # from the loop.
    modules = {
        "keras_distrib.training": ("", True),
        "keras_distrib.training.gradients": ("from keras_distrib.training import step\n", False),
        "keras_distrib.training.step": ("from keras_distrib.training import gradients\n", False),
        "keras_distrib.training.replica": ("from keras_distrib.training import scaling\n", False),
        "keras_distrib.training.scaling": ("", False),
        "keras_distrib.training.loop": ("def f():\n    from . import models\n", False),
        "keras_distrib.training.models": ("from keras_distrib.training import loop\n", False),
    }
    assert order_violations(modules) == [
        "keras_distrib.training.gradients -> keras_distrib.training.step (gradients may import "
        "only: penalties, replica, scaling, coupling, losses, logs, batch_norm, draws, forward, deferral, "
        "buckets)",
        "keras_distrib.training.loop -> keras_distrib.training.models (loop may import only: "
        "penalties, replica, scaling, coupling, losses, logs, batch_norm, draws, forward, deferral, buckets, "
        "gradients, hooks, collectives, first_step, step, refusals, data, served, inputs)",
        "keras_distrib.training.replica -> keras_distrib.training.scaling (replica may import "
        "only: penalties)",
    ]
