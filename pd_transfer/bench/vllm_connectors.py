"""``pd-transfer bench vllm``: PdTransferConnector against vLLM's own NixlConnector, same engine, same model, one run.

For each connector a prefill and a decode vLLM server start with the same flags (``--dtype float32
--max-model-len 2048 --seed 0 --block-size 128``, 1 GiB of KV cache, prefill bound to core 0 and decode to core 1);
only ``--kv-transfer-config`` (and, for NixlConnector, its side-channel variables) differ. The pairs run one after
the other, never together: four servers on two cores would measure the contention between them, and
NixlConnector's progress threads keep a core busy each even when idle. A plain server (no connector) starts beside
the first pair, computes the reference tokens of every prompt and is stopped before anything is measured.

Each pair gets the same requests, lengths interleaved (50, 677, 1500, 50, ...), one at a time, as a proxy would send
them: the prompt to the prefill with ``kv_transfer_params {"do_remote_decode": true}`` and ``max_tokens`` 1, then
the prompt with the returned params to the decode (greedy, ``max_tokens`` 16). One warm-up request first (its
decode includes the connectors' handshake), reported apart. Per request, from ``/metrics`` deltas: the decode's
KV load (NixlConnector: ``vllm:nixl_xfer_time_seconds`` and ``vllm:nixl_bytes_transferred``, NIXL's own transfer
telemetry; ours: ``vllm:pd_transfer_pull_seconds`` and ``vllm:pd_transfer_pull_bytes``, first read to usable KV),
the decode's ``external_kv_transfer`` prompt tokens, and the seconds from the decode's answer until the prefill's
``vllm:kv_cache_usage_perc`` is back to 0 (its blocks freed). Last for each pair (it may kill the engine): one
decode request whose live params carry ``remote_block_ids: "zzz"``, then a normal request.

Every process group started here is stopped at the end, also on errors, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pd_transfer.affinity import allowed_cpu
from pd_transfer.cluster.launch import ServerSpec, vllm_command, vllm_env
from pd_transfer.cluster.processes import ManagedProcess, group_members, stop_all

__all__ = ["add_arguments", "build_result", "render_table", "run", "run_bench", "summarize"]

CONNECTORS = ("nixl", "ours")
CONNECTOR_NAMES = {"nixl": "NixlConnector", "ours": "PdTransferConnector"}
DEFAULT_LENGTHS = (50, 677, 1500)
BLOCK_SIZE = 128
MAX_TOKENS = 16
CPU_INDEX = {"prefill": 0, "decode": 1, "reference": 0}  # the n-th CPU this process may use (allowed_cpu)
MODEL_ENV = "PD_TRANSFER_VLLM_MODEL"
MEMORY_PER_SERVER_GIB = 3.0  # a tiny-model server takes ~2.5 GB here; vLLM refuses to start short of memory
REQUEST_TIMEOUT_S = 120.0
ROBUSTNESS_TIMEOUT_S = 60.0  # for the malformed request and the normal one after it
METRIC_WAIT_S = 10.0  # connector stats reach /metrics with a later engine step
FREE_WAIT_S = 45.0  # longer than both connectors' 30 s lease: blocks are freed by then either way
POLL_S = 0.05

EXTERNAL = "vllm:prompt_tokens_by_source_total"
USAGE = "vllm:kv_cache_usage_perc"
#: per connector: (seconds histogram, bytes histogram) of the decode's KV loads
LOAD_METRICS = {
    "nixl": ("vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred"),
    "ours": ("vllm:pd_transfer_pull_seconds", "vllm:pd_transfer_pull_bytes"),
}


# ------------------------------------------------------------------------------------------------ servers
def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _spec(role: str, model: str) -> ServerSpec:
    return ServerSpec(
        role="both" if role == "reference" else role,  # type: ignore[arg-type]
        model=model,
        port=_free_port(),
        side_channel_port=_free_port(),
        block_size=BLOCK_SIZE,
        cpu_bind=allowed_cpu(CPU_INDEX[role]),
        kvcache_gib=1.0,
        dtype="float32",
        max_model_len=2048,
        seed=0,
    )


def server_process(connector: str | None, role: str, model: str, python: str, log_dir: Path) -> ManagedProcess:
    """One vLLM server: ``connector`` ``"nixl"``, ``"ours"`` or None (plain reference); same flags for all."""
    spec = _spec(role, model)
    env = vllm_env(spec, os.environ)
    if connector == "ours":
        command = vllm_command(spec, python)
    else:
        command = vllm_command(spec, python, connector=False)
        if connector == "nixl":
            nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
            command += ["--kv-transfer-config", json.dumps(nixl, separators=(",", ":"))]
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.side_channel_host
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_channel_port)
    name = role if connector is None else f"{connector}-{role}"
    return ManagedProcess(name, command, env, log_dir / f"{name}.log", f"{spec.url}/health", info={"url": spec.url})


def _url(process: ManagedProcess) -> str:
    return str(process.info["url"])


def _available_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return math.inf


def start_servers(servers: Sequence[ManagedProcess], timeout_s: float, log: Callable[[str], None]) -> None:
    """Start ``servers`` at once and wait (at most ``timeout_s`` s) until all answer /health. Raises on a server
    that exits or is late (the caller stops them)."""
    need = MEMORY_PER_SERVER_GIB * len(servers)
    if (have := _available_gib()) < need:
        raise RuntimeError(f"{have:.1f} GiB available, {len(servers)} vLLM servers need about {need:.0f} GiB")
    for server in servers:
        server.start()
    deadline = time.monotonic() + timeout_s
    last_note = 0.0
    while not all(server.check_ready() for server in servers):
        for server in servers:
            if (code := server.exit_code()) is not None:
                raise RuntimeError(f"{server.name} exited with {code} while starting:\n{server.log_tail()}")
        if time.monotonic() > deadline:
            late = [s for s in servers if s.ready_after_s is None]
            raise TimeoutError(f"not healthy after {timeout_s:.0f} s: {late[0].name}\n{late[0].log_tail()}")
        if time.monotonic() - last_note > 30:
            last_note = time.monotonic()
            waiting = [s.name for s in servers if s.ready_after_s is None]
            log(f"  waiting for {', '.join(waiting)} ({time.monotonic() - servers[0].started_at:.0f} s)")
        time.sleep(1.0)


# ------------------------------------------------------------------------------------------------ HTTP, metrics
class RequestFailed(RuntimeError):
    """An HTTP error status, a timeout or a refused connection, with a short description."""


def _post(url: str, payload: Mapping[str, object], timeout_s: float, request_id: str) -> dict[str, Any]:
    request = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": request_id},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        body = error.read().decode(errors="replace")[:200]
        raise RequestFailed(f"HTTP {error.code}: {body}") from None
    except TimeoutError:
        raise RequestFailed(f"no answer in {timeout_s:.0f} s") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise RequestFailed(f"{type(reason).__name__}: {reason}") from None


def completion(
    base_url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    request_id: str,
    kv_transfer_params: Mapping[str, object] | None = None,
    timeout_s: float = REQUEST_TIMEOUT_S,
) -> dict[str, Any]:
    """A greedy, non-streamed completion of token ids (logprobs on: the generated tokens come back as pieces)."""
    payload: dict[str, object] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 1,
    }
    if kv_transfer_params is not None:
        payload["kv_transfer_params"] = dict(kv_transfer_params)
    return _post(f"{base_url}/v1/completions", payload, timeout_s, request_id)


def tokens_of(response: Mapping[str, Any]) -> list[str]:
    """The generated tokens of a completion (pieces from logprobs)."""
    return list((response["choices"][0].get("logprobs") or {}).get("tokens") or [])


def scrape(base_url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout_s) as response:
        return response.read().decode()


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` (exactly) whose labels include ``labels``, in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass(frozen=True)
class DecodeCounters:
    """The decode's cumulative counters that one request moves."""

    load_seconds: float
    load_count: float
    load_bytes: float
    external_tokens: float

    @classmethod
    def read(cls, base_url: str, connector: str) -> DecodeCounters:
        text = scrape(base_url)
        seconds, nbytes = LOAD_METRICS[connector]
        return cls(
            metric_sum(text, f"{seconds}_sum"),
            metric_sum(text, f"{seconds}_count"),
            metric_sum(text, f"{nbytes}_sum"),
            metric_sum(text, EXTERNAL, source="external_kv_transfer"),
        )


