"""The P/D path across hosts: the proxy on this host, KV-moving stand-in prefill and decode servers
(``pd_transfer.sim.kv_standin``: real KV caches, real NIXL reads, real ZMQ side channel) in two network
namespaces, each with its own address on a bridge, as separate machines on one network would be.

UCX is forced onto TCP over each namespace's veth (``UCX_TLS=tcp``, ``UCX_NET_DEVICES=<veth>``) and the decode
reads with NIXL (``--transport nixl``): the namespaces share the PID namespace, so CMA (UCX's, or the decode's own
reads in place) would otherwise read the prefill's memory straight across, and the test checks the veth byte
counters to prove the KV crossed the wire. Skipped where network namespaces cannot be created (not root,
no ``ip``, no permission). A loopback variant (no namespaces) runs anywhere.

Every wait is bounded; processes are killed and namespaces, veths and the bridge deleted in ``finally`` blocks (the
children also die with the test process: ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the proxy needs the 'proxy' extra (aiohttp)")

from kv_standins import (  # noqa: E402
    HTTP,
    REQUEST_TIMEOUT_S,
    Result,
    standins,
    through_proxy,
    wait_released,
    words,
)
from namespaces import Network, network_or_skip  # noqa: E402

pytestmark = pytest.mark.timeout(300)

BLOCK_BYTES = 4 * 2 * 4 * 16 * 64 * 2  # kv_standin's default model: layers x K,V x heads x tokens x dim x bf16
BLOCK_SIZE = 16
HTTP_PORT = {"prefill": 8100, "decode": 8200}  # inside the namespaces: each has its own ports
SIDE_CHANNEL_PORT = 5600


def kv_bytes(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE) * BLOCK_BYTES


def request_mix(tag: str) -> list[tuple[str, dict[str, Any]]]:
    """A cold and a warm non-streamed completion (8 MiB of KV each), a streamed one, a streamed chat."""
    return [
        ("completion, first (handshake)", {"model": "m", "prompt": words(2048, tag + "a"), "max_tokens": 4}),
        ("completion", {"model": "m", "prompt": words(2048, tag + "b"), "max_tokens": 4}),
        ("streamed completion", {"model": "m", "prompt": words(1000, tag + "c"), "max_tokens": 5, "stream": True}),
        (
            "streamed chat",
            {
                "model": "m",
                "messages": [{"role": "user", "content": words(333, tag + "d")}],
                "max_tokens": 3,
                "stream": True,
            },
        ),
    ]


def check_results(results: list[Result], remote: str | None) -> None:
    for result in results:
        report = result.report
        assert report["verified"] is True, result
        assert report["tokens"] == result.prompt_tokens
        assert report["bytes"] == kv_bytes(result.prompt_tokens) > 0, result
        if remote is not None:
            assert report["remote"] == remote, report


def summary(results: list[Result]) -> str:
    lines = []
    for r in results:
        mib_s = r.report["bytes"] / 2**20 / (r.report["read_ms"] / 1e3)
        lines.append(
            f"  {r.kind}: {r.report['bytes'] / 2**20:.2f} MiB, {r.report['ms']:.1f} ms (pull {r.report['pull_ms']:.1f},"
            f" reads {r.report['read_ms']:.1f} ms = {mib_s:.0f} MiB/s)"
        )
    return "\n".join(lines)


# ---- loopback ----


def test_kv_standins_through_the_proxy_on_loopback(tmp_path: Path) -> None:
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    env.pop("UCX_TLS", None)
    args = ["--host", "127.0.0.1", "--port", "0", "--side-channel-host", "127.0.0.1", "--side-channel-port", "0"]
    with standins(tmp_path, {"prefill": (env, args, None), "decode": (env, args, None)}) as servers:
        prefill, decode = servers["prefill"], servers["decode"]
        results = asyncio.run(through_proxy(prefill.url, decode.url, request_mix("L")))
        check_results(results, remote=None)
        assert wait_released(prefill)["requests_held"] == 0

        # the check can fail: a decode given the prefill's params for another prompt of the same length refuses it
        prompt = words(100, "x")
        body = {"model": "m", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        request = urllib.request.Request(
            prefill.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with HTTP.open(request, timeout=REQUEST_TIMEOUT_S) as answer:
            params = json.load(answer)["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_block_size"] == BLOCK_SIZE
        body = {"model": "m", "prompt": words(100, "y"), "max_tokens": 2, "kv_transfer_params": params}
        request = urllib.request.Request(
            decode.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            HTTP.open(request, timeout=REQUEST_TIMEOUT_S)
        assert refused.value.code == 500
        assert "verification failed" in refused.value.read().decode()
        assert wait_released(prefill)["requests_held"] == 0  # read, then released, even though it was the wrong KV
    print("\nloopback (the decode reads the prefill in place, host_cma):\n" + summary(results))


# ---- two network namespaces ----


@pytest.fixture
def network() -> Iterator[Network]:
    with network_or_skip() as net:
        yield net


@pytest.mark.parametrize("transport", ["nixl", "tcp"])
def test_kv_moves_between_network_namespaces_through_the_proxy(
    network: Network, tmp_path: Path, transport: str
) -> None:
    """By NIXL (UCX over TCP: the prefill pushes), and by the ``tcp`` transport (its own connections, offered and
    opened by both sides' setting)."""
    specs: dict[str, tuple[dict[str, str], list[str], str | None]] = {}
    for role, side in (("prefill", "p"), ("decode", "d")):
        env = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": network.veth(side)}
        address = network.address(side)
        args = ["--host", address, "--port", str(HTTP_PORT[role])]
        args += ["--side-channel-host", address, "--side-channel-port", str(SIDE_CHANNEL_PORT)]
        if role == "decode" or transport == "tcp":  # as between hosts: no reads in place
            args += ["--transport", transport]
        specs[role] = (env, args, network.ns(side))
    with standins(tmp_path, specs) as servers:
        prefill, decode = servers["prefill"], servers["decode"]
        assert prefill.url == f"http://{network.address('p')}:{HTTP_PORT['prefill']}"
        before = {side: network.counters(side) for side in ("p", "d")}
        results = asyncio.run(through_proxy(prefill.url, decode.url, request_mix("N")))
        after = {side: network.counters(side) for side in ("p", "d")}
        check_results(results, remote=f"{network.address('p')}:{SIDE_CHANNEL_PORT}")
        assert {result.report["transport"] for result in results} == {transport}, [r.report for r in results]
        state = wait_released(prefill)
        assert state["requests_held"] == 0 and state["released"] == len(results), state

    moved = sum(r.report["bytes"] for r in results)
    into_decode = after["d"]["rx"] - before["d"]["rx"]
    out_of_prefill = after["p"]["tx"] - before["p"]["tx"]
    # the decode's veth saw the KV arrive, the prefill's saw it leave (plus HTTP, ZMQ and TCP overhead)
    assert into_decode >= moved, (into_decode, moved)
    assert out_of_prefill >= moved, (out_of_prefill, moved)
    print(
        f"\nacross namespaces ({network.address('p')} -> {network.address('d')}, {transport} over veth):\n"
        + summary(results)
        + f"\n  KV moved {moved} B; veth bytes into the decode {into_decode} B, out of the prefill {out_of_prefill} B"
        f" ({into_decode / moved:.3f} x the KV)"
    )
