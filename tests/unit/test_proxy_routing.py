"""The routing policies through the proxy, over HTTP stand-ins (tests/unit/test_proxy.py's cluster): cache_aware on
the prefills keeps each system prompt on one prefill while the decodes go round robin; session affinity keeps a
user on one decode; the choices reach /metrics; kv_aware without event sources is refused at start."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("aiohttp", reason="the proxy needs the 'proxy' extra (aiohttp)")

from test_proxy import MODEL, Cluster, run

from pd_transfer.proxy import flow
from pd_transfer.proxy.server import Proxy, ProxyConfig

pytestmark = pytest.mark.timeout(60)

SYSTEMS = ["You answer questions about ships. " * 30, "You translate French into English. " * 30]


def request(system: str, user: str, turn: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": f"{system}\nUser {user}, turn {turn}: hello?", "max_tokens": 2, "user": user}


def prefill_of(c: Cluster, system: str) -> set[str]:
    return {s.url for s in c.prefills for r in s.records if str(r.body.get("prompt", "")).startswith(system)}


def test_cache_aware_prefills_keep_each_system_prompt_and_sessions_keep_their_decode() -> None:
    async def scenario(c: Cluster) -> None:
        for turn in range(3):
            for user in ("ann", "bob", "cy"):
                for system in SYSTEMS:
                    status, _, _ = await c.call(
                        flow.COMPLETIONS, request(system, f"{user}{SYSTEMS.index(system)}", turn)
                    )
                    assert status == 200
        homes = [prefill_of(c, system) for system in SYSTEMS]
        assert all(len(home) == 1 for home in homes) and homes[0] != homes[1]
        # each user went to one decode all along
        for user in ("ann", "bob", "cy"):
            for i in range(len(SYSTEMS)):
                name = f"{user}{i}"
                decodes = {s.url for s in c.decodes for r in s.records if r.body.get("user") == name}
                assert len(decodes) == 1
        text = await c.metrics()
        assert 'pd_proxy_route_choices_total{backend="' in text and 'reason="prefix",role="prefill"' in text
        assert 'reason="session",role="decode"' in text

    run(scenario, prefill_policy="cache_aware", decode_policy="round_robin", session_ttl_s=300.0)


def test_kv_aware_without_event_sources_is_refused_with_what_to_give() -> None:
    with pytest.raises(ValueError, match="--kv-event-source"):
        Proxy(ProxyConfig(prefill=["http://p"], decode=["http://d"], policy="kv_aware"))
    with pytest.raises(ValueError, match="no prefill or decode backend"):
        Proxy(
            ProxyConfig(
                prefill=["http://p"], decode=["http://d"], policy="kv_aware", kv_event_sources=["http://x=tcp://x:1"]
            )
        )
