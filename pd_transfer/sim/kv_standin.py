"""Stand-in prefill and decode servers that move real KV: :mod:`pd_transfer.sim.http_standin`'s HTTP surface and
``kv_transfer_params`` flow, with a real KV cache, real NIXL reads and a real ZMQ side channel. For tests and demos
of the whole P/D path (proxy included) without a model, on one host or across hosts.

- role ``prefill``: a prompt with ``do_remote_decode`` gets blocks in a :class:`KVCache` served by the connector's
  engine-agnostic halves (``SchedulerSide`` with its side channel, one ``WorkerSide``); they are filled with
  :func:`kv_pattern` of the prompt's tokens and held under a lease, and the answer carries the
  ``kv_transfer_params`` our vLLM connector returns (``SchedulerSide.request_finished``). Blocks a decode read (or
  whose lease ended) are poisoned and reused.
- role ``decode``: ``kv_transfer_params`` are checked with :func:`~pd_transfer.connector.params.parse_transfer_params`,
  the KV pulled with ``DecodeRank.pull_confirmed`` into local blocks and compared with :func:`kv_pattern` of *its own*
  prompt. The completion's first word (streamed or not) is the transfer report as compact JSON, and non-streamed
  answers also carry it as ``kv_transfer``: ``{"bytes", "ms", "pull_ms", "verified", ...}``. A failed pull or a
  mismatch answers 500 naming it; malformed params 400.
- ``GET /control/kv``: the engine's state (blocks free and held, pulls, bytes moved).

Tokens: a prompt of token ids is used as is; text is split on whitespace and each word hashed (CRC-32).
``python -m pd_transfer.sim.kv_standin --role prefill|decode --port N --side-channel-host H
--side-channel-port N`` prints ``kv-standin ROLE URL`` once it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import logging
import signal
import sys
import time
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
from aiohttp import web

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.config import ConnectorConfig
from pd_transfer.connector.decode import DecodeRank
from pd_transfer.connector.params import InvalidTransferParams, RemotePrefill, parse_transfer_params
from pd_transfer.connector.scheduler import SchedulerSide
from pd_transfer.connector.worker import OutputAggregator, WorkerSide
from pd_transfer.proxy.server import REQUEST_ID
from pd_transfer.sim.http_standin import StandIn, error_response, json_response, prompt_text
from pd_transfer.sim.verify import logical, plane_tensors
from pd_transfer.spec import KVCacheLayout, ModelFingerprint

logger = logging.getLogger(__name__)

POISON = -0x5A5A5A5B  # every 4-byte word of a block the prefill got back (0xA5A5A5A5)
_STEP_S = 0.005  # the prefill engine's step: collects blocks freed by readers and expired leases
_REPORT: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("kv_report", default=None)


class KVModel(msgspec.Struct, frozen=True, kw_only=True):
    """The stand-in model's KV cache shape (both sides must agree, as with a real model)."""

    layers: int = 4
    kv_heads: int = 4
    head_size: int = 64
    dtype: str = "bfloat16"
    block_size: int = 16
    num_blocks: int = 1024

    def layout(self) -> KVCacheLayout:
        fingerprint = ModelFingerprint(
            model="kv-standin",
            dtype=self.dtype,
            num_layers=self.layers,
            total_num_kv_heads=self.kv_heads,
            head_size=self.head_size,
        )
        return KVCacheLayout(fingerprint=fingerprint, tp_size=1, tp_rank=0, block_size=self.block_size)


def prompt_tokens(body: dict[str, Any]) -> list[int]:
    """The prompt as token ids: a list of ints as is, text as the CRC-32 of each whitespace-separated word."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [int(t) & 0x7FFFFFFF for t in prompt]
    return [zlib.crc32(word.encode()) & 0x7FFFFFFF for word in prompt_text(body).split()]


def kv_pattern(layout: KVCacheLayout, tokens: Sequence[int]) -> torch.Tensor:
    """The KV of ``tokens`` as int32 words, (planes, tokens, local heads, words per head): a hash of (token id,
    position, plane, global head, word), so a block of another request, position or head never matches."""
    planes = layout.fingerprint.num_layers * (1 if layout.fingerprint.use_mla else 2)
    words = layout.fingerprint.head_size * layout.element_size // 4
    first = layout.first_global_head
    ids = torch.tensor(list(tokens), dtype=torch.int64)
    mixed = (
        torch.arange(planes, dtype=torch.int64).view(-1, 1, 1, 1) * 0xC2B2AE3D
        + (ids * 0x9E3779B1 + torch.arange(len(ids), dtype=torch.int64) * 0x85EBCA77).view(1, -1, 1, 1)
        + torch.arange(first, first + layout.num_local_heads, dtype=torch.int64).view(1, 1, -1, 1) * 0x27D4EB2F
        + torch.arange(words, dtype=torch.int64).view(1, 1, 1, -1) * 0x165667B1
    )
    mixed ^= mixed >> 15
    return (mixed & 0xFFFFFFFF).to(torch.int32)


def write_pattern(cache: KVCache, block_ids: Sequence[int], pattern: torch.Tensor) -> None:
    """Write ``pattern`` (from :func:`kv_pattern`) into ``block_ids`` in token order; the tail of the last block
    is zeroed."""
    layout = cache.layout
    tokens = pattern.shape[1]
    slots = len(block_ids) * layout.block_size
    index = torch.tensor(list(block_ids), dtype=torch.long)
    for plane, values in zip(plane_tensors(cache), pattern, strict=True):
        words = plane.view(torch.int32)
        padded = torch.zeros((slots, *values.shape[1:]), dtype=torch.int32)
        padded[:tokens] = values
        blocks = padded.view(len(block_ids), layout.block_size, *values.shape[1:])
        words[index] = blocks.permute(0, 2, 1, 3) if layout.layout == "HND" else blocks


def holds_pattern(cache: KVCache, block_ids: Sequence[int], pattern: torch.Tensor) -> bool:
    """True when ``block_ids`` hold ``pattern`` bit for bit, read through the cache's own layout
    (:func:`pd_transfer.sim.verify.logical`, not the transfer plan)."""
    got = logical(cache, list(block_ids), pattern.shape[1]).contiguous().view(torch.int32)
    return torch.equal(got, pattern)


class BlockPool:
    """Free block ids of one cache."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        return [self._free.pop() for _ in range(count)]

    def give(self, block_ids: Sequence[int]) -> None:
        self._free.extend(reversed(block_ids))


