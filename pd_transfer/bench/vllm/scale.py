"""``pd-transfer bench vllm --scale``: time to first token at Llama-3-8B's KV geometry, ours against NixlConnector.

Three setups, one after the other, never two at once: a plain vLLM server alone (the TTFT a user gets without P/D,
and the reference tokens), then for each connector a prefill (core 0) + decode (core 1) pair with the same flags
(``--dtype float32 --max-model-len 4608 --seed 0 --block-size 128``, ``VLLM_CPU_KVCACHE_SPACE=2``: one 4,096-token
request is 1 GiB of KV at 256 KiB per token, and each server holds one request at a time). Each server's whole
process runs on its core, threads that left it are put back once it is healthy (:mod:`.scale_affinity`, which says
why). Each setup gets one warm-up request (for a pair it includes the connectors' handshake), its servers' idle CPU
over 5 s, then ``requests`` per prompt length, interleaved. A P/D request is driven as a proxy drives it: the
prompt to the prefill (``max_tokens`` 1, ``do_remote_decode``), then the prompt with the returned params to the
decode, streamed. Measured from outside, the same way for both connectors:

- ``decode_ttft_s``: the decode request sent until its first streamed token (the KV load is on this path);
- ``pd_ttft_s``: the prefill hop's seconds plus ``decode_ttft_s`` (what a user of the proxy waits);
- ``ttft_s`` of the plain server: the request sent until its first streamed token;
- ``load_s`` and ``bytes``: the decode's KV load from each connector's own metrics (NixlConnector:
  ``vllm:nixl_xfer_time_seconds`` / ``vllm:nixl_bytes_transferred``; ours: ``vllm:pd_transfer_pull_seconds`` /
  ``vllm:pd_transfer_pull_bytes``), so ``kv_gbps`` (GiB/s) is each connector's bytes over its own pull seconds;
- the decode's greedy tokens, compared with the plain server's for the same prompt.

The report is built by :mod:`.scale_report`. Every server started here is stopped at the end, also on errors and
Ctrl-C (SIGTERM and SIGHUP raise it while the run lasts).
"""

from __future__ import annotations

import datetime
import json
import os
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pd_transfer.affinity import allowed_cpu
from pd_transfer.bench.vllm.pairs import CPU_INDEX, Pair, bench_server, idle_cpu_percent, start_servers
from pd_transfer.bench.vllm.requests import (
    USAGE,
    DecodeCounters,
    _counters_after,
    make_prompt,
    prefill_hop,
    vocab_size,
)
from pd_transfer.bench.vllm.run import BenchSettings, _scrub, _terminate_as_interrupt, portable_path
from pd_transfer.bench.vllm.scale_affinity import affinity_census, pinned_command, restore_strays
from pd_transfer.cluster.http_client import RequestFailed, answer_tokens, wait_metric
from pd_transfer.cluster.processes import ManagedProcess, stop_all
from pd_transfer.settings import read_settings

__all__ = ["SCALE_KVCACHE_GIB", "SCALE_LENGTHS", "SCALE_MAX_MODEL_LEN", "host_copy_gbps", "run_scale"]

SCALE_LENGTHS = (256, 1024, 4096)
SCALE_MAX_MODEL_LEN = 4608  # a 4,096-token prompt, its decoded tokens, and room
SCALE_KVCACHE_GIB = 2.0  # one 4,608-token request is 1.125 GiB at 256 KiB per token
SERVER_GIB = 3.0  # what a server of this model takes besides its KV cache
SCALE_TIMEOUT_S = 900.0  # one request: a 4,096-token prefill on one core under load
FREE_WAIT_S = 45.0  # longer than both connectors' 30 s lease
CPU_PLACEMENT = (
    "each server's whole process bound to its core at launch (sched_setaffinity before exec; every thread inherits"
    " it) and VLLM_CPU_OMP_THREADS_BIND to the same core; once healthy, every thread whose affinity no longer"
    " includes its server's core is put back on it (NixlConnector's CPU worker moves its model thread to the"
    " machine's last core, the decode's here; see setups.*.threads.moved_back); threads allowed on more cores"
    " including their own keep that: ours as PD_TRANSFER_THREAD_CPUS says (unset: widen to every CPU, as in"
    " production), NixlConnector's NIXL threads stay on their server's core"
)


