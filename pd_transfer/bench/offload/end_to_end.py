"""``pd-transfer bench offload --end-to-end``: time to first token of a prompt whose prefix a connector holds,
on real vLLM servers, against recomputing that prefix.

One vLLM server per setup, one at a time, all with the same model, flags and a small KV cache
(``CACHE_BLOCKS`` blocks of ``BLOCK`` tokens); the tiers' byte budgets follow the model's KV bytes per token
(:mod:`.end_to_end_sizing`, which also saves the results per model):

* ``recompute``: no connector; the prefix is computed again (the baseline, and the reference tokens);
* ``pd_host``: ``PdOffloadConnector`` with a host tier (and a directory behind it): B's prefix from host memory;
* ``pd_host_only``: the host tier alone (no directory behind it);
* ``pd_disk``: ``PdOffloadConnector`` with a directory tier only: B's prefix read from its files, which the page
  cache holds (A wrote them);
* ``pd_disk_cold``: the same, with every file of the directory dropped from the page cache right before B;
* ``vllm_offloading``: vLLM's ``OffloadingConnector`` (its CPU spec, ``cpu_bytes_to_use``);
* ``vllm_example``: vLLM's ``ExampleConnector`` (safetensors files under ``shared_storage_path``);
  ``vllm_example_cold``: the same, its files dropped from the page cache right before B.

The setups with files record, round by round, the share of their files' pages in the page cache right before B
(``page_cache``), so each figure says which state it measured.

A round: request A (a fresh ``PREFIX``-token prefix and a tail), then vLLM's own prefix cache is flushed
(``POST /reset_prefix_cache``, served with ``VLLM_SERVER_DEV_MODE=1``; retried while stores still hold blocks;
``reset_external`` stays false, so the connectors keep what they stored), then B (the same prefix, another tail)
is streamed and timed to its first token. The first round is a warm-up; ``repeats`` rounds are measured. Each
B's prompt tokens by source are read from ``/metrics`` and its greedy tokens compared with the recompute server's.

This module talks to the servers over HTTP only (it does not import vLLM).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pd_transfer.affinity import allowed_cpu
from pd_transfer.cluster.http_client import (
    RequestFailed,
    completion,
    free_port,
    metric_sum,
    post_json,
    scrape_metrics,
)
from pd_transfer.cluster.launch import (
    CONNECTOR_MODULE,
    OFFLOAD_CONNECTOR_CLASS,
    TINY_MODEL_DIR,
    ServerSpec,
    server_process,
)
from pd_transfer.cluster.processes import ManagedProcess, StartupFailed, wait_ready
from pd_transfer.offload.page_cache import DROP_METHOD, drop_from_cache, resident_fraction
from pd_transfer.settings import child_environment

from .end_to_end_sizing import BLOCK, MAX_TOKENS, PREFIX, TAIL, Sizing, save_result, sizing_for

__all__ = ["SETUPS", "Settings", "add_arguments", "cli_run", "run_end_to_end", "vllm_absent"]

GOAL_HOST_VS_BEST_VLLM = 0.8
#: the directory tier's hit (page cache warm) at most this many times vLLM's own prefix-cache hit's TTFT
GOAL_DISK_VS_LOCAL_HIT = 1.2
PROMPT_METRIC = "vllm:prompt_tokens_by_source_total"
SOURCES = ("external_kv_transfer", "local_cache_hit", "local_compute")
REQUEST_TIMEOUT_S = 120.0
FLUSH_TIMEOUT_S = 60.0
_EXCEPTION = re.compile(r"^(\(\w+ pid=\d+\) )?([\w.]+)?(Error|Exception)\b: ")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

#: setup -> (what it is, its ``--kv-transfer-config`` given a fresh scratch directory and the model's budgets;
#: None: no connector)
ConfigOf = Callable[[Path, Sizing], dict[str, object] | None]


def _pd_config(extra: dict[str, object]) -> dict[str, object]:
    return {
        "kv_connector": OFFLOAD_CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def _pd_host(scratch: Path, size: Sizing) -> dict[str, object]:
    return _pd_config(
        {"offload_host_bytes": size.host_bytes, "offload_dir": str(scratch), "offload_dir_bytes": size.dir_bytes}
    )


def _pd_host_only(scratch: Path, size: Sizing) -> dict[str, object]:
    return _pd_config({"offload_host_bytes": size.host_bytes})


def _pd_host_async(scratch: Path, size: Sizing) -> dict[str, object]:
    return _pd_config({"offload_host_bytes": size.host_bytes, "offload_load": "async"})


def _pd_disk(scratch: Path, size: Sizing) -> dict[str, object]:
    return _pd_config({"offload_dir": str(scratch), "offload_dir_bytes": size.dir_bytes})


def _vllm_offloading(scratch: Path, size: Sizing) -> dict[str, object]:
    extra = {"cpu_bytes_to_use": size.vllm_cpu_bytes}
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def _vllm_example(scratch: Path, size: Sizing) -> dict[str, object]:
    extra = {"shared_storage_path": str(scratch)}
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


SETUPS: dict[str, tuple[str, ConfigOf]] = {
    "recompute": ("no connector: the prefix is computed again", lambda scratch, size: None),
    "pd_host": ("PdOffloadConnector, host tier hit", _pd_host),
    "pd_host_only": ("PdOffloadConnector, host tier alone (no directory behind it)", _pd_host_only),
    "pd_host_async": ("PdOffloadConnector, host tier alone, loads asynchronous (offload_load: async)", _pd_host_async),
    "pd_disk": ("PdOffloadConnector, directory tier only (its files in the page cache)", _pd_disk),
    "pd_disk_cold": ("PdOffloadConnector, directory tier only, its files dropped from the page cache", _pd_disk),
    "vllm_offloading": ("vLLM OffloadingConnector (CPU spec)", _vllm_offloading),
    "vllm_example": ("vLLM ExampleConnector (safetensors files)", _vllm_example),
    "vllm_example_cold": ("vLLM ExampleConnector, its files dropped from the page cache", _vllm_example),
}
VLLM_SETUPS = ("vllm_offloading", "vllm_example")
#: setups whose B reads files from the scratch directory: their page cache state is recorded before each B
FILE_SETUPS = ("pd_host", "pd_disk", "pd_disk_cold", "vllm_example", "vllm_example_cold")
#: setups whose scratch directory's files are dropped from the page cache right before each B
COLD_SETUPS = ("pd_disk_cold", "vllm_example_cold")
#: setups whose B finds its prefix in vLLM's own prefix cache (no flush): the floor every connector aims at
LOCAL_HIT = "local_hit"
SETUPS[LOCAL_HIT] = (
    "no connector, no flush: B's prefix is a hit in vLLM's own prefix cache (the floor)",
    lambda scratch, size: None,
)


@dataclass
class Settings:
    """What one run uses; ``salt`` picks the prompts (the same in every setup of a run)."""

    model: str
    python: str
    log_dir: Path
    repeats: int = 5
    startup_timeout_s: float = 900.0
    setups: tuple[str, ...] = tuple(SETUPS)
    salt: int = field(default_factory=lambda: time.time_ns() % 10**9)
    sizing: Sizing | None = None  # None: from the model's config.json when the run starts
    note: str = ""  # what this run left out or changed, saved with it
    load_at_start: float | None = None
    log: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))


def _size(settings: Settings) -> Sizing:
    if settings.sizing is None:
        settings.sizing = sizing_for(settings.model)
    return settings.sizing


def vllm_absent(python: str) -> str | None:
    """Why ``python`` cannot run vLLM servers (no such interpreter, or no ``vllm`` module there), or None."""
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"cannot run the interpreter {python!r}: {type(error).__name__}: {error}"
    if done.returncode != 0:
        return f"vLLM is not installed for {python!r} (give the vllm-cpu venv's python with --python)"
    return None


def _tokens(length: int, seed: int, salt: int) -> list[int]:
    rng = random.Random(seed * 10**9 + salt)
    return [rng.randrange(3, 2048) for _ in range(length)]


def _server(name: str, config: dict[str, object] | None, settings: Settings) -> ManagedProcess:
    size = _size(settings)
    args: tuple[str, ...] = ("--num-gpu-blocks-override", str(size.cache_blocks))
    if config is not None:
        args += ("--kv-transfer-config", json.dumps(config))
    spec = ServerSpec(
        role="both",
        model=settings.model,
        port=free_port(),
        side_channel_port=free_port(),
        block_size=BLOCK,
        cpu_bind=allowed_cpu(0),
        kvcache_gib=size.kv_cache_bytes / 2**30,
        extra_args=args,
        dtype="float32",
        max_model_len=size.max_model_len,
        seed=0,
    )
    env = child_environment({"VLLM_SERVER_DEV_MODE": "1"})
    log_path = settings.log_dir / f"{name}.log"
    return server_process(name, spec, log_path, python=settings.python, connector=False, base_env=env)


def _first_token(url: str, model: str, prompt: list[int]) -> tuple[float, list[str]]:
    """Stream a greedy completion of ``prompt``: seconds to the first generated token, and all its tokens."""
    payload = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
               "ignore_eos": True, "logprobs": 1, "stream": True}  # fmt: skip
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(payload).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    first: float | None = None
    tokens: list[str] = []
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line.removeprefix("data:")).get("choices") or []:
                    got = list((choice.get("logprobs") or {}).get("tokens") or [])
                    if got and first is None:
                        first = time.perf_counter() - started
                    tokens += got
    except (urllib.error.URLError, OSError) as error:
        raise RequestFailed(url, f"streamed completion failed: {error}") from None
    if first is None:
        raise RequestFailed(url, "the stream carried no token")
    return first, tokens


def _flush(url: str) -> str:
    """Empty vLLM's own prefix cache (not the connector's); returns how. Retries while blocks are held."""
    deadline = time.monotonic() + FLUSH_TIMEOUT_S
    while True:
        try:
            if post_json(f"{url}/reset_prefix_cache", {}, 30.0).get("success"):
                return "reset_prefix_cache"
        except RequestFailed as error:
            if error.status != 404:
                raise
            raise RequestFailed(url, "this server does not serve /reset_prefix_cache") from None
        if time.monotonic() > deadline:
            raise RequestFailed(url, f"reset_prefix_cache did not succeed in {FLUSH_TIMEOUT_S:.0f} s")
        time.sleep(0.1)


def _sources(url: str) -> dict[str, float]:
    text = scrape_metrics(url)
    return {source: metric_sum(text, PROMPT_METRIC, source=source) for source in SOURCES}


def _sources_after(url: str, before: Mapping[str, float], prompt_len: int) -> dict[str, int]:
    """B's prompt tokens by source: the counters' growth once all of B's prompt is counted (at most 10 s)."""
    deadline = time.monotonic() + 10.0
    while True:
        now = _sources(url)
        delta = {source: int(now[source] - before[source]) for source in SOURCES}
        if sum(delta.values()) >= prompt_len or time.monotonic() > deadline:
            return delta
        time.sleep(0.05)


