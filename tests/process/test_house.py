"""The import contracts bite: lint-imports (pyproject's tool.importlinter) passes on the package as it is and fails,
naming the contract, on a copy with a forbidden import. No import cycle inside the package:
tests/unit/test_import_cycles.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "pd_transfer"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """Run the project's import contracts (pyproject's tool.importlinter) on the package copy under ``root``."""
    command = [
        str(Path(sys.executable).parent / "lint-imports"),
        "--no-cache",
        "--config",
        str(root / "pyproject.toml"),
    ]
    return subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def package_copy(tmp_path: Path) -> Path:
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(PACKAGE, tmp_path / "pd_transfer", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


@pytest.mark.skipif(
    shutil.which("lint-imports", path=str(Path(sys.executable).parent)) is None, reason="no lint-imports"
)
def test_the_contracts_hold_for_the_package_as_it_is(package_copy: Path) -> None:
    result = lint_imports(package_copy)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "BROKEN" not in result.stdout


@pytest.mark.skipif(
    shutil.which("lint-imports", path=str(Path(sys.executable).parent)) is None, reason="no lint-imports"
)
@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("connector/errors.py", "import vllm", "Only pd_transfer.integrations imports vllm"),
        ("handshake/auth.py", "import nixl", "Only pd_transfer.transfer imports nixl"),
        ("connector/leases.py", "import pd_transfer.sim.verify", "Layers: data flows one way, downward"),
        ("topology/grids.py", "import pd_transfer.connector.cache", "Layers: data flows one way, downward"),
        ("cluster/launch.py", "import aiohttp", "speaks HTTP with aiohttp"),
    ],
)
def test_a_forbidden_import_breaks_the_check(package_copy: Path, module: str, line: str, contract: str) -> None:
    path = package_copy / "pd_transfer" / module
    path.write_text(path.read_text() + f"\n{line}  # deliberately against the house rules\n")
    result = lint_imports(package_copy)
    assert result.returncode != 0
    broken = " ".join(result.stdout.split("Broken contracts", 1)[-1].split())  # names wrap at the terminal width
    assert contract in broken, result.stdout[-3000:]