def host_copy_gbps(mib: int = 256, repeats: int = 5) -> float:
    """The host's in-process copy rate, GiB/s: the median of ``repeats`` copies of ``mib`` MiB (numpy)."""
    import numpy as np

    source = np.ones(mib << 20, dtype=np.uint8)
    target = np.empty_like(source)
    np.copyto(target, source)  # touch the pages first
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(target, source)
        seconds.append(time.perf_counter() - started)
    return round((mib / 1024) / sorted(seconds)[repeats // 2], 3)


def stream_completion(
    base_url: str, model: str, prompt: Sequence[int], max_tokens: int, params: Mapping[str, object] | None, tag: str
) -> dict[str, Any]:
    """A greedy streamed ``/v1/completions`` (``logprobs`` 1): seconds to the first token and to the end, and the
    tokens. Each read of the stream is bounded by ``SCALE_TIMEOUT_S``. Raises ``RequestFailed``."""
    payload: dict[str, object] = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 1,
        "stream": True,
    }
    if params is not None:
        payload["kv_transfer_params"] = dict(params)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream", "X-Request-Id": tag}
    request = urllib.request.Request(f"{base_url}/v1/completions", json.dumps(payload).encode(), headers)
    events: list[dict[str, Any]] = []
    first: float | None = None
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=SCALE_TIMEOUT_S) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:") or (data := line.removeprefix("data:").strip()) == "[DONE]":
                    continue
                events.append(json.loads(data))
                if first is None and answer_tokens(events[-1:]):
                    first = time.perf_counter() - started
    except (OSError, ValueError) as error:  # URLError and HTTPError are OSErrors; ValueError: bad JSON, no logprobs
        raise RequestFailed(base_url, f"{type(error).__name__}: {str(error)[:200]}") from None
    total = time.perf_counter() - started
    return {"ttft_s": round(first if first is not None else total, 4), "total_s": round(total, 4), "events": events}


def scale_prompts(lengths: Sequence[int], requests: int, vocab: int) -> dict[str, list[list[int]]]:
    """A warm-up prompt (the shortest length) and ``requests`` prompts per length, interleaved; seeded, each
    different from the others from its first token."""
    seeds = iter(range(1, 10**6))
    measured = [make_prompt(n, next(seeds), vocab) for _ in range(requests) for n in lengths]
    return {"warmup": [make_prompt(min(lengths), next(seeds), vocab)], "measured": measured}


def plain_request(server: ManagedProcess, model: str, prompt: Sequence[int], max_tokens: int, tag: str) -> dict:
    """One request to the plain server: its length, TTFT and total seconds, tokens."""
    answer = stream_completion(server.url, model, prompt, max_tokens, None, tag)
    tokens = answer_tokens(answer["events"])
    return {"length": len(prompt), "ttft_s": answer["ttft_s"], "total_s": answer["total_s"], "tokens": tokens}


def pd_stream_request(pair: Pair, prompt: list[int], tag: str) -> dict[str, Any]:
    """One P/D request, the decode hop streamed: prefill seconds, decode TTFT and total, P/D TTFT, the KV load's
    seconds and bytes from the decode's metrics, ``external_kv_transfer`` tokens, seconds until the prefill's
    blocks are free, tokens. Raises ``RequestFailed``, ``RuntimeError`` on a prefill without params."""
    before = DecodeCounters.read(pair.decode.url, pair.connector)
    started = time.perf_counter()
    params = prefill_hop(pair, prompt, tag, SCALE_TIMEOUT_S).get("kv_transfer_params")
    prefill_s = time.perf_counter() - started
    if not params:
        raise RuntimeError(f"{pair.connector}: the prefill returned no kv_transfer_params")
    answer = stream_completion(pair.decode.url, pair.model, prompt, pair.max_tokens, params, tag)
    freed = wait_metric(pair.prefill.url, USAGE, lambda usage: usage <= 0, FREE_WAIT_S)
    after = _counters_after(pair, before)
    loads = after.load_count - before.load_count
    return {
        "length": len(prompt),
        "prefill_s": round(prefill_s, 4),
        "decode_ttft_s": answer["ttft_s"],
        "decode_total_s": answer["total_s"],
        "pd_ttft_s": round(prefill_s + answer["ttft_s"], 4),
        "load_s": round(after.load_seconds - before.load_seconds, 6) if loads else None,
        "loads": int(loads),
        "bytes": int(after.load_bytes - before.load_bytes),
        "external_tokens": int(after.external_tokens - before.external_tokens),
        "freed_s": round(freed.seconds, 3) if freed.reached else None,
        "tokens": answer_tokens(answer["events"]),
    }


