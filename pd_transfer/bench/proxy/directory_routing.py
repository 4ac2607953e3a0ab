"""``pd-transfer bench routing-directory``: a prefix held only in the shared directory tier, routed by ``kv_aware`` to
a prefill that mounts the directory and loaded from it there, against round robin, which also sends it to a prefill
that does not mount it and recomputes it there.

The cluster: ``pd-transfer up`` with 2 prefills and 1 decode (SmolLM2, 32-token blocks, KV events on), an offload
directory mounted by ``prefill-0`` only (``--offload-prefills 1``), and ``kvcache_gib`` of KV cache each (0.1 GiB:
about 70 blocks), small enough that a few long prompts push a prefix out of an engine's own cache.

Per policy (``kv_aware``, then ``round_robin``; each with its own prefix, and our proxy started first, so that its
index follows the engines' events from the start):

1. *seed*: the prefix prompt is sent straight to ``prefill-0``: computed there, stored in the directory;
2. *evict*: ``fillers`` long prompts of other text are sent straight to ``prefill-0``, more blocks than its cache
   holds, so the prefix leaves its own cache (the first ask's matched tiers say whether it did: ``shared``, not
   ``engine``);
3. *ask*: the prefix plus a question goes through the proxy, ``asks`` times (different questions).

Reported per ask: the prefill it reached (the one whose ``vllm:prefix_cache_queries`` moved), the blocks the proxy
matched by tier (its route metrics), the tokens a connector gave that prefill (``vllm:external_prefix_cache_hits``:
on a prefill, only the offload connector gives any), its own prefix-cache hits, and the TTFT. At the end: each
prefill's offload counters over the whole run (``vllm:pd_transfer_offload_loaded_bytes_total`` and hits, tier
``disk``) and the lines of ``prefill-0``'s log that report offload loads.
Results go to ``--out`` (default ``benchmarks/routing-directory.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from pd_transfer.bench.proxy.routing import (
    HITS,
    QUERIES,
    REQUEST_TIMEOUT_S,
    Cluster,
    our_command,
    start_front,
    stream_ttft,
    up_cluster,
)
from pd_transfer.cluster.http_client import free_port, metric_value, scrape_metrics

KVCACHE_GIB = 0.1
LOADED = "vllm:pd_transfer_offload_loaded_bytes_total"  # tier="disk": the directory
OFFLOAD_HITS = "vllm:pd_transfer_offload_hits_total"
#: tokens a KV connector gave the engine (counted in the step; for a prefill only the offload connector gives any)
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
PROMPT_WORDS = 900  # about 30 blocks of 32 tokens: a long system prompt
FILLER_WORDS = 1500  # about 48 blocks: two of them exceed a 70-block cache


def _text(rng: random.Random, words: int, head: str) -> str:
    vocabulary = "ship harbour river castle garden letter window engine market winter silver forest".split()
    vocabulary += "answer careful simple question history number detail reason travel morning".split()
    return head + " " + " ".join(rng.choice(vocabulary) for _ in range(words))


def _counters(url: str) -> dict[str, float]:
    return {
        "prompt_tokens_looked_up": metric_value(url, QUERIES),
        "prefix_hits": metric_value(url, HITS),
        "connector_hit_tokens": metric_value(url, EXTERNAL_HITS),
        "directory_loaded_bytes": metric_value(url, LOADED, tier="disk"),
        "directory_hits": metric_value(url, OFFLOAD_HITS, tier="disk"),
    }


def complete(url: str, model: str, prompt: str) -> float:
    """Seconds from sending a streamed completion of ``prompt`` (one token) to its first token."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "stream": True}

    async def once() -> float:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await stream_ttft(session, url, body, "/v1/completions")

    return asyncio.run(once())


def _route_tiers(proxy: str) -> dict[str, float]:
    """The proxy's prefill choices' matched blocks by tier so far."""
    out: dict[str, float] = {}
    for line in scrape_metrics(proxy).splitlines():
        if line.startswith("pd_proxy_route_matched_blocks_total{") and 'role="prefill"' in line:
            tier = line.split('tier="', 1)[1].split('"', 1)[0]
            out[tier] = float(line.rsplit(" ", 1)[1])
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 1) for k, v in after.items() if v - before.get(k, 0.0)}


