"""The rooms' import order, checked on the source: every ``import`` of every file in src/dtrain (those inside
functions and under ``TYPE_CHECKING`` too) is an edge of one module graph, which must have no cycle and no
edge going up docs/architecture.md's order of the rooms."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "dtrain"

# docs/architecture.md's order, lowest first: a module may import its own level or any level below it.
# A module's level is the longest prefix of its dotted name listed here.
LEVELS: dict[str, int] = {
    "dtrain": 0, "dtrain.errors": 0, "dtrain.launchenv": 0, "dtrain.dist": 0,
    "dtrain.config": 1, "dtrain.config.bounds": 1, "dtrain.config.safeyaml": 1,
    "dtrain.profiling": 2,
    "dtrain.sync": 3,
    "dtrain.config.schema": 4, "dtrain.config.determined": 4, "dtrain.config.filevalues": 4,
    "dtrain.config.rungs": 4, "dtrain.config.model": 4,
    "dtrain.engine": 5,
    "dtrain.determined": 6,
    "dtrain.launcher": 6,
    "dtrain.explain": 7,
    "dtrain.search": 8,
    "dtrain.cli": 9,
    # python -m dtrain.profile: a command line beside cli (its imports are function-level, for the .pth file).
    "dtrain.profile": 9,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted((SRC / PACKAGE).rglob("*.py"))}


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of dtrain that ``name`` imports anywhere in its file: ``from a import b`` counts as
    ``a.b`` where ``b`` is a module, else as ``a``."""
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, name, path.name == "__init__.py")
            for alias in node.names:
                child = f"{source}.{alias.name}"
                targets.add(child if child in modules else source)
    return {target for target in targets if target in modules and target != name}


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def level(module: str) -> int:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in LEVELS:
            return LEVELS[prefix]
    raise KeyError(f"{module} has no room in LEVELS: add it (and to docs/architecture.md)")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as the list of its modules (first repeated at the end), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = GREY
        stack.append(node)
        for target in sorted(graph[node]):
            if colour[target] == GREY:
                return [*stack[stack.index(target):], target]
            if colour[target] == WHITE and (cycle := visit(target)):
                return cycle
        stack.pop()
        colour[node] = BLACK
        return None

    for node in sorted(graph):
        if colour[node] == WHITE and (cycle := visit(node)):
            return cycle
    return None


def test_the_module_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_no_import_goes_up_the_rooms():
    upward = [f"{source} (level {level(source)}) imports {target} (level {level(target)})"
              for source, targets in import_graph().items() for target in sorted(targets)
              if level(target) > level(source)]
    assert not upward, "\n".join(upward)


def test_the_finder_sees_function_level_and_type_checking_imports(tmp_path):
    # The checker's own invariant: a cycle hidden in a function body or under TYPE_CHECKING is still found.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dtrain import errors\n"
                      "def f():\n    import dtrain.dist\n")
    modules = {"dtrain.errors": source, "dtrain.dist": source, "dtrain": source}
    assert imports_of("m", source, modules) == {"dtrain.errors", "dtrain.dist"}


def test_docs_architecture_lists_every_source_file():
    # A row names a file by its path, or by its bare name beside the first file of its folder ("`a.py`, `b.py`").
    doc = (SRC.parent / "docs" / "architecture.md").read_text()
    missing = [path.relative_to(SRC / PACKAGE).as_posix() for path in sorted((SRC / PACKAGE).rglob("*.py"))
               if f"{path.name}`" not in doc]
    assert not missing, f"docs/architecture.md does not list: {', '.join(missing)}"
