"""Layers point down: no import circle in the package, compat at the floor.

The graph counts every import, also those inside functions (a function-level
import that only breaks a circle still means the code sits in the wrong
module). `_keras_compat` (a package of parts) is the floor: accessors for
Keras/TensorFlow internals, importing no kd module.
"""

import ast
import os

from tests import _project

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules():
    found = {}
    for path in _project.project_files("keras_distrib", ".py"):
        name = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
        found[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return found


def import_graph():
    """{module: set of kd modules it imports} over the whole package."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    edges.add(child if child in modules else node.module)
        graph[name] = {edge for edge in edges if edge in modules and edge != name}
    return graph


def circles(graph):
    """The groups of modules that import each other (strongly connected, size > 1)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph.get(module, ())):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                group.append(other)
                if other == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert len(graph) > 30
    assert circles(graph) == []


def test_compat_is_the_floor():
    # `_keras_compat` is a package of parts: together they import no other kd module.
    graph = import_graph()
    compat = {name for name in graph if name.split(".")[:2] == ["keras_distrib", "_keras_compat"]}
    assert "keras_distrib._keras_compat" in compat
    assert set().union(*(graph[name] for name in compat)) - compat == set()


def test_a_circle_would_be_found():
    # Contrast: the check sees a circle through a function-level import.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert import_graph()["keras_distrib.training.models"] >= {"keras_distrib.training.loop", "keras_distrib.training.front"}