class PrefillKV:
    """A TP 1 prefill engine as the connector sees it: a scheduler side (with the side channel), one worker, an
    aggregator, a block pool. Not thread-safe: drive it from one thread (the event loop)."""

    def __init__(self, engine_id: str, model: KVModel, config: ConnectorConfig) -> None:
        self.layout = model.layout()
        self.cache = KVCache.allocate(self.layout, model.num_blocks)
        self.pool = BlockPool(model.num_blocks)
        self.worker = WorkerSide(engine_id, self.cache, config)
        self.scheduler = SchedulerSide(config, engine_id=engine_id, block_size=model.block_size)
        self.port = self.scheduler.start_side_channel([self.worker.rank_metadata])
        self.aggregator = OutputAggregator(1)
        self.held: dict[str, list[int]] = {}
        self.requests = 0
        self.released = 0

    def prefill(self, request_id: str, tokens: Sequence[int]) -> dict[str, object]:
        """Compute ``tokens`` (write their pattern), hold the blocks for a decode; the params for it."""
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
        return out

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
            "side_channel_port": self.port,
        }

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()


@dataclass
class DecodeKV:
    """A TP 1 decode engine's receiving side: pulls a prompt's KV and checks it against the prompt."""

    engine_id: str
    model: KVModel
    config: ConnectorConfig
    hold_window: bool = False  # trust the prefill's hold window as the vLLM connector does (else always confirm)
    pulls: int = 0
    failures: int = 0
    bytes_moved: int = 0
    reports: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.layout = self.model.layout()
        self.rank = DecodeRank(
            self.engine_id,
            KVCache.allocate(self.layout, self.model.num_blocks),
            secret=self.config.secret,
            handshake_timeout_s=self.config.handshake_timeout_s,
            read_timeout_s=self.config.read_timeout_s,
            confirm_timeout_s=self.config.confirm_timeout_s,
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
            "verified": verified,
        }

    def state(self) -> dict[str, object]:
        return {
            "blocks_free": self.pool.free,
            "pulls": self.pulls,
            "failures": self.failures,
            "bytes_moved": self.bytes_moved,
            "handshakes": self.rank.client.handshakes_performed,
            "last": self.reports[-1] if self.reports else None,
        }

    def close(self) -> None:
        self.rank.close()


