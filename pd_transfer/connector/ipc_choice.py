"""Which transport a decode rank reads a prefill engine with: NIXL, or same-host IPC (a pure decision, once per engine).

Same-host IPC is chosen (``auto``) when every prefill rank the plan reads from offered its memory (which it did only
after this process proved it runs on the prefill's host, :mod:`pd_transfer.handshake.host_identity`), on a host with
our boot id, in the same kind of memory as our cache, and, for GPU memory, on a GPU ours can read (the same one, or a
peer it can access); and when the plan reads rows straight into place (engine-packed blocks of another block size
are read whole into a staging area by NIXL). It is ``cuda_ipc`` for GPU caches, ``host_ipc`` for host caches in
shareable memory. ``nixl`` never uses it; ``ipc`` requires it (the engine is refused, saying why, where it cannot be
used). Everything else reads with NIXL.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pd_transfer.handshake.messages import CudaSegment, RankMetadata
from pd_transfer.spec import MemoryPlace, memory_of

#: The setting (``ConnectorConfig.transport``).
TransportSetting = Literal["auto", "nixl", "ipc"]
#: What a pull went by (the ``transport`` label of the pull metrics).
Transport = Literal["nixl", "cuda_ipc", "host_ipc"]
TRANSPORTS: tuple[Transport, ...] = ("nixl", "cuda_ipc", "host_ipc")
#: (our GPU index, the prefill GPU's UUID) -> "" when ours can read it, else why not.
GpuReach = Callable[[int, str], str]


@dataclass(frozen=True)
class TransportChoice:
    """A transport and why it was chosen (for the log line at connect)."""

    transport: Transport
    reason: str


def choose_transport(
    setting: TransportSetting,
    local: MemoryPlace,
    sources: Sequence[RankMetadata],
    boot_id: str,
    *,
    packed: bool,
    reach: GpuReach,
) -> TransportChoice:
    """The transport for reading ``sources`` (the prefill ranks a plan reads) into a cache at ``local`` on the host
    ``boot_id``; ``packed``: the plan reads engine-packed blocks of another block size."""
    if setting == "nixl":
        return TransportChoice("nixl", "transport is set to nixl")
    if packed:
        return TransportChoice("nixl", "packed blocks of another block size are read whole and regrouped")
    for rank in sources:
        why_not = _why_not_ipc(rank, local, boot_id, reach)
        if why_not:
            return TransportChoice("nixl", f"prefill rank {rank.tp_rank}: {why_not}")
    if local.is_host:
        return TransportChoice("host_ipc", "same host, the prefill's cache in shareable host memory")
    return TransportChoice("cuda_ipc", f"same host, the prefill's GPU memory readable from {local}")


def _why_not_ipc(rank: RankMetadata, local: MemoryPlace, boot_id: str, reach: GpuReach) -> str:
    """ "" when ``rank``'s memory can be read through IPC into a cache at ``local``, else why not."""
    if rank.ipc is None:
        return "no IPC offered (another host, or memory it cannot share)"
    if not boot_id or rank.ipc.boot_id != boot_id:
        return "on another host"
    remote = memory_of(list(rank.regions))
    if remote.is_host != local.is_host:
        return f"its cache is in {'host' if remote.is_host else 'GPU'} memory, ours in {local}"
    for segment in rank.ipc.segments:
        if isinstance(segment, CudaSegment) != (not local.is_host):
            return "its IPC segments are not of its cache's memory kind"
        if isinstance(segment, CudaSegment):
            why_not = reach(local.device_index, segment.device_uuid)
            if why_not:
                return why_not
    return ""
