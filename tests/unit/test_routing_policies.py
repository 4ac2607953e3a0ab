"""The routing policies' choices and the prefix tree's bounds, on stand-in backends (no HTTP, no clock)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from pd_transfer.proxy import flow
from pd_transfer.proxy.kv.block_hash import BlockHasher
from pd_transfer.proxy.kv.index import KvIndex
from pd_transfer.proxy.prompt import Prompt
from pd_transfer.proxy.routing.affinity import Affinity, choose
from pd_transfer.proxy.routing.cache_aware import CacheAware
from pd_transfer.proxy.routing.kv_aware import KvAware
from pd_transfer.proxy.routing.local_prefill import LocalPrefill
from pd_transfer.proxy.routing.policy import Balance
from pd_transfer.proxy.routing.power_of_two import PowerOfTwo
from pd_transfer.proxy.routing.prefix_tree import PrefixTree, text_chunks, token_chunks
from pd_transfer.proxy.routing.request import RouteRequest
from pd_transfer.proxy.routing.round_robin import RoundRobin


@dataclass(eq=False)
class Node:
    url: str
    in_flight: int = 0


SYSTEM = "You are a careful assistant. " * 40  # 1,160 characters: 19 chunks


def completion(prompt: object, user: str | None = None) -> RouteRequest:
    body: dict[str, object] = {"model": "m", "prompt": prompt}
    if user is not None:
        body["user"] = user
    return RouteRequest(Prompt.read(flow.COMPLETIONS, body))


def test_prefix_tree_matches_the_longest_shared_prefix_per_worker() -> None:
    tree = PrefixTree(1000)
    a, b = text_chunks(SYSTEM + "question one"), text_chunks(SYSTEM + "question two")
    tree.insert(a, 0)
    assert tree.match(b, [0, 1]) == {0: len(a) - 1, 1: 0}  # all but the last (differing) chunk
    assert tree.match(a, [0, 1]) == {0: len(a), 1: 0}
    tree.insert(b, 1)
    assert tree.match(a, [0, 1]) == {0: len(a), 1: len(a) - 1}
    assert tree.held(0) == len(a) and tree.held(1) == len(b)
    tree.remove_worker(1)
    assert tree.match(b, [0, 1]) == {0: len(a) - 1, 1: 0} and tree.held(1) == 0


def test_prefix_tree_stays_within_its_bound_evicting_the_least_recent() -> None:
    tree = PrefixTree(50)
    old = text_chunks("old prompt " * 100)  # 18 chunks
    tree.insert(old, 0)
    for i in range(20):
        tree.insert(text_chunks(f"prompt {i} " * 40), 1)
        tree.match(old[:1], [0])  # the old prompt's first chunk stays recent
        assert len(tree) <= 50
    assert tree.evicted > 0
    assert tree.match(old, [0])[0] == 1  # its root chunk kept, the rest evicted
    assert tree.held(0) + tree.held(1) == sum(bin(m).count("1") for m in tree._nodes.values())  # noqa: SLF001


def test_token_and_text_chunks_are_chained_prefix_names() -> None:
    tokens = list(range(100))
    assert token_chunks(tokens)[:3] == token_chunks(tokens[:48])
    assert token_chunks([5, *tokens[1:]])[0] != token_chunks(tokens)[0]
    assert text_chunks("x" * 130) == text_chunks("x" * 128)[:2] + text_chunks("x" * 130)[2:]


def test_cache_aware_follows_the_prefix_then_balances_a_busy_pool() -> None:
    nodes = [Node("a"), Node("b"), Node("c")]
    policy = CacheAware(nodes, PrefixTree(10_000), threshold=0.5, balance=Balance(abs=4, rel=1.5))
    first = choose(policy, None, nodes, completion(SYSTEM + "first user"))
    assert first.reason == "low_match"  # nothing matched: the least loaded cache
    # the same system prompt follows the first request
    for i in range(5):
        again = choose(policy, None, nodes, completion(SYSTEM + f"user {i}"))
        assert (again.backend, again.reason) == (first.backend, "prefix")
        assert again.matched["routed"] >= again.of - 1
    # a different prompt goes to a backend holding less of the tree
    other = choose(policy, None, nodes, completion("A different system prompt. " * 40))
    assert other.backend is not first.backend and other.reason == "low_match"
    # out of balance: the busy backend is passed over although it holds the prefix
    first.backend.in_flight = 10
    busy = choose(policy, None, nodes, completion(SYSTEM + "late user"))
    assert busy.reason == "balance" and busy.backend.in_flight == 0


def test_cache_aware_forgets_a_backend_that_left() -> None:
    nodes = [Node("a"), Node("b")]
    policy = CacheAware(nodes, PrefixTree(1000))
    first = choose(policy, None, nodes, completion(SYSTEM)).backend
    policy.forget(first)
    assert policy.tree.held(nodes.index(first)) == 0


def test_power_of_two_takes_the_less_busy_of_two() -> None:
    nodes = [Node("a", 5), Node("b", 0), Node("c", 5)]
    policy = PowerOfTwo(random.Random(7))
    picks = [choose(policy, None, nodes, None).backend.url for _ in range(300)]
    # b is taken whenever it is one of the two drawn (2 pairs of 3); the other pair goes to a or c
    assert 150 < picks.count("b") < 250 and set(picks) == {"a", "b", "c"}
    assert choose(PowerOfTwo(), None, nodes[:1], None).backend.url == "a"


def test_session_affinity_sticks_until_idle_past_its_ttl_or_the_backend_leaves() -> None:
    now = [0.0]
    nodes = [Node("a"), Node("b")]
    affinity = Affinity(ttl_s=60, max_sessions=2, clock=lambda: now[0])
    policy = RoundRobin()
    first = choose(policy, affinity, nodes, completion("hi", user="alice")).backend
    for _ in range(3):
        now[0] += 59
        assert choose(policy, affinity, nodes, completion("hi", user="alice")).backend is first
    now[0] += 61  # idle past the TTL: the policy decides again (round robin moves on)
    assert choose(policy, affinity, nodes, completion("hi", user="alice")).reason == "rotation"
    # the header names the session before the body's user
    header = RouteRequest(Prompt.read(flow.COMPLETIONS, {"model": "m", "prompt": "p", "user": "x"}), "s1")
    sticky = choose(policy, affinity, nodes, header).backend
    assert choose(policy, affinity, nodes, RouteRequest(completion("q").prompt, "s1")).backend is sticky
    # a backend out of rotation: its sessions go elsewhere
    rest = [n for n in nodes if n is not sticky]
    assert choose(policy, affinity, rest, RouteRequest(completion("q").prompt, "s1")).backend is rest[0]
    for i in range(5):
        choose(policy, affinity, nodes, completion("p", user=f"u{i}"))
    assert len(affinity) == 2  # bounded


def test_kv_aware_scores_by_tier_and_credits_the_shared_directory_to_every_engine_mounting_it() -> None:
    hasher = BlockHasher("sha256", None, block_size=4)
    index = KvIndex(max_blocks=1000, routed_ttl_s=0)  # routed blocks: the test below
    nodes = [Node("http://p0"), Node("http://p1"), Node("http://p2")]
    policy = KvAware(index, hasher, Balance(abs=8, rel=1.5))
    tokens = list(range(40))  # 10 blocks
    hashes = hasher.hashes(tokens)
    index.stored("http://p0", hashes[:5], "GPU")  # 5 x 1.0
    index.stored("http://p1", hashes[:8], "CPU")  # 8 x 0.8
    choice = choose(policy, None, nodes, completion(tokens))
    assert (choice.backend.url, choice.reason, choice.matched, choice.of) == ("http://p1", "prefix", {"host": 8}, 10)
    # the whole prompt in the shared directory (reported by p2): every engine that mounts it (has stored a block
    # there) reaches it at 0.6 past its own blocks; p1 never did (no offload tier there): its own blocks only
    index.stored("http://p2", hashes, "DISK")
    index.stored("http://p0", hasher.hashes(list(range(500, 504))), "DISK")
    matches = index.match(hasher.keys(tokens), [n.url for n in nodes])
    assert matches["http://p0"].by_tier == {"engine": 5, "shared": 5}
    assert matches["http://p0"].score == pytest.approx(5 + 5 * 0.6)
    assert matches["http://p1"].by_tier == {"host": 8}
    assert matches["http://p2"].score == pytest.approx(10 * 0.6)
    assert choose(policy, None, nodes, completion(tokens)).backend.url == "http://p0"
    # only in the directory: its mounts, never p1
    index.cleared("http://p0")
    index.removed("http://p1", hashes, "CPU")
    matches = index.match(hasher.keys(tokens), [n.url for n in nodes])
    assert {url: m.by_tier for url, m in matches.items()} == {
        "http://p0": {"shared": 10},
        "http://p1": {},
        "http://p2": {"shared": 10},
    }
    index.drop("http://p0")  # a dropped engine no longer mounts it
    assert index.match(hasher.keys(tokens), ["http://p0"])["http://p0"].blocks == 0
    index.stored("http://p0", hashes[:5], "GPU")
    # a text prompt cannot be hashed without a tokenizer: the least busy
    nodes[0].in_flight = 1
    assert choose(policy, None, nodes, completion("text")).reason == "no_prompt"
    # no match at all: the least busy
    miss = choose(policy, None, nodes, completion(list(range(100, 140))))
    assert miss.reason == "low_match" and miss.backend.in_flight == 0
    # out of balance: the idlest, match or not
    nodes[0].in_flight = 20
    assert choose(policy, None, nodes, completion(tokens)).reason == "balance"


def test_kv_aware_credits_a_routed_prefix_to_its_backend_until_the_events_catch_up() -> None:
    hasher = BlockHasher("sha256", None, block_size=4)
    now = [0.0]
    index = KvIndex(max_blocks=1000, routed_ttl_s=5.0, clock=lambda: now[0])
    nodes = [Node("http://p0"), Node("http://p1")]
    policy = KvAware(index, hasher, Balance(abs=8, rel=1.5))
    system = list(range(32))  # 8 blocks no engine reported
    first = choose(policy, None, nodes, completion([*system, 900, 901, 902, 903]))
    assert first.reason == "low_match"
    first.backend.in_flight = 1  # still prefilling: the other backend is idler
    # the same system prompt, another user, before any event: where the first went, by its routed blocks
    second = choose(policy, None, nodes, completion([*system, 700, 701, 702, 703]))
    assert (second.backend, second.reason, second.matched) == (first.backend, "prefix", {"routed": 8})
    # the engine's events report the blocks: the engine's own tier from then on (the routed entries go)
    index.stored(first.backend.url, hasher.hashes(system), "GPU")
    assert index.match(hasher.keys(system), [first.backend.url])[first.backend.url].by_tier == {"engine": 8}
    assert index.routed_blocks() == 2  # the two users' own last blocks, not reported yet
    # evicted right after: nothing credited, not even as routed
    choose(policy, None, nodes, completion(system))
    index.removed(first.backend.url, hasher.hashes(system), "GPU")
    assert index.match(hasher.keys(system), [first.backend.url])[first.backend.url].blocks == 0
    # never reported (the request failed, or was cut short): forgotten after the time to live
    now[0] = 5.1
    assert choose(policy, None, nodes, completion(system)).reason == "low_match"
    assert index.routed_blocks() == 8  # this last choice's own blocks; the expired ones went
    # bounded: at most max_blocks routed blocks, the oldest go first
    index.routed("http://p1", list(range(2000)))
    assert index.routed_blocks() == 1000
    assert index.match([1999], ["http://p1"])["http://p1"].by_tier == {"routed": 1}
    assert index.match([0], ["http://p1"])["http://p1"].blocks == 0
    index.drop("http://p1")
    assert index.routed_blocks() == 0
    # a request's blocks routed to a prefill, then to the decode that receives them: both credited, apart
    index.routed("http://p0", [7, 8])
    index.routed("http://d0", [7, 8])
    matches = index.match([7, 8], ["http://p0", "http://d0"])
    assert matches["http://p0"].by_tier == matches["http://d0"].by_tier == {"routed": 2}
    index.stored("http://d0", [7], "GPU")  # the decode's report ends the decode's routed entry only
    assert index.match([7], ["http://p0"])["http://p0"].by_tier == {"routed": 1}
    index.drop("http://p0")
    assert index.match([7, 8], ["http://d0"])["http://d0"].by_tier == {"engine": 1, "routed": 1}
    with pytest.raises(ValueError, match="time to live"):
        KvIndex(routed_ttl_s=float("nan"))


def test_local_prefill_takes_the_decode_holding_all_but_at_most_its_bound() -> None:
    hasher = BlockHasher("sha256", None, block_size=4)
    index = KvIndex(max_blocks=1000, routed_ttl_s=5.0, clock=lambda: 0.0)
    decodes = [Node("http://d0"), Node("http://d1")]
    local = LocalPrefill(index, hasher, max_tokens=6, followed={"http://d0", "http://d1", "http://p0"})
    history = list(range(40))  # 10 blocks
    index.stored("http://d1", hasher.hashes(history[:32]), "GPU")  # 8 blocks
    index.stored("http://d0", hasher.hashes(history[:16]), "CPU")  # 4, in its host tier
    # 38 tokens, 32 held on d1: 6 to compute, within the bound
    chosen = local.decode_for(decodes, completion(history[:38]))
    assert chosen is not None and (chosen.backend.url, chosen.reason) == ("http://d1", "local_prefill")
    assert (chosen.matched, chosen.of) == ({"engine": 8}, 9)
    # ... and credited with the prompt's blocks it will hold (the 9th, routed)
    assert index.match(hasher.keys(history[:36]), ["http://d1"])["http://d1"].by_tier == {"engine": 8, "routed": 1}
    # a prefill holding more of a prompt (d1 holds 9 blocks of these 10): the prefill hop computes less
    index.stored("http://p0", hasher.hashes(history), "GPU")
    prefill = [Node("http://p0")]
    assert local.decode_for(decodes, completion([*history, 1, 2]), prefills=prefill) is None
    assert local.decode_for(decodes, completion([*history[:36], 1, 2]), prefills=prefill) is not None  # a tie
    # a prefill whose events the index does not follow is not weighed
    unfollowed = LocalPrefill(index, hasher, max_tokens=6, followed={"http://d0", "http://d1"})
    assert unfollowed.decode_for(decodes, completion([*history, 1, 2]), prefills=prefill) is not None
    # one token more than the bound: through P/D
    assert local.decode_for(decodes, completion([*history[:32], 100, 101, 102, 103, 104, 105, 106])) is None
    # a short prompt nobody holds costs as little: the least busy decode
    decodes[1].in_flight = 2
    short = local.decode_for(decodes, completion([500, 501, 502]))
    assert short is not None and short.backend.url == "http://d0" and short.matched == {}
    # a prompt without ids (text, no tokenizer), or no healthy decode: nothing to go on
    assert local.decode_for(decodes, completion("a text prompt")) is None
    assert local.decode_for([], completion(history[:38])) is None
    with pytest.raises(ValueError, match="at least 1 token"):
        LocalPrefill(index, hasher, max_tokens=0)


def test_local_prefill_leaves_a_busy_decodes_request_to_a_prefill_with_a_short_queue() -> None:
    """Issue 41 item 6: with ``max_busy`` 2, a decode with 2 requests in flight or more takes no local prefill while a
    prefill has fewer than 2; when every prefill is as busy, or with no prefill to go to, it still does; 0 weighs no
    load."""
    hasher = BlockHasher("sha256", None, block_size=4)
    index = KvIndex(max_blocks=1000, routed_ttl_s=5.0, clock=lambda: 0.0)
    history = list(range(32))
    index.stored("http://d0", hasher.hashes(history), "GPU")
    decode, prefills = Node("http://d0"), [Node("http://p0"), Node("http://p1")]
    weighing = LocalPrefill(index, hasher, max_tokens=8, max_busy=2)
    prompt = completion([*history, 1, 2])
    decode.in_flight = 1  # below the bound: taken
    assert weighing.decode_for([decode], prompt, prefills) is not None
    decode.in_flight = 2
    prefills[0].in_flight, prefills[1].in_flight = 2, 1  # p1's queue is short: the prefill hop
    assert weighing.decode_for([decode], prompt, prefills) is None
    prefills[1].in_flight = 3  # every prefill as busy: the decode still takes it
    chosen = weighing.decode_for([decode], prompt, prefills)
    assert chosen is not None and chosen.reason == "local_prefill"
    assert weighing.decode_for([decode], prompt, []) is not None  # no healthy prefill
    prefills[1].in_flight = 0
    assert LocalPrefill(index, hasher, max_tokens=8).decode_for([decode], prompt, prefills) is not None  # off
    with pytest.raises(ValueError, match="busy bound"):
        LocalPrefill(index, hasher, max_tokens=8, max_busy=-1)
