"""The reader's half of same-host IPC: a prefill's offered memory opened in this process (:func:`open_segments`),
its probe checked before its memory is read in place (:func:`check_probe`), and a watch on its process. Torch and the
standard library only: no engine, no transport.

* **GPU memory**: a legacy CUDA IPC handle is opened as ``torch.multiprocessing`` opens a shared CUDA storage
  (``rebuild_cuda_tensor``), on the reader's own GPU: the same one, or a peer it can access (:func:`gpu_reach`).
* **Host memory**: a reader opens ``/proc/<pid>/fd/<fd>`` (same host, same user, a pid namespace that sees the
  owner), checks it opened that memfd (its name carries a random token), and maps it read-only. Memory offered to
  ``process_vm_readv`` is read in place (:mod:`pd_transfer.connector.transports.ipc.cma_reads`) once the owner's
  probe bytes read back right.

Lifetimes: opened segments are tensors: the mapping (host) or the IPC mapping (GPU, through torch's cache of opened
handles) ends when the last tensor on it is dropped, which :class:`~.ipc_engine.IpcEngine` does when its engine is
forgotten, refreshed or closed.
"""

from __future__ import annotations

import errno
import mmap
import os
import select
import warnings
from typing import Generic, TypeVar

import torch

from pd_transfer.handshake.messages import CmaSegment, CudaSegment, HostSegment, RankIpc
from pd_transfer.spec import MemoryPlace
from pd_transfer.transfer import cma
from pd_transfer.transfer.errors import PeerDisconnected

from .common import SHARED_NAME, IpcUnavailable, device_uuid, pid_namespace

SourceT = TypeVar("SourceT")


def check_probe(offer: RankIpc, segment: CmaSegment) -> None:
    """``IpcUnavailable`` unless this process can read ``segment``'s probe back from ``offer.pid``: it then is the
    owner, and its memory may be read here."""
    try:
        got = cma.read_bytes(offer.pid, segment.probe_address, len(segment.probe))
    except PeerDisconnected:
        raise IpcUnavailable(f"the prefill's process {offer.pid} is not in this pid namespace (or exited)") from None
    except cma.CmaError as error:
        if error.errno == errno.EFAULT:
            raise IpcUnavailable(f"process {offer.pid} here is not the prefill (no probe where it said)") from None
        raise IpcUnavailable(
            f"the prefill's memory cannot be read in place ({error}): another user, or ptrace not permitted"
            " (kernel.yama.ptrace_scope, a container's seccomp profile)"
        ) from None
    if got != segment.probe:
        raise IpcUnavailable(f"process {offer.pid} here is not the prefill (its probe bytes differ)")


def gpu_reach(local_index: int, remote_uuid: str) -> str:
    """ "" when this process's GPU ``local_index`` can read memory of the GPU ``remote_uuid`` (the same GPU, or a peer
    it can access), else why not."""
    if not torch.cuda.is_available():
        return "CUDA is not available in this process"
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) != remote_uuid:
            continue
        if index == local_index or torch.cuda.can_device_access_peer(local_index, index):
            return ""
        return f"cuda:{local_index} cannot access the prefill's GPU (cuda:{index} here) as a peer"
    return "the prefill's GPU is not visible to this process (CUDA_VISIBLE_DEVICES)"


class OwnerWatch:
    """Whether the process that offered some memory (``offer``) is still running: a pidfd of it where we share its
    pid namespace (elsewhere its pid may name another process), else unknown. ``close`` releases the pidfd."""

    def __init__(self, offer: RankIpc) -> None:
        self._fd: int | None = None
        if offer.pid_namespace and offer.pid_namespace == pid_namespace():
            try:
                self._fd = os.pidfd_open(offer.pid)
            except (OSError, AttributeError):
                self._fd = None

    @property
    def watching(self) -> bool:
        """Whether the owner's exit can be told here."""
        return self._fd is not None

    def exited(self) -> bool:
        """True once the owner exited (False while it runs, or when that cannot be told)."""
        fd = self._fd
        if fd is None:
            return False
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class WatchedSources(Generic[SourceT]):
    """What a decode opened of a prefill engine's processes: a source per source rank of its plan (``sources``) and a
    watch on each rank's process (``owners``). ``close`` drops the sources and releases the watches (idempotent)."""

    def __init__(self, sources: list[SourceT], owners: list[OwnerWatch]) -> None:
        self.sources = sources
        self.owners = owners

    def owner_exited(self) -> bool:
        """Whether a process opened here exited (its memory is then stale, or its pid another process's)."""
        return any(owner.exited() for owner in self.owners)

    @property
    def closed(self) -> bool:
        return not self.sources

    def close(self) -> None:
        self.sources = []
        owners, self.owners = self.owners, []
        for owner in owners:
            owner.close()


def open_segments(ipc: RankIpc, local: MemoryPlace) -> list[torch.Tensor]:
    """Each segment of ``ipc`` opened in this process, as a uint8 tensor of its bytes (host memory, or on the GPU
    ``local``); ``IpcUnavailable`` when one cannot be opened (what was opened is dropped again)."""
    opened: list[torch.Tensor] = []
    for segment in ipc.segments:
        if isinstance(segment, HostSegment):
            if not local.is_host:
                raise IpcUnavailable("the prefill's cache is in host memory and ours is not")
            opened.append(_open_memfd(segment))
        elif isinstance(segment, CmaSegment):
            raise IpcUnavailable("the prefill's memory is read in place (process_vm_readv), not opened")
        else:
            if local.is_host:
                raise IpcUnavailable("the prefill's cache is in GPU memory and ours is not")
            opened.append(_open_cuda(segment, local.device_index))
    return opened


def _open_memfd(segment: HostSegment) -> torch.Tensor:
    """The memfd segment mapped read-only; ``IpcUnavailable`` unless ``/proc/<pid>/fd/<fd>`` opens that memfd."""
    if not SHARED_NAME.fullmatch(segment.name):
        raise IpcUnavailable("the prefill named a host segment pd-transfer does not make")
    try:
        fd = os.open(f"/proc/{segment.pid}/fd/{segment.fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        raise IpcUnavailable(
            f"the prefill's host memory cannot be opened ({error.strerror}): another user or pid namespace"
        ) from None
    try:
        if os.readlink(f"/proc/self/fd/{fd}") != f"/memfd:{segment.name} (deleted)":
            raise IpcUnavailable("the prefill's host memory descriptor is not the memfd it named")
        if os.fstat(fd).st_size < segment.nbytes:
            raise IpcUnavailable("the prefill's host memory is smaller than it said")
        mapping = mmap.mmap(fd, segment.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only: torch warns that it cannot be written
        return torch.frombuffer(mapping, dtype=torch.uint8)


def _open_cuda(segment: CudaSegment, local_index: int) -> torch.Tensor:
    """The CUDA segment opened on our GPU ``local_index`` (torch opens each allocation once per process)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    why_not = gpu_reach(local_index, segment.device_uuid)
    if why_not:
        raise IpcUnavailable(why_not)
    try:
        tensor: torch.Tensor = rebuild_cuda_tensor(
            torch.Tensor,
            (segment.nbytes,),
            (1,),
            0,
            torch.UntypedStorage,
            torch.uint8,
            local_index,
            segment.handle,
            segment.nbytes,
            segment.offset_bytes,
            False,
            segment.ref_counter,
            segment.ref_counter_offset,
            segment.event_handle,
            segment.event_sync_required,
        )
    except RuntimeError as error:
        raise IpcUnavailable(f"the prefill's CUDA IPC handle does not open here: {error}") from None
    return tensor
