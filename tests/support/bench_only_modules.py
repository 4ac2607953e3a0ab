"""Product modules that only the benchmarks, the stand-ins or the tests use: code for them kept inside the product.

The product is ``pd_transfer/`` less ``bench/``, ``sim/`` and ``cli.py``. A product module is in use when something
the product is made of or for uses it: a product module in use, the command (``cli.py``), an example
(``examples/``) or a file of ``docker/``. A file uses a module when it imports it (anywhere in the file, relative
imports resolved: :mod:`import_cycles`), imports a module inside it (a package's ``__init__`` runs first), or names
it in a string (``python -m pd_transfer...``, vLLM's ``kv_connector_module_path``). A product module that no file
uses at all is an entry point of its own (a ``__main__``), in use. The modules listed are the others: used, but
only from ``bench/``, ``sim/`` or ``tests/`` (directly, or through product modules only those use).

Run as ``python tests/support/bench_only_modules.py [REPO]`` (default: this repository): prints each such module
with the files that use it, one a line; exit 0 when there is none, 1 otherwise. scripts/test runs it;
tests/unit/test_bench_only_modules.py checks the same.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from import_cycles import imports_in, module_files

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "pd_transfer"
ASIDE = ("bench", "sim", "cli")  # what is beside the product in the package: the benchmarks, stand-ins, command
USERS = ("examples", "docker")  # folders of the repository whose files use the product as its users do
TESTS = ("tests", "conftest.py")


def in_product(module: str, package: str = PACKAGE) -> bool:
    """Whether ``module`` (dotted) is of the product: in ``package``, not in one of :data:`ASIDE`."""
    parts = module.split(".")
    return parts[0] == package and (len(parts) == 1 or parts[1] not in ASIDE)


def _with_parents(modules: Iterable[str]) -> set[str]:
    """``modules`` and every package above each (importing ``a.b.c`` runs ``a`` and ``a.b`` first)."""
    return {".".join(name.split(".")[:end]) for name in modules for end in range(1, name.count(".") + 2)}


def uses(path: Path, module: str | None, modules: Mapping[str, Path]) -> set[str]:
    """The modules of ``modules`` the file at ``path`` uses: imports (relative ones resolved when it is the module
    ``module`` of the package) and dotted names in strings; with the packages above them. Never itself."""
    tree = ast.parse(path.read_text(), str(path))
    package = "" if module is None else module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    named = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    return _with_parents(imports_in(tree, package, modules) | (named & set(modules))) - {module}


def _files(repo: Path, names: Iterable[str]) -> list[Path]:
    """The ``.py`` files of ``names`` (folders searched, files taken) under ``repo``."""
    found: list[Path] = []
    for name in names:
        path = repo / name
        found += sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.is_file() else []
    return found


def bench_only(repo: Path = REPO, package: str = PACKAGE) -> dict[str, list[str]]:
    """Product module -> the modules and files (relative to ``repo``) that use it, for every product module used
    only from beside the product (see the module's docstring). Empty when all is well."""
    modules = module_files(repo / package)
    used_by: dict[str, set[str]] = {name: set() for name in modules}
    seeds: set[str] = set()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = uses(path, name, modules)
        for target in graph[name]:
            used_by[target].add(name)
        if name == f"{package}.cli":
            seeds |= graph[name]
    for users, of_product in ((_files(repo, USERS), True), (_files(repo, TESTS), False)):
        for path in users:
            targets = uses(path, None, modules)
            for target in targets:
                used_by[target].add(path.relative_to(repo).as_posix())
            if of_product:
                seeds |= targets
    product = [name for name in modules if in_product(name, package)]
    seeds |= {name for name in product if not used_by[name]}  # entry points of their own
    reached: set[str] = set()
    work = [name for name in seeds if in_product(name, package)]
    while work:
        name = work.pop()
        if name not in reached:
            reached.add(name)
            work += [target for target in graph[name] if in_product(target, package)]
    return {name: sorted(used_by[name]) for name in sorted(product) if name not in reached}


def main(argv: list[str]) -> int:
    repo = Path(argv[0]) if argv else REPO
    found = bench_only(repo)
    for module, users in found.items():
        print(f"{module}: used only by {', '.join(users)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
