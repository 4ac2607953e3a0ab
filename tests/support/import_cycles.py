"""Import cycles inside a package: every module's imports read with ``ast`` (those under ``if TYPE_CHECKING:`` and
inside functions too, relative ones resolved), the strongly connected components of that graph with more than one
module. import-linter's contracts do not see these: grimp leaves type-only imports out.

An edge runs from a module to each module of the package it names: ``import a.b`` and ``from a.b import name`` to
``a.b``, ``from a import b`` to ``a.b`` where that is a module (else to ``a``). Importing ``a.b`` also runs
``a/__init__.py``; that implicit edge is not drawn (a package's ``__init__`` re-exporting its modules is no cycle).

Run as ``python tests/support/import_cycles.py [--known MODULE,MODULE,...]... [PACKAGE_DIR]`` (default
``pd_transfer``): exit 0 when the only cycles are the ``--known`` ones, 1 when another cycle is found or a known one
is gone (remove it from the command then). tests/unit/test_import_cycles.py checks the same.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

Graph = dict[str, set[str]]


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> its file, for every ``.py`` file under ``package_dir`` (a package's ``__init__.py``
    under the package's own name)."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(node: ast.Import | ast.ImportFrom, package: str, modules: Mapping[str, Path]) -> list[str]:
    """The dotted names ``node`` imports, relative ones resolved against ``package`` (the importing module's)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join([*anchor, *([node.module] if node.module else [])])
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]


def _module_of(name: str, modules: Mapping[str, Path]) -> str | None:
    """The module of the package that ``name`` is or lies in (``a.b.C`` -> ``a.b``), None outside the package."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in modules else None


def imports_in(tree: ast.AST, package: str, modules: Mapping[str, Path]) -> set[str]:
    """The modules of ``modules`` that the parsed file ``tree`` imports anywhere (relative imports resolved against
    ``package``, the importing module's)."""
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            targets |= {_module_of(target, modules) for target in _imported(node, package, modules)}
    return {target for target in targets if target is not None}


def import_graph(package_dir: Path) -> Graph:
    """Module -> the modules of the same package it imports (anywhere in its file)."""
    modules = module_files(package_dir)
    graph: Graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        graph[name] = imports_in(ast.parse(path.read_text(), str(path)), package, modules) - {name}
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module, each sorted, sorted (Tarjan's
    algorithm, iterative: no recursion limit)."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = lowest[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = lowest[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    lowest[node] = min(lowest[node], index[successor])
            else:
                work.pop()
                if work:
                    lowest[work[-1][0]] = min(lowest[work[-1][0]], lowest[node])
                if lowest[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def check(package_dir: Path, known: Iterable[frozenset[str]] = ()) -> list[str]:
    """What is wrong with ``package_dir``'s imports: each cycle not in ``known``, each ``known`` cycle that is gone.
    Empty when all is well."""
    expected = set(known)
    found = {frozenset(cycle): cycle for cycle in cycles(import_graph(package_dir))}
    problems = [f"import cycle: {' <-> '.join(cycle)}" for members, cycle in found.items() if members not in expected]
    problems += [
        f"the known cycle {', '.join(sorted(members))} is gone: take it off the list of known cycles"
        for members in expected - set(found)
    ]
    return problems


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("package_dir", nargs="?", type=Path, default=REPO / "pd_transfer")
    parser.add_argument(
        "--known", action="append", default=[], metavar="MODULE,MODULE,...", help="a cycle expected for now"
    )
    args = parser.parse_args(argv)
    known = [frozenset(name.strip() for name in cycle.split(",")) for cycle in args.known]
    problems = check(args.package_dir, known)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
