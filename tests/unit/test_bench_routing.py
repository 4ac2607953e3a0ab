"""``bench routing``'s workload and fronts, without a cluster: users of one system prompt share it, each turn extends
the user's history, every front gets its own text; the kv_aware fronts are given the prefills' event streams (and
the decode's, with local prefills)."""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="the benchmark's client needs the 'proxy' extra (aiohttp)")

from pd_transfer.bench.proxy.routing import Cluster, Workload, conversations, our_command, their_command


def test_the_workload_shares_system_prompts_and_grows_each_history() -> None:
    workload = Workload(systems=2, users=3, turns=3, system_words=20)
    turns = conversations(workload, salt=1)
    assert [len(t) for t in turns] == [6, 6, 6]
    first = turns[0]
    systems = {messages[0]["content"] for messages in first}
    assert len(systems) == 2 and all(sum(m[0]["content"] == s for m in first) == 3 for s in systems)
    for earlier, later in itertools.pairwise(turns):
        for b in later:  # each request extends one of the turn before: the history, a reply, the next question
            assert sum(b[: len(a)] == a and len(b) == len(a) + 2 for a in earlier) == 1
    assert conversations(workload, salt=2)[0][0] != first[0]  # each front its own text


def test_kv_aware_fronts_read_the_prefills_event_streams() -> None:
    cluster = Cluster(
        subprocess.Popen(["true"]),
        Path("."),
        ["http://127.0.0.1:1", "http://127.0.0.1:2"],
        ["http://127.0.0.1:3"],
        {"http://127.0.0.1:1": ("tcp://a:1", "tcp://a:2"), "http://127.0.0.1:2": ("tcp://b:1", "tcp://b:2")},
        {"http://127.0.0.1:3": ("tcp://c:1", "tcp://c:2")},
        "m",
    )
    cluster.process.wait(10)
    ours = our_command(cluster, "kv_aware", 9)
    assert "http://127.0.0.1:1=tcp://a:1,tcp://a:2" in ours and ours[ours.index("--kv-block-size") + 1] == "32"
    assert "--kv-event-source" not in our_command(cluster, "cache_aware", 9)
    assert "tcp://c:1" not in " ".join(ours) and "--max-local-prefill" not in ours
    # kv_aware_local: the decode's stream too, kv_aware on both roles, the local prefill's bound
    local = our_command(cluster, "kv_aware_local", 9, max_local_prefill=128)
    assert "http://127.0.0.1:3=tcp://c:1,tcp://c:2" in local and "http://127.0.0.1:1=tcp://a:1,tcp://a:2" in local
    assert local[local.index("--decode-policy") + 1] == local[local.index("--prefill-policy") + 1] == "kv_aware"
    assert local[local.index("--max-local-prefill") + 1] == "128" and "--local-prefill-max-busy" not in local
    # kv_aware_local_busy: the same, weighing the decode's load
    busy = our_command(cluster, "kv_aware_local_busy", 9, max_local_prefill=128, max_busy=3)
    assert busy[busy.index("--local-prefill-max-busy") + 1] == "3" and busy[: len(local)] == local
    theirs = their_command("vllm-router", cluster, "kv_aware", 9)
    assert theirs[theirs.index("--prefill-policy") + 1] == "kv_aware" and "--policy" not in theirs
    assert "http://127.0.0.1:2=tcp://b:1" in theirs
