"""One run of ``pd-transfer bench vllm``: both pairs, one after the other, never together (four servers on two
cores would measure the contention between them, and NixlConnector's progress threads keep a core busy each even
when idle). A plain server (no connector) starts beside the first pair, computes the reference tokens of every
prompt and is stopped before anything is measured. Each pair gets one warm-up request (its decode includes the
connectors' handshake, reported apart), its idle CPU is measured, then the measured requests one at a time, then
the robustness row. Every process group started here is stopped at the end, also on errors, Ctrl-C and SIGTERM.

The result records no machine-specific path: the model by its folder's name, the log folder relative to the
working directory (or by its name), and error texts with those paths shortened the same way.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pd_transfer.affinity import allowed_cpu
from pd_transfer.bench.vllm.pairs import (
    BLOCK_SIZE,
    CONNECTOR_NAMES,
    CONNECTORS,
    CPU_INDEX,
    NIXL_KV_TRANSFER_CONFIG,
    Pair,
    bench_server,
    idle_cpu_percent,
    start_servers,
)
from pd_transfer.bench.vllm.report import build_result, format_value
from pd_transfer.bench.vllm.requests import Prompts, pd_request, plan_prompts, reference_tokens, vocab_size
from pd_transfer.bench.vllm.robustness import robustness
from pd_transfer.cluster.processes import ManagedProcess, stop_all

__all__ = ["DEFAULT_LENGTHS", "MAX_TOKENS", "BenchSettings", "portable_path", "run_bench"]

DEFAULT_LENGTHS = (50, 677, 1500)
MAX_TOKENS = 16
ERROR_CHARS = 2000


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class BenchSettings:
    """What a run does: the model folder, prompt ``lengths`` (tokens, interleaved), measured ``requests`` per
    pair, decode ``max_tokens``, the interpreter that runs vLLM, where logs go, the startup bound (s), whether a
    plain reference server runs, the pairs' ``order``, and where progress lines go."""

    model: str
    log_dir: Path
    lengths: Sequence[int] = DEFAULT_LENGTHS
    requests: int = 30
    max_tokens: int = MAX_TOKENS
    python: str = sys.executable
    startup_timeout_s: float = 900.0
    reference: bool = True
    order: Sequence[str] = CONNECTORS
    log: Callable[[str], None] = field(default=_stderr)


def portable_path(path: str | Path) -> str:
    """``path`` as a result may record it: as given when relative, relative to the working directory when under
    it, else only its last part (no machine-specific absolute path)."""
    given = Path(path)
    if not given.is_absolute():
        return str(given)
    try:
        return str(given.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return given.name


def _scrub(text: str, settings: BenchSettings) -> str:
    """``text`` with the model's and the log folder's absolute paths, and the working directory, shortened."""
    replacements = {str(Path(settings.model).resolve()): Path(settings.model).name}
    replacements[str(settings.log_dir.resolve())] = portable_path(settings.log_dir)
    replacements[str(Path.cwd().resolve()) + os.sep] = ""
    for old in sorted(replacements, key=len, reverse=True):
        text = text.replace(old, replacements[old])
    return text


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


def _measure(
    pair: Pair, prompts: Prompts, data: dict[str, Any], reference: Mapping[str, Any], log: Callable[[str], None]
) -> None:
    """Warm-up, idle CPU, the measured requests and the robustness row of ``pair``, recorded into ``data``."""
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
            f" load {format_value(record['load_s'], 'ms')}, {record['bytes']} B,"
            f" external {record['external_tokens']}, freed {format_value(record['freed_s'], 'ms')}"
        )
    data["load_average_1m"]["after"] = round(os.getloadavg()[0], 2)
    log("  robustness: malformed remote_block_ids, then a normal request")
    bad_prompt, good_prompt = prompts["robustness"]
    data["robustness"] = robustness(pair, bad_prompt, good_prompt, reference)
    log(f"  {data['robustness']}")