class KVStandIn(StandIn):
    """A :class:`StandIn` whose prefill holds real KV and whose decode pulls and verifies it."""

    def __init__(self, role: str, engine: PrefillKV | DecodeKV, **kwargs: Any) -> None:
        super().__init__(role, **kwargs)
        self.engine = engine
        self.app.router.add_get("/control/kv", self._control_kv)
        self._stepper: asyncio.Task[None] | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        url = await super().start(host, port)
        if isinstance(self.engine, PrefillKV):
            self._stepper = asyncio.get_running_loop().create_task(self._step_forever(self.engine))
        return url

    async def stop(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stepper
            self._stepper = None
        await super().stop()

    async def _step_forever(self, engine: PrefillKV) -> None:
        while True:
            try:
                engine.step()
            except Exception:
                logger.exception("kv-standin prefill: step failed")
            await asyncio.sleep(_STEP_S)

    async def _control_kv(self, _request: web.Request) -> web.Response:
        return json_response({"role": self.role, "engine_id": self.engine_id, **self.engine.state()})

    async def _serve(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        if not isinstance(self.engine, DecodeKV):
            return await super()._serve(request, endpoint)
        rid = request.headers.get(REQUEST_ID, "")
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError:
            body = None
        if not isinstance(body, dict) or body.get("kv_transfer_params") is None:
            return await super()._serve(request, endpoint)  # refused there, or computed "locally"
        tokens = prompt_tokens(body)
        engine = self.engine
        try:
            remote = engine.parse(body["kv_transfer_params"], tokens)
        except InvalidTransferParams as error:
            return error_response(400, f"kv-standin decode: {error}", rid)
        blocks = engine.pool.take(-(-(remote.num_tokens or len(tokens)) // engine.layout.block_size))
        if blocks is None:
            return error_response(503, f"kv-standin decode: out of blocks ({engine.pool.free} free)", rid)
        try:
            report = await asyncio.to_thread(engine.pull, rid or uuid.uuid4().hex, remote, tokens, blocks)
        except Exception as error:
            engine.failures += 1
            message = f"kv-standin decode: pulling the KV of {remote.engine_id} failed: {type(error).__name__}: {error}"
            logger.error("%s", message)
            return error_response(500, message, rid)
        finally:
            engine.pool.give(blocks)
        engine.reports.append(report)
        del engine.reports[:-100]
        if not report["verified"]:
            engine.failures += 1
            return error_response(
                500,
                f"kv-standin decode: the KV pulled from {remote.engine_id} ({report['bytes']} bytes) is not the"
                " prompt's: verification failed",
                rid,
            )
        engine.pulls += 1
        engine.bytes_moved += report["bytes"]
        token = _REPORT.set(report)  # read by _word and _answer; reset: a connection's requests share a task
        try:
            return await super()._serve(request, endpoint)
        finally:
            _REPORT.reset(token)

    def _prefill_params(self, rid: str, body: dict[str, Any]) -> dict[str, Any]:
        assert isinstance(self.engine, PrefillKV)
        tokens = prompt_tokens(body)
        if not tokens:
            raise web.HTTPBadRequest(text="kv-standin prefill: empty prompt")
        return self.engine.prefill(f"{rid or 'req'}-{uuid.uuid4().hex[:8]}", tokens)

    def _word(self, body: dict[str, Any], i: int) -> str:
        report = _REPORT.get()
        if report is None:
            return super()._word(body, i)
        return msgspec.json.encode(report).decode() if i == 0 else super()._word(body, i - 1)

    def _answer(self, chat: bool, body: dict[str, Any], rid: str, words: list[str], finish: str) -> dict[str, Any]:
        answer = super()._answer(chat, body, rid, words, finish)
        answer["kv_transfer"] = _REPORT.get()
        return answer


def make_engine(
    role: str, engine_id: str, model: KVModel, config: ConnectorConfig, *, hold_window: bool = False
) -> PrefillKV | DecodeKV:
    if role == "prefill":
        return PrefillKV(engine_id, model, config)
    return DecodeKV(engine_id, model, config, hold_window=hold_window)


async def _serve_forever(args: argparse.Namespace) -> None:
    model = KVModel(
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_size=args.head_size,
        dtype=args.dtype,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
    )
    config = ConnectorConfig(
        side_channel_host=args.side_channel_host,
        side_channel_port=args.side_channel_port,
        lease_seconds=args.lease_seconds,
        secret=args.secret,
        read_timeout_s=args.read_timeout,
    )
    engine_id = args.engine_id or f"kv-standin-{args.role}-{uuid.uuid4().hex[:8]}"
    engine = await asyncio.to_thread(make_engine, args.role, engine_id, model, config, hold_window=args.hold_window)
    server = KVStandIn(args.role, engine, engine_id=engine_id, default_tokens=args.tokens, keep_bodies=False)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start(args.host, args.port)
        print(f"kv-standin {args.role} {server.url}", flush=True)
        await stop.wait()
    finally:
        await server.stop()
        engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pd_transfer.sim.kv_standin", description=__doc__.split("\n")[0])
    defaults = KVModel()
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="HTTP port (default 0: a free port)")
    parser.add_argument(
        "--side-channel-host", default="127.0.0.1", help="prefill: side channel address, bound and advertised"
    )
    parser.add_argument("--side-channel-port", type=int, default=0, help="prefill: side channel port (0: free)")
    parser.add_argument("--engine-id", default="")
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--kv-heads", type=int, default=defaults.kv_heads)
    parser.add_argument("--head-size", type=int, default=defaults.head_size)
    parser.add_argument("--dtype", default=defaults.dtype)
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--num-blocks", type=int, default=defaults.num_blocks)
    parser.add_argument("--lease-seconds", type=float, default=30.0)
    parser.add_argument("--read-timeout", type=float, default=30.0, help="decode: seconds for one request's reads")
    parser.add_argument("--secret", default=None, help="shared secret of the side channel")
    parser.add_argument(
        "--hold-window",
        action="store_true",
        help="decode: a read that ends inside the prefill's hold window needs no lease confirmation (as in vLLM)",
    )
    parser.add_argument("--tokens", type=int, default=8, help="completion tokens when the request sets none")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from pd_transfer.proxy.cli import loop_factory

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(_serve_forever(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
