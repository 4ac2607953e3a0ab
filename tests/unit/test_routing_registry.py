"""A routing policy added as one module and one registry entry: the toy ``by_length`` (``toy_policy.py`` beside this
test, the module docs/proxy.md shows) registered with one line, then taken by the proxy's flags, given the token ids
it says it needs (a backend's ``/tokenize`` of a text prompt), used on real requests through a proxy over HTTP
stand-ins, and checked and wired by ``pd-transfer up`` through the same registry. No product file names it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="the proxy needs the 'proxy' extra (aiohttp)")

import toy_policy
from test_proxy import Cluster, completion, run

from pd_transfer.cluster import up_args
from pd_transfer.proxy import flow
from pd_transfer.proxy.cli import add_arguments, config_from_args
from pd_transfer.proxy.routing import registry
from pd_transfer.proxy.routing.registry import Needs, Registered
from pd_transfer.proxy.server import Proxy, ProxyConfig
from pd_transfer.sim.http_standin import standin_tokens

pytestmark = pytest.mark.timeout(60)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "proxy.md"


def register(monkeypatch: pytest.MonkeyPatch, needs: Needs) -> None:
    """The one line a new policy adds to the table in pd_transfer/proxy/routing/registry.py (for this test only)."""
    monkeypatch.setitem(registry.POLICIES, "by_length", Registered(toy_policy.build, needs))


def prefill_records(c: Cluster) -> list[int]:
    return [len(server.records) for server in c.prefills]


def test_a_registered_policy_routes_real_requests_with_the_token_ids_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    register(monkeypatch, Needs(token_ids=True))
    parser = argparse.ArgumentParser()
    add_arguments(parser)  # the flags' choices are the registry's names
    args = parser.parse_args(["--prefill", "http://p", "--decode", "http://d", "--prefill-policy", "by_length"])
    assert config_from_args(args, {}).policy_of("prefill") == "by_length"

    async def scenario(c: Cluster) -> None:
        # token ids the client sent, read as they are: 3 ids go to the second prefill of two, 4 to the first
        for ids, chosen in (([1, 2, 3], [0, 1]), ([1, 2, 3, 4], [1, 1])):
            status, _, _ = await c.call(flow.COMPLETIONS, completion(prompt=ids))
            assert status == 200 and prefill_records(c) == chosen
        assert sum(server.tokenize_calls for server in c.prefills + c.decodes) == 0
        # a text prompt: the policy needs token ids, so the proxy asks a backend's /tokenize for them
        text = "one two three four five"
        assert len(standin_tokens({"prompt": text})) % 2 == 1
        status, _, _ = await c.call(flow.COMPLETIONS, completion(prompt=text))
        assert status == 200 and prefill_records(c) == [1, 2]
        assert sum(server.tokenize_calls for server in c.prefills + c.decodes) == 1
        metrics = await c.metrics()
        assert f'backend="{c.prefills[1].url}",reason="length",role="prefill"' in metrics
        assert 'pd_proxy_tokenize_total{result="ok"} 1.0' in metrics

    run(scenario, prefill_policy="by_length", decode_policy="round_robin")


def test_what_a_policy_needs_is_checked_and_wired_by_the_proxy_and_up_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same toy, registered as reading the engines' KV events: the proxy refuses it without event sources, and
    ``up`` turns the events on in the engines of the roles that use it; both by its needs, never by its name."""
    parser = argparse.ArgumentParser()
    up_args.add_arguments(parser)
    with pytest.raises(SystemExit):  # not registered: no such choice
        parser.parse_args(["--routing", "by_length"])
    register(monkeypatch, Needs(token_ids=True, events=True))
    parser = argparse.ArgumentParser()
    up_args.add_arguments(parser)
    args = parser.parse_args(["--prefill-policy", "by_length", "--max-local-prefill", "64"])
    assert up_args.kv_event_roles(args) == ["prefill"]
    assert up_args.validate(args) == [
        registry.problems({"prefill": "by_length", "decode": "round_robin"}, local_prefill=True)[0]
    ]
    assert up_args.validate(parser.parse_args(["--routing", "by_length", "--max-local-prefill", "64"])) == []
    with pytest.raises(ValueError, match="--kv-event-source"):
        Proxy(ProxyConfig(prefill=["http://p"], decode=["http://d"], policy="by_length"))
    with pytest.raises(ValueError, match="unknown decode routing policy 'by_lenght'"):
        Proxy(ProxyConfig(prefill=["http://p"], decode=["http://d"], decode_policy="by_lenght"))


def test_the_docs_show_this_very_module() -> None:
    """docs/proxy.md ("Adding a routing policy") shows the toy module as this test runs it."""
    source = (Path(toy_policy.__file__)).read_text()
    assert source in DOCS.read_text()