def run_policy(cluster: Cluster, policy: str, work: Path, fillers: int, asks: int, salt: int) -> dict[str, Any]:
    """Seed, evict and ask (module docstring) with our proxy under ``policy``."""
    rng = random.Random(salt)
    prefix = _text(rng, PROMPT_WORDS, f"Shared instructions {salt}:")
    mounting = cluster.prefills[0]
    port = free_port()
    proxy_url = f"http://127.0.0.1:{port}"
    process = start_front(our_command(cluster, policy, port), work / f"directory-{policy}.log", proxy_url)
    try:
        seed_s = complete(mounting, cluster.model, prefix)
        for k in range(fillers):
            complete(mounting, cluster.model, _text(rng, FILLER_WORDS, f"Filler {salt}-{k}:"))
        asked = []
        for k in range(asks):
            before = {url: _counters(url) for url in cluster.prefills}
            tiers = _route_tiers(proxy_url)
            ttft = complete(proxy_url, cluster.model, f"{prefix}\nQuestion {k}: {_text(rng, 8, 'why')}?")
            changes = {url: _delta(_counters(url), before[url]) for url in cluster.prefills}
            reached = next((url for url, change in changes.items() if change.get("prompt_tokens_looked_up")), None)
            if reached is None:
                raise RuntimeError(f"ask {k} under {policy}: no prefill's prefix-cache lookups moved")
            asked.append(
                {
                    "ttft_ms": round(1000 * ttft, 1),
                    "prefill": "prefill-0 (mounts the directory)" if reached == mounting else "prefill-1",
                    "matched_blocks_by_tier": _delta(_route_tiers(proxy_url), tiers),
                    "counters": changes[reached],
                }
            )
        return {"policy": policy, "seed_ttft_ms": round(1000 * seed_s, 1), "fillers": fillers, "asks": asked}
    finally:
        process.terminate()
        process.wait(15)


def _offload_lines(log: Path) -> list[str]:
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    return [line[-240:] for line in lines if "offload MiB loaded" in line and "offload MiB loaded: 0.0," not in line]


def run_bench(model: Path | None, startup_s: float, kvcache_gib: float, fillers: int, asks: int) -> dict[str, Any]:
    started_utc = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    results = []
    with tempfile.TemporaryDirectory(prefix="pd-bench-directory-") as folder:
        work = Path(folder)
        extra = ["--offload-dir", str(work / "directory"), "--offload-prefills", "1"]
        with up_cluster(work, model, startup_s, kvcache_gib, extra) as cluster:
            for k, policy in enumerate(("kv_aware", "round_robin")):
                result = run_policy(cluster, policy, work, fillers, asks, salt=2000 + k)
                print(json.dumps(result), flush=True)
                results.append(result)
            # the offload connector's own counters, over the whole run
            totals = {
                name: _counters(url) for name, url in zip(("prefill-0", "prefill-1"), cluster.prefills, strict=True)
            }
            log = json.loads((cluster.log_dir / "cluster.json").read_text())
            prefill0 = next(Path(p["log"]) for p in log["processes"] if p.get("name") == "prefill-0")
            engine_lines = _offload_lines(prefill0)
            model_name = cluster.model
    return {
        "benchmark": "routing-directory",
        "started_utc": started_utc,
        "model": model_name,
        "cluster": {"prefills": 2, "mounting_the_directory": ["prefill-0"], "decodes": 1, "kvcache_gib": kvcache_gib},
        "cpus": os.cpu_count(),
        "results": results,
        "prefill_counters_at_the_end": totals,
        "prefill_0_log_offload_lines": engine_lines[-6:],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, metavar="DIR", help="default: pd-transfer up's (SmolLM2)")
    parser.add_argument("--kvcache-gib", type=float, default=KVCACHE_GIB, help=f"per engine ({KVCACHE_GIB})")
    parser.add_argument("--fillers", type=int, default=3, metavar="N", help="long prompts that evict the prefix (3)")
    parser.add_argument("--asks", type=int, default=2, metavar="N", help="requests of the prefix per policy (2)")
    parser.add_argument("--startup-timeout", type=float, default=900.0, metavar="S", help="the servers' startup (900)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/routing-directory.json"))


def run(args: argparse.Namespace) -> int:
    if args.fillers < 1 or args.asks < 1 or not args.kvcache_gib > 0:
        print("bench routing-directory: --fillers and --asks at least 1, --kvcache-gib positive", file=sys.stderr)
        return 2
    report = run_bench(args.model, args.startup_timeout, args.kvcache_gib, args.fillers, args.asks)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {args.out}")
    return 0
