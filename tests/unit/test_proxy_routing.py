"""The routing policies through the proxy, over HTTP stand-ins (tests/unit/test_proxy.py's cluster): cache_aware on
the prefills keeps each system prompt on one prefill while the decodes go round robin; session affinity keeps a
user on one decode; the choices reach /metrics; kv_aware without event sources is refused at start; kv_aware routes
text and chat prompts by the backends' /tokenize; a decode holding most of a prompt prefills the rest itself."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("aiohttp", reason="the proxy needs the 'proxy' extra (aiohttp)")

from test_proxy import MODEL, Cluster, chat, completion, run

from pd_transfer.proxy import flow
from pd_transfer.proxy.prompt import Prompt
from pd_transfer.proxy.server import Proxy, ProxyConfig
from pd_transfer.proxy.tokenize import tokenize_body
from pd_transfer.sim.http_standin import StandIn, standin_tokens

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


def test_kv_aware_routes_text_and_chat_prompts_by_the_engines_tokenization() -> None:
    """A text or chat prompt is tokenized by a backend's /tokenize (the stand-ins' deterministic ids), hashed as the
    engines hash blocks and sent to the prefill the index says holds it; a failing /tokenize falls back, counted."""

    async def scenario(c: Cluster) -> None:
        routing = c.proxy.routing
        assert routing.index is not None and routing.hasher is not None
        holder = c.prefills[1]
        text = completion(prompt=SYSTEMS[0] + " and one question")
        talk = chat(messages=[{"role": "system", "content": SYSTEMS[1]}, {"role": "user", "content": "hi"}])
        for body in (text, talk):
            routing.index.stored(holder.url, routing.hasher.hashes(standin_tokens(body)), "GPU")
        for body, endpoint in ((text, flow.COMPLETIONS), (talk, flow.CHAT)):
            before = len(holder.records)
            status, _, _ = await c.call(endpoint, body)
            assert status == 200 and len(holder.records) == before + 1
        assert sum(s.tokenize_calls for s in c.prefills) == 2
        text_metrics = await c.metrics()
        assert 'pd_proxy_tokenize_total{result="ok"} 2.0' in text_metrics
        assert f'backend="{holder.url}",reason="prefix",role="prefill"' in text_metrics
        assert 'pd_proxy_route_matched_blocks_total{role="prefill",tier="engine"}' in text_metrics
        # a /tokenize that fails leaves the prompt without ids: the least busy prefill, counted
        for server in c.prefills:
            server.tokenize_fail = 500
        status, _, _ = await c.call(flow.COMPLETIONS, text)
        assert status == 200
        text_metrics = await c.metrics()
        assert 'pd_proxy_tokenize_total{result="refused"} 1.0' in text_metrics
        assert 'reason="no_prompt",role="prefill"' in text_metrics

    def sources(prefills: list[StandIn], _decodes: list[StandIn]) -> dict[str, Any]:
        # nobody publishes there (the test fills the index itself); silence long enough never to be probed
        return {"kv_event_sources": [f"{s.url}=tcp://127.0.0.1:9" for s in prefills]}

    run(scenario, prefill_policy="kv_aware", decode_policy="round_robin", kv_silence_s=3600.0, settings_of=sources)


def test_a_decode_holding_most_of_a_prompt_prefills_the_rest_itself() -> None:
    """--max-local-prefill: a prompt a decode holds all but a few tokens of goes to that decode alone (no prefill hop,
    no kv_transfer_params), counted as ``local_prefill``; one no decode holds goes through P/D; a decode out of
    rotation is credited with nothing."""

    async def scenario(c: Cluster) -> None:
        routing = c.proxy.routing
        assert routing.index is not None and routing.hasher is not None
        holder = c.decodes[1]
        # the decode decoded the system prompt before (11 full blocks of 16 stand-in tokens, 4 tokens left over)
        routing.index.stored(holder.url, routing.hasher.hashes(standin_tokens(completion(prompt=SYSTEMS[0]))), "GPU")
        status, _, _ = await c.call(flow.COMPLETIONS, completion(prompt=SYSTEMS[0] + " and one question?"))
        assert status == 200
        assert not any(s.records for s in c.prefills)
        assert [r.kv_transfer_params for r in holder.records] == [None] and not c.decodes[0].records
        # 183 tokens, none held: through a prefill, its params to a decode
        status, _, _ = await c.call(flow.COMPLETIONS, completion(prompt=SYSTEMS[1] + " and one question?"))
        assert status == 200
        assert sum(len(s.records) for s in c.prefills) == 1
        others = [r for s in c.decodes for r in s.records if r is not holder.records[0]]
        assert len(others) == 1 and others[0].kv_transfer_params is not None
        text = await c.metrics()
        assert 'pd_proxy_routes_total{path="local_prefill"} 1.0' in text
        assert 'pd_proxy_routes_total{path="disaggregated"} 1.0' in text
        assert f'backend="{holder.url}",reason="local_prefill",role="decode"' in text
        # the holder goes out of rotation: what it held is forgotten, the next turn goes through P/D
        c.proxy.decode.set_health(c.backend(holder), False, "test")
        status, _, _ = await c.call(flow.COMPLETIONS, completion(prompt=SYSTEMS[0] + " and one more question?"))
        assert status == 200
        assert sum(len(s.records) for s in c.prefills) == 2 and len(holder.records) == 1

    def sources(prefills: list[StandIn], decodes: list[StandIn]) -> dict[str, Any]:
        return {
            "kv_event_sources": [f"{s.url}=tcp://127.0.0.1:9" for s in prefills + decodes],
            "max_local_prefill_tokens": 40,
        }

    run(scenario, policy="kv_aware", kv_silence_s=3600.0, settings_of=sources)


def test_local_prefill_without_the_decodes_events_is_refused() -> None:
    sources = ["http://p=tcp://127.0.0.1:9"]
    for decode_policy in ("round_robin", "cache_aware"):
        with pytest.raises(ValueError, match="--max-local-prefill needs a decode policy that reads the engines' KV"):
            Proxy(
                ProxyConfig(
                    prefill=["http://p"],
                    decode=["http://d"],
                    prefill_policy="kv_aware",
                    decode_policy=decode_policy,
                    kv_event_sources=sources,
                    max_local_prefill_tokens=64,
                )
            )
    with pytest.raises(ValueError, match="must be >= 0"):
        Proxy(ProxyConfig(prefill=["http://p"], decode=["http://d"], max_local_prefill_tokens=-1))
    with pytest.raises(ValueError, match="--local-prefill-max-busy must be >= 0 requests"):
        Proxy(ProxyConfig(prefill=["http://p"], decode=["http://d"], local_prefill_max_busy=-1))


def test_a_tokenize_past_its_timeout_falls_back_and_is_counted() -> None:
    """A backend whose /tokenize does not answer within ``tokenize_timeout_s``: the request is routed without ids (the
    least busy prefill) and answered, and the timeout is counted."""

    async def scenario(c: Cluster) -> None:
        held = asyncio.Event()
        for server in c.prefills:
            server.tokenize_held = held
        try:
            status, _, _ = await c.call(flow.COMPLETIONS, completion(prompt=SYSTEMS[0] + " and one question"))
            assert status == 200
            assert sum(s.tokenize_calls for s in c.prefills) == 1
            text_metrics = await c.metrics()
            assert 'pd_proxy_tokenize_total{result="timeout"} 1.0' in text_metrics
            assert 'reason="no_prompt",role="prefill"' in text_metrics
        finally:
            held.set()

    def sources(prefills: list[StandIn], _decodes: list[StandIn]) -> dict[str, Any]:
        return {"kv_event_sources": [f"{s.url}=tcp://127.0.0.1:9" for s in prefills], "tokenize_timeout_s": 0.2}

    run(scenario, prefill_policy="kv_aware", decode_policy="round_robin", kv_silence_s=3600.0, settings_of=sources)


def test_tokenize_body_carries_what_changes_the_rendered_prompt() -> None:
    talk = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False},
        "tools": [],
        "max_tokens": 3,
        "stream": True,
    }
    assert tokenize_body(Prompt.read(flow.CHAT, talk)) == {
        "model": MODEL,
        "messages": talk["messages"],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False},
        "tools": [],
    }
    one_text = {"model": MODEL, "prompt": ["one text"], "add_special_tokens": False}
    assert tokenize_body(Prompt.read(flow.COMPLETIONS, one_text)) == {
        "model": MODEL,
        "prompt": "one text",
        "add_special_tokens": False,
    }
    for nothing in ({"prompt": ["a", "b"]}, {"prompt": [1, 2]}, {"prompt": [[1, 2]]}):  # a batch, token ids
        assert tokenize_body(Prompt.read(flow.COMPLETIONS, nothing)) is None
    for endpoint, unreadable in ((flow.COMPLETIONS, {"prompt": ""}), (flow.CHAT, {"messages": []})):
        with pytest.raises(flow.BadRequest):  # refused with a 400 before anything is tokenized
            Prompt.read(endpoint, unreadable)
