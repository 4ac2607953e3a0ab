"""One-unit read latency, the benchmarks' probe of a connected engine: moves of one unit (one plane block when the
plan moves whole blocks) from its first source rank into scratch memory, each waited for; the cache is not touched.

The unit moves the way the decode rank reads that engine (:attr:`RemoteEngine.transport`): a NIXL read posted to
done through the engines' registry (:meth:`RemoteEngines.scratch_reads`, the reads it warms a peer up with); for an
engine opened through IPC, a one-row copy queued on the IPC reader's stream and waited for; for one read in place,
one ``process_vm_readv`` call of the row.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from pd_transfer.connector.decode.cma_reads import CmaReader
from pd_transfer.connector.decode.ipc_reads import IpcReader
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.decode.remote_engines import RemoteEngine
from pd_transfer.same_host import IpcUnavailable
from pd_transfer.transfer.cma import CmaPool, plan_calls
from pd_transfer.transfer.errors import PeerDisconnected


def one_unit_read_latencies(decode: DecodeRank, host: str, port: int, samples: int) -> list[float]:
    """Seconds of ``samples`` one-unit moves from the first source rank of the engine at ``host:port`` (connected
    first if need be) into scratch memory, by the transport ``decode`` reads it with."""
    remote = decode.remotes.connect(host, port)
    if remote.transport == "nixl":
        unit = remote.plan.sources[0].unit_bytes
        return list(decode.remotes.scratch_reads(remote.sources[0].remote, unit, samples))
    reader = decode.readers[remote.transport]
    if isinstance(reader, IpcReader):
        return _ipc_copies(reader, remote, samples)
    if isinstance(reader, CmaReader):
        return _cma_calls(reader, remote, samples)
    raise TypeError(f"no one-unit probe for transport {remote.transport!r} ({type(reader).__name__})")


def _ipc_copies(reader: IpcReader, remote: RemoteEngine, samples: int) -> list[float]:
    """Copies of the first source's remote row 0 into scratch memory, each queued on ``reader``'s stream and waited
    for."""
    ipc = remote.ipc
    if ipc is None or not ipc.sources:
        raise IpcUnavailable(f"engine {remote.engine.engine_id} is not connected through IPC (any more)")
    if ipc.owner_exited():
        raise PeerDisconnected(f"engine {remote.engine.engine_id}: a prefill process whose memory is open exited")
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


def _cma_calls(reader: CmaReader, remote: RemoteEngine, samples: int) -> list[float]:
    """``process_vm_readv`` calls of the first source's remote row 0 into scratch memory (one call runs on the
    calling thread, as in the reader's pool), each bounded by ``reader``'s timeout."""
    engine = remote.cma
    if engine is None or not engine.sources:
        raise IpcUnavailable(f"engine {remote.engine.engine_id} is not read in place (any more)")
    source = engine.sources[0]
    unit = source.plan.unit_bytes
    scratch = np.empty(unit, dtype=np.uint8)
    address = np.array([scratch.ctypes.data], dtype=np.uint64)
    seconds = []
    with CmaPool(1, name="bench-cma") as pool:
        for _ in range(samples):
            started = time.perf_counter()
            pool.run(plan_calls(source.pid, address, source.plan.remote_grid[:1, 0], unit), reader.timeout_s)
            seconds.append(time.perf_counter() - started)
    return seconds
