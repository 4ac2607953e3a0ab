"""The examples run as a user would run them, so none of them rots."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_library_transfer_example() -> None:
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "library_transfer.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "match" in result.stdout
    assert "prefill: request-1 released" in result.stdout
