"""The result of ``pd-transfer bench vllm --scale``: per setup and prompt length the TTFT median and p90, per
connector its KV load and rate and whether its tokens equal the plain server's; per length and at the longest
prompt the ratios the issue sets goals for; the table; and the plot (matplotlib, where installed).

Ratios, all of medians (p50) at one prompt length:

- ``decode_ttft_ratio``: our decode TTFT over NixlConnector's (goal <= 0.8);
- ``ttft_overhead_ratio``: what P/D adds to a plain server's TTFT, ours over NixlConnector's:
  ``(ours pd_ttft - plain ttft) / (nixl pd_ttft - plain ttft)`` (goal <= 0.8; None when NixlConnector adds nothing);
- ``ttft_over_plain``: each connector's P/D TTFT over the plain server's TTFT;
- ``kv_gbps``: each connector's KV bytes over its own pull seconds, GiB/s (median over the requests).

Command line: ``python -m pd_transfer.bench.vllm.scale_report RESULT.json PLOT.png`` draws the plot of a result.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pd_transfer.bench.vllm.pairs import CONNECTOR_NAMES
from pd_transfer.bench.vllm.report import percentile

__all__ = ["GOAL", "build_scale_result", "plot_ttft", "render_scale_table"]

GOAL = 0.8
NAMES = {"plain": "plain vLLM", **CONNECTOR_NAMES}


def _r(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _stats(values: Sequence[float], key: str) -> dict[str, float | None]:
    return {f"{key}_p50_s": _r(percentile(values, 50)), f"{key}_p90_s": _r(percentile(values, 90))}


def _equal(records: Sequence[Mapping[str, Any]], reference: Sequence[Mapping[str, Any]] | None) -> str | None:
    """ "same/requests": tokens equal to the plain server's for the same prompt (None without a reference)."""
    if reference is None:
        return None
    same = sum(r["tokens"] == p["tokens"] for r, p in zip(records, reference, strict=False))
    return f"{same}/{len(records)}"


def _length_entry(same: list[Mapping[str, Any]], reference: list[Mapping[str, Any]] | None) -> dict[str, Any]:
    """One setup at one prompt length: TTFT p50/p90; for a pair also the decode's, the KV load and rate."""
    if "pd_ttft_s" not in same[0]:
        return {"requests": len(same), **_stats([r["ttft_s"] for r in same], "ttft")}
    rates = [r["bytes"] / r["load_s"] / 2**30 for r in same if r["load_s"]]
    return {
        "requests": len(same),
        **_stats([r["pd_ttft_s"] for r in same], "pd_ttft"),
        **_stats([r["decode_ttft_s"] for r in same], "decode_ttft"),
        **_stats([r["prefill_s"] for r in same], "prefill"),
        "load_p50_s": _r(percentile([r["load_s"] for r in same if r["load_s"] is not None], 50), 6),
        "bytes": same[0]["bytes"],
        "kv_gbps": _r(percentile(rates, 50), 3),
        "every_prompt_token_external": all(r["external_tokens"] == r["length"] for r in same),
        "freed_max_s": max((r["freed_s"] for r in same if r["freed_s"] is not None), default=None),
        "tokens_equal_plain": _equal(same, reference),
    }


