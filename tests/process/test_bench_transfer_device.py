"""``pd-transfer bench transfer --device cpu --quick --json``: the one-node device section's logic on host memory (a
real prefill process offering shareable memory, our pull through the host IPC path, raw NIXL on the same descriptors,
the in-process copy and a raw IPC copy beside it), as ``--device cuda`` runs it on a GPU; no timing checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


def test_the_device_section_runs_its_yardsticks_beside_our_verified_pulls() -> None:
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
    argv = [sys.executable, "-m", "pd_transfer.cli", "bench", "transfer", "--device", "cpu", "--quick", "--json"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    section = json.loads(done.stdout.strip().splitlines()[-1])["gpu"]
    assert (section["device"], section["device_name"], section["transport"]) == ("cpu", "host", "host_ipc")
    assert section["device_copy_gbps"] > 0 and section["one_block_p50_us"] > 0 and section["one_block_pull_p50_us"] > 0
    for case in ("contiguous", "scattered"):
        measured = section[case]
        assert measured["verified"] is True and measured["transport"] == "host_ipc", case
        for key in ("gbps", "device_copy_gbps", "ratio_vs_device_copy", "raw_nixl_gbps", "raw_ipc_gbps"):
            assert measured[key] > 0, (case, key)
        assert measured["gather_limit_bytes"] == measured["bytes"]  # the same rows, one index_select
        assert measured["gather_limit_gbps"] > 0 and measured["ratio_vs_gather_limit"] > 0
