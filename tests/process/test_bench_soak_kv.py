"""``pd-transfer bench soak --kv-standins`` (the release soak of issue 33) on a small load: its own processes (two
prefill and two decode KV stand-ins, the proxy), requests of every kind with clients that leave early and mid-stream,
every staying request answered with its own KV (verified by the decode), every block free after the round, and the
report written as the command prints it. Its pure parts (the plan, the answer check): tests/unit/test_soak_kv.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="the proxy needs the 'proxy' extra (aiohttp)")

pytestmark = pytest.mark.timeout(300)


def test_a_small_release_soak_answers_every_staying_client_and_frees_every_block(tmp_path: Path) -> None:
    output = tmp_path / "soak_kv.json"
    command = [sys.executable, "-m", "pd_transfer.cli", "bench", "soak", "--kv-standins", "--requests", "150"]
    command += ["--concurrency", "16", "--leave-early", "15", "--leave-mid", "10", "--rounds", "2", "--lease", "6"]
    command += ["--num-blocks", "512", "--log-dir", str(tmp_path / "logs"), "--output", str(output), "--seed", "7"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(output.read_text())
    assert result["failed"] == 0 and result["rounds_with_blocks_held"] == 0, result["rounds"]
    assert [r["round"] for r in result["rounds"]] == [1, 2]
    assert all(r["held_after"] == {} and r["settled_s"] <= 6 + 5 for r in result["rounds"])
    assert sum(result["proxy_releases"].values()) > 0  # clients left, and the proxy released what it could
    assert result["proxy_releases"].get("unreachable", 0) == result["proxy_releases"].get("invalid", 0) == 0
    assert "2 round(s) of 150 requests at concurrency 16: 0 failed" in run.stdout
