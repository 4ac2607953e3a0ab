"""Finding 6 of issue 11: blocks a prefill holds for a decode that will never read them are released by the proxy.

Real processes: a KV-moving stand-in prefill and decode (``pd_transfer.sim.kv_standin``: real KV cache, real NIXL
reads, real ZMQ side channel with a shared secret, real leases), the real proxy in this process in front of them,
and for one case a decode that takes the request and never answers (an aiohttp server in this process). Each case
reads the prefill's held blocks (``GET /control/kv``: its lease ledger, which ``pd_transfer_prefill_blocks_held``
mirrors) with a bounded poll. Before the release path, every one of these blocks stayed held for the whole lease.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the proxy needs the 'proxy' extra (aiohttp)")

from aiohttp import web  # noqa: E402
from kv_standins import HTTP, Server, get_json, standins  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pd_transfer.handshake.errors import AuthenticationError  # noqa: E402
from pd_transfer.handshake.release import Releaser  # noqa: E402
from pd_transfer.proxy.server import Proxy, ProxyConfig  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SECRET = "release-test-secret"
LEASE_S = 9.0  # the hold window the prefill promises decodes is a third of it: 3 s
FREED_WITHIN_S = 1.0
SECRET_ENV = "PD_TEST_RELEASE_SECRET"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    env.pop("UCX_TLS", None)
    args = ["--side-channel-host", "127.0.0.1", "--secret", SECRET, "--lease-seconds", str(LEASE_S)]
    with standins(tmp_path_factory.mktemp("release"), {"prefill": (env, args, None), "decode": (env, args, None)}) as s:
        yield s


def kv_state(prefill: Server) -> dict[str, Any]:
    return get_json(prefill.url + "/control/kv")


def wait_for(predicate: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until ``predicate`` held (polled every 20 ms); fails after ``timeout_s``."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"not within {timeout_s} s")
        time.sleep(0.02)  # polling pace
    return time.monotonic() - started


def proxy_config(decode_url: str, prefill: Server, secret: str | None = SECRET) -> ProxyConfig:
    return ProxyConfig(prefill=[prefill.url], decode=[decode_url], health_interval_s=30.0, handshake_secret=secret)


def releases(proxy: Proxy) -> dict[str, float]:
    """``pd_proxy_releases_total`` by outcome, scraped."""
    text = proxy.metrics.render().decode()
    return {
        sample.labels["outcome"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "pd_proxy_releases_total"
    }


def reruns_of(proxy: Proxy) -> float:
    """Requests the proxy ran once more from the prefill hop (``pd_proxy_retries_total{hop="prefill",
    reason="decode_failed"}``), scraped."""
    text = proxy.metrics.render().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "pd_proxy_retries_total" and sample.labels == {"hop": "prefill", "reason": "decode_failed"}
    )


def released(proxy: Proxy, outcome: str) -> float:
    return releases(proxy).get(outcome, 0.0)


def body(tag: str) -> dict[str, Any]:
    return {"model": "m", "prompt": " ".join(f"{tag}{i}" for i in range(200)), "max_tokens": 2}


def control(server: Server, path: str, payload: dict[str, Any]) -> None:
    request = urllib.request.Request(
        server.url + path, json.dumps(payload).encode(), {"Content-Type": "application/json"}
    )
    with HTTP.open(request, timeout=5.0) as answer:
        assert answer.status == 200


def test_a_decode_refusing_the_request_frees_the_prefill_blocks_at_once(pair: dict[str, Server]) -> None:
    """A decode that answers 503 at once (overloaded) never read: the prefill frees the blocks now."""
    prefill = pair["prefill"]
    before = kv_state(prefill)

    async def scenario() -> float:
        runner, url, _arrived = await fake_decode(stall=False)
        try:
            async with Proxy(proxy_config(url, prefill)) as proxy:
                await proxy.start()
                async with aiohttp.ClientSession() as client:
                    async with client.post(proxy.url + "/v1/completions", json=body("e")) as answer:
                        assert answer.status == 502, await answer.text()
                answered = time.monotonic()
                assert kv_state(prefill)["requests"] == before["requests"] + 1  # it computed the prompt, held it
                await asyncio.to_thread(wait_for, lambda: kv_state(prefill)["blocks_held"] == 0, FREED_WITHIN_S)
                freed = time.monotonic() - answered
                await asyncio.to_thread(wait_for, lambda: sum(releases(proxy).values()) == 1, FREED_WITHIN_S)
                assert {outcome: n for outcome, n in releases(proxy).items() if n} == {"releasing": 1}
                return freed
        finally:
            await runner.cleanup()

    seconds = asyncio.run(scenario())
    print(f"\nfreed {seconds * 1e3:.0f} ms after the 502 (lease {LEASE_S:g} s)")


def test_no_reachable_decode_frees_the_prefill_blocks_at_once(pair: dict[str, Server]) -> None:
    prefill = pair["prefill"]
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: the decode hop is never sent

    async def scenario() -> None:
        async with Proxy(proxy_config(dead, prefill)) as proxy:
            await proxy.start()
            async with aiohttp.ClientSession() as client:
                async with client.post(proxy.url + "/v1/completions", json=body("n")) as answer:
                    assert answer.status in (502, 503), await answer.text()
            await asyncio.to_thread(wait_for, lambda: kv_state(prefill)["blocks_held"] == 0, FREED_WITHIN_S)
            assert released(proxy, "releasing") == 1

    asyncio.run(scenario())


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def fake_decode(stall: bool) -> tuple[web.AppRunner, str, asyncio.Event]:
    """A healthy decode that answers every request 503 at once (``stall`` False), or takes requests and never
    answers them (a queue that never moves); the event is set when a request arrived."""
    arrived = asyncio.Event()

    async def never(request: web.Request) -> web.Response:
        await request.read()
        arrived.set()
        if not stall:
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    runner, url = await decode_backend(never)
    return runner, url, arrived


async def decode_backend(
    completions: Callable[[web.Request], Awaitable[web.Response]], on_cleanup: Callable[[], object] | None = None
) -> tuple[web.AppRunner, str]:
    """A healthy decode backend on a free port whose completions are ``completions`` (a client leaving cancels its
    handler); ``on_cleanup`` runs when the runner is cleaned up."""

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def cleanup(_app: web.Application) -> None:
        if on_cleanup is not None:
            await asyncio.to_thread(on_cleanup)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    app.on_cleanup.append(cleanup)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def test_a_client_leaving_while_the_decode_hop_runs_frees_the_blocks_after_the_hold_window(
    pair: dict[str, Server],
) -> None:
    """The decode got the params and might be reading, so the prefill keeps the blocks to the end of the hold window
    it promised (a third of the lease) and no longer: before the release path, to the end of the lease."""
    prefill = pair["prefill"]

    async def scenario() -> float:
        runner, url, arrived = await fake_decode(stall=True)
        try:
            async with Proxy(proxy_config(url, prefill)) as proxy:
                await proxy.start()
                async with aiohttp.ClientSession() as client:
                    request = asyncio.create_task(client.post(proxy.url + "/v1/completions", json=body("s")))
                    await asyncio.wait_for(arrived.wait(), 30.0)
                    assert kv_state(prefill)["blocks_held"] > 0
                    left = time.monotonic()
                    request.cancel()  # the client leaves: its connection closes
                    await asyncio.gather(request, return_exceptions=True)
                await asyncio.to_thread(wait_for, lambda: released(proxy, "releasing") == 1, FREED_WITHIN_S)
                await asyncio.to_thread(wait_for, lambda: kv_state(prefill)["blocks_held"] == 0, LEASE_S / 3 + 1.0)
                return time.monotonic() - left
        finally:
            await runner.cleanup()

    seconds = asyncio.run(scenario())
    assert seconds < LEASE_S - 1.0
    print(f"\nfreed {seconds:.2f} s after the client left (hold window {LEASE_S / 3:g} s, lease {LEASE_S:g} s)")


def prefill_directly(prefill: Server, tag: str, request_id: str | None = None) -> dict[str, Any]:
    """A prefill-only request straight to the prefill (``request_id``: its ``X-Request-Id``): its blocks are held
    under a lease; its params."""
    payload = {**body(tag), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    request = urllib.request.Request(prefill.url + "/v1/completions", json.dumps(payload).encode(), headers)
    with HTTP.open(request, timeout=30.0) as answer:
        params: dict[str, Any] = json.load(answer)["kv_transfer_params"]
    return params


def test_only_the_secret_releases_and_releasing_is_idempotent(pair: dict[str, Server]) -> None:
    prefill = pair["prefill"]
    params = prefill_directly(prefill, "i")
    where = (params["remote_host"], params["remote_port"], params["remote_engine_id"], params["remote_request_id"])
    assert kv_state(prefill)["blocks_held"] > 0
    for secret in (None, "not-the-secret"):
        releaser = Releaser(secret, timeout_s=2.0)
        try:
            with pytest.raises(AuthenticationError):
                releaser.release(*where, read_possible=False)
        finally:
            releaser.close()
    assert kv_state(prefill)["blocks_held"] > 0  # refused: still held
    releaser = Releaser(SECRET, timeout_s=2.0)
    try:
        assert releaser.release(*where, read_possible=False) == "releasing"
        wait_for(lambda: kv_state(prefill)["blocks_held"] == 0, FREED_WITHIN_S)
        assert releaser.release(*where, read_possible=False) == "not_held"
    finally:
        releaser.close()


def decode_directly(decode: Server, tag: str, params: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The decode of ``tag``'s prompt with a prefill's ``params``, straight to the decode: (status, its answer)."""
    payload = {**body(tag), "kv_transfer_params": params}
    request = urllib.request.Request(
        decode.url + "/v1/completions", json.dumps(payload).encode(), {"Content-Type": "application/json"}
    )
    try:
        with HTTP.open(request, timeout=30.0) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def test_a_release_ends_only_the_lease_it_names_not_one_of_a_similar_id(pair: dict[str, Server]) -> None:
    """Issue 33: a release reaches the lease of the request it was sent for and no other. Four requests are held
    whose ids share their client's id or a prefix of it (two clients sent the same ``X-Request-Id``; the prefill
    adds its own suffix, as vLLM does); releasing one leaves the other three held, and each of them is read by a
    decode, verified, while the released one is refused."""
    prefill, decode = pair["prefill"], pair["decode"]
    held = {
        tag: prefill_directly(prefill, tag, rid)
        for tag, rid in (("s0", "sim-7"), ("s1", "sim-7"), ("s2", "sim-77"), ("s3", "sim"))
    }
    ids = [params["remote_request_id"] for params in held.values()]
    assert len(set(ids)) == 4 and all(i.startswith("sim") for i in ids), ids
    blocks = {tag: len(params["remote_block_ids"][0]) for tag, params in held.items()}
    assert kv_state(prefill)["blocks_held"] == sum(blocks.values())
    released_params = held.pop("s0")
    releaser = Releaser(SECRET, timeout_s=2.0)
    try:
        where = (released_params["remote_host"], released_params["remote_port"], released_params["remote_engine_id"])
        assert releaser.release(*where, released_params["remote_request_id"], read_possible=False) == "releasing"
    finally:
        releaser.close()
    wait_for(lambda: kv_state(prefill)["blocks_held"] == sum(blocks.values()) - blocks["s0"], FREED_WITHIN_S)
    status, answer = decode_directly(decode, "s0", released_params)
    assert status == 500 and "released" in answer["error"]["message"], answer
    for tag, params in held.items():
        status, answer = decode_directly(decode, tag, params)
        assert status == 200 and answer["kv_transfer"]["verified"] is True, (tag, answer)
    wait_for(lambda: kv_state(prefill)["blocks_held"] == 0, FREED_WITHIN_S)


