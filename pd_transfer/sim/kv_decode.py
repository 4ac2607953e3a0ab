"""The KV stand-in's decode engine: a prompt's KV pulled from the prefill named in its ``kv_transfer_params``, then
checked against the KV of *its own* prompt.

The params are checked with :func:`~pd_transfer.connector.params.parse_transfer_params`, the KV pulled with
``DecodeRank.pull_confirmed`` (or relying on the prefill's hold window, as the vLLM connector does) into local
blocks and compared with :func:`~.kv_model.kv_pattern` of the prompt; the report says what moved, how long each part
took and whether it verified.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.config import ConnectorConfig
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.options import DecodeOptions
from pd_transfer.connector.params import InvalidTransferParams, RemotePrefill, parse_transfer_params
from pd_transfer.settings import Settings
from pd_transfer.sim.block_pool import BlockPool
from pd_transfer.sim.kv_model import KVModel, holds_pattern, kv_pattern
from pd_transfer.sim.verify import plane_tensors

logger = logging.getLogger(__name__)

#: What a failed pull's watched blocks are filled with (exact in every float dtype; no prompt's pattern is all of it).
CANARY = -3.5


@dataclass
class DecodeKV:
    """A TP 1 decode engine's receiving side: pulls a prompt's KV and checks it against the prompt."""

    engine_id: str
    model: KVModel
    config: ConnectorConfig
    hold_window: bool = False  # trust the prefill's hold window as the vLLM connector does (else always confirm)
    settings: Settings = field(kw_only=True)  # the process's, read at its edge
    #: seconds a failed pull's blocks are kept from reuse, a canary in them (0: given back at once; see ``failed``)
    watch_failed_s: float = field(default=0.0, kw_only=True)
    pulls: int = 0
    failures: int = 0
    bytes_moved: int = 0
    late_landings: int = 0  # watched blocks written into after their pull failed
    reports: list[dict[str, Any]] = field(default_factory=list)
    _watched: list[tuple[float, list[int]]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.layout = self.model.layout()
        self.rank = DecodeRank(
            self.engine_id,
            KVCache.allocate(self.layout, self.model.num_blocks, huge_pages=self.settings.own_huge_pages),
            DecodeOptions.from_config(self.config, self.settings),
        )
        self.pool = BlockPool(self.model.num_blocks)

    def parse(self, params: object, tokens: Sequence[int]) -> RemotePrefill:
        parsed = parse_transfer_params(params, prompt_len=len(tokens), local_block_size=self.layout.block_size)
        if not isinstance(parsed, RemotePrefill):
            raise InvalidTransferParams("do_remote_prefill", "a decode needs the params a prefill returned")
        return parsed

    def pull(self, request_id: str, remote: RemotePrefill, tokens: Sequence[int], blocks: list[int]) -> dict[str, Any]:
        """Pull ``remote`` into ``blocks`` and verify it (blocking: run it off the event loop). The report."""
        started = time.perf_counter()
        trust_until = remote.trust_deadline(time.monotonic(), time.time()) if self.hold_window else None
        num_tokens = remote.num_tokens if remote.num_tokens is not None else len(tokens)
        engine = self.rank.check_engine(remote.host, remote.port, remote.engine_id)
        if engine.tp_size != remote.tp_size:
            raise ValueError(f"tp_size {remote.tp_size} in the params, but the engine runs TP {engine.tp_size}")
        checked = time.perf_counter()
        stats = self.rank.pull_confirmed(
            remote.request_id,
            remote.host,
            remote.port,
            list(remote.block_ids),
            blocks,
            num_tokens,
            timeout_s=self.config.read_timeout_s,
            confirm_timeout_s=self.config.confirm_timeout_s,
            trust_until=trust_until,
            incarnation=remote.incarnation,
        )
        pulled = time.perf_counter()
        verified = holds_pattern(self.rank.cache, blocks, kv_pattern(self.layout, tokens[:num_tokens]))
        return {
            "request_id": request_id,
            "remote_engine_id": remote.engine_id,
            "remote": f"{remote.host}:{remote.port}",
            "tokens": num_tokens,
            "bytes": stats.bytes,
            "pushed_bytes": stats.pushed_bytes,  # of which the prefill wrote (push)
            "ms": round((pulled - started) * 1e3, 3),  # handshake (first time), reads, lease confirmation
            "pull_ms": round(stats.seconds * 1e3, 3),
            "read_ms": round(stats.read_seconds * 1e3, 3),
            # the parts of "ms": reaching the engine (handshake, NIXL peers, warm-up: first contact only), the
            # reads (first post to last completion), the layout fix-up after the last read, the lease confirmation
            "connect_ms": round((checked - started + stats.connect_seconds) * 1e3, 3),
            "fixup_exposed_ms": round(stats.postprocess_exposed_seconds * 1e3, 3),
            "confirm_ms": round(stats.confirm_seconds * 1e3, 3),
            "in_window": trust_until is not None and stats.confirm_seconds == 0.0,
            "verify_ms": round((time.perf_counter() - pulled) * 1e3, 3),
            "transport": stats.transport,
            "verified": verified,
        }

    def failed(self, request_id: str, blocks: list[int]) -> None:
        """A pull into ``blocks`` failed: give them back, or, with ``watch_failed_s``, fill them with
        :data:`CANARY` and keep them from reuse that long; :meth:`release_watched` then checks the canary. A changed
        canary is a transfer that wrote after its pull had failed (a late landing: wrong KV in the next request to
        get those blocks), counted in ``late_landings``."""
        if self.watch_failed_s <= 0:
            self.pool.give(blocks)
            return
        index = torch.tensor(blocks, dtype=torch.long)
        for plane in plane_tensors(self.rank.cache):
            plane.index_fill_(0, index.to(plane.device), CANARY)
        self._watched.append((time.monotonic() + self.watch_failed_s, blocks))
        logger.info(
            "request %s: its pull failed; %d blocks watched for %g s", request_id, len(blocks), self.watch_failed_s
        )

    def release_watched(self) -> None:
        """Check and give back the watched blocks whose time is up (see :meth:`failed`)."""
        now = time.monotonic()
        due = [blocks for until, blocks in self._watched if until <= now]
        self._watched = [(until, blocks) for until, blocks in self._watched if until > now]
        for blocks in due:
            index = torch.tensor(blocks, dtype=torch.long)
            for plane in plane_tensors(self.rank.cache):
                if not bool((plane.index_select(0, index.to(plane.device)) == CANARY).all()):
                    self.late_landings += 1
                    logger.error(
                        "blocks %s..%s were written after their pull failed (a late landing)", blocks[0], blocks[-1]
                    )
                    break
            self.pool.give(blocks)

    def state(self) -> dict[str, object]:
        self.release_watched()
        return {
            "blocks_free": self.pool.free,
            "blocks_watched": sum(len(blocks) for _, blocks in self._watched),
            "late_landings": self.late_landings,
            "digest_mismatches": self.rank.metrics.registry.get_sample_value(
                "pd_transfer_digest_checks_total", {"outcome": "mismatch"}
            )
            or 0,
            "pulls": self.pulls,
            "failures": self.failures,
            "bytes_moved": self.bytes_moved,
            "handshakes": self.rank.client.handshakes_performed,
            "last": self.reports[-1] if self.reports else None,
        }

    def close(self) -> None:
        self.rank.close()
