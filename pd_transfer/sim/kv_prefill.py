"""The KV stand-in's prefill engine: a prompt's KV written into blocks the connector's engine-agnostic halves hold
for a decode under a lease, and poisoned once they come back.

A TP 1 engine as the connector sees it: a ``SchedulerSide`` with its side channel, one ``WorkerSide``, an
``OutputAggregator`` and a block pool; blocks are filled with :func:`~.kv_model.kv_pattern` of the prompt's tokens
and the answer carries the ``kv_transfer_params`` our vLLM connector returns (``SchedulerSide.request_finished``).
Blocks a decode read (or whose lease ended) are poisoned and reused. Once the scheduler side drains
(``SchedulerSide.drain``), a new prompt is refused with ``Draining`` before anything is computed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import msgspec
import torch
from aiohttp import web

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.config import ConnectorConfig
from pd_transfer.connector.scheduler import SchedulerSide
from pd_transfer.connector.worker import OutputAggregator, WorkerSide
from pd_transfer.settings import Settings
from pd_transfer.sim.block_pool import BlockPool
from pd_transfer.sim.kv_model import KVModel, kv_pattern, write_pattern

POISON = -0x5A5A5A5B  # every 4-byte word of a block the prefill got back (0xA5A5A5A5)


class PrefillKV:
    """A TP 1 prefill engine as the connector sees it: a scheduler side (with the side channel), one worker, an
    aggregator, a block pool. Not thread-safe: drive it from one thread (the event loop)."""

    def __init__(
        self, engine_id: str, model: KVModel, config: ConnectorConfig, settings: Settings, *, corrupt_every: int = 0
    ) -> None:
        """``corrupt_every`` N > 0: every Nth request gets one byte of its KV changed in the cache once it is held
        (after its forward, before any decode reads it: a fault the decodes' digests must catch), counted in
        ``corrupted``."""
        self.layout = model.layout()
        self.cache = KVCache.allocate(self.layout, model.num_blocks, huge_pages=settings.own_huge_pages)
        self.pool = BlockPool(model.num_blocks)
        self.worker = WorkerSide(engine_id, self.cache, config, settings=settings)
        self.scheduler = SchedulerSide(config, engine_id=engine_id, block_size=model.block_size)
        self.port = self.scheduler.start_side_channel([self.worker.rank_metadata])
        self.aggregator = OutputAggregator(1)
        self.held: dict[str, list[int]] = {}
        self.requests = 0
        self.released = 0
        self.corrupt_every = corrupt_every
        self.corrupted = 0
        self._random = random.Random(engine_id)

    def prefill(self, request_id: str, tokens: Sequence[int]) -> dict[str, object]:
        """Compute ``tokens`` (write their pattern), hold the blocks for a decode; the params for it. Raises
        ``Draining`` once the engine drains."""
        self.scheduler.refuse_new()
        count = -(-len(tokens) // self.layout.block_size)
        blocks = self.pool.take(count)
        if blocks is None:
            raise web.HTTPServiceUnavailable(
                text=msgspec.json.encode(
                    {"error": {"message": f"kv-standin prefill: {count} blocks needed, {self.pool.free} free"}}
                ).decode(),
                content_type="application/json",
            )
        write_pattern(self.cache, blocks, kv_pattern(self.layout, tokens))
        params = {"do_remote_decode": True}
        self.scheduler.get_num_new_matched_tokens(request_id, len(tokens), 0, params)
        self.scheduler.update_state_after_alloc(request_id, blocks, 0)
        delay, out = self.scheduler.request_finished(
            request_id, blocks, "length", params, num_computed_tokens=len(tokens)
        )
        if not delay or out is None:
            self._free(blocks)
            raise RuntimeError(f"kv-standin prefill: the connector did not hold request {request_id}")
        self.held[request_id] = blocks
        self.requests += 1
        self.step()  # the holds start now
        if self.corrupt_every and self.requests % self.corrupt_every == 0:
            self._corrupt(blocks)
        return out

    def _corrupt(self, blocks: list[int]) -> None:
        """Change one byte of a block of ``blocks`` (one drawn at random, in a plane and at an offset drawn too)."""
        tensor = self._random.choice(self.cache.tensors)
        block = tensor[self._random.choice(blocks)].view(torch.uint8).view(-1)
        block[self._random.randrange(block.numel())] ^= 0xFF
        self.corrupted += 1

    def step(self) -> None:
        metadata = self.scheduler.build_step_metadata()
        self.worker.start_load(metadata)
        results = self.aggregator.aggregate([self.worker.step_output()])
        self.scheduler.update_connector_output(results.finished_sending, results.finished_recving)
        for request_id in results.finished_sending:
            self._free(self.held.pop(request_id, []))
            self.released += 1

    def _free(self, blocks: list[int]) -> None:
        if blocks:
            index = torch.tensor(blocks, dtype=torch.long)
            for tensor in self.cache.tensors:
                tensor.view(torch.int32)[index] = POISON
            self.pool.give(blocks)

    def state(self) -> dict[str, object]:
        return {
            "blocks_free": self.pool.free,
            "blocks_held": self.worker.prefill.ledger.blocks_held,
            "requests_held": len(self.held),
            "requests": self.requests,
            "released": self.released,
            "corrupted": self.corrupted,
            "side_channel_port": self.port,
            "draining": self.scheduler.drain_state.draining,
        }

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()