def test_a_lease_a_decode_read_ends_as_read_and_a_release_after_it_changes_nothing(pair: dict[str, Server]) -> None:
    prefill, decode = pair["prefill"], pair["decode"]
    params = prefill_directly(prefill, "r")
    status, answer = decode_directly(decode, "r", params)
    assert status == 200 and answer["kv_transfer"]["verified"] is True
    wait_for(lambda: kv_state(prefill)["blocks_held"] == 0, FREED_WITHIN_S)
    releaser = Releaser(SECRET, timeout_s=2.0)
    try:
        where = (params["remote_host"], params["remote_port"], params["remote_engine_id"])
        assert releaser.release(*where, params["remote_request_id"], read_possible=False) == "not_held"
    finally:
        releaser.close()


async def releasing_relay(prefill: Server, decode: Server, releases_first: int) -> tuple[web.AppRunner, str, list[int]]:
    """A decode backend in front of the real decode stand-in that, for its first ``releases_first`` requests,
    releases the prefill's blocks their params name (as another request's stray release did in issue 33) and waits
    until the prefill freed them before passing them on; the list holds the status the decode answered each
    request. (One request at a time: the prefill then holds nothing.)"""
    statuses: list[int] = []
    releaser = Releaser(SECRET, timeout_s=2.0)

    async def relay(request: web.Request) -> web.Response:
        payload = await request.json()
        params = payload["kv_transfer_params"]
        if len(statuses) < releases_first:
            where = (params["remote_host"], params["remote_port"], params["remote_engine_id"])
            outcome = await asyncio.to_thread(
                releaser.release, *where, params["remote_request_id"], read_possible=False
            )
            assert outcome == "releasing"
            await asyncio.to_thread(wait_for, lambda: kv_state(prefill)["blocks_held"] == 0, FREED_WITHIN_S)
        async with aiohttp.ClientSession() as client:
            async with client.post(decode.url + request.path, json=payload) as answer:
                raw = await answer.read()
                statuses.append(answer.status)
                return web.Response(body=raw, status=answer.status, content_type="application/json")

    runner, url = await decode_backend(relay, releaser.close)
    return runner, url, statuses