@dataclass
class _Scale:
    """A scale run's settings, prompts and every server it started."""

    settings: BenchSettings
    prompts: dict[str, list[list[int]]]
    max_model_len: int
    kvcache_gib: float
    extra_args: tuple[str, ...]
    everything: list[ManagedProcess]
    cores: dict[str, set[int]] = field(default_factory=dict)  # server name -> the CPU its process is bound to

    def server(self, connector: str | None, role: str) -> ManagedProcess:
        """A server of ``role`` (not started), its whole process bound to its role's core
        (``vllm_scale_affinity``)."""
        s = self.settings
        server = bench_server(
            connector,
            role,
            s.model,
            s.python,
            s.log_dir,
            max_model_len=self.max_model_len,
            kvcache_gib=self.kvcache_gib,
            extra_args=self.extra_args,
        )
        self.cores[server.name] = {int(allowed_cpu(CPU_INDEX[role]))}
        server.command = pinned_command(self.cores[server.name], server.command)
        self.everything.append(server)
        return server

    def place_threads(self, servers: Sequence[ManagedProcess]) -> dict[str, Any]:
        """Put back on its server's core every thread that left it (``restore_strays``); per server what was
        moved and then how many threads may run where."""
        placed = {}
        for server in servers:
            moved = restore_strays(server.pid, self.cores[server.name])
            placed[server.name] = {"moved_back": moved, "threads_by_cpus": affinity_census(server.pid)}
        return placed


def _phase(
    run: _Scale, name: str, servers: list[ManagedProcess], measure: Callable[[list[int], str], dict[str, Any]]
) -> dict[str, Any]:
    """Start ``servers``, a warm-up and the measured requests through ``measure``, stop them; the phase's data
    (an error recorded in ``data["error"]``, not raised; Ctrl-C is)."""
    log = run.settings.log
    data: dict[str, Any] = {"requests": []}
    try:
        log(f"{name}: starting {', '.join(s.name for s in servers)}")
        start_servers(servers, run.settings.startup_timeout_s, log, SERVER_GIB + run.kvcache_gib)
        data["startup_s"] = {s.name: round(s.ready_after_s or 0.0, 1) for s in servers}
        data["threads"] = run.place_threads(servers)
        log(f"  threads: {data['threads']}")
        data["load_average_1m"] = {"before": round(os.getloadavg()[0], 2)}
        data["first_request"] = measure(run.prompts["warmup"][0], f"scale-{name}-warmup-{time.time_ns()}")
        data["first_request"].pop("tokens")
        log(f"  warm-up: {data['first_request']}")
        data["idle_cpu_percent"] = idle_cpu_percent(servers)
        log(f"  idle CPU (% of a core): {data['idle_cpu_percent']}")
        for index, prompt in enumerate(run.prompts["measured"]):
            record = measure(prompt, f"scale-{name}-{index}-{time.time_ns()}")
            data["requests"].append(record)
            shown = {k: v for k, v in record.items() if k != "tokens"}
            log(f"  {index + 1}/{len(run.prompts['measured'])}: {shown}")
        data["load_average_1m"]["after"] = round(os.getloadavg()[0], 2)
    except Exception as error:  # recorded; the next setup still runs
        data["error"] = _scrub(f"{type(error).__name__}: {str(error)[:2000]}", run.settings)
        log(f"  {name} failed: {data['error']}")
    finally:
        left = stop_all(servers)
        log(f"  stopped {', '.join(s.name for s in servers)}" + (f" (still alive: {left})" if left else ""))
    return data


