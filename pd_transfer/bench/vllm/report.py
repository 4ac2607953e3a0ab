"""The result of ``pd-transfer bench vllm``: per-connector summaries (p50/p95 of decode latency, KV load and
freeing), greedy-token equality across the pairs and the plain server, ratios ours / NixlConnector, and the
human-readable table."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pd_transfer.bench.vllm.pairs import CONNECTOR_NAMES, CONNECTORS

__all__ = ["build_result", "format_value", "percentile", "render_table", "summarize"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100), None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _r(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _by_length(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per prompt length: p50 of decode latency and KV load (s), and the bytes one request of it moved."""
    by_length: dict[str, dict[str, Any]] = {}
    for length in sorted({r["length"] for r in records}):
        same = [r for r in records if r["length"] == length]
        loads = [r["load_s"] for r in same if r["load_s"] is not None]
        by_length[str(length)] = {
            "decode_p50_s": _r(percentile([r["decode_s"] for r in same], 50)),
            "load_p50_s": _r(percentile(loads, 50), 6),
            "bytes": same[0]["bytes"],
        }
    return by_length


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """p50/p95 of decode latency, KV load and freeing (s), bytes and external tokens, over ``records``, and per
    prompt length."""
    decode = [r["decode_s"] for r in records]
    loads = [r["load_s"] for r in records if r["load_s"] is not None]
    freed = [r["freed_s"] for r in records if r["freed_s"] is not None]
    prompt_tokens = sum(r["length"] for r in records)
    external = sum(r["external_tokens"] for r in records)
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
        "by_length": _by_length(records),
    }


def _ratio(ours: float | None, nixl: float | None) -> float | None:
    return None if ours is None or not nixl else round(ours / nixl, 3)


def _without_tokens(record: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k != "tokens"}


def _connector_entry(name: str, data: Mapping[str, Any]) -> dict[str, Any]:
    records = data["requests"]
    return {
        "connector": CONNECTOR_NAMES[name],
        "startup_s": data.get("startup_s"),
        "summary": summarize(records) if records else None,
        "first_request": _without_tokens(data.get("first_request") or {}) or None,
        "requests": [_without_tokens(r) for r in records],
        "robustness": data.get("robustness"),
        "load_average_1m": data.get("load_average_1m"),
        "idle_cpu_percent": data.get("idle_cpu_percent"),
        "error": data.get("error"),
    }


def _equality(tokens: Mapping[str, list[list[str]]], reference: list[list[str]] | None) -> dict[str, str]:
    """ "same/requests" of greedy tokens: ours against NixlConnector's (over the requests both answered), and each
    against the plain server's."""
    equality: dict[str, str] = {}
    if len(tokens) == 2 and all(tokens.values()):
        pairs = list(zip(tokens["nixl"], tokens["ours"], strict=False))
        equality["ours_vs_nixl"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
    if reference is not None:
        for name, produced in tokens.items():
            same = sum(a == b for a, b in zip(produced, reference, strict=False))
            equality[f"{name}_vs_reference"] = f"{same}/{len(produced)}"
    return equality


def build_result(
    setup: Mapping[str, Any], runs: Mapping[str, Mapping[str, Any]], reference: list[list[str]] | None
) -> dict[str, Any]:
    """The JSON result: ``runs[connector]`` holds ``requests`` (records, tokens included), ``first_request``,
    ``startup_s`` and ``robustness``; ``reference`` the plain server's tokens per request (or None)."""
    connectors = {name: _connector_entry(name, data) for name, data in runs.items()}
    tokens = {name: [r["tokens"] for r in data["requests"]] for name, data in runs.items()}
    ratios: dict[str, Any] = {}
    if all(connectors.get(c, {}).get("summary") for c in CONNECTORS):
        ours, nixl = connectors["ours"]["summary"], connectors["nixl"]["summary"]
        for key in ("decode_p50_s", "decode_p95_s", "load_p50_s", "load_p95_s", "load_mean_s", "freed_p50_s"):
            ratios[key] = _ratio(ours[key], nixl[key])
        ratios["bytes_total"] = _ratio(ours["bytes_total"], nixl["bytes_total"])
    return {
        "setup": dict(setup),
        "connectors": connectors,
        "greedy_tokens_equal": _equality(tokens, reference),
        "ours_over_nixl": ratios,
    }


def format_value(value: Any, unit: str = "") -> str:
    """A table cell: ``-`` for None, yes/NO, seconds as ms with ``unit`` ``"ms"``, floats to 3 decimals."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value * 1e3:.1f} ms" if unit == "ms" else f"{value:.3f}{unit}"
    return f"{value}{unit}"


#: (label, summary key, unit, with a ratio column) of the table's summary rows
SUMMARY_ROWS = (
    ("decode latency p50", "decode_p50_s", "ms", True),
    ("decode latency p95", "decode_p95_s", "ms", True),
    ("KV load p50", "load_p50_s", "ms", True),
    ("KV load p95", "load_p95_s", "ms", True),
    ("KV load mean", "load_mean_s", "ms", True),
    ("bytes moved (all requests)", "bytes_total", "", True),
    ("external_kv_transfer tokens", "external_tokens", "", False),
    ("prompt tokens", "prompt_tokens", "", False),
    ("prefill freed after read p50", "freed_p50_s", "ms", True),
    ("prefill freed after read max", "freed_max_s", "ms", False),
)


def _table_rows(result: Mapping[str, Any], names: Sequence[str]) -> list[tuple[str, ...]]:
    connectors = result["connectors"]
    sums = {c: connectors[c]["summary"] or {} for c in names}
    ratios = result.get("ours_over_nixl") or {}
    rows: list[tuple[str, ...]] = [("", *(CONNECTOR_NAMES[c] for c in names), "ours / nixl")]
    for label, key, unit, ratio in SUMMARY_ROWS:
        cells = (format_value(sums[c].get(key), unit) for c in names)
        rows.append((label, *cells, format_value(ratios.get(key)) if ratio else ""))
    idle = [connectors[c].get("idle_cpu_percent") or {} for c in names]
    rows.append(("idle CPU % of a core (prefill, decode)", *(", ".join(map(str, i.values())) or "-" for i in idle), ""))
    first = [(connectors[c]["first_request"] or {}).get("decode_s") for c in names]
    rows.append(("first request decode (handshake)", *(format_value(value, "ms") for value in first), ""))
    robust = [connectors[c]["robustness"] or {} for c in names]
    for key, label in (("malformed", "malformed 'zzz' request"), ("next_request", "normal request after it")):
        rows.append((label, *(str(r.get(key, "-"))[:60] for r in robust), ""))
    rows.append(("decode server still serving", *(format_value(r.get("still_serving")) for r in robust), ""))
    return rows


def render_table(result: Mapping[str, Any]) -> str:
    """The human-readable table of a result from ``build_result``, then token equality and errors."""
    connectors = result["connectors"]
    names = [c for c in CONNECTORS if c in connectors]
    rows = _table_rows(result, names)
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
