"""``pd-transfer bench transfer --tcp``: the transfer benchmark with UCX forced onto TCP, against the raw limit of
that path measured in the same run: a plain TCP stream between the same two endpoints (two processes, Python
sockets; ``iperf3`` too where installed) and raw NIXL on the same descriptors.

With TCP a NIXL READ is emulated by the target: the prefill's progress thread serves it, so its polling decides
latency and throughput (see :mod:`pd_transfer.transfer.progress`). The UCX settings come from
:data:`pd_transfer.transfer.tcp.TCP_UCX_ENV` (the user's own ``UCX_*`` variables win), put in this process's
environment for the section (:func:`pd_transfer.settings.process_environment`: UCX reads them there, and the prefill
process inherits them); the JSON names them and the transports UCX chose. GiB/s throughout (``gbps`` keys, 2**30
bytes per second).

Over TCP the decode asks the prefill to push (``PD_TRANSFER_PUSH=auto``,
:mod:`pd_transfer.connector.transports.nixl.push_writer`): the ``gbps`` and ``ratio_vs_tcp_stream`` keys are then
the pushed pulls, and ``read_gbps``, ``read_ratio_vs_tcp_stream`` the same requests read (by a second decode rank that
never asks to push), each right after its pushed twin. ``tcp_transport`` holds the same requests pulled by the built-in
``tcp`` transport instead of NIXL (:mod:`.own_tcp`), with its own ``ratio_vs_tcp_stream``.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

import torch

from pd_transfer.settings import Settings, process_environment
from pd_transfer.sim.shape import Shape
from pd_transfer.transfer.tcp import tcp_ucx_env

from . import own_tcp, reads
from .tcp_stream import iperf3_gbps, stream_gbps
from .ucx_transports import ucx_transports


def request_bytes_of(shape: Shape) -> int:
    """Bytes of one request of ``shape`` (K and V of every layer), what the benchmark's reads move."""
    itemsize = torch.empty(0, dtype=getattr(torch, shape.dtype)).element_size()
    per_token = shape.num_layers * 2 * shape.num_kv_heads * shape.head_size * itemsize
    return shape.request_blocks * shape.block_size * per_token


def run(
    shape: Shape,
    *,
    repeats: int = 5,
    idle_seconds: float = 5.0,
    read_lanes: int | None = None,
    extra_env: Mapping[str, str] | None = None,
    prefill_host: str = "127.0.0.1",
    decode_host: str = "127.0.0.1",
    stream_prefix: Sequence[str] = (),
    prefill_options: dict[str, str] | None = None,
    busy_prefill: bool = False,
    settings: Settings,
) -> dict:
    """The transfer benchmark over UCX's tcp transport, the TCP stream measured before and after it (the median of
    both is the stream's rate the ratios use). ``extra_env``: UCX settings to try on top of the defaults;
    ``prefill_host``, ``stream_prefix`` and ``prefill_options`` (``netns``, ``ucx_net_devices``) put the prefill
    and the stream's sender elsewhere (another network namespace); the stream's receiver listens on
    ``decode_host``. ``busy_prefill`` and ``settings``: as :func:`.reads.run` takes them."""
    env = {**tcp_ucx_env(settings), "UCX_TLS": "tcp,self", **(extra_env or {})}
    with process_environment(env):
        request_bytes = request_bytes_of(shape)
        before = stream_gbps(request_bytes, repeats, host=decode_host, prefix=stream_prefix)
        result = reads.run(
            shape,
            repeats=repeats,
            idle_seconds=idle_seconds,
            read_lanes=read_lanes,
            prefill_options={"host": prefill_host, **(prefill_options or {})},
            busy_prefill=busy_prefill,
            settings=settings,
        )
        ours = own_tcp.run(
            shape, repeats=repeats, prefill_options={"host": prefill_host, **(prefill_options or {})}, settings=settings
        )
        after = stream_gbps(request_bytes, repeats, host=decode_host, prefix=stream_prefix)
        iperf3 = iperf3_gbps(4 * request_bytes, host=decode_host, prefix=stream_prefix)
        transports = ucx_transports()
    stream = statistics.median([before["gbps"], after["gbps"]])
    stream_cpus = [run["cpu_seconds_per_gib"] for run in (before, after) if run["cpu_seconds_per_gib"] is not None]
    stream_cpu = statistics.median(stream_cpus) if stream_cpus else None
    for case in ("contiguous", "scattered"):
        read_way = ("read_",) if "read_gbps" in result[case] else ()  # our pulls read beside pushed ones
        for way in ("", *read_way, "raw_nixl_", "raw_nixl_write_") if stream_cpu else ():  # a GiB's CPU, the stream's
            result[case][f"{way}cpu_ratio_vs_tcp_stream"] = round(
                result[case][f"{way}cpu_seconds_per_gib"] / stream_cpu, 3
            )
        result[case]["ratio_vs_tcp_stream"] = round(result[case]["gbps"] / stream, 3)
        for way in read_way:
            result[case][f"{way}ratio_vs_tcp_stream"] = round(result[case][f"{way}gbps"] / stream, 3)
        result[case]["raw_nixl_ratio_vs_tcp_stream"] = round(result[case]["raw_nixl_gbps"] / stream, 3)
        result[case]["raw_nixl_write_ratio_vs_tcp_stream"] = round(result[case]["raw_nixl_write_gbps"] / stream, 3)
    for case in ("contiguous", "scattered"):
        ours[case]["ratio_vs_tcp_stream"] = round(ours[case]["gbps"] / stream, 3)
        if stream_cpu:
            ours[case]["cpu_ratio_vs_tcp_stream"] = round(ours[case]["cpu_seconds_per_gib"] / stream_cpu, 3)
    result["tcp_transport"] = ours
    result["settings"]["ucx_transports"] = transports
    result["tcp_stream"] = {
        "gbps": stream,
        "before_gbps": before["gbps"],
        "after_gbps": after["gbps"],
        "bytes": request_bytes,
        "bytes_ok": before["bytes_ok"] and after["bytes_ok"],
        "cpu_seconds_per_gib": stream_cpu,
        "iperf3_gbps": iperf3,
    }
    return result
