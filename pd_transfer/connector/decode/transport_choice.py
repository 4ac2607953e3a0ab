"""Which transport a decode rank reads a prefill engine with: NIXL, or same-host IPC (a pure decision, once per engine).

Same-host IPC is chosen (``auto``) when every prefill rank the plan reads from offered its memory (which it did only
after this process proved it runs on the prefill's host, :mod:`pd_transfer.handshake.host_identity`), on a host with
our boot id, in the same kind of memory as our cache, and, for GPU memory, on a GPU ours can read (the same one, or a
peer it can access); and when the plan reads rows straight into place (engine-packed blocks of another block size
are read whole into a staging area by NIXL). It is ``cuda_ipc`` for GPU caches, ``host_ipc`` for host caches in
shareable memory, ``host_cma`` for other host caches (read in place with ``process_vm_readv``, which needs the
prefill's process in our pid namespace; the probe read at open checks the rest). ``nixl`` never uses it; ``ipc``
requires it (the engine is refused, saying why, where it cannot be used). Everything else reads with NIXL.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pd_transfer.handshake.messages import CmaSegment, CudaSegment, HostSegment, RankMetadata
from pd_transfer.spec import MemoryPlace, Transport, TransportSetting, memory_of

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
    pid_namespace: int = 0,
) -> TransportChoice:
    """The transport for reading ``sources`` (the prefill ranks a plan reads) into a cache at ``local`` on the host
    ``boot_id``, from a process in the pid namespace ``pid_namespace`` (0: unknown); ``packed``: the plan reads
    engine-packed blocks of another block size."""
    if setting == "nixl":
        return TransportChoice("nixl", "transport is set to nixl")
    if packed:
        return TransportChoice("nixl", "packed blocks of another block size are read whole and regrouped")
    kinds: set[Transport] = set()
    for rank in sources:
        kind, why_not = _ipc_kind(rank, local, boot_id, reach, pid_namespace)
        if why_not:
            return TransportChoice("nixl", f"prefill rank {rank.tp_rank}: {why_not}")
        kinds.add(kind)
    if len(kinds) > 1:
        return TransportChoice("nixl", f"the prefill ranks offer different kinds of IPC: {sorted(kinds)}")
    kind = kinds.pop() if kinds else "host_ipc" if local.is_host else "cuda_ipc"
    if kind == "host_cma":
        return TransportChoice(kind, "same host and pid namespace, the prefill's host cache read in place")
    if kind == "host_ipc":
        return TransportChoice(kind, "same host, the prefill's cache in shareable host memory")
    return TransportChoice(kind, f"same host, the prefill's GPU memory readable from {local}")


def _ipc_kind(
    rank: RankMetadata, local: MemoryPlace, boot_id: str, reach: GpuReach, pid_namespace: int
) -> tuple[Transport, str]:
    """(the IPC transport that reads ``rank``'s memory into a cache at ``local``, "") or ("nixl", why not)."""
    if rank.ipc is None:
        return "nixl", "no IPC offered (another host, or memory it cannot share)"
    if not boot_id or rank.ipc.boot_id != boot_id:
        return "nixl", "on another host"
    remote = memory_of(list(rank.regions))
    if remote.is_host != local.is_host:
        return "nixl", f"its cache is in {'host' if remote.is_host else 'GPU'} memory, ours in {local}"
    segments = rank.ipc.segments
    if not segments:
        return "nixl", "it offered no memory"
    if remote.is_host:
        if all(isinstance(segment, CmaSegment) for segment in segments):
            if not pid_namespace or rank.ipc.pid_namespace != pid_namespace:
                return "nixl", "its process is in another pid namespace (another container), so not readable in place"
            return "host_cma", ""
        if all(isinstance(segment, HostSegment) for segment in segments):
            return "host_ipc", ""
        return "nixl", "its IPC segments are not of its cache's memory kind"
    for segment in segments:
        if not isinstance(segment, CudaSegment):
            return "nixl", "its IPC segments are not of its cache's memory kind"
        why_not = reach(local.device_index, segment.device_uuid)
        if why_not:
            return "nixl", why_not
    return "cuda_ipc", ""
