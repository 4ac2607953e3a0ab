"""``pd-transfer bench offload``: the offload tiers against the machine, measured side by side in one run.

* host tier: a store job (engine cache -> pool) and a load job (pool -> engine cache) through the
  :class:`~pd_transfer.offload.TransferWorker`, against a torch copy of the same bytes (one thread, like
  the tier's copies);
* disk tier: the same jobs against a :class:`~pd_transfer.offload.DirectoryTier` (a file per block, checksummed,
  temporary name and rename), against plain sequential writes and reads of the same bytes in one file.
  Neither side fsyncs, so both measure the page cache of the filesystem named in the result. Two states of
  the tier: empty (its files deleted before each store, so every block file is created; the headline) and
  full (``full_tier``: at its bound, every store evicts the oldest job's files and rewrites them). The rate
  of the payload checksum the tier computes on every store and load, and the cost of creating one file in
  that filesystem, are measured beside them, and the empty tier's jobs once more with no helper thread
  (``one_thread``: every checksum computed on the store's own thread, every file read by the load's own thread;
  the tier's defaults where the process may use two or more CPUs hash a store's files on a helper thread while it
  writes them, ``checksum_thread``, and read a load's files on its thread and a helper at once, ``read_thread``).
  The disk tier's loads, and their yardstick's reads, are timed twice each round: with the page cache warm and
  cold (``page_cache`` says how and what was resident).

Ratios are baseline / ours (1.0: as fast as the baseline), by the wall clock and by this process's CPU
seconds (``*_cpu_ratio_*``: on a machine shared with other jobs, the CPU time is the steadier of the two).
``end_to_end`` is measured by ``--end-to-end``
(:mod:`pd_transfer.bench.offload.end_to_end`, real vLLM servers).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pd_transfer.bench.offload import end_to_end
from pd_transfer.offload import (
    DEFAULT_GROUP_BLOCKS,
    DirectoryTier,
    HostPool,
    PageFormat,
    TierBlocks,
    TransferJob,
    TransferWorker,
    chain_block_keys,
    file_keys,
)
from pd_transfer.offload.checksum import payload_checksum
from pd_transfer.offload.helpers import helper_useful
from pd_transfer.offload.page_cache import DROP_METHOD, drop_from_cache, resident_fraction
from pd_transfer.spec import ModelFingerprint

GOAL_RATIO = 0.7
_GB = 1e9


@dataclass(frozen=True)
class Shape:
    """The engine cache moved: ``num_tensors`` cache tensors (one per layer) of ``page_bytes`` per block;
    ``blocks`` blocks move per job (a Llama-8B-like layer page: 16 tokens x 8 KV heads x 128 x bf16 x K,V)."""

    num_tensors: int = 32
    page_bytes: int = 65536
    blocks: int = 128
    engine_blocks: int = 160

    @property
    def block_bytes(self) -> int:
        return self.num_tensors * self.page_bytes

    @property
    def job_bytes(self) -> int:
        return self.blocks * self.block_bytes

    def page_format(self) -> PageFormat:
        model = ModelFingerprint(model="bench-llama", dtype="bfloat16", num_layers=self.num_tensors,
                                 total_num_kv_heads=8, head_size=128)  # fmt: skip
        return PageFormat(fingerprint=model, page_bytes=(self.page_bytes,) * self.num_tensors, block_size=16)


QUICK_SHAPE = Shape(num_tensors=8, page_bytes=65536, blocks=64, engine_blocks=80)


def filesystem_of(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/mounts; "unknown" elsewhere)."""
    try:
        mounts = [line.split()[:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "unknown"
    resolved = str(path.resolve())
    best = max((m for m in mounts if resolved == m[1] or resolved.startswith(m[1].rstrip("/") + "/")),
               key=lambda m: len(m[1]), default=None)  # fmt: skip
    return best[2] if best else "unknown"


def _seconds(action: Callable[[], object]) -> float:
    return _timed(action)[0]


def _timed(action: Callable[[], object]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system, every thread of this process) of ``action``."""
    cpu, started = _cpu_seconds(), time.perf_counter()
    action()
    return time.perf_counter() - started, _cpu_seconds() - cpu


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _run_job(worker: TransferWorker, job: TransferJob) -> None:
    if not worker.submit(job):
        raise RuntimeError("offload worker queue full")
    results = worker.poll(timeout=600)
    if len(results) != 1 or not results[0].ok:
        raise RuntimeError(f"offload job failed: {results[:1]}")


@dataclass(frozen=True)
class Baseline:
    """The machine's way of moving the same bytes: ``store`` and ``load`` are timed alternately with the
    tier's jobs (so both see the same load on the machine); ``reset`` runs untimed before each store;
    ``fresh_keys``: the tier stores another prompt's blocks every round; ``path``: the file ``load`` reads
    (a disk yardstick: its loads are then timed with the page cache warm and cold, as the tier's)."""

    store: Callable[[], object]
    load: Callable[[], object]
    reset: Callable[[], object]
    fresh_keys: bool = False
    path: Path | None = None


def _tier_case(tier: HostPool | DirectoryTier, cache: list[torch.Tensor], shape: Shape, repeats: int,
               scattered: bool, baseline: Baseline, *, warm_up: int = 0) -> dict:  # fmt: skip
    """Median seconds of store and load jobs of ``shape.blocks`` blocks through the worker and of the
    baseline, alternately; whether the loaded blocks equal the stored ones. ``baseline.fresh_keys``: every
    round stores another prefix (after ``warm_up`` untimed rounds), else the same one again. A disk yardstick
    (``baseline.path``): every load round times both sides warm, then cold (:func:`_load_states`)."""
    rng = np.random.default_rng(3)
    sources = rng.permutation(shape.engine_blocks)[: shape.blocks] if scattered else np.arange(shape.blocks)
    targets = rng.permutation(shape.engine_blocks)[: shape.blocks] if scattered else np.arange(shape.blocks)
    expected = [t[torch.from_numpy(sources)].clone() for t in cache]
    times: dict[str, list[tuple[float, float]]] = {"store": [], "load": [], "base_store": [], "base_load": []}
    worker = TransferWorker(cache, tier)
    states: dict[str, Any] = {}
    try:
        for round_ in range(warm_up + repeats):
            blocks = _job_blocks(tier, shape, round_ if baseline.fresh_keys else 0)
            baseline.reset()
            base = _timed(baseline.store)
            ours = _job_timed(worker, TransferJob(1, "store", _ids(sources), blocks))
            if round_ >= warm_up:
                times["base_store"].append(base)
                times["store"].append(ours)
        for t in cache:
            t.zero_()
        load = TransferJob(2, "load", _ids(targets), blocks)
        if isinstance(tier, DirectoryTier) and baseline.path is not None:
            states = _load_states(worker, load, tier, baseline, repeats, times)
        else:
            for _ in range(repeats):
                times["base_load"].append(_timed(baseline.load))
                times["load"].append(_job_timed(worker, load))
    finally:
        worker.close()
    verified = all(torch.equal(t[torch.from_numpy(targets)], e) for t, e in zip(cache, expected, strict=True))
    _fill(cache)
    medians = {name: statistics.median(wall for wall, _ in values) for name, values in times.items()}
    cpu = {f"{name}_cpu": statistics.median(cpu for _, cpu in values) for name, values in times.items()}
    return medians | cpu | {"verified": verified} | ({"page_cache": states} if states else {})


def _load_states(worker: TransferWorker, load: TransferJob, tier: DirectoryTier, baseline: Baseline, repeats: int,
                 times: dict[str, list[tuple[float, float]]]) -> dict:  # fmt: skip
    """``repeats`` rounds of the tier's load job and the yardstick's read, each timed with the page cache warm (every
    file read wholly resident: read once, untimed, if not) and then cold (every file dropped from the cache right
    before its read: :func:`~pd_transfer.offload.page_cache.drop_from_cache`), into ``times`` (warm: ``load`` and
    ``base_load``; cold: ``cold_load`` and ``base_cold_load``). Returns, per state, the fraction of the read files'
    pages in the cache right before the timed reads (lowest warm, highest cold) and whether the state was made."""
    assert baseline.path is not None
    ours = tier.files_holding(load.tier_blocks.keys, load.tier_blocks.files)
    if ours is None:
        raise RuntimeError("the tier lost a file of the job it stored")
    sides: dict[str, tuple[list[Path], Callable[[], object]]] = {
        "base_": ([baseline.path], baseline.load),
        "": (ours, lambda: _run_job(worker, load)),
    }
    times.update(cold_load=[], base_cold_load=[])
    resident: dict[str, list[float]] = {"warm": [], "cold": []}
    for _ in range(repeats):
        for prefix, (paths, read) in sides.items():
            if _resident(paths) < 1.0:
                read()  # untimed: brings every page into the cache
            resident["warm"].append(_resident(paths))
            times[f"{prefix}load"].append(_timed(read))
        for prefix, (paths, read) in sides.items():
            for path in paths:
                drop_from_cache(path)
            resident["cold"].append(_resident(paths))
            times[f"{prefix}cold_load"].append(_timed(read))
    warm, cold = min(resident["warm"]), max(resident["cold"])
    states = {
        "warm": {"resident_fraction_min": round(warm, 4), "achieved": warm == 1.0},
        "cold": {"resident_fraction_max": round(cold, 4), "achieved": cold <= _COLD_RESIDENT, "method": DROP_METHOD},
    }
    return states


#: a read counts as cold when at most this share of its files' pages was in the page cache right before it
_COLD_RESIDENT = 0.01


def _resident(paths: list[Path]) -> float:
    """The share of the pages of ``paths`` in the page cache (weighted by size); 0.0 when it cannot be told."""
    sizes = [path.stat().st_size for path in paths]
    fractions = [resident_fraction(path) or 0.0 for path in paths]
    return sum(f * s for f, s in zip(fractions, sizes, strict=True)) / max(1, sum(sizes))


def _job_timed(worker: TransferWorker, job: TransferJob) -> tuple[float, float]:
    return _timed(lambda: _run_job(worker, job))


def _job_blocks(tier: HostPool | DirectoryTier, shape: Shape, prefix: int) -> TierBlocks:
    """The keys of a ``shape.blocks``-block prompt (``prefix`` tells prompts apart) in tier rows 0.., and for
    the disk tier the file of each (its group's, as the vLLM connector names them)."""
    tokens = [prefix, *range(1, 16 * shape.blocks)]
    keys = chain_block_keys(shape.page_format().fingerprint, tokens, 16)
    files = file_keys(keys, tier.group_blocks) if isinstance(tier, DirectoryTier) else ()
    return TierBlocks(tier.name, tuple(keys), tuple(range(shape.blocks)), files)  # type: ignore[arg-type]


def _ids(blocks: np.ndarray) -> tuple[int, ...]:
    return tuple(int(b) for b in blocks)


def _fill(cache: list[torch.Tensor]) -> None:
    generator = torch.Generator().manual_seed(7)
    for t in cache:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=generator))


def _memcpy_baseline(cache: list[torch.Tensor], shape: Shape) -> Baseline:
    """A torch copy of the job's bytes (the same pages, in contiguous runs) into another buffer."""
    scratch = [torch.empty((shape.blocks, shape.page_bytes), dtype=torch.uint8) for _ in cache]

    def copy() -> None:
        for a, b in zip(cache, scratch, strict=True):
            b.copy_(a[: shape.blocks])

    return Baseline(store=copy, load=copy, reset=lambda: None)


def _file_baseline(root: Path, tier: DirectoryTier, cache: list[torch.Tensor], shape: Shape, *, full: bool) -> Baseline:
    """The job's bytes written to one new file in large sequential writes, and read back; ``reset``
    deletes that file (untimed). An empty tier (``full`` False): ``reset`` deletes the tier's block files
    too, so each store creates its files anew. A full tier: each store writes another prompt's blocks, and
    the tier evicts the oldest files to make room (what a tier in use does once it has reached its bound)."""
    views = [t[: shape.blocks].numpy() for t in cache]
    path = root / "baseline.bin"
    buffer = np.empty(shape.job_bytes, np.uint8)

    def write() -> None:
        with open(path, "wb", buffering=0) as f:
            for view in views:
                f.write(view.data)

    def read() -> None:
        with open(path, "rb", buffering=0) as f:
            assert f.readinto(buffer.data) == shape.job_bytes

    def reset() -> None:  # the fan-out directories stay, as they do in a tier in use
        path.unlink(missing_ok=True)
        for block_file in [] if full else tier.directory.glob("*/*.kv*"):
            block_file.unlink()

    return Baseline(store=write, load=read, reset=reset, fresh_keys=full, path=path)


def _rates(shape: Shape, case: dict, store_name: str, load_name: str) -> dict:
    rates = {
        f"baseline_store_gb_s ({store_name})": _rate(shape.job_bytes, case["base_store"]),
        f"baseline_load_gb_s ({load_name})": _rate(shape.job_bytes, case["base_load"]),
        "store_gb_s": _rate(shape.job_bytes, case["store"]),
        "load_gb_s": _rate(shape.job_bytes, case["load"]),
        f"store_ratio_vs_{store_name}": round(case["base_store"] / case["store"], 3),
        f"load_ratio_vs_{load_name}": round(case["base_load"] / case["load"], 3),
        f"store_cpu_ratio_vs_{store_name}": _ratio(case["base_store_cpu"], case["store_cpu"]),
        f"load_cpu_ratio_vs_{load_name}": _ratio(case["base_load_cpu"], case["load_cpu"]),
        "verified": case["verified"],
    }
    if "page_cache" not in case:
        return rates
    cold = case["page_cache"]["cold"]["achieved"]
    return rates | {
        "load_state": "page cache warm (load_*); cold: cold_load_*",
        f"baseline_cold_load_gb_s ({load_name})": _rate(shape.job_bytes, case["base_cold_load"]),
        "cold_load_gb_s": _rate(shape.job_bytes, case["cold_load"]),
        f"cold_load_ratio_vs_{load_name}": round(case["base_cold_load"] / case["cold_load"], 3) if cold else None,
        f"cold_load_cpu_ratio_vs_{load_name}": _ratio(case["base_cold_load_cpu"], case["cold_load_cpu"])
        if cold
        else None,
        "page_cache": case["page_cache"],
    }


def _ratio(baseline: float, ours: float) -> float | None:
    """``baseline / ours`` (None when the clock saw no CPU time: too small a shape)."""
    return round(baseline / ours, 3) if ours > 0 and baseline > 0 else None


def _rate(num_bytes: int, seconds: float) -> float:
    return round(num_bytes / seconds / _GB, 3)


def run(
    shape: Shape = Shape(), *, repeats: int = 5, directory: str | None = None, group_blocks: int = DEFAULT_GROUP_BLOCKS
) -> dict:
    """Run the whole benchmark; returns the JSON-ready result. ``directory``: where the disk tier's
    files go (default: a new directory under ``$TMPDIR``), removed afterwards. ``group_blocks``: the disk
    tier's blocks per group file (the per-block layout, 1, is measured beside it in the same run)."""
    torch.set_num_threads(1)
    cache = [torch.empty((shape.engine_blocks, shape.page_bytes), dtype=torch.uint8) for _ in range(shape.num_tensors)]
    _fill(cache)
    memcpy = _memcpy_baseline(cache, shape)
    pool = HostPool.create(shape.page_format(), shape.job_bytes)
    try:
        host = {label: _tier_case(pool, cache, shape, repeats, scattered, memcpy) for label, scattered in _CASES}
    finally:
        pool.close()
    root = Path(tempfile.mkdtemp(prefix="pd-offload-bench-", dir=directory))
    try:
        disk = _disk_cases(root, cache, shape, repeats, group_blocks)
        per_block = (
            _disk_cases(root, cache, shape, repeats, 1, cases=(("scattered", True),)) if group_blocks > 1 else {}
        )
        serial = _disk_cases(root, cache, shape, repeats, group_blocks, cases=(("scattered", True),),
                             helpers=False, full_tier=False)  # fmt: skip
        create_us = file_create_us(root)
        filesystem = filesystem_of(root)
        blocks = [[t[b].numpy() for t in cache] for b in range(shape.blocks)]
        crc_s = statistics.median(_seconds(lambda: [payload_checksum(b) for b in blocks]) for _ in range(repeats))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    host_result = {label: _rates(shape, case, "memcpy", "memcpy") for label, case in host.items()}
    disk_result: dict = {
        "filesystem": filesystem,
        "directory": "$TMPDIR" if directory is None else "given by --dir",
        "fsync": False,
        "checksum": "XXH3-64 of each block's pages (offload/checksum.py)",
        "checksum_gb_s": _rate(shape.job_bytes, crc_s),
        "file_create_us": create_us,
        "group_blocks": group_blocks,
        "checksum_thread": helper_useful(),  # the tier's defaults here: helper threads with 2+ CPUs
        "read_thread": helper_useful(),
    }
    disk_result |= {label: _rates(shape, case, "file_write", "file_read") for label, case in disk.items()}
    # the empty tier's scattered case again, every checksum and read on the job's own thread (the code before the
    # helper threads), in this run
    disk_result["one_thread"] = {
        label: _rates(shape, case, "file_write", "file_read") for label, case in serial.items()
    }
    if per_block:  # the same cases with a file per block (group_blocks 1), measured in this run
        disk_result["per_block"] = {
            label: _rates(shape, case, "file_write", "file_read") for label, case in per_block.items()
        }
    return _summary(shape, repeats, host_result, disk_result)


_CASES = (("contiguous", False), ("scattered", True))


def _disk_cases(
    root: Path,
    cache: list[torch.Tensor],
    shape: Shape,
    repeats: int,
    group_blocks: int,
    cases: tuple[tuple[str, bool], ...] = _CASES,
    *,
    helpers: bool | None = None,
    full_tier: bool = True,
) -> dict[str, dict]:
    """The disk tier's cases: an empty tier (``cases``: contiguous and scattered engine blocks), and a full one
    (its bound two jobs, two untimed rounds to fill it, then every store evicts the oldest job's files).
    ``helpers``: the tier's ``checksum_thread`` and ``read_thread`` (None: its defaults)."""
    fmt = shape.page_format()
    tier = DirectoryTier(root / f"tier{group_blocks}", fmt, max_bytes=4 * shape.job_bytes, group_blocks=group_blocks,
                         checksum_thread=helpers, read_thread=helpers)  # fmt: skip
    files = _file_baseline(root, tier, cache, shape, full=False)
    result = {label: _tier_case(tier, cache, shape, repeats, scattered, files) for label, scattered in cases}
    shutil.rmtree(tier.directory, ignore_errors=True)
    if not full_tier:
        return result
    groups, tail = divmod(shape.blocks, group_blocks) if group_blocks > 1 else (0, shape.blocks)
    bound = 2 * (groups * tier.group_file_bytes + tail * tier.file_bytes)  # two jobs' files
    full = DirectoryTier(root / f"full{group_blocks}", fmt, max_bytes=bound, group_blocks=group_blocks)
    baseline = _file_baseline(root, full, cache, shape, full=True)
    result["full_tier"] = _tier_case(full, cache, shape, repeats, True, baseline, warm_up=2)
    shutil.rmtree(full.directory, ignore_errors=True)
    return result


def file_create_us(directory: Path, count: int = 64) -> float:
    """Median microseconds to create (and close) one empty file in a new directory under ``directory``;
    the files are deleted afterwards (untimed)."""
    target = Path(tempfile.mkdtemp(prefix="creates-", dir=directory))
    seconds = []
    for index in range(count):
        started = time.perf_counter()
        os.close(os.open(target / str(index), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        seconds.append(time.perf_counter() - started)
    shutil.rmtree(target)
    return round(statistics.median(seconds) * 1e6, 1)


def _summary(shape: Shape, repeats: int, host: dict, disk: dict) -> dict:
    """The result, with the headline ratios (scattered engine blocks: what an engine hands over) on top."""
    for key in ("store_ratio_vs_memcpy", "load_ratio_vs_memcpy"):
        host[key] = host["scattered"][key]
    copies = [host[c][f"baseline_{d}_gb_s (memcpy)"] for c in ("contiguous", "scattered") for d in ("store", "load")]
    host["memcpy_gb_s"] = round(statistics.median(copies), 3)
    loads = ("load_ratio_vs_file_read", "load_cpu_ratio_vs_file_read", "cold_load_ratio_vs_file_read",
             "cold_load_cpu_ratio_vs_file_read")  # fmt: skip
    for case, prefix in (("scattered", ""), ("full_tier", "full_tier_")):
        for key in ("store_ratio_vs_file_write", "store_cpu_ratio_vs_file_write", *loads):
            disk[prefix + key] = disk[case][key]
    disk["page_cache"] = disk["scattered"]["page_cache"]
    disk["file_write_gb_s"] = disk["scattered"]["baseline_store_gb_s (file_write)"]
    disk["file_read_gb_s"] = disk["scattered"]["baseline_load_gb_s (file_read)"]
    disk["cold_file_read_gb_s"] = disk["scattered"]["baseline_cold_load_gb_s (file_read)"]
    goals = {"host_store": host["store_ratio_vs_memcpy"], "host_load": host["load_ratio_vs_memcpy"],
             "disk_store": disk["store_ratio_vs_file_write"]}  # fmt: skip
    for state, prefix in (("warm", ""), ("cold", "cold_")):
        goals[f"disk_load_{state}"] = disk[f"{prefix}load_ratio_vs_file_read"]
        goals[f"disk_full_tier_load_{state}"] = disk[f"full_tier_{prefix}load_ratio_vs_file_read"]
    return {
        "shape": asdict(shape),
        "job_bytes": shape.job_bytes,
        "block_bytes": shape.block_bytes,
        "repeats": repeats,
        "torch_threads": 1,
        "machine": {"cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2)},
        "units": "GB/s = 1e9 bytes per second; ratios are baseline seconds / our seconds (wall clock; *_cpu_ratio_*:"
        " CPU seconds of this process, user + system, which other jobs on the machine disturb less); disk loads:"
        " load_* with the files in the page cache (warm), cold_load_* with them dropped from it right before each"
        " read (page_cache says how and what was resident; a cold ratio is null where the cache kept the files)",
        "host_copy_gb_s": host["memcpy_gb_s"],
        "host": host,
        "disk": disk,
        "goal_ratio": GOAL_RATIO,
        "goals": {name: None if ratio is None else ratio >= GOAL_RATIO for name, ratio in goals.items()},
        "goals_met": all(ratio is not None and ratio >= GOAL_RATIO for ratio in goals.values()),
        "verified": all(part[c]["verified"] for part in (host, disk) for c in ("contiguous", "scattered"))
        and disk["full_tier"]["verified"]
        and all(case["verified"] for key in ("per_block", "one_thread") for case in disk.get(key, {}).values()),
        "end_to_end": None,
        "end_to_end_note": "measured by `bench offload --end-to-end` (real vLLM servers), not by this run",
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="a small shape, for smoke checks")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the disk tier's files go (default: $TMPDIR)")
    parser.add_argument(
        "--group-blocks", type=int, default=DEFAULT_GROUP_BLOCKS, help="the disk tier's blocks per group file"
    )
    parser.add_argument(
        "--device",
        default=None,
        help="cpu, cuda or cuda:N: only the host tier, from an engine cache there (gpu.offload)",
    )
    end_to_end.add_arguments(parser)


def cli_run(args: argparse.Namespace) -> int:
    """``pd-transfer bench offload [--json] [--quick] [--repeats N] [--dir PATH]``; ``--end-to-end``: the vLLM part
    (:mod:`pd_transfer.bench.offload.end_to_end`) instead."""
    if args.end_to_end:
        return end_to_end.cli_run(args)
    shape, repeats = (QUICK_SHAPE, 3) if args.quick else (Shape(), args.repeats)
    if args.device is not None:  # the host tier from a cache on a device (pd_transfer.bench.device)
        from pd_transfer.bench import device

        return device.offload_cli(args.device, shape, repeats, as_json=args.json)
    result = run(shape, repeats=repeats, directory=args.dir, group_blocks=args.group_blocks)
    if args.json:
        print(json.dumps(result))
    else:
        host, disk = result["host"], result["disk"]
        print(f"job: {result['job_bytes'] / 2**20:.0f} MiB; host copy {result['host_copy_gb_s']} GB/s")
        print(f"  host  store {host['store_ratio_vs_memcpy']:.3f} x memcpy, load {host['load_ratio_vs_memcpy']:.3f}")
        print(
            f"  disk ({disk['filesystem']})  store {disk['store_ratio_vs_file_write']:.3f} x plain write"
            f" ({disk['file_write_gb_s']} GB/s), load {disk['load_ratio_vs_file_read']:.3f} x plain read"
            f" ({disk['file_read_gb_s']} GB/s), cold {disk['cold_load_ratio_vs_file_read']} x plain read"
            f" ({disk['cold_file_read_gb_s']} GB/s)"
        )
        print(
            f"  disk, full tier  store {disk['full_tier_store_ratio_vs_file_write']:.3f} x plain write,"
            f" load {disk['full_tier_load_ratio_vs_file_read']:.3f} x plain read,"
            f" cold {disk['full_tier_cold_load_ratio_vs_file_read']}; creating a file {disk['file_create_us']} us"
        )
        serial = disk["one_thread"]["scattered"]
        print(
            f"  disk, no helper thread  store {serial['store_ratio_vs_file_write']:.3f} x plain write,"
            f" load {serial['load_ratio_vs_file_read']:.3f} x plain read, cold {serial['cold_load_ratio_vs_file_read']}"
        )
        for label, case in disk.get("per_block", {}).items():
            print(
                f"  disk, a file per block ({label})  store {case['store_ratio_vs_file_write']:.3f} x plain write,"
                f" load {case['load_ratio_vs_file_read']:.3f} x plain read, cold {case['cold_load_ratio_vs_file_read']}"
            )
        print(f"  verified {result['verified']}, goals met {result['goals_met']}")
    return 0 if result["verified"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pd-transfer bench offload", description=__doc__)
    add_arguments(parser)
    return cli_run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
