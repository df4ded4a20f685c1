"""Import graph of a Python package: files, floors, arrows, cycles and upward arrows between layers.

Usage: ``python tools/import_graph.py src/comera`` (standard library only; nothing is imported or executed).

- **files**: every ``.py`` file under the package folder, named by its path relative to that folder.
- **arrows**: internal import edges, one per (importing file, imported file) pair.
  ``from comera.tt import paths`` points at ``tt/paths.py`` when ``paths`` is a module, else at
  ``tt/__init__.py``; imports inside functions count like top-level ones. Running a parent package's
  ``__init__`` on import is not counted as an arrow.
- **floors**: a file that imports no internal file is on floor 0; any other file is one floor above the
  highest file it imports. The number of floors is the length of the longest import chain plus one; one
  such chain is printed.
- **cycles**: the graph must be acyclic; the script names one cycle and exits with status 1 if it is not.
- **upward arrows**: each file belongs to the layer named by its first path part (``tt/lookup.py`` -> ``tt``,
  ``io.py`` -> ``io``), ranked by ``LAYERS``; an arrow from a lower layer to a higher one is upward. Top-level
  modules named in no layer (``version``, ``atomic``, ...) form the base, below ``tt``; the package's own
  ``__init__.py`` is the public facade, above everything. The exit status is 1 when an upward arrow exists.
- **crossing arrows**: the folders of a layer named in ``SEPARATE`` (each workload in ``workloads/``) must not
  import each other: ``workloads/nli/recipe.py -> workloads/dlrm/model.py`` is a crossing arrow, and the
  exit status is 1 when one exists. What two of them share belongs to a lower layer.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

LAYERS: tuple[tuple[str, ...], ...] = (
    ("tt",),
    ("nn",),
    ("tensorize", "tensorize_config", "io", "report", "modules"),
    ("rank",),
    ("train",),
    ("methods",),
    ("recipes", "data", "models", "metrics", "measure", "integrations"),
    ("workloads",),
    ("bench",),
    ("cli",),
    ("__main__",),
)
"""Layers from the bottom up; a file may import its own layer and those below."""
SEPARATE: tuple[str, ...] = ("workloads",)
"""Layers whose folders are independent of each other (no import from one into another)."""
BASE_LAYER = "base"
FACADE_LAYER = "facade"


def module_names(package: Path) -> dict[str, Path]:
    """Dotted module name (``comera.tt.paths``; a package is its ``__init__``) -> file, for every file."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = (package.name, *path.relative_to(package).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imported_files(tree: ast.Module, this_module: str, is_package: bool, known: set[str]) -> set[str]:
    """Internal modules one file imports, as dotted names in ``known``.

    ``import X.Y`` points at the longest known prefix of ``X.Y``; ``from X import a`` at ``X.a`` when that
    is a module, else at ``X``. Relative imports are resolved against ``this_module``.
    """
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                prefixes = (".".join(parts[:n]) for n in range(len(parts), 0, -1))
                found.update(next(([p] for p in prefixes if p in known), []))
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = this_module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            for alias in node.names:
                if f"{source}.{alias.name}" in known:
                    found.add(f"{source}.{alias.name}")
                elif source in known:
                    found.add(source)
    return found


def import_edges(package: Path) -> dict[str, set[str]]:
    """File (path relative to the package folder) -> set of internal files it imports (itself excluded)."""
    modules = module_names(package)
    files = {name: str(path.relative_to(package)) for name, path in modules.items()}
    edges = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = imported_files(tree, name, path.name == "__init__.py", set(files))
        edges[files[name]] = {files[t] for t in targets} - {files[name]}
    return edges


def layer_of(file: str) -> str:
    """Layer name of a file given by its path relative to the package folder."""
    if file == "__init__.py":
        return FACADE_LAYER
    first = Path(file).parts[0].removesuffix(".py")
    return first if any(first in group for group in LAYERS) else BASE_LAYER


def layer_rank(layer: str) -> int:
    """0 for the base, 1.. for ``LAYERS`` in order, one above the last for the facade."""
    if layer == BASE_LAYER:
        return 0
    if layer == FACADE_LAYER:
        return len(LAYERS) + 1
    return next(i for i, group in enumerate(LAYERS, start=1) if layer in group)


def crosses(source: str, target: str) -> bool:
    """Whether the arrow ``source -> target`` runs between two folders of a layer in ``SEPARATE``."""
    source_parts, target_parts = Path(source).parts, Path(target).parts
    return (
        len(source_parts) > 2
        and len(target_parts) > 2
        and source_parts[0] == target_parts[0]
        and source_parts[0] in SEPARATE
        and source_parts[1] != target_parts[1]
    )


def floors(edges: dict[str, set[str]]) -> dict[str, int]:
    """Floor of every file (0 for a file that imports nothing internal); raises ``CycleError`` on a cycle."""
    floor: dict[str, int] = {}
    for file in TopologicalSorter(edges).static_order():
        floor[file] = 1 + max((floor[t] for t in edges.get(file, ())), default=-1)
    return floor


def longest_chain(edges: dict[str, set[str]], floor: dict[str, int]) -> list[str]:
    """One import chain through every floor, from a file on the top floor down to floor 0."""
    chain = [min(f for f in floor if floor[f] == max(floor.values()))]
    while floor[chain[-1]] > 0:
        chain.append(min(t for t in edges[chain[-1]] if floor[t] == floor[chain[-1]] - 1))
    return chain


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", type=Path, help="package folder, e.g. src/comera")
    package = parser.parse_args(argv).package
    if not (package / "__init__.py").is_file():
        parser.error(f"package must be a folder holding __init__.py, got {package}")
    edges = import_edges(package)
    arrows = sum(len(targets) for targets in edges.values())
    print(f"files: {len(edges)}")
    try:
        floor = floors(edges)
    except CycleError as error:
        # graphlib lists each node before the node that imports it; print the cycle as import arrows.
        print(f"arrows: {arrows}\ncycles: found: {' -> '.join(reversed(error.args[1]))}")
        return 1
    print(f"floors: {max(floor.values()) + 1}\narrows: {arrows}\ncycles: 0")
    for level in range(max(floor.values()) + 1):
        print(f"  floor {level}: {' '.join(sorted(f for f in floor if floor[f] == level))}")
    print(f"longest chain: {' -> '.join(longest_chain(edges, floor))}")
    upward = sorted(
        (layer_of(source), layer_of(target), source, target)
        for source, targets in edges.items()
        for target in targets
        if layer_rank(layer_of(target)) > layer_rank(layer_of(source))
    )
    print(f"upward arrows: {len(upward)}")
    for (low, high), count in sorted(Counter((u[0], u[1]) for u in upward).items()):
        print(f"  {low} -> {high}: {count}")
        for _, _, source, target in (u for u in upward if (u[0], u[1]) == (low, high)):
            print(f"    {source} -> {target}")
    crossing = sorted(
        (source, target) for source, targets in edges.items() for target in targets if crosses(source, target)
    )
    print(f"crossing arrows: {len(crossing)}")
    for source, target in crossing:
        print(f"    {source} -> {target}")
    base = sorted({f for f in edges if layer_of(f) == BASE_LAYER})
    print(f"base (in no named layer): {' '.join(base) or '-'}")
    return 1 if upward or crossing else 0


if __name__ == "__main__":
    sys.exit(main())
