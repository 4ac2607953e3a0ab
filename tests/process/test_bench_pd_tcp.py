"""``pd-transfer bench pd-tcp``, small: two KV stand-in processes (the connector's real halves, real NIXL reads over
UCX's tcp transport, the real side channel), on loopback and across a veth where network namespaces can be made.
Checks the breakdown's shape and what each mode must (and must not) wait for; no timing thresholds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pd_transfer.bench.transfer.pd_tcp import PARTS, bytes_per_token
from pd_transfer.bench.transfer.ucx_transports import ucx_transports

pytestmark = pytest.mark.timeout(400)

_RUN_TIMEOUT_S = 360.0


@pytest.fixture(scope="module")
def result() -> dict:
    env = {**os.environ, "UCX_TLS": "tcp,self"}
    if "tcp" not in ucx_transports(env):
        pytest.skip("UCX has no tcp transport here")
    argv = [sys.executable, "-m", "pd_transfer.cli", "bench", "pd-tcp", "--json", "--sizes-mib", "1", "--rounds", "2"]
    argv += ["--wire-gbit", "10"]  # the veth as a 10 Gbit/s wire
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=_RUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout))


@pytest.mark.parametrize("path", ["loopback", "veth"])
def test_every_request_is_broken_down_and_verified(result: dict, path: str) -> None:
    section = result[path]
    if "skipped" in section:
        pytest.skip(f"no veth here: {section['skipped']}")
    assert result["ucx_env"]["UCX_TLS"] == "tcp,self"
    for mode in ("hold_window", "confirm"):
        row = section[f"{mode}.1MiB"]
        assert row["bytes"] == 2**20 == 2**20 // bytes_per_token() * bytes_per_token()
        assert row["rounds"] == 2
        for key in PARTS:
            assert row[key] >= 0 and row["first_request"][key] >= 0, (mode, key)
        assert row["read_ms"] > 0 and row["read_gbps"] > 0
        assert sum(row["first_request"][key] for key in PARTS) <= row["first_request"]["ms"]
        # the first request reaches the engine (handshake, NIXL peers, warm-up): the warm ones find it cached
        assert row["first_request"]["connect_ms"] > row["connect_ms"], (mode, row)
    # inside the prefill's hold window no read waits for a confirmation; without a window every read does
    assert section["hold_window.1MiB"]["in_window"] is True
    assert section["hold_window.1MiB"]["confirm_ms"] == 0.0
    assert section["confirm.1MiB"]["in_window"] is False
    assert section["confirm.1MiB"]["confirm_ms"] > 0
    assert section["tcp_stream"]["bytes_ok"] is True and section["tcp_stream"]["gbps"] > 0
    assert section["confirm.1MiB"]["read_ratio_vs_tcp_stream"] > 0
    if path == "veth":
        assert section["decode_rx_bytes"] >= 2 * 3 * 2**20  # every request's KV crossed the veth
        assert section["wire_gbit"] == 10.0
