"""``pd-transfer bench transfer``'s sections, run by name and printed: the default transports (CMA on one host),
``tcp`` (:mod:`.tcp`), ``tcp_netns`` (:mod:`.netns`, across a veth) and ``verify_cost`` (:mod:`.verify_cost`)."""

from __future__ import annotations

from collections.abc import Sequence

from pd_transfer.settings import Settings
from pd_transfer.sim.shape import Shape

from . import reads, tcp, verify_cost
from .netns import run_netns


def run_sections(
    sections: Sequence[str],
    shape: Shape,
    *,
    repeats: int,
    idle_seconds: float,
    wire_gbit: float | None = None,
    busy_prefill: bool = False,
    settings: Settings,
) -> dict:
    """The benchmark's sections by name: ``default`` (the transports UCX picks: CMA on one host) at the top level,
    ``tcp`` and ``tcp_netns`` (across a veth, where network namespaces can be made; ``wire_gbit``: the veth shaped
    to that rate) under their names; every one with the command's ``settings``, and with ``busy_prefill`` a
    prefill process whose engine loop holds the GIL (:class:`~pd_transfer.sim.peer.PrefillSpec`'s
    ``busy_engine``)."""
    result: dict = {}
    if "default" in sections:
        result.update(
            reads.run(shape, repeats=repeats, idle_seconds=idle_seconds, busy_prefill=busy_prefill, settings=settings)
        )
    if "tcp" in sections:
        result["tcp"] = tcp.run(
            shape, repeats=repeats, idle_seconds=idle_seconds, busy_prefill=busy_prefill, settings=settings
        )
    if "verify_cost" in sections:
        result["verify_cost"] = verify_cost.run(shape, repeats=repeats, settings=settings)
    if "tcp_netns" in sections:
        result["tcp_netns"] = run_netns(
            shape,
            repeats=repeats,
            idle_seconds=idle_seconds,
            wire_gbit=wire_gbit,
            busy_prefill=busy_prefill,
            settings=settings,
        )
    return result


def summary_lines(result: dict) -> list[str]:
    """The text form of :func:`run_sections`'s result: one line per case, then idle CPU and one-block latency."""
    lines = []
    for name, section in (("default", result), ("tcp", result.get("tcp")), ("tcp_netns", result.get("tcp_netns"))):
        if not section or "contiguous" not in section:
            if section and "skipped" in section:
                lines.append(f"{name}: skipped ({section['skipped']})")
            continue
        stream = section.get("tcp_stream", {}).get("gbps")
        wire = f", wire {section['wire_gbit']} Gbit/s" if section.get("wire_gbit") else ""
        lines.append(
            f"{name}: request {section['request_bytes'] / 2**20:.0f} MiB, connect {section['connect_ms']} ms{wire}"
        )
        for case in ("contiguous", "scattered"):
            r = section[case]
            vs_stream = f"  vs TCP stream ({stream} GiB/s) {r['ratio_vs_tcp_stream']:.3f}" if stream else ""
            lines.append(
                f"  {case:10s} {r['gbps']:6.2f} GiB/s  raw NIXL {r['raw_nixl_gbps']:6.2f}"
                f"  memcpy {r['memcpy_gbps']:6.2f}"
                f"  ratio vs raw {r['ratio_vs_raw_nixl']:.3f}{vs_stream}  verified {r['verified']}"
            )
        own = section.get("tcp_transport") or {}
        for case in ("contiguous", "scattered") if own else ():
            r = own[case]
            lines.append(
                f"  {case:10s} {r['gbps']:6.2f} GiB/s by the tcp transport  vs TCP stream ({stream} GiB/s)"
                f" {r['ratio_vs_tcp_stream']:.3f}  verified {r['verified']}"
            )
        if own:
            lines.append(f"  one-block pull by the tcp transport p50 {own['one_block_pull_p50_us']} us")
            checked = own.get("scattered_by_verify") or {}
            lines.append(
                "  scattered by the tcp transport, checked against the prefill's digests: "
                + ", ".join(
                    f"verify {mode} {r['gbps']:.2f} GiB/s ({r['cost_vs_off']} x off's time)"
                    for mode, r in checked.items()
                )
            )
        way = "pushed" if section["contiguous"].get("pushed") else "read"
        lines.append(
            f"  idle CPU {section['idle_cpu_percent']}%  one-block read p50 {section['one_block_p50_us']} us,"
            f" pull ({way}) p50 {section['one_block_pull_p50_us']} us"
        )
    if "verify_cost" in result:
        lines.extend(verify_cost.summary_lines(result["verify_cost"]))
    return lines
