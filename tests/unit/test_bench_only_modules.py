"""No product module is used only by the benchmarks, the stand-ins or the tests (tests/support/bench_only_modules.py;
scripts/test runs the same check before the tests). The checker itself on a small repository written here: a module
only a benchmark or a test imports is listed, and so is one only such a module imports; one the product, the command,
an example or a ``python -m`` string uses is not, nor an entry point nothing imports."""

from __future__ import annotations

import textwrap
from pathlib import Path

from bench_only_modules import REPO, bench_only, main


def test_no_product_module_is_used_only_beside_the_product() -> None:
    assert bench_only(REPO) == {}


def _repo(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_modules_used_only_beside_the_product_are_listed(tmp_path: Path) -> None:
    repo = _repo(
        tmp_path,
        {
            "pd_transfer/__init__.py": "",
            "pd_transfer/core.py": "from .helper import help_\n",
            "pd_transfer/helper.py": "",
            "pd_transfer/probe.py": "from pd_transfer import probe_part\n",
            "pd_transfer/probe_part.py": "",
            "pd_transfer/tested.py": "",
            "pd_transfer/spawned.py": "",
            "pd_transfer/by_command.py": "",
            "pd_transfer/by_example.py": "",
            "pd_transfer/main.py": "import pd_transfer.core\nARGS = ['-m', 'pd_transfer.spawned']\n",
            "pd_transfer/cli.py": "from pd_transfer import by_command\n",
            "pd_transfer/bench/__init__.py": "",
            "pd_transfer/bench/run.py": "from pd_transfer.probe import probe\nfrom ..core import x\n",
            "examples/use.py": "import pd_transfer.by_example\n",
            "tests/test_it.py": "from pd_transfer.tested import thing\n",
        },
    )
    assert bench_only(repo) == {
        "pd_transfer.probe": ["pd_transfer.bench.run"],
        "pd_transfer.probe_part": ["pd_transfer.probe"],
        "pd_transfer.tested": ["tests/test_it.py"],
    }
    assert main([str(repo)]) == 1


def test_a_product_used_by_itself_is_clean(tmp_path: Path) -> None:
    repo = _repo(
        tmp_path,
        {
            "pd_transfer/__init__.py": "",
            "pd_transfer/sub/__init__.py": "",
            "pd_transfer/sub/part.py": "",
            "pd_transfer/__main__.py": "from .sub import part\n",
            "pd_transfer/sim/__init__.py": "from pd_transfer.sub import part\n",
        },
    )
    assert bench_only(repo) == {}
    assert main([str(repo)]) == 0
