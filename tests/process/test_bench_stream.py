"""``pd-transfer bench stream --no-netns``, small: a real prefill process streaming a request to decode ranks of each
verify mode beside the sequential path, on loopback; the JSON's shape, every round's KV equal to the prefill's, each
mode's figures (no timing checks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pd_transfer.transfer.digests import VERIFY_MODES

_RUN_TIMEOUT_S = 300.0


def test_each_verify_mode_streams_beside_the_sequential_path() -> None:
    argv = [sys.executable, "-m", "pd_transfer.cli", "bench", "stream", "--no-netns", "--prompts", "100", "300"]
    argv += ["--rounds", "1", "--compute-us-per-token", "20", "--json"]
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=_RUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert result["path"] == "loopback" and result["verify"] == list(VERIFY_MODES)
    assert [row["tokens"] for row in result["prompts"]] == [100, 300]
    for row in result["prompts"]:
        assert row["verified"] and row["sequential_p50_s"] > 0
        assert set(row["by_verify"]) == set(VERIFY_MODES)
        assert row["by_verify"]["off"]["verify_cost"] == 1.0
        assert row["streamed_p50_s"] == row["by_verify"]["sample"]["streamed_p50_s"]  # the default's figures
