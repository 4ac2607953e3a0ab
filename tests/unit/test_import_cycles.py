"""No import cycle inside pd_transfer, type-only (``TYPE_CHECKING``) imports included (tests/support/import_cycles.py;
scripts/test runs the same check before the tests). The checker itself on small packages written here: a type-only
cycle is one, relative imports resolve, a package's ``__init__`` re-exporting its modules is none."""

from __future__ import annotations

import functools
import textwrap
from pathlib import Path

from import_cycles import REPO, check, cycles, import_graph, main


@functools.cache
def _pd_transfer_graph() -> dict[str, set[str]]:
    return import_graph(REPO / "pd_transfer")


def test_pd_transfer_has_no_import_cycle() -> None:
    assert cycles(_pd_transfer_graph()) == []


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root / "pkg"


def test_a_type_only_import_closes_a_cycle(tmp_path: Path) -> None:
    package = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from .b import B\n",
            "b.py": """\
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from pkg.a import A
                """,
            "c.py": "import pkg.b\n",
        },
    )
    assert import_graph(package) == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.b"}}
    assert cycles(import_graph(package)) == [["pkg.a", "pkg.b"]]
    assert check(package) == ["import cycle: pkg.a <-> pkg.b"]
    assert main([str(package)]) == 1
    assert main([str(package), "--known", "pkg.b, pkg.a"]) == 0


def test_relative_imports_resolve_and_a_package_init_is_no_cycle(tmp_path: Path) -> None:
    package = _package(
        tmp_path,
        {
            "__init__.py": "",
            "sub/__init__.py": "from .x import X\nfrom . import y\n",
            "sub/x.py": "from ..z import Z\nfrom pkg.sub.y import Y\n",
            "sub/y.py": "def later():\n    from .. import z\n",
            "z.py": "import json\nfrom pkg import sub\n",
        },
    )
    graph = import_graph(package)
    assert graph["pkg.sub"] == {"pkg.sub.x", "pkg.sub.y"}
    assert graph["pkg.sub.x"] == {"pkg.z", "pkg.sub.y"}  # x's own package (pkg.sub) is not drawn
    assert graph["pkg.sub.y"] == {"pkg.z"}  # inside a function too
    assert graph["pkg.z"] == {"pkg.sub"}  # json is not the package's
    assert cycles(graph) == [["pkg.sub", "pkg.sub.x", "pkg.sub.y", "pkg.z"]]  # z imports the package that imports x


def test_a_known_cycle_that_is_gone_is_reported(tmp_path: Path) -> None:
    package = _package(tmp_path, {"__init__.py": "", "a.py": "import pkg.b\n", "b.py": ""})
    assert check(package) == []
    assert check(package, [frozenset({"pkg.a", "pkg.b"})]) == [
        "the known cycle pkg.a, pkg.b is gone: take it off the list of known cycles"
    ]
