"""Pulls between a prefill in a child process and a decode here, on one host: what the same-host IPC tests share
(test_ipc_pull.py, test_cma_pull.py)."""

from __future__ import annotations

from typing import Any

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.options import DecodeOptions
from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.peer import PrefillProcess
from pd_transfer.sim.verify import received_correctly
from pd_transfer.spec import KVCacheLayout

BLOCKS = 64
TOKENS = 100


def decode_rank(name: str, layout: KVCacheLayout, secret: str, transport: str = "auto", **more: Any) -> DecodeRank:
    """A decode rank here, of ``BLOCKS`` blocks, with a 20 s read timeout."""
    metrics = more.pop("metrics", None)
    options = DecodeOptions(settings=DEFAULTS, secret=secret, transport=transport, read_timeout_s=20.0, **more)
    return DecodeRank(name, KVCache.allocate(layout, BLOCKS), options, metrics=metrics)


def pull(decode: DecodeRank, prefill: PrefillProcess, request_id: str, first: int = 3) -> tuple[str, bool]:
    """Hold a request of ``TOKENS`` tokens on the prefill (its blocks from ``first`` on, backwards), pull it with
    confirmation into local blocks 40 on; (transport, verified)."""
    remote_block_size = prefill.spec.layouts[0].block_size
    remote_ids = list(range(first + 9, first - 1, -1))[: -(-TOKENS // remote_block_size)]
    local_ids = list(range(40, 40 + -(-TOKENS // decode.cache.layout.block_size)))
    prefill.request("hold", request_id, remote_ids)
    stats = decode.pull_confirmed(request_id, prefill.host, prefill.port, remote_ids, local_ids, TOKENS)
    verified = received_correctly(decode.cache, local_ids, prefill.spec.caches(), remote_ids, TOKENS)
    return stats.transport, verified