def _wait_usage_zero(prefill_url: str, timeout_s: float) -> float | None:
    """Seconds until the prefill's KV cache usage reads 0 (polled every ``POLL_S``), or None if not in time."""
    started = time.monotonic()
    while metric_sum(scrape(prefill_url), USAGE) > 0:
        if time.monotonic() - started > timeout_s:
            return None
        time.sleep(POLL_S)
    return time.monotonic() - started


def _group_cpu_seconds(process: ManagedProcess) -> float:
    """CPU seconds (user + system) used so far by the live processes of ``process``'s group."""
    total = 0
    for pid in group_members(process.pid):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


def idle_cpu_percent(servers: Sequence[ManagedProcess], seconds: float = 5.0) -> dict[str, float]:
    """Each server's CPU use (% of one core) over ``seconds`` with no request in flight."""
    before = {s.name: _group_cpu_seconds(s) for s in servers}
    time.sleep(seconds)
    return {s.name: round(100 * (_group_cpu_seconds(s) - before[s.name]) / seconds, 1) for s in servers}


# ------------------------------------------------------------------------------------------------ requests
def make_prompt(length: int, seed: int, vocab: int) -> list[int]:
    """``length`` seeded token ids, avoiding ids 0-2 (the tiny model's specials)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def _vocab_size(model: str) -> int:
    try:
        return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError):
        return 2048


@dataclass
class Pair:
    connector: str
    prefill: ManagedProcess
    decode: ManagedProcess
    model: str
    max_tokens: int


def pd_request(pair: Pair, prompt: list[int], request_id: str) -> dict[str, Any]:
    """One P/D request, then what it moved: seconds (prefill, decode, KV load, until the prefill freed its blocks),
    bytes, ``external_kv_transfer`` tokens, the decode's tokens."""
    prefill_url, decode_url = _url(pair.prefill), _url(pair.decode)
    before = DecodeCounters.read(decode_url, pair.connector)
    started = time.perf_counter()
    first = completion(prefill_url, pair.model, prompt, 1, request_id, {"do_remote_decode": True})
    prefill_s = time.perf_counter() - started
    params = first.get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"{pair.connector}: the prefill returned no kv_transfer_params")
    started = time.perf_counter()
    second = completion(decode_url, pair.model, prompt, pair.max_tokens, request_id, params)
    decode_s = time.perf_counter() - started
    freed_s = _wait_usage_zero(prefill_url, FREE_WAIT_S)
    deadline = time.monotonic() + METRIC_WAIT_S
    while (after := DecodeCounters.read(decode_url, pair.connector)).load_count <= before.load_count:
        if time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    loads = after.load_count - before.load_count
    return {
        "length": len(prompt),
        "prefill_s": round(prefill_s, 4),
        "decode_s": round(decode_s, 4),
        "load_s": round(after.load_seconds - before.load_seconds, 6) if loads else None,
        "loads": int(loads),
        "bytes": int(after.load_bytes - before.load_bytes),
        "external_tokens": int(after.external_tokens - before.external_tokens),
        "freed_s": None if freed_s is None else round(freed_s, 3),
        "tokens": tokens_of(second),
    }