@dataclass
class _RunState:
    """What the pairs of a run share: the prompts, the reference tokens once computed, every server started."""

    prompts: Prompts
    reference: dict[str, Any] = field(default_factory=dict)
    everything: list[ManagedProcess] = field(default_factory=list)


def _run_pair(connector: str, with_plain: bool, settings: BenchSettings, state: _RunState) -> dict[str, Any]:
    """Start the pair of ``connector`` (and the plain server), measure, stop them; the pair's data. An error is
    recorded in ``data["error"]``, not raised (Ctrl-C is)."""
    model, python, log_dir, log = settings.model, settings.python, settings.log_dir, settings.log
    prefill, decode = (bench_server(connector, role, model, python, log_dir) for role in ("prefill", "decode"))
    pair = Pair(connector, prefill, decode, model, settings.max_tokens)
    plain = bench_server(None, "reference", model, python, log_dir) if with_plain else None
    servers = [pair.prefill, pair.decode, *([plain] if plain else [])]
    state.everything += servers
    data: dict[str, Any] = {"requests": []}
    try:
        log(f"{CONNECTOR_NAMES[connector]}: starting {', '.join(s.name for s in servers)}")
        start_servers(servers, settings.startup_timeout_s, log)
        data["startup_s"] = {s.name: round(s.ready_after_s or 0.0, 1) for s in servers}
        log(f"  healthy: {data['startup_s']}")
        if plain is not None:
            state.reference = reference_tokens(plain.url, model, state.prompts, settings.max_tokens)
            plain.stop()
            log("  reference tokens computed, plain server stopped")
        _measure(pair, state.prompts, data, state.reference, log)
    except Exception as error:  # recorded; the other pair still runs
        data["error"] = _scrub(f"{type(error).__name__}: {str(error)[:ERROR_CHARS]}", settings)
        log(f"  {CONNECTOR_NAMES[connector]} failed: {data['error']}")
    finally:
        left = stop_all(servers)
        log(f"  stopped {', '.join(s.name for s in servers)}" + (f" (still alive: {left})" if left else ""))
    return data


def _setup(settings: BenchSettings, started_utc: str) -> dict[str, Any]:
    return {
        "model": Path(settings.model).name,
        "block_size": BLOCK_SIZE,
        "max_tokens": settings.max_tokens,
        "lengths": list(settings.lengths),
        "requests": settings.requests,
        "cpu_bind": {role: allowed_cpu(index) for role, index in CPU_INDEX.items()},
        "order": list(settings.order),
        "pairs": "one after the other; a plain reference server beside the first pair, stopped before measuring",
        "flags": "--dtype float32 --max-model-len 2048 --seed 0 --block-size 128, VLLM_CPU_KVCACHE_SPACE=1",
        "nixl_kv_transfer_config": dict(NIXL_KV_TRANSFER_CONFIG),
        "cpus": os.cpu_count(),
        "started_utc": started_utc,
        "log_dir": portable_path(settings.log_dir),
    }


def run_bench(settings: BenchSettings) -> dict[str, Any]:
    """Both pairs, one after the other (in ``settings.order``); returns ``build_result``'s dict. Errors of one pair
    are recorded in its entry and the other pair still runs; every server is stopped before returning or raising
    (``KeyboardInterrupt`` on Ctrl-C, SIGTERM or SIGHUP)."""
    state = _RunState(plan_prompts(settings.lengths, settings.requests, vocab_size(settings.model)))
    started_utc = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    runs: dict[str, dict[str, Any]] = {}
    with _terminate_as_interrupt():
        try:
            for index, connector in enumerate(settings.order):
                runs[connector] = _run_pair(
                    connector, settings.reference and index == 0, state=state, settings=settings
                )
        finally:
            stop_all(state.everything)
    measured_reference = state.reference.get("measured") if state.reference else None
    return build_result(_setup(settings, started_utc), runs, measured_reference)
