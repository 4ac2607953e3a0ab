"""A transport written only in tests/ carries real P/D requests between two processes, plugged in by configuration
alone: KV-moving stand-in prefill and decode servers (``pd_transfer.sim.kv_standin``: the real connector, a real side
channel) started with ``--transport toy_socket_transport:TOY``, requests sent through the proxy. Every request's KV
moves over the toy's socket (the decode's report names it) and verifies against the prompt; every lease ends as read.
No module of ``pd_transfer`` names the toy: adding it edited none."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from kv_standins import standins, through_proxy, wait_released, words

pytestmark = pytest.mark.timeout(300)

SUPPORT = Path(__file__).resolve().parents[1] / "support"
PACKAGE = Path(__file__).resolve().parents[2] / "pd_transfer"
TOY = "toy_socket_transport:TOY"


def test_the_toy_transport_carries_requests_through_the_proxy_by_configuration_alone(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "UCX_NET_DEVICES": "lo",
        "PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("UCX_TLS", None)
    args = ["--port", "0", "--side-channel-port", "0", "--transport", TOY]
    requests = [
        ("completion", {"model": "m", "prompt": words(700, "toy-a"), "max_tokens": 3}),
        (
            "streamed chat",
            {
                "model": "m",
                "messages": [{"role": "user", "content": words(333, "toy-b")}],
                "max_tokens": 2,
                "stream": True,
            },
        ),
    ]
    with standins(tmp_path, {"prefill": (env, args, None), "decode": (env, args, None)}) as servers:
        results = asyncio.run(through_proxy(servers["prefill"].url, servers["decode"].url, requests))
        for result in results:
            assert result.report["verified"] is True, result
            assert result.report["transport"] == "toy_socket", result.report
            assert result.report["tokens"] == result.prompt_tokens and result.report["bytes"] > 0
        assert wait_released(servers["prefill"])["requests_held"] == 0  # the toy's ReadDone reached the prefill


def test_no_module_of_the_package_names_the_toy() -> None:
    naming = [path for path in PACKAGE.rglob("*.py") if "toy_socket" in path.read_text()]
    assert naming == []