def robustness(pair: Pair, bad_prompt: list[int], good_prompt: list[int], reference: dict[str, list[str]]) -> dict:
    """A decode request with a live request's params but ``remote_block_ids: "zzz"``, then a normal P/D request:
    what each got, and whether the decode server still runs and answers /health afterwards."""
    prefill_url, decode_url = _url(pair.prefill), _url(pair.decode)
    tag = f"bench-{pair.connector}-zzz-{time.time_ns()}"
    live = completion(prefill_url, pair.model, bad_prompt, 1, tag, {"do_remote_decode": True})["kv_transfer_params"]
    bad = {**live, "remote_block_ids": "zzz"}
    out: dict[str, Any] = {"params": {key: ("zzz" if key == "remote_block_ids" else "...") for key in bad}}
    started = time.perf_counter()
    try:
        answer = completion(decode_url, pair.model, bad_prompt, pair.max_tokens, tag, bad, ROBUSTNESS_TIMEOUT_S)
        same = tokens_of(answer) == reference.get("zzz")
        out["malformed"] = "answered, tokens equal the reference" if same else "answered, tokens DIFFER"
    except RequestFailed as error:
        out["malformed"] = str(error)
    out["malformed_s"] = round(time.perf_counter() - started, 2)
    time.sleep(1.0)  # an engine that dies of it does so within a moment
    started = time.perf_counter()
    try:
        tag = f"bench-{pair.connector}-after-{time.time_ns()}"
        first = completion(prefill_url, pair.model, good_prompt, 1, tag, {"do_remote_decode": True})
        params = first["kv_transfer_params"]
        answer = completion(decode_url, pair.model, good_prompt, pair.max_tokens, tag, params, ROBUSTNESS_TIMEOUT_S)
        same = tokens_of(answer) == reference.get("after")
        out["next_request"] = "answered, tokens equal the reference" if same else "answered, tokens DIFFER"
        out["still_serving"] = True
    except RequestFailed as error:
        out["next_request"] = str(error)
        out["still_serving"] = False
    out["next_request_s"] = round(time.perf_counter() - started, 2)
    out["decode_process_running"] = pair.decode.exit_code() is None
    out["decode_healthy"] = pair.decode.healthy()
    return out