def test_a_decode_refused_because_the_blocks_were_released_runs_again_from_the_prefill(
    pair: dict[str, Server],
) -> None:
    """Issue 33: a decode whose pull is refused (the prefill no longer holds the blocks) answers 500; the client is
    still there, so the proxy runs the request once more from its prefill hop instead of answering 502, and the
    client gets the KV of its own prompt, verified."""
    prefill = pair["prefill"]
    before = kv_state(prefill)["requests"]

    async def scenario() -> tuple[int, dict[str, Any], list[int], float]:
        runner, url, statuses = await releasing_relay(prefill, pair["decode"], releases_first=1)
        try:
            async with Proxy(proxy_config(url, prefill)) as proxy:
                await proxy.start()
                async with aiohttp.ClientSession() as client:
                    async with client.post(proxy.url + "/v1/completions", json=body("g")) as answer:
                        status, answer_body = answer.status, await answer.json()
                reruns = reruns_of(proxy)
                return status, answer_body, statuses, reruns
        finally:
            await runner.cleanup()

    status, answer, statuses, reruns = asyncio.run(scenario())
    assert status == 200, answer
    assert answer["kv_transfer"]["verified"] is True
    assert statuses == [500, 200]  # refused (released), then read from the second prefill hop's blocks
    assert reruns == 1
    assert kv_state(prefill)["requests"] == before + 2
    wait_for(lambda: kv_state(prefill)["blocks_held"] == 0, FREED_WITHIN_S)