def _plain_phase(run: _Scale) -> dict[str, Any]:
    plain = run.server(None, "reference")
    s = run.settings

    def measure(prompt: list[int], tag: str) -> dict[str, Any]:
        return plain_request(plain, s.model, prompt, s.max_tokens, tag)

    return _phase(run, "plain", [plain], measure)


def _pair_phase(run: _Scale, connector: str) -> dict[str, Any]:
    s = run.settings
    pair = Pair(connector, run.server(connector, "prefill"), run.server(connector, "decode"), s.model, s.max_tokens)
    return _phase(run, connector, [pair.prefill, pair.decode], lambda p, tag: pd_stream_request(pair, p, tag))


def _setup(run: _Scale, started_utc: str, copy_gbps: float) -> dict[str, Any]:
    from pd_transfer.bench.vllm.model import kv_bytes_per_token

    settings = run.settings
    kv = (
        f"VLLM_CPU_KVCACHE_SPACE={run.kvcache_gib:g}"
        if run.kvcache_gib.is_integer()
        else (f"--kv-cache-memory-bytes {int(run.kvcache_gib * 2**30)}")
    )
    return {
        "model": portable_path(settings.model),
        "geometry": "Llama-3-8B KV: 32 layers, 8 KV heads x 128, float32 (8 attention heads, hidden 256)",
        "kv_bytes_per_token": kv_bytes_per_token("float32"),
        "lengths": list(settings.lengths),
        "requests_per_length": settings.requests,
        "max_tokens": settings.max_tokens,
        "order": ["plain", *settings.order],
        "setups": "one after the other, never two at once; prefill on core 0, decode on core 1, plain on core 0",
        "cpu_placement": CPU_PLACEMENT,
        "pd_transfer_thread_cpus": read_settings().thread_cpus,  # what the servers inherit
        "flags": f"--dtype float32 --max-model-len {run.max_model_len} --seed 0 --block-size 128"
        + "".join(f" {arg}" for arg in run.extra_args)
        + f", {kv}",
        "ttft": "from outside: decode_ttft_s = decode request sent to first streamed token; pd_ttft_s = prefill"
        " hop + decode_ttft_s; plain ttft_s = request sent to first streamed token",
        "kv_gbps_unit": "GiB/s: KV bytes over pull seconds, each connector's own metrics",
        "host_copy_gbps": copy_gbps,
        "cpus": os.cpu_count(),
        "started_utc": started_utc,
        "log_dir": portable_path(settings.log_dir),
    }


def run_scale(
    settings: BenchSettings,
    *,
    max_model_len: int = SCALE_MAX_MODEL_LEN,
    kvcache_gib: float = SCALE_KVCACHE_GIB,
    extra_args: Sequence[str] = (),
) -> dict[str, Any]:
    """The plain server, then each connector's pair (``settings.order``), one after the other, each server with
    ``max_model_len`` tokens, ``kvcache_gib`` GiB of KV cache and ``extra_args`` (vLLM flags); the result of
    ``vllm_scale_report.build_scale_result``. ``settings.requests`` is per prompt length. Every server is stopped
    before returning or raising (``KeyboardInterrupt`` on Ctrl-C, SIGTERM or SIGHUP)."""
    from pd_transfer.bench.vllm.scale_report import build_scale_result

    started_utc = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    copy_gbps = host_copy_gbps()
    settings.log(f"host copy rate {copy_gbps} GiB/s, load average {os.getloadavg()[0]:.2f}")
    prompts = scale_prompts(settings.lengths, settings.requests, vocab_size(settings.model))
    run = _Scale(settings, prompts, max_model_len, float(kvcache_gib), tuple(extra_args), [])
    phases: dict[str, dict[str, Any]] = {}
    with _terminate_as_interrupt():
        try:
            phases["plain"] = _plain_phase(run)
            for connector in settings.order:
                phases[connector] = _pair_phase(run, connector)
        finally:
            stop_all(run.everything)
    return build_scale_result(_setup(run, started_utc, copy_gbps), phases)
