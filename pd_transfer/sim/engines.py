"""Engines without an engine, for tests and demos of the connector's request lifecycle.

``PrefillEngines`` runs prefill engines in a child process (``spawn``): each is a ``SchedulerSide``, one
``WorkerSide`` per TP rank, an ``OutputAggregator`` and a block allocator, driven over a pipe the way an
engine drives a connector (finish a prompt, then step), through the engine contract only
(:mod:`pd_transfer.connector.contract`). Blocks are never reused, and the allocator scribbles
over blocks when the connector hands them back, so a read of freed blocks gets garbage, as it would in a
real engine that reused them. ``LocalPrefillEngines`` runs the same engines in the calling process (for fake agents);
``DecodeEngine`` does the same for a decode engine in the calling process.

Waiting is polling with a deadline: step, look, step again.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.config import ConnectorConfig
from pd_transfer.connector.contract import SchedulerContract, WorkerContract
from pd_transfer.connector.leases import LeaseLedger
from pd_transfer.metrics import TransferMetrics
from pd_transfer.settings import Settings, apply_process_defaults, read_settings
from pd_transfer.sim.child import ChildProcess, commands
from pd_transfer.spec import KVCacheLayout
from pd_transfer.transfer.agent import NIXL_AGENTS
from pd_transfer.transfer.agent_protocol import AgentFactory

_READY_TIMEOUT_S = 120.0
_REPLY_TIMEOUT_S = 60.0
_POLL_S = 0.005
POISON = 0xA5  # every byte of a block the engine got back


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True):
    engine_id: str
    layouts: list[KVCacheLayout]  # one per TP rank
    num_blocks: int
    lease_seconds: float = 30.0
    seed: int = 1
    side_channel_port: int = 0  # 0: any free port; a fixed one to restart an engine where it was

    def caches(self, *, huge_pages: bool = False) -> list[KVCache]:
        """The ranks' caches, filled as the child fills them (recomputed here to check what was read); in huge pages
        with ``huge_pages`` (an engine's own, as its settings say)."""
        from pd_transfer.sim.peer import fill_pattern

        caches = []
        for layout in self.layouts:
            cache = KVCache.allocate(layout, self.num_blocks, huge_pages=huge_pages)
            fill_pattern(cache, self.seed)
            caches.append(cache)
        return caches


def _scribble(caches: Sequence[KVCache], block_ids: Sequence[int]) -> None:
    if not block_ids:
        return
    index = torch.tensor(list(block_ids), dtype=torch.long)
    for cache in caches:
        for tensor in cache.tensors:
            tensor.view(torch.uint8)[index] = POISON


class _PrefillEngine:
    """One prefill engine as its scheduler and workers see it, with the child process's ``settings``, its workers'
    agents made by ``agent_factory``."""

    def __init__(self, spec: EngineSpec, settings: Settings, agent_factory: AgentFactory = NIXL_AGENTS) -> None:
        from pd_transfer.connector.scheduler import SchedulerSide
        from pd_transfer.connector.worker import OutputAggregator, WorkerSide

        self.spec = spec
        self.caches = spec.caches(huge_pages=settings.own_huge_pages)
        config = ConnectorConfig(
            side_channel_host="127.0.0.1", side_channel_port=spec.side_channel_port, lease_seconds=spec.lease_seconds
        )
        self.block_size = spec.layouts[0].block_size
        sides = [
            WorkerSide(spec.engine_id, cache, config, settings=settings, agent_factory=agent_factory)
            for cache in self.caches
        ]
        self.ledgers: list[LeaseLedger] = [side.prefill.ledger for side in sides]  # looked at, never driven
        self.workers: list[WorkerContract] = list(sides)
        self.scheduler: SchedulerContract = SchedulerSide(
            config, engine_id=spec.engine_id, block_size=self.block_size, tp_size=len(spec.layouts)
        )
        self.port = self.scheduler.start_side_channel([worker.rank_metadata for worker in self.workers])
        self.aggregator = OutputAggregator(len(self.workers))
        self.next_block = 0
        self.lent: dict[str, tuple[int, ...]] = {}  # held by the connector until finished_sending
        self.finished_sending: set[str] = set()

    def prefill(self, request_id: str, prompt_len: int, params: object, reason: str) -> dict[str, object]:
        matched = self.scheduler.get_num_new_matched_tokens(request_id, prompt_len, 0, params)
        count = -(-prompt_len // self.block_size)
        if self.next_block + count > self.spec.num_blocks:
            raise RuntimeError(f"engine {self.spec.engine_id} is out of blocks")
        blocks = tuple(range(self.next_block, self.next_block + count))
        self.next_block += count
        self.scheduler.update_state_after_alloc(request_id, blocks, 0)
        delay, out = self.scheduler.request_finished(
            request_id, list(blocks), reason, params, num_computed_tokens=prompt_len
        )
        metadata = self.scheduler.build_step_metadata()
        for worker in self.workers:
            worker.start_load(metadata)
        if delay:
            self.lent[request_id] = blocks
        else:
            _scribble(self.caches, blocks)
        return {"matched": matched, "delay_free": delay, "params": out, "block_ids": list(blocks)}

    def step(self) -> None:
        metadata = self.scheduler.build_step_metadata()
        for worker in self.workers:
            worker.start_load(metadata)
        results = self.aggregator.aggregate([worker.step_output() for worker in self.workers])
        self.scheduler.update_connector_output(results.finished_sending, results.finished_recving)
        for request_id in results.finished_sending:
            _scribble(self.caches, self.lent.pop(request_id, ()))
        self.finished_sending |= results.finished_sending

    def abort(self, request_id: str) -> None:
        """The engine wants a held request's blocks back now (``abort_held``), then steps once."""
        self.scheduler.abort_held(request_id)
        self.step()

    def state(self, request_ids: Sequence[str]) -> dict[str, object]:
        return {
            "held_blocks": [ledger.blocks_held for ledger in self.ledgers],
            "lent_blocks": sum(len(blocks) for blocks in self.lent.values()),
            "status": {r: [ledger.status(r) for ledger in self.ledgers] for r in request_ids},
        }

    def wait_sending(self, request_ids: Sequence[str], timeout_s: float) -> dict[str, object]:
        deadline = time.monotonic() + timeout_s
        while True:
            self.step()
            if set(request_ids) <= self.finished_sending or time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        done = sorted(set(request_ids) & self.finished_sending)
        return {"finished_sending": done, **self.state(request_ids)}

    def close(self) -> None:
        self.scheduler.close()
        for worker in self.workers:
            worker.close()


def _child(conn: multiprocessing.connection.Connection, specs: bytes) -> None:
    settings = apply_process_defaults(read_settings(), net_devices="lo")  # this child's edge: its environment
    decoded = msgspec.msgpack.decode(specs, type=list[EngineSpec])
    engines = {spec.engine_id: _PrefillEngine(spec, settings) for spec in decoded}
    conn.send(("ready", {engine_id: engine.port for engine_id, engine in engines.items()}))
    try:
        for command, engine_id, *args in commands(conn):
            engine = engines.get(engine_id)
            try:
                if engine is None:
                    raise KeyError(f"no engine {engine_id!r}")
                if command == "prefill":
                    conn.send(("ok", engine.prefill(*args)))
                elif command == "wait_sending":
                    conn.send(("ok", engine.wait_sending(*args)))
                elif command == "abort":
                    engine.abort(*args)
                    conn.send(("ok", engine.state(args)))
                elif command == "state":
                    engine.step()
                    conn.send(("ok", engine.state(*args)))
                else:
                    conn.send(("error", f"unknown command {command!r}"))
            except Exception as error:
                conn.send(("error", f"{type(error).__name__}: {error}"))
    finally:
        for engine in engines.values():
            engine.close()


class PrefillEngines(ChildProcess):
    """Prefill engines in a child process; use as a context manager."""

    stop_command = ("stop", "")

    def __init__(self, specs: Sequence[EngineSpec]) -> None:
        self.specs = {spec.engine_id: spec for spec in specs}
        payload = msgspec.msgpack.encode(list(specs))
        super().__init__(_child, payload, what="prefill engines", ready_timeout_s=_READY_TIMEOUT_S)
        kind, ports = self.ready
        assert kind == "ready", (kind, ports)
        self.host = "127.0.0.1"
        self.ports: dict[str, int] = ports

    def _request(self, *command: object, timeout_s: float = _REPLY_TIMEOUT_S) -> dict:
        self.send(*command)
        kind, reply = self.receive(timeout_s)
        if kind != "ok":
            raise RuntimeError(f"prefill engines: {reply}")
        return reply

    def prefill(
        self, engine_id: str, request_id: str, prompt_len: int, params: object = None, reason: str = "length"
    ) -> dict:
        """Run a prompt to completion on ``engine_id`` with ``params`` (default: ``do_remote_decode``); returns
        ``{"params": what the decode gets, "delay_free": ..., "block_ids": ...}``."""
        if params is None:
            params = {"do_remote_decode": True}
        return self._request("prefill", engine_id, request_id, prompt_len, params, reason)

    def wait_sending(self, engine_id: str, request_ids: Sequence[str], timeout_s: float = 10.0) -> dict:
        """Step the engine until every request in ``request_ids`` is finished sending (or ``timeout_s``);
        returns the finished ids, blocks still held per rank, blocks lent to the connector, statuses."""
        return self._request("wait_sending", engine_id, list(request_ids), timeout_s, timeout_s=timeout_s + 30)

    def state(self, engine_id: str, request_ids: Sequence[str] = ()) -> dict:
        return self._request("state", engine_id, list(request_ids))

    def abort(self, engine_id: str, request_id: str) -> dict:
        """Abort a held request on ``engine_id`` (the engine wants its blocks back); returns ``state``."""
        return self._request("abort", engine_id, request_id)


class LocalPrefillEngines:
    """The engines of :class:`PrefillEngines` in this process, behind the same methods: for tests whose agents are
    in-process fakes (``tests/support/fake_agent.py``), where a child's real agents could not reach them. Use as a
    context manager. ``settings``: the engines'. ``agent_factory``: makes the engines' agents (a fake fabric's, for
    the tests this class is for)."""

    def __init__(
        self, specs: Sequence[EngineSpec], settings: Settings, *, agent_factory: AgentFactory = NIXL_AGENTS
    ) -> None:
        self.specs = {spec.engine_id: spec for spec in specs}
        self._engines: dict[str, _PrefillEngine] = {}
        try:
            for spec in specs:
                self._engines[spec.engine_id] = _PrefillEngine(spec, settings, agent_factory)
        except BaseException:
            self.close()
            raise
        self.host = "127.0.0.1"
        self.ports = {engine_id: engine.port for engine_id, engine in self._engines.items()}

    def _engine(self, engine_id: str) -> _PrefillEngine:
        engine = self._engines.get(engine_id)
        if engine is None:
            raise RuntimeError(f"prefill engines: KeyError: no engine {engine_id!r}")
        return engine

    def prefill(
        self, engine_id: str, request_id: str, prompt_len: int, params: object = None, reason: str = "length"
    ) -> dict:
        """As :meth:`PrefillEngines.prefill`."""
        params = {"do_remote_decode": True} if params is None else params
        return self._engine(engine_id).prefill(request_id, prompt_len, params, reason)

    def wait_sending(self, engine_id: str, request_ids: Sequence[str], timeout_s: float = 10.0) -> dict:
        """As :meth:`PrefillEngines.wait_sending`."""
        return self._engine(engine_id).wait_sending(list(request_ids), timeout_s)

    def state(self, engine_id: str, request_ids: Sequence[str] = ()) -> dict:
        engine = self._engine(engine_id)
        engine.step()
        return engine.state(list(request_ids))

    def abort(self, engine_id: str, request_id: str) -> dict:
        """As :meth:`PrefillEngines.abort`."""
        engine = self._engine(engine_id)
        engine.abort(request_id)
        return engine.state([request_id])

    def close(self) -> None:
        for engine in self._engines.values():
            engine.close()
        self._engines.clear()

    def __enter__(self) -> LocalPrefillEngines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Received:
    """How a request's load ended, as the decode engine saw it."""

    request_id: str
    finished: bool
    local_block_ids: list[int]
    load_errors: set[int] = field(default_factory=set)
    failed: bool = False

    @property
    def ok(self) -> bool:
        return self.finished and not self.failed and not (self.load_errors & set(self.local_block_ids))


class DecodeEngine:
    """A decode engine in this process: a scheduler side, one worker per layout (their agents made by
    ``agent_factory``), an aggregator."""

    def __init__(
        self,
        engine_id: str,
        layouts: Sequence[KVCacheLayout],
        num_blocks: int,
        config: ConnectorConfig,
        *,
        metrics: TransferMetrics | None = None,
        settings: Settings,
        agent_factory: AgentFactory = NIXL_AGENTS,
    ):
        from pd_transfer.connector.scheduler import SchedulerSide
        from pd_transfer.connector.worker import OutputAggregator, WorkerSide

        self.engine_id = engine_id
        self.block_size = layouts[0].block_size
        self.num_blocks = num_blocks
        self._caches = [KVCache.allocate(layout, num_blocks, huge_pages=settings.own_huge_pages) for layout in layouts]
        self.workers: list[WorkerContract] = [
            WorkerSide(engine_id, cache, config, metrics=metrics, settings=settings, agent_factory=agent_factory)
            for cache in self._caches
        ]
        self.scheduler: SchedulerContract = SchedulerSide(
            config, engine_id=engine_id, block_size=self.block_size, tp_size=len(layouts)
        )
        self.aggregator = OutputAggregator(len(layouts))
        self.next_block = 0
        self.finished_recving: set[str] = set()
        self.failed: set[str] = set()
        self.load_errors: set[int] = set()
        self.blocks: dict[str, list[int]] = {}

    @property
    def caches(self) -> list[KVCache]:
        return list(self._caches)

    def allocate(self, tokens: int) -> list[int]:
        count = -(-tokens // self.block_size)
        if self.next_block + count > self.num_blocks:
            raise RuntimeError(f"decode engine {self.engine_id} is out of blocks")
        blocks = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        return blocks

    def admit(self, request_id: str, prompt_len: int, params: object, num_computed: int = 0) -> tuple[int, bool]:
        """Queue and schedule a request: match, allocate, and (when loading) start the load."""
        self.scheduler.on_new_request(request_id, params, prompt_len=prompt_len)
        tokens, load = self.scheduler.get_num_new_matched_tokens(request_id, prompt_len, num_computed, params)
        blocks = self.allocate(max(tokens, 1))
        self.blocks[request_id] = blocks
        self.scheduler.update_state_after_alloc(request_id, blocks, tokens)
        self.step()
        return tokens, load

    def step(self) -> None:
        metadata = self.scheduler.build_step_metadata()
        for worker in self.workers:
            worker.start_load(metadata)
        results = self.aggregator.aggregate([worker.step_output() for worker in self.workers])
        self.scheduler.update_connector_output(
            results.finished_sending, results.finished_recving, results.load_error_block_ids, results.failed_recving
        )
        self.finished_recving |= results.finished_recving
        self.failed |= results.failed_recving
        self.load_errors |= results.load_error_block_ids

    def wait_received(self, request_id: str, timeout_s: float = 15.0) -> Received:
        deadline = time.monotonic() + timeout_s
        while request_id not in self.finished_recving and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            self.step()
        return Received(
            request_id=request_id,
            finished=request_id in self.finished_recving,
            local_block_ids=self.blocks.get(request_id, []),
            load_errors=set(self.load_errors),
            failed=request_id in self.failed,
        )

    def receive(self, request_id: str, prompt_len: int, params: object, timeout_s: float = 15.0) -> Received:
        _, load = self.admit(request_id, prompt_len, params)
        if not load:
            return Received(request_id=request_id, finished=False, local_block_ids=self.blocks[request_id])
        return self.wait_received(request_id, timeout_s)

    def close(self) -> None:
        self.scheduler.close()
        for worker in self.workers:
            worker.close()

    def __enter__(self) -> DecodeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
