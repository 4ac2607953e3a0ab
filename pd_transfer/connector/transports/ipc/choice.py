"""Whether a same-host transport can read a prefill engine's offers into our cache (a pure decision, once per engine).

Each built-in same-host transport reads one kind of offer: ``cuda_ipc`` GPU memory shared through CUDA IPC handles,
``host_ipc`` host memory in a memfd, ``host_cma`` other host memory read in place with ``process_vm_readv``. It reads
an engine when every prefill rank the plan reads offered its memory of that kind (which it did only after this process
proved it runs on the prefill's host, :mod:`pd_transfer.handshake.host_identity`), on a host with our boot id, in the
same kind of memory as our cache, and, for GPU memory, on a GPU ours can read (the same one, or a peer it can access);
``host_cma`` also needs the prefill's process in our pid namespace (the probe read at open checks the rest).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from pd_transfer.handshake.messages import CmaSegment, CudaSegment, HostSegment, RankIpc
from pd_transfer.spec import MemoryPlace

#: The built-in same-host transports.
SameHostKind = Literal["cuda_ipc", "host_ipc", "host_cma"]
#: (our GPU index, the prefill GPU's UUID) -> "" when ours can read it, else why not.
GpuReach = Callable[[int, str], str]

_SEGMENTS: dict[SameHostKind, type] = {"cuda_ipc": CudaSegment, "host_ipc": HostSegment, "host_cma": CmaSegment}


def refusal(
    kind: SameHostKind,
    local: MemoryPlace,
    offers: Sequence[tuple[int, RankIpc | None]],
    boot_id: str,
    *,
    reach: GpuReach,
    pid_namespace: int = 0,
) -> str:
    """Why ``kind`` cannot read the ranks' ``offers`` ((tp rank, its offer or None) of each rank the plan reads) into a
    cache at ``local`` on the host ``boot_id`` from a process in the pid namespace ``pid_namespace`` (0: unknown); ""
    when it can."""
    if (kind == "cuda_ipc") == local.is_host:
        return f"our cache is in {local}, which {kind} does not read into"
    for tp_rank, offer in offers:
        why_not = _rank_refusal(kind, local, offer, boot_id, reach, pid_namespace)
        if why_not:
            return f"prefill rank {tp_rank}: {why_not}"
    return ""


def _rank_refusal(
    kind: SameHostKind, local: MemoryPlace, offer: RankIpc | None, boot_id: str, reach: GpuReach, pid_namespace: int
) -> str:
    """Why ``kind`` cannot read one rank's ``offer`` ("" when it can)."""
    if offer is None:
        return f"no {kind} offer (another host, or memory it cannot share that way)"
    if not boot_id or offer.boot_id != boot_id:
        return "on another host"
    segments = offer.segments
    if not segments or not all(isinstance(segment, _SEGMENTS[kind]) for segment in segments):
        return f"its offer holds no {kind} segments only"
    if kind == "host_cma" and (not pid_namespace or offer.pid_namespace != pid_namespace):
        return "its process is in another pid namespace (another container), so not readable in place"
    for segment in segments:
        if isinstance(segment, CudaSegment):
            why_not = reach(local.device_index, segment.device_uuid)
            if why_not:
                return why_not
    return ""