def _round(url: str, settings: Settings, index: int, flush: bool = True,
           before_b: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    """One A / flush / B round on prompts ``index`` of the run: B's TTFT, tokens and prompt sources
    (``flush`` False: B finds the prefix in vLLM's own cache); ``before_b`` runs right before B, untimed, and
    what it returns is kept as the round's ``page_cache``."""
    prefix = _tokens(PREFIX, 2 * index, settings.salt)
    prompt_a = prefix + _tokens(TAIL, 2 * index + 1, settings.salt)
    prompt_b = prefix + _tokens(TAIL, 10**6 + index, settings.salt)
    completion(url, settings.model, prompt_a, MAX_TOKENS, timeout_s=REQUEST_TIMEOUT_S)
    if flush:
        _flush(url)
    before = _sources(url)
    state = before_b() if before_b is not None else None
    ttft, tokens = _first_token(url, settings.model, prompt_b)
    sources = _sources_after(url, before, len(prompt_b))
    floor, _ = _first_token(url, settings.model, prompt_b)  # B again: its prefix now in vLLM's own cache
    result = {"ttft_s": ttft, "tokens": tokens, "sources": sources, "local_hit_s": floor}
    return result | ({"page_cache": state} if state is not None else {})


def _page_cache(scratch: Path, *, drop: bool) -> Callable[[], dict[str, Any]]:
    """Before B: the files under ``scratch`` (``drop``: first dropped from the page cache, every one) and the share
    of their pages the page cache then holds (weighted by size)."""

    def state() -> dict[str, Any]:
        files = [path for path in scratch.rglob("*") if path.is_file() and not path.name.startswith(".")]
        for path in files if drop else ():
            drop_from_cache(path)
        sizes = {path: path.stat().st_size for path in files}
        held = sum((resident_fraction(path) or 0.0) * size for path, size in sizes.items())
        return {"files": len(files), "resident_fraction": round(held / max(1, sum(sizes.values())), 4)}

    return state


def _error_line(log_path: Path) -> str:
    """The first exception line of the log (the root cause of a refusal), else its last line; no absolute paths."""
    try:
        lines = [_ANSI.sub("", line).strip() for line in log_path.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    causes = [line for line in lines if _EXCEPTION.match(line)]
    line = (causes or [ln for ln in lines if ln] or [""])[0 if causes else -1]
    return _scrub(line)[:400]


def _scrub(text: str) -> str:
    for old, new in ((str(Path.cwd().resolve()) + os.sep, ""), (tempfile.gettempdir() + os.sep, "$TMPDIR/")):
        text = text.replace(old, new)
    return text


def _measure(server: ManagedProcess, settings: Settings, flush: bool,
             before_b: Callable[[], dict[str, Any]] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    _round(server.url, settings, 0, flush, before_b)  # warm-up: first compiles and first loads
    return [_round(server.url, settings, index, flush, before_b) for index in range(1, settings.repeats + 1)]


def _run_setup(name: str, settings: Settings) -> dict[str, Any]:
    """Start the setup's server, run its rounds, stop it: the rounds, or the error that stopped it."""
    describe, config_of = SETUPS[name]
    scratch = Path(tempfile.mkdtemp(prefix=f"pd-e2e-{name}-"))
    server = _server(name, config_of(scratch, _size(settings)), settings)
    result: dict[str, Any] = {"what": describe, "log": f"{name}.log"}
    before_b = _page_cache(scratch, drop=name in COLD_SETUPS) if name in FILE_SETUPS else None
    if name in COLD_SETUPS:
        result["page_cache_dropped_by"] = DROP_METHOD
    try:
        server.start()
        wait_ready([server], settings.startup_timeout_s)
        result["startup_s"] = round(server.ready_after_s or 0.0, 1)
        result["rounds"] = _measure(server, settings, name != LOCAL_HIT, before_b)
    except StartupFailed:
        result["error"] = "refused to start: " + _error_line(server.log_path)
        result["refused_to_start"] = True
    except (RequestFailed, ValueError) as error:
        result["error"] = f"failed while serving: {_scrub(str(error))[:300]}; log: {_error_line(server.log_path)}"
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return result


def _ms(values: list[float], quantile: float) -> float:
    ordered = sorted(values)
    return round(1e3 * ordered[min(len(ordered) - 1, round(quantile * (len(ordered) - 1)))], 1)


def _summarize(result: dict[str, Any], reference: list[list[str]] | None) -> dict[str, Any]:
    """A setup's row: TTFT median and p90 (ms), B's prompt tokens by source (median), tokens equal."""
    rounds = result.pop("rounds", None)
    if not rounds:
        return result
    ttfts = [r["ttft_s"] for r in rounds]
    result["ttft_ms"] = {"median": round(1e3 * statistics.median(ttfts), 1), "p90": _ms(ttfts, 0.9),
                         "all": [round(1e3 * t, 1) for t in ttfts]}  # fmt: skip
    result["prompt_tokens_by_source"] = {s: int(statistics.median(r["sources"][s] for r in rounds)) for s in SOURCES}
    result["over_local_hit_ms"] = round(1e3 * statistics.median(r["ttft_s"] - r["local_hit_s"] for r in rounds), 1)
    result["x_local_hit"] = round(statistics.median(r["ttft_s"] / r["local_hit_s"] for r in rounds), 3)
    result["tokens"] = [r["tokens"] for r in rounds]
    states = [r["page_cache"]["resident_fraction"] for r in rounds if "page_cache" in r]
    if states:
        result["page_cache"] = {"resident_fraction_before_b": {"min": min(states), "max": max(states)},
                                "files": max(r["page_cache"]["files"] for r in rounds)}  # fmt: skip
    if reference is not None:
        equal = sum(a == b for a, b in zip(result["tokens"], reference, strict=False))
        result["tokens_equal_recompute"] = f"{equal}/{len(rounds)}"
    return result


def _median(rows: Mapping[str, dict[str, Any]], name: str) -> float | None:
    row = rows.get(name) or {}
    return row.get("ttft_ms", {}).get("median")


def _verdict(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The top-level keys: host hit vs the best vLLM connector's, both tiers vs recompute, verified, goals."""
    host, disk, recompute = (_median(rows, n) for n in ("pd_host", "pd_disk", "recompute"))
    vllm = {n: m for n in VLLM_SETUPS if (m := _median(rows, n)) is not None}
    best = min(vllm, key=lambda n: vllm[n]) if vllm else None
    ratio = round(host / vllm[best], 3) if host is not None and best is not None else None
    host_faster = host is not None and recompute is not None and host < recompute
    disk_faster = disk is not None and recompute is not None and disk < recompute
    checked = [r["tokens_equal_recompute"] for r in rows.values() if "tokens_equal_recompute" in r]
    verified = bool(checked) and all(c.split("/")[0] == c.split("/")[1] for c in checked)
    goal = ratio is not None and ratio <= GOAL_HOST_VS_BEST_VLLM
    return {
        "best_vllm_connector": best,
        "host_hit_ratio_vs_best_vllm": ratio,
        "goal_host_vs_best_vllm": GOAL_HOST_VS_BEST_VLLM,
        "host_faster_than_recompute": host_faster,
        "disk_faster_than_recompute": disk_faster,
        "verified": verified,
        "goals_met": goal and host_faster and disk_faster and verified,
    } | _disk_verdict(rows)


def _disk_verdict(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The directory tier's hit against vLLM's own prefix-cache hit (the ``local_hit`` setup's median), page cache
    warm (the goal, judged only where every round found the files wholly cached) and cold (no goal: what the
    storage gives); beside them, the median of each round's B over B asked again on the same server (``x_local_hit``:
    vLLM's own hit seconds later, which other jobs on the machine disturb less)."""
    local = _median(rows, LOCAL_HIT)

    def ratio(name: str) -> float | None:
        median = _median(rows, name)
        return round(median / local, 3) if median is not None and local else None

    def resident(name: str, end: str) -> float | None:
        state = (rows.get(name) or {}).get("page_cache", {}).get("resident_fraction_before_b")
        return state[end] if state else None

    def paired(name: str) -> float | None:
        return (rows.get(name) or {}).get("x_local_hit")

    warm = ratio("pd_disk")
    return {
        "disk_hit_ratio_vs_local_hit": warm,
        "disk_hit_x_own_local_hit": paired("pd_disk"),
        "disk_cold_hit_x_own_local_hit": paired("pd_disk_cold"),
        "disk_cold_hit_ratio_vs_local_hit": ratio("pd_disk_cold"),
        "goal_disk_vs_local_hit": GOAL_DISK_VS_LOCAL_HIT,
        "disk_goal_met": warm is not None and warm <= GOAL_DISK_VS_LOCAL_HIT and resident("pd_disk", "min") == 1.0,
        "disk_page_cache": {
            "pd_disk_resident_min": resident("pd_disk", "min"),
            "pd_disk_cold_resident_max": resident("pd_disk_cold", "max"),
        },
    }


def run_end_to_end(settings: Settings) -> dict[str, Any]:
    """Every setup in turn (recompute first: its tokens are the reference); the JSON-ready result."""
    settings.log_dir.mkdir(parents=True, exist_ok=True)
    settings.load_at_start = round(os.getloadavg()[0], 2)
    rows: dict[str, dict[str, Any]] = {}
    reference: list[list[str]] | None = None
    for name in settings.setups:
        settings.log(f"end-to-end: {name} ...")
        row = _run_setup(name, settings)
        rows[name] = _summarize(row, reference)
        if name == "recompute" and "tokens" in row:
            reference = row["tokens"]
        settings.log(f"end-to-end: {name}: {row.get('ttft_ms', {}).get('median', row.get('error'))}")
    for row in rows.values():
        row.pop("tokens", None)
    return _result(settings, rows)


def _result(settings: Settings, rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    size = _size(settings)
    load_end = round(os.getloadavg()[0], 2)
    return {
        "method": (
            f"one vLLM server per setup, one at a time, bound to one core; {size.cache_blocks} blocks of {BLOCK} "
            f"tokens, --max-model-len {size.max_model_len}, float32; tier budgets from the model's KV bytes per token "
            f"(sizing); "
            f"request A ({PREFIX}-token prefix + {TAIL}-token tail), POST /reset_prefix_cache (vLLM's own cache "
            f"only), then B (same prefix, another tail) streamed, timed to its first token, then B again (a hit "
            f"in vLLM's own cache: over_local_hit_ms is the median of the differences, x_local_hit of the ratios); "
            f"1 warm-up round, "
            f"{settings.repeats} measured rounds with fresh prefixes; greedy, {MAX_TOKENS} tokens"
        ),
        "model": Path(settings.model).name,
        "kv_bytes_per_token": size.kv_bytes_per_token,
        "sizing": size.as_json(),
        "prefix_tokens": PREFIX,
        "repeats": settings.repeats,
        "note": settings.note,
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_1m": load_end,
            "load_average_1m_start": settings.load_at_start,
        },
        "setups": rows,
    } | _verdict(rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The end-to-end flags of ``pd-transfer bench offload`` (``--repeats`` and ``--json`` are the command's)."""
    parser.add_argument("--end-to-end", action="store_true", help="TTFT of prefix hits on real vLLM servers")
    parser.add_argument("--output", type=Path, default=None,
                        help="end-to-end: merge the result into this JSON file (end_to_end*)")  # fmt: skip
    parser.add_argument("--model", default=None, help=f"end-to-end: model folder ({TINY_MODEL_DIR})")
    parser.add_argument("--python", default=sys.executable, help="end-to-end: the interpreter that runs vLLM")
    parser.add_argument("--log-dir", type=Path, default=None, help="end-to-end: server logs (runs/bench-offload-*)")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="end-to-end: seconds to healthy")
    parser.add_argument("--setups", default=",".join(SETUPS), help=f"end-to-end: a subset of {','.join(SETUPS)}")
    parser.add_argument("--note", default="", help="end-to-end: a note saved with the result (what was left out)")


def _settings(args: argparse.Namespace) -> Settings:
    setups = tuple(s.strip() for s in args.setups.split(",") if s.strip())
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        raise ValueError(f"unknown setups {unknown}; known: {', '.join(SETUPS)}")
    return Settings(
        model=args.model or str(TINY_MODEL_DIR),
        python=args.python,
        log_dir=args.log_dir or Path("runs") / time.strftime("bench-offload-%Y%m%d-%H%M%S"),
        repeats=args.repeats,
        startup_timeout_s=args.startup_timeout,
        setups=setups,
        note=args.note,
    )


def _table(result: dict[str, Any]) -> str:
    lines = [f"{'setup':16} {'median ms':>10} {'p90 ms':>8} {'over local':>10} {'external':>9} {'equal':>6}  error"]
    for name, row in result["setups"].items():
        ttft, sources = row.get("ttft_ms", {}), row.get("prompt_tokens_by_source", {})
        lines.append(f"{name:16} {ttft.get('median', '-')!s:>10} {ttft.get('p90', '-')!s:>8} "
                     f"{row.get('over_local_hit_ms', '-')!s:>10} "
                     f"{sources.get('external_kv_transfer', '-')!s:>9} {row.get('tokens_equal_recompute', '-'):>6}  "
                     f"{row.get('error', '')}")  # fmt: skip
    host = ("host_hit_ratio_vs_best_vllm", "host_faster_than_recompute", "disk_faster_than_recompute", "verified")
    lines.append(", ".join(f"{k} {result[k]}" for k in (*host, "goals_met")))
    disk = (
        "disk_hit_ratio_vs_local_hit",
        "disk_goal_met",
        "disk_cold_hit_ratio_vs_local_hit",
        "disk_hit_x_own_local_hit",
        "disk_cold_hit_x_own_local_hit",
        "disk_page_cache",
    )
    lines.append(", ".join(f"{k} {result[k]}" for k in disk))
    return "\n".join(lines)


def cli_run(args: argparse.Namespace) -> int:
    """``pd-transfer bench offload --end-to-end``: :func:`exit_code`, or 2 when vLLM is absent or the arguments are
    wrong."""
    try:
        settings = _settings(args)
    except ValueError as error:
        print(f"pd-transfer bench offload --end-to-end: {error}", file=sys.stderr)
        return 2
    if (absent := vllm_absent(settings.python)) is not None:
        print(f"pd-transfer bench offload --end-to-end: {absent}", file=sys.stderr)
        return 2
    if not (Path(settings.model) / "config.json").exists():
        print(f"pd-transfer bench offload --end-to-end: no model at {settings.model} (pd-transfer make-model)",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        settings.sizing = sizing_for(settings.model)
    except ValueError as error:
        print(f"pd-transfer bench offload --end-to-end: {error}", file=sys.stderr)
        return 2
    result = run_end_to_end(settings)
    if args.output is not None:
        save_result(args.output, result)
    print(json.dumps(result, indent=1) if args.json else _table(result))
    return exit_code(result)


def exit_code(result: dict[str, Any]) -> int:
    """0 when B's tokens equal recompute's and every setup ran, but for a vLLM yardstick that refused to start on
    this platform (its reason stays in the result: vLLM's OffloadingConnector always refuses on CPU builds); else 1."""
    failed = [
        name
        for name, row in result["setups"].items()
        if "error" in row and not (name in VLLM_SETUPS and row.get("refused_to_start"))
    ]
    return 0 if not failed and result["verified"] else 1
