"""One-unit read latency, the benchmarks' probe of a connected engine: moves of one unit (one plane block when the
plan moves whole blocks) from its first source rank into scratch memory, each waited for; the cache is not touched.

The unit moves the way the decode rank reads that engine (its link's transport): a NIXL read posted to done into
registered scratch memory (as the read a link is warmed up with); for an engine opened through IPC, a one-row copy
queued on the IPC reader's stream and waited for; for one read in place, one ``process_vm_readv`` call of the row.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.transports.ipc.ipc_reads import IpcReader
from pd_transfer.connector.transports.ipc.transport import SameHostLink
from pd_transfer.connector.transports.nixl.transport import NixlLink
from pd_transfer.same_host import CmaEngine, IpcEngine, IpcUnavailable
from pd_transfer.transfer.agent import DescriptorList
from pd_transfer.transfer.agent_protocol import Agent
from pd_transfer.transfer.cma import CmaPool, plan_calls
from pd_transfer.transfer.errors import PeerDisconnected


def one_unit_read_latencies(decode: DecodeRank, host: str, port: int, samples: int) -> list[float]:
    """Seconds of ``samples`` one-unit moves from the first source rank of the engine at ``host:port`` (connected
    first if need be) into scratch memory, by the transport ``decode`` reads it with."""
    link = decode.remotes.connect(host, port).link
    if isinstance(link, NixlLink):
        source = link.engine.sources[0]
        return _nixl_reads(decode.agent, source.remote, link.plan.sources[0].unit_bytes, samples)
    if isinstance(link, SameHostLink):
        opened, end = link.opened, link.end
        if isinstance(opened, IpcEngine) and end.ipc_reader is not None:
            return _ipc_copies(end.ipc_reader, opened, samples)
        if isinstance(opened, CmaEngine) and end.cma_reader is not None:
            return _cma_calls(end.cma_reader.timeout_s, opened, samples)
    raise TypeError(f"no one-unit probe for transport {link.transport!r} ({type(link).__name__})")


def _nixl_reads(agent: Agent, remote: DescriptorList, unit_bytes: int, samples: int) -> list[float]:
    """Reads of remote row 0 (``unit_bytes``) into a registered scratch buffer, each posted and waited for."""
    scratch = torch.empty(unit_bytes, dtype=torch.uint8)
    registration = agent.register_spans([(scratch.data_ptr(), scratch.data_ptr() + unit_bytes)])
    try:
        local = agent.prepare_local(np.array([[scratch.data_ptr(), unit_bytes, 0]], dtype=np.uint64))
        try:
            zero = np.zeros(1, dtype=np.int32)
            return [agent.read(local, zero, remote, zero, timeout_s=30.0).seconds for _ in range(samples)]
        finally:
            local.release()
    finally:
        agent.deregister(registration)


def _ipc_copies(reader: IpcReader, ipc: IpcEngine, samples: int) -> list[float]:
    """Copies of the first source's remote row 0 into scratch memory, each queued on ``reader``'s stream and waited
    for."""
    if not ipc.sources:
        raise IpcUnavailable(f"engine {ipc.engine_id} is not connected through IPC (any more)")
    if ipc.owner_exited():
        raise PeerDisconnected(f"engine {ipc.engine_id}: a prefill process whose memory is open exited")
    source = ipc.sources[0]
    (segment,), (offset,) = source.memory.locate(source.remote_at[:1], source.row_bytes)
    row = source.memory.storages[int(segment)][int(offset) : int(offset) + source.row_bytes]
    scratch = torch.empty_like(row)
    seconds = []
    for _ in range(samples):
        started = time.perf_counter()
        with reader.stream.running():
            scratch.copy_(row)
        seconds.append(time.perf_counter() - started)
    return seconds


def _cma_calls(timeout_s: float, engine: CmaEngine, samples: int) -> list[float]:
    """``process_vm_readv`` calls of the first source's remote row 0 into scratch memory (one call runs on the
    calling thread, as in the reader's pool), each bounded by ``timeout_s``."""
    if not engine.sources:
        raise IpcUnavailable(f"engine {engine.engine_id} is not read in place (any more)")
    source = engine.sources[0]
    unit = source.plan.unit_bytes
    scratch = np.empty(unit, dtype=np.uint8)
    address = np.array([scratch.ctypes.data], dtype=np.uint64)
    seconds = []
    with CmaPool(1, name="bench-cma") as pool:
        for _ in range(samples):
            started = time.perf_counter()
            pool.run(plan_calls(source.pid, address, source.plan.remote_grid[:1, 0], unit), timeout_s)
            seconds.append(time.perf_counter() - started)
    return seconds