# ------------------------------------------------------------------------------------------------ summaries
def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100), None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _r(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """p50/p95 of decode latency, KV load and freeing (s), bytes and external tokens, over ``records``, and per
    prompt length."""
    decode = [r["decode_s"] for r in records]
    loads = [r["load_s"] for r in records if r["load_s"] is not None]
    freed = [r["freed_s"] for r in records if r["freed_s"] is not None]
    prompt_tokens = sum(r["length"] for r in records)
    external = sum(r["external_tokens"] for r in records)
    lengths = sorted({r["length"] for r in records})
    return {
        "requests": len(records),
        "decode_p50_s": _r(percentile(decode, 50)),
        "decode_p95_s": _r(percentile(decode, 95)),
        "load_p50_s": _r(percentile(loads, 50), 6),
        "load_p95_s": _r(percentile(loads, 95), 6),
        "load_mean_s": _r(sum(loads) / len(loads), 6) if loads else None,
        "requests_with_a_load": len(loads),
        "bytes_total": sum(r["bytes"] for r in records),
        "prompt_tokens": prompt_tokens,
        "external_tokens": external,
        "every_prompt_token_external": external == prompt_tokens,
        "freed_p50_s": _r(percentile(freed, 50), 3),
        "freed_max_s": _r(max(freed), 3) if freed else None,
        "freed_all": len(freed) == len(records),
        "by_length": {
            str(length): {
                "decode_p50_s": _r(percentile([r["decode_s"] for r in records if r["length"] == length], 50)),
                "load_p50_s": _r(
                    percentile([r["load_s"] for r in records if r["length"] == length and r["load_s"] is not None], 50),
                    6,
                ),
                "bytes": next(r["bytes"] for r in records if r["length"] == length),
            }
            for length in lengths
        },
    }


def _ratio(ours: float | None, nixl: float | None) -> float | None:
    return None if ours is None or not nixl else round(ours / nixl, 3)


def build_result(setup: Mapping[str, Any], runs: Mapping[str, Mapping[str, Any]], reference: list | None) -> dict:
    """The JSON result: ``runs[connector]`` holds ``requests`` (records, tokens included), ``first_request``,
    ``startup_s`` and ``robustness``; ``reference`` the plain server's tokens per request (or None)."""
    connectors: dict[str, Any] = {}
    for name, data in runs.items():
        records = data["requests"]
        connectors[name] = {
            "connector": CONNECTOR_NAMES[name],
            "startup_s": data.get("startup_s"),
            "summary": summarize(records) if records else None,
            "first_request": {k: v for k, v in (data.get("first_request") or {}).items() if k != "tokens"} or None,
            "requests": [{k: v for k, v in r.items() if k != "tokens"} for r in records],
            "robustness": data.get("robustness"),
            "load_average_1m": data.get("load_average_1m"),
            "idle_cpu_percent": data.get("idle_cpu_percent"),
            "error": data.get("error"),
        }
    tokens = {name: [r["tokens"] for r in data["requests"]] for name, data in runs.items()}
    equality: dict[str, Any] = {}
    if len(tokens) == 2 and all(tokens.values()):  # over the requests both pairs answered
        pairs = list(zip(tokens["nixl"], tokens["ours"], strict=False))
        equality["ours_vs_nixl"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
    if reference is not None:
        for name, produced in tokens.items():
            same = sum(a == b for a, b in zip(produced, reference, strict=False))
            equality[f"{name}_vs_reference"] = f"{same}/{len(produced)}"
    ratios: dict[str, Any] = {}
    if all(connectors.get(c, {}).get("summary") for c in CONNECTORS):
        ours, nixl = connectors["ours"]["summary"], connectors["nixl"]["summary"]
        for key in ("decode_p50_s", "decode_p95_s", "load_p50_s", "load_p95_s", "load_mean_s", "freed_p50_s"):
            ratios[key] = _ratio(ours[key], nixl[key])
        ratios["bytes_total"] = _ratio(ours["bytes_total"], nixl["bytes_total"])
    return {"setup": dict(setup), "connectors": connectors, "greedy_tokens_equal": equality, "ours_over_nixl": ratios}


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value * 1e3:.1f} ms" if unit == "ms" else f"{value:.3f}{unit}"
    return f"{value}{unit}"


def render_table(result: Mapping[str, Any]) -> str:
    """The human-readable table of a result from ``build_result``."""
    connectors = result["connectors"]
    names = [c for c in CONNECTORS if c in connectors]
    sums = {c: connectors[c]["summary"] or {} for c in names}
    ratios = result.get("ours_over_nixl") or {}
    rows: list[tuple[str, ...]] = [("", *(CONNECTOR_NAMES[c] for c in names), "ours / nixl")]

    def row(label: str, key: str, unit: str = "", ratio: bool = True) -> None:
        rows.append((label, *(_fmt(sums[c].get(key), unit) for c in names), _fmt(ratios.get(key)) if ratio else ""))

    row("decode latency p50", "decode_p50_s", "ms")
    row("decode latency p95", "decode_p95_s", "ms")
    row("KV load p50", "load_p50_s", "ms")
    row("KV load p95", "load_p95_s", "ms")
    row("KV load mean", "load_mean_s", "ms")
    row("bytes moved (all requests)", "bytes_total")
    row("external_kv_transfer tokens", "external_tokens", ratio=False)
    row("prompt tokens", "prompt_tokens", ratio=False)
    row("prefill freed after read p50", "freed_p50_s", "ms")
    row("prefill freed after read max", "freed_max_s", "ms", ratio=False)
    idle = [connectors[c].get("idle_cpu_percent") or {} for c in names]
    rows.append(("idle CPU % of a core (prefill, decode)", *(", ".join(map(str, i.values())) or "-" for i in idle), ""))
    first = [(connectors[c]["first_request"] or {}).get("decode_s") for c in names]
    rows.append(("first request decode (handshake)", *(_fmt(value, "ms") for value in first), ""))
    robust = [connectors[c]["robustness"] or {} for c in names]
    for key, label in (("malformed", "malformed 'zzz' request"), ("next_request", "normal request after it")):
        rows.append((label, *(str(r.get(key, "-"))[:60] for r in robust), ""))
    rows.append(("decode server still serving", *(_fmt(r.get("still_serving")) for r in robust), ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    equal = result.get("greedy_tokens_equal") or {}
    if equal:
        lines.append("greedy tokens equal: " + ", ".join(f"{k} {v}" for k, v in equal.items()))
    for c in names:
        if connectors[c].get("error"):
            lines.append(f"{CONNECTOR_NAMES[c]}: {connectors[c]['error']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the run
@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt here, so that cleanup runs."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _plan(lengths: Sequence[int], requests: int, vocab: int) -> dict[str, list[list[int]]]:
    """The prompts: a warm-up, the measured ones (lengths interleaved), and the robustness row's two. Each prompt
    differs from the others from its first token, so no request is helped by another's cached prefix."""
    seeds = iter(range(1, 10**6))
    return {
        "warmup": [make_prompt(lengths[0], next(seeds), vocab)],
        "measured": [make_prompt(lengths[i % len(lengths)], next(seeds), vocab) for i in range(requests)],
        "robustness": [make_prompt(300, next(seeds), vocab), make_prompt(300, next(seeds), vocab)],
    }


def run_bench(
    model: str,
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    requests: int = 30,
    max_tokens: int = MAX_TOKENS,
    python: str = sys.executable,
    log_dir: Path,
    startup_timeout_s: float = 900.0,
    reference: bool = True,
    order: Sequence[str] = CONNECTORS,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Both pairs, one after the other (in ``order``); returns ``build_result``'s dict. Errors of one pair are
    recorded in its entry and the other pair still runs; every server is stopped before returning or raising."""
    vocab = _vocab_size(model)
    prompts = _plan(lengths, requests, vocab)
    started_utc = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    everything: list[ManagedProcess] = []
    reference_tokens: dict[str, list[str]] = {}
    runs: dict[str, dict[str, Any]] = {}
    with _terminate_as_interrupt():
        try:
            for index, connector in enumerate(order):
                pair = Pair(
                    connector,
                    server_process(connector, "prefill", model, python, log_dir),
                    server_process(connector, "decode", model, python, log_dir),
                    model,
                    max_tokens,
                )
                plain = server_process(None, "reference", model, python, log_dir) if reference and index == 0 else None
                servers = [pair.prefill, pair.decode, *([plain] if plain else [])]
                everything += servers
                data: dict[str, Any] = {"requests": []}
                runs[connector] = data
                try:
                    log(f"{CONNECTOR_NAMES[connector]}: starting {', '.join(s.name for s in servers)}")
                    start_servers(servers, startup_timeout_s, log)
                    data["startup_s"] = {s.name: round(s.ready_after_s or 0.0, 1) for s in servers}
                    log(f"  healthy: {data['startup_s']}")
                    if plain is not None:
                        reference_tokens = _reference_tokens(plain, model, prompts, max_tokens)
                        stop_all([plain])
                        log("  reference tokens computed, plain server stopped")
                    _measure(pair, prompts, data, reference_tokens, log)
                except KeyboardInterrupt:
                    raise
                except Exception as error:
                    data["error"] = f"{type(error).__name__}: {str(error)[:2000]}"
                    log(f"  {CONNECTOR_NAMES[connector]} failed: {data['error']}")
                finally:
                    left = stop_all(servers)
                    log(f"  stopped {', '.join(s.name for s in servers)}" + (f" (still alive: {left})" if left else ""))
        finally:
            stop_all(everything)
    setup = {
        "model": model,
        "block_size": BLOCK_SIZE,
        "max_tokens": max_tokens,
        "lengths": list(lengths),
        "requests": requests,
        "cpu_bind": {role: allowed_cpu(index) for role, index in CPU_INDEX.items()},
        "order": list(order),
        "pairs": "one after the other; a plain reference server beside the first pair, stopped before measuring",
        "flags": "--dtype float32 --max-model-len 2048 --seed 0 --block-size 128, VLLM_CPU_KVCACHE_SPACE=1",
        "nixl_kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"},
        "cpus": os.cpu_count(),
        "started_utc": started_utc,
    }
    measured_reference = reference_tokens.get("measured") if reference_tokens else None
    return build_result(setup, runs, measured_reference)  # type: ignore[arg-type]


def _reference_tokens(
    plain: ManagedProcess, model: str, prompts: Mapping[str, list[list[int]]], max_tokens: int
) -> dict[str, Any]:
    url = _url(plain)

    def tokens(prompt: list[int], tag: str) -> list[str]:
        return tokens_of(completion(url, model, prompt, max_tokens, f"bench-ref-{tag}-{time.time_ns()}"))

    return {
        "measured": [tokens(p, str(i)) for i, p in enumerate(prompts["measured"])],
        "zzz": tokens(prompts["robustness"][0], "zzz"),
        "after": tokens(prompts["robustness"][1], "after"),
    }


def _measure(
    pair: Pair,
    prompts: Mapping[str, list[list[int]]],
    data: dict[str, Any],
    reference: Mapping[str, Any],
    log: Callable[[str], None],
) -> None:
    tag = f"bench-{pair.connector}"
    data["load_average_1m"] = {"before": round(os.getloadavg()[0], 2)}
    data["first_request"] = pd_request(pair, prompts["warmup"][0], f"{tag}-warmup-{time.time_ns()}")
    log(f"  warm-up: decode {data['first_request']['decode_s']:.2f} s")
    data["idle_cpu_percent"] = idle_cpu_percent([pair.prefill, pair.decode])
    log(f"  idle CPU (% of a core): {data['idle_cpu_percent']}")
    for index, prompt in enumerate(prompts["measured"]):
        record = pd_request(pair, prompt, f"{tag}-{index}-{time.time_ns()}")
        data["requests"].append(record)
        log(
            f"  {index + 1}/{len(prompts['measured'])}: {record['length']} tokens, decode {record['decode_s']:.3f} s,"
            f" load {_fmt(record['load_s'], 'ms')}, {record['bytes']} B, external {record['external_tokens']},"
            f" freed {_fmt(record['freed_s'], 'ms')}"
        )
    data["load_average_1m"]["after"] = round(os.getloadavg()[0], 2)
    log("  robustness: malformed remote_block_ids, then a normal request")
    data["robustness"] = robustness(pair, *prompts["robustness"], reference)
    log(f"  {data['robustness']}")


# ------------------------------------------------------------------------------------------------ command line
def _lengths(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or any(not 1 <= v <= 2000 for v in values):
        raise argparse.ArgumentTypeError(f"lengths must be 1..2000 tokens (max-model-len 2048): {text!r}")
    return values


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _default_model() -> str:
    for candidate in (os.environ.get(MODEL_ENV), "/work/models/tiny-llama-f32", ".models/tiny-llama-f32"):
        if candidate and (Path(candidate) / "config.json").is_file():
            return candidate
    return ".models/tiny-llama-f32"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON result to this file")
    parser.add_argument("--requests", type=_positive, default=30, help="measured requests per connector (30)")
    parser.add_argument(
        "--lengths", type=_lengths, default=list(DEFAULT_LENGTHS), help="prompt lengths, interleaved (50,677,1500)"
    )
    parser.add_argument("--max-tokens", type=_positive, default=MAX_TOKENS, help="decode tokens per request (16)")
    parser.add_argument("--model", default=None, help=f"model folder (${MODEL_ENV} or the tiny float32 model)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs vLLM (this one)")
    parser.add_argument("--log-dir", type=Path, default=None, help="server logs (runs/bench-vllm-TIMESTAMP)")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for servers to be healthy")
    parser.add_argument("--no-reference", action="store_true", help="no plain server: compare the connectors only")
    parser.add_argument("--ours-first", action="store_true", help="run PdTransferConnector's pair first")


def run(args: argparse.Namespace) -> int:
    """``pd-transfer bench vllm``: 0 when both pairs ran and every answer matched; 1 otherwise; 130 on Ctrl-C."""
    log_dir = args.log_dir or Path("runs") / time.strftime("bench-vllm-%Y%m%d-%H%M%S")
    try:
        result = run_bench(
            args.model or _default_model(),
            lengths=args.lengths,
            requests=args.requests,
            max_tokens=args.max_tokens,
            python=args.python,
            log_dir=log_dir,
            startup_timeout_s=args.startup_timeout,
            reference=not args.no_reference,
            order=("ours", "nixl") if args.ours_first else CONNECTORS,
        )
    except KeyboardInterrupt:
        print("interrupted; every server stopped", file=sys.stderr)
        return 130
    result["setup"]["log_dir"] = str(log_dir)
    text = json.dumps(result, indent=1)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    print(text if args.json else render_table(result))
    ok = all(not c.get("error") and c.get("summary") for c in result["connectors"].values())
    equal = result["greedy_tokens_equal"]
    return 0 if ok and equal and all(v.split("/")[0] == v.split("/")[1] for v in equal.values()) else 1