def _setup_entry(name: str, data: Mapping[str, Any], plain: Mapping[str, Any] | None) -> dict[str, Any]:
    records = data.get("requests") or []
    by_length: dict[str, Any] = {}
    for length in sorted({r["length"] for r in records}):
        same = [r for r in records if r["length"] == length]
        reference = [r for r in (plain or {}).get("requests") or [] if r["length"] == length] if plain else None
        by_length[str(length)] = _length_entry(same, reference or None)
    return {
        "name": NAMES[name],
        "startup_s": data.get("startup_s"),
        "first_request": data.get("first_request"),
        "load_average_1m": data.get("load_average_1m"),
        "threads": data.get("threads"),
        "idle_cpu_percent": data.get("idle_cpu_percent"),
        "by_length": by_length,
        "requests": [{k: v for k, v in r.items() if k != "tokens"} for r in records],
        "error": data.get("error"),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else round(a / b, 3)


def _comparison(setups: Mapping[str, Mapping[str, Any]], length: str) -> dict[str, Any]:
    """The ratios at one prompt length (see the module's docstring)."""
    at = {name: entry["by_length"].get(length, {}) for name, entry in setups.items()}
    plain = at.get("plain", {}).get("ttft_p50_s")
    ours, nixl = at.get("ours", {}), at.get("nixl", {})
    overhead = {
        c: None if plain is None or at[c].get("pd_ttft_p50_s") is None else at[c]["pd_ttft_p50_s"] - plain
        for c in ("ours", "nixl")
        if c in at
    }
    return {
        "decode_ttft_ratio": _ratio(ours.get("decode_ttft_p50_s"), nixl.get("decode_ttft_p50_s")),
        "ttft_overhead_ratio": _ratio(overhead.get("ours"), overhead.get("nixl")),
        "ttft_over_plain": {c: _ratio(at[c].get("pd_ttft_p50_s"), plain) for c in ("ours", "nixl") if c in at},
        "kv_gbps": {c: at[c].get("kv_gbps") for c in ("ours", "nixl") if c in at},
        "tokens_equal_plain": {c: at[c].get("tokens_equal_plain") for c in ("ours", "nixl") if c in at},
    }


def _all_equal(comparisons: Mapping[str, Mapping[str, Any]]) -> bool:
    cells = [v for c in comparisons.values() for v in c["tokens_equal_plain"].values()]
    return bool(cells) and all(v is not None and v.split("/")[0] == v.split("/")[1] for v in cells)


def build_scale_result(setup: Mapping[str, Any], phases: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The JSON result: ``phases["plain"]`` and each connector's hold ``requests`` (records with tokens),
    ``first_request``, ``startup_s``, ``load_average_1m`` and maybe ``error``."""
    plain = phases.get("plain")
    setups = {name: _setup_entry(name, data, plain if name != "plain" else None) for name, data in phases.items()}
    lengths = [str(n) for n in setup["lengths"]]
    comparisons = {length: _comparison(setups, length) for length in lengths}
    longest = comparisons[lengths[-1]] if lengths else {}
    met = {
        key: None if longest.get(key) is None else longest[key] <= GOAL
        for key in ("decode_ttft_ratio", "ttft_overhead_ratio")
    }
    return {
        "longest_prompt_tokens": int(lengths[-1]) if lengths else None,
        "tokens_equal": _all_equal(comparisons),
        "decode_ttft_ratio": longest.get("decode_ttft_ratio"),
        "ttft_overhead_ratio": longest.get("ttft_overhead_ratio"),
        "ttft_over_plain": longest.get("ttft_over_plain"),
        "kv_gbps": longest.get("kv_gbps"),
        "host_copy_gbps": setup.get("host_copy_gbps"),
        "goals_met": {f"{key} <= {GOAL}": value for key, value in met.items()},
        "by_length": comparisons,
        "setup": dict(setup),
        "setups": setups,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:,.0f} ms"


def render_scale_table(result: Mapping[str, Any]) -> str:
    """A Markdown table: per prompt length, TTFT p50 of the plain server and of both pairs (P/D and decode), the
    ratios, KV rates and token equality; then errors."""
    setups = result["setups"]
    head = (
        "| prompt tokens | KV MiB | plain TTFT | NixlConnector P/D TTFT (decode) | ours P/D TTFT (decode) |"
        " decode_ttft_ratio | ttft_overhead_ratio | kv_gbps ours / nixl | tokens equal ours, nixl |"
    )
    lines = [head, "|" + "---|" * 9]
    per_token = result["setup"]["kv_bytes_per_token"]
    for length, c in result["by_length"].items():
        at = {name: entry["by_length"].get(length, {}) for name, entry in setups.items()}
        pair = {
            k: f"{_ms(at.get(k, {}).get('pd_ttft_p50_s'))} ({_ms(at.get(k, {}).get('decode_ttft_p50_s'))})"
            for k in ("nixl", "ours")
        }
        rates, equal = c["kv_gbps"], c["tokens_equal_plain"]
        lines.append(
            f"| {length} | {int(length) * per_token / 2**20:,.0f} | {_ms(at.get('plain', {}).get('ttft_p50_s'))} |"
            f" {pair['nixl']} | {pair['ours']} | {c['decode_ttft_ratio']} | {c['ttft_overhead_ratio']} |"
            f" {rates.get('ours')} / {rates.get('nixl')} | {equal.get('ours')}, {equal.get('nixl')} |"
        )
    lines += [f"{entry['name']}: {entry['error']}" for entry in setups.values() if entry.get("error")]
    return "\n".join(lines)


def plot_ttft(result: Mapping[str, Any], path: Path) -> str:
    """Draw TTFT p50 against prompt length (plain; each pair's P/D and decode TTFT) into ``path`` (PNG); a line
    saying what was written, or why nothing was (matplotlib not installed)."""
    try:  # imported by name: matplotlib is optional and untyped
        importlib.import_module("matplotlib").use("Agg")
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return "no plot: matplotlib is not installed (python -m pd_transfer.bench.vllm.scale_report draws it later)"
    lengths = [int(n) for n in result["by_length"]]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, key, style in (
        ("plain", "ttft_p50_s", "k-o"),
        ("nixl", "pd_ttft_p50_s", "C0-s"),
        ("ours", "pd_ttft_p50_s", "C1-^"),
        ("nixl", "decode_ttft_p50_s", "C0--s"),
        ("ours", "decode_ttft_p50_s", "C1--^"),
    ):
        entry = result["setups"].get(name)
        points = [(n, (entry or {}).get("by_length", {}).get(str(n), {}).get(key)) for n in lengths]
        points = [(n, value) for n, value in points if value is not None]  # a setup that failed part-way: its points
        if points:
            label = NAMES[name] + ("" if name == "plain" else (" P/D" if key.startswith("pd") else " decode only"))
            axes.plot([n for n, _ in points], [value for _, value in points], style, label=label)
    axes.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="time to first token, p50 (s)")
    axes.set_xticks(lengths, [str(n) for n in lengths])
    axes.tick_params(axis="x", which="minor", labelbottom=False)
    axes.set_title(f"TTFT at Llama-3-8B KV geometry (256 KiB/token), host copy {result['host_copy_gbps']} GiB/s")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)
    return f"plot written to {path}"


def main(argv: Sequence[str]) -> int:
    """``RESULT.json PLOT.png``: draw the plot of a saved result."""
    if len(argv) != 2:
        print("usage: python -m pd_transfer.bench.vllm.scale_report RESULT.json PLOT.png", file=sys.stderr)
        return 2
    print(plot_ttft(json.loads(Path(argv[0]).read_text()), Path(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
