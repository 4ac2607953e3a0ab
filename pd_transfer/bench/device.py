"""The ``--device`` sections of ``bench topology`` and ``bench offload``: the device's name and copy rates, and ours
against the device's own copy of the same bytes, in the same run, under the result's ``gpu`` key.

* topology: each case's pull (ours, caches on the device) against the in-process device copy of the same rows (the
  request's blocks of every prefill cache it reads, gathered with ``index_select`` on the device, a plane at a time):
  ``gpu.topology.<case>.ratio_vs_device_copy``; and against the gather limit (:func:`gather_limit`: the same rows
  gathered by one ``index_select`` over one flat view, what one kernel does): ``ratio_vs_gather_limit``;
* offload: a store job (engine cache on the device -> host pool, pinned on a CUDA device) and a load job (back) of
  scattered blocks through :class:`~pd_transfer.offload.TransferWorker`, against a pinned copy of the same bytes
  (one contiguous device buffer to pinned host memory and back): ``gpu.offload.store_ratio_vs_pinned_copy``,
  ``gpu.offload.load_ratio_vs_pinned_copy``.

Ratios are rates, ours over the yardstick's (1.0: as fast). ``--device cpu`` runs the same logic on CPU tensors (the
offload jobs through the device path, plain copies): cheap, so CI exercises the flag; its ratios say nothing about a
GPU. Timings wait for the device (``torch.cuda.synchronize``) before and after each timed action.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.offload import HostPool, PageFormat, TierBlocks, TransferJob, TransferWorker, chain_block_keys
from pd_transfer.topology import plane_views

if TYPE_CHECKING:
    from pd_transfer.connector.decode.rank import PullStats

_GB = 1e9


class Shape(Protocol):
    """What ``bench offload --device`` moves (``bench.offload.Shape`` is one): ``num_tensors`` cache tensors of
    ``page_bytes`` per block, ``blocks`` of ``engine_blocks`` moved per job of ``job_bytes``."""

    @property
    def num_tensors(self) -> int: ...
    @property
    def page_bytes(self) -> int: ...
    @property
    def blocks(self) -> int: ...
    @property
    def engine_blocks(self) -> int: ...
    @property
    def job_bytes(self) -> int: ...

    def page_format(self) -> PageFormat: ...


_PROBE_BYTES = {"cuda": 256 * 2**20, "cpu": 16 * 2**20}  # the copy-rate probe: large on a GPU, cheap on a CPU
_JOB_TIMEOUT_S = 600.0


def parse_device(text: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``, checked to exist here; raises ``ValueError`` saying why not."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device: {text[:40]!r} is not cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: {device.type} is not cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: this machine has no CUDA device (torch.cuda.is_available() is False)")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"--device {text}: there are {torch.cuda.device_count()} CUDA device(s)")
        device = torch.device("cuda", index)
    return device


def seconds_on(device: torch.device, action: Callable[[], object]) -> float:
    """Wall seconds of ``action`` with the device idle before and after (its queued work counted)."""
    _synchronize(device)
    started = time.perf_counter()
    action()
    _synchronize(device)
    return time.perf_counter() - started


def device_info(device: torch.device) -> dict:
    """The device's name and, measured now, its copy rate (device memory to device memory) and, on a CUDA device,
    the pinned copy rates to and from host memory (GB/s, 1e9 bytes a second; medians of 3)."""
    probe_bytes = _PROBE_BYTES[device.type]
    source = torch.empty(probe_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    info = {
        "device": str(device),
        "name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "copy_gb_s": _rate(probe_bytes, _median_seconds(device, lambda: target.copy_(source))),
    }
    if device.type == "cuda":
        host = torch.empty(probe_bytes, dtype=torch.uint8, pin_memory=True)
        info["pinned_d2h_gb_s"] = _rate(probe_bytes, _median_seconds(device, lambda: host.copy_(source, True)))
        info["pinned_h2d_gb_s"] = _rate(probe_bytes, _median_seconds(device, lambda: target.copy_(host, True)))
    return info


# ---------------------------------------------------------------------------------------------- the gather limit
def gather_limit(device: torch.device, planes: list[torch.Tensor], block_ids: list[int], repeats: int) -> dict:
    """What one gather kernel does with the same rows: the request's blocks of every plane in ``planes`` (each a
    ``(blocks, ...)`` tensor on ``device``) as rows of one flat view, all planes' blocks end to end (a buffer of the
    planes' size, filled once), gathered by one ``index_select`` into one output (one per row size when the planes'
    block sizes differ). Returns ``gather_limit_bytes`` and ``gather_limit_gbps`` (GiB/s, median of ``repeats``)."""
    by_row: dict[int, list[torch.Tensor]] = {}
    for plane in planes:
        by_row.setdefault(plane[0].numel() * plane.element_size(), []).append(plane)
    work: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for row_bytes, group in by_row.items():
        blocks = group[0].shape[0]
        flat = torch.empty((len(group) * blocks, row_bytes), dtype=torch.uint8, device=device)
        for i, plane in enumerate(group):
            flat[i * blocks : (i + 1) * blocks].copy_(plane.reshape(blocks, -1).view(torch.uint8))
        ids = torch.tensor(block_ids, dtype=torch.long)
        index = (torch.arange(len(group)).view(-1, 1) * blocks + ids.view(1, -1)).reshape(-1).to(device)
        work.append((flat, index, torch.empty((len(index), row_bytes), dtype=torch.uint8, device=device)))

    def gather() -> None:
        for flat, index, out in work:
            torch.index_select(flat, 0, index, out=out)

    gather()  # warm-up
    seconds = statistics.median(seconds_on(device, gather) for _ in range(repeats))
    nbytes = sum(out.numel() for _flat, _index, out in work)
    return {"gather_limit_bytes": nbytes, "gather_limit_gbps": round(nbytes / seconds / 2**30, 3)}


# ---------------------------------------------------------------------------------------------- topology
def topology_section(
    device: torch.device, cases: dict[str, tuple[list[KVCache], list[int], list[PullStats]]], repeats: int
) -> dict:
    """``gpu`` of ``bench topology --device``: for each case (the prefill caches it reads, on ``device``, the
    request's blocks there, our pulls' stats), our rate against the device copy of the same rows."""
    section: dict = device_info(device)
    section["topology"] = {
        case: _against_device_copy(device, caches, remote_ids, stats, repeats)
        for case, (caches, remote_ids, stats) in cases.items()
    }
    return section


def _against_device_copy(
    device: torch.device, caches: list[KVCache], remote_ids: list[int], stats: list[PullStats], repeats: int
) -> dict:
    planes = [plane for cache in caches for plane in plane_views(cache.tensors, cache.regions)]
    index = torch.tensor(remote_ids, dtype=torch.long, device=device)
    outputs = [torch.empty((len(remote_ids), *plane.shape[1:]), dtype=plane.dtype, device=device) for plane in planes]

    def copy_rows() -> None:
        for plane, out in zip(planes, outputs, strict=True):
            torch.index_select(plane, 0, index, out=out)

    copy_bytes = sum(out.numel() * out.element_size() for out in outputs)
    copy_seconds = statistics.median(seconds_on(device, copy_rows) for _ in range(repeats))
    ours_seconds = statistics.median(s.seconds for s in stats)
    ours, yardstick = stats[0].bytes / ours_seconds, copy_bytes / copy_seconds
    limit = gather_limit(device, planes, remote_ids, repeats)
    ours_gib = ours / 2**30
    return {
        "bytes": stats[0].bytes,
        "seconds": round(ours_seconds, 6),
        "gb_s": round(ours / _GB, 3),
        "device_copy_bytes": copy_bytes,
        "device_copy_gb_s": round(yardstick / _GB, 3),
        "ratio_vs_device_copy": round(ours / yardstick, 3),
        **limit,
        "ratio_vs_gather_limit": round(ours_gib / limit["gather_limit_gbps"], 3),
    }


# ---------------------------------------------------------------------------------------------- offload
def offload_section(device: torch.device, shape: Shape, repeats: int) -> dict:
    """``gpu`` of ``bench offload --device``: a store and a load job of ``shape.blocks`` scattered blocks between
    an engine cache on ``device`` and the host tier, against a pinned copy of the same bytes, alternately."""
    generator = torch.Generator().manual_seed(5)
    cache = [
        torch.randint(0, 256, (shape.engine_blocks, shape.page_bytes), dtype=torch.uint8, generator=generator).to(
            device
        )
        for _ in range(shape.num_tensors)
    ]
    rng = np.random.default_rng(9)
    sources = tuple(int(b) for b in rng.permutation(shape.engine_blocks)[: shape.blocks])
    targets = tuple(int(b) for b in rng.permutation(shape.engine_blocks)[: shape.blocks])
    expected = [t[list(sources)].clone() for t in cache]
    keys = chain_block_keys(shape.page_format().fingerprint, list(range(16 * shape.blocks)), 16)
    blocks = TierBlocks("host", tuple(keys), tuple(range(shape.blocks)))
    pinned = device.type == "cuda"
    device_buffer = torch.empty(shape.job_bytes, dtype=torch.uint8, device=device)
    host_buffer = torch.empty(shape.job_bytes, dtype=torch.uint8, pin_memory=pinned)
    pool = HostPool.create(shape.page_format(), shape.job_bytes, pinned=pinned)
    worker = TransferWorker(cache, pool, device_copies=True)
    times: dict[str, list[float]] = {"store": [], "load": [], "pinned_store": [], "pinned_load": []}
    try:
        for _ in range(repeats):
            times["pinned_store"].append(seconds_on(device, lambda: host_buffer.copy_(device_buffer, pinned)))
            times["store"].append(seconds_on(device, lambda: _job(worker, TransferJob(1, "store", sources, blocks))))
        for t in cache:
            t.zero_()
        for _ in range(repeats):
            times["pinned_load"].append(seconds_on(device, lambda: device_buffer.copy_(host_buffer, pinned)))
            times["load"].append(seconds_on(device, lambda: _job(worker, TransferJob(2, "load", targets, blocks))))
    finally:
        worker.close()
        pool.close()
    verified = all(torch.equal(t[list(targets)], e) for t, e in zip(cache, expected, strict=True))
    median = {name: statistics.median(values) for name, values in times.items()}
    section: dict = device_info(device)
    section["offload"] = {
        "job_bytes": shape.job_bytes,
        "blocks": shape.blocks,
        "pool_pinned": pinned,
        "store_gb_s": _rate(shape.job_bytes, median["store"]),
        "load_gb_s": _rate(shape.job_bytes, median["load"]),
        "pinned_copy_store_gb_s": _rate(shape.job_bytes, median["pinned_store"]),
        "pinned_copy_load_gb_s": _rate(shape.job_bytes, median["pinned_load"]),
        "store_ratio_vs_pinned_copy": round(median["pinned_store"] / median["store"], 3),
        "load_ratio_vs_pinned_copy": round(median["pinned_load"] / median["load"], 3),
        "verified": verified,
    }
    return section


def offload_cli(device_name: str, shape: Shape, repeats: int, *, as_json: bool) -> int:
    """``bench offload --device``: prints :func:`offload_section`'s result (exit 1 unless the blocks came back
    right, 2 for a device that is not here)."""
    try:
        device = parse_device(device_name)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    gpu = offload_section(device, shape, repeats)
    part = gpu["offload"]
    described = {"num_tensors": shape.num_tensors, "page_bytes": shape.page_bytes, "blocks": shape.blocks}
    result = {
        "shape": {**described, "engine_blocks": shape.engine_blocks},
        "repeats": repeats,
        "gpu": gpu,
        "verified": part["verified"],
    }
    if as_json:
        print(json.dumps(result))
    else:
        print(f"{gpu['name']} ({gpu['device']}): device copy {gpu['copy_gb_s']} GB/s")
        print(f"  store {part['store_ratio_vs_pinned_copy']} x pinned copy, load {part['load_ratio_vs_pinned_copy']}")
        print(f"  verified {part['verified']}")
    return 0 if part["verified"] else 1


def _job(worker: TransferWorker, job: TransferJob) -> None:
    if not worker.submit(job):
        raise RuntimeError("offload worker queue full")
    results = worker.poll(timeout=_JOB_TIMEOUT_S)
    if len(results) != 1 or not results[0].ok:
        raise RuntimeError(f"offload {job.direction} job failed: {results[:1]}")


# ---------------------------------------------------------------------------------------------- helpers
def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(device: torch.device, action: Callable[[], object], repeats: int = 3) -> float:
    action()  # warm-up
    return statistics.median(seconds_on(device, action) for _ in range(repeats))


def _rate(num_bytes: int, seconds: float) -> float:
    return round(num_bytes / seconds / _GB, 3)
