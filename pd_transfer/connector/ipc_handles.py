"""Handles of a rank's cache memory for readers on the same host: made by the owner (:func:`export_cache`), opened
by a reader (:func:`open_segments`). Torch and the standard library only: no engine, no transport.

* **GPU memory**: one legacy CUDA IPC handle per torch storage, made and opened as ``torch.multiprocessing`` shares a
  CUDA storage (``UntypedStorage._share_cuda_`` in the owner, ``rebuild_cuda_tensor`` in the reader, which opens it
  on the reader's own GPU: the same one, or a peer it can access, :func:`gpu_reach`). Memory from CUDA's virtual
  memory API (PyTorch's expandable segments, vLLM's sleep-mode allocator) cannot be shared by a legacy handle: the
  driver says so (``CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE``) and the export is refused with that reason;
  NIXL moves such caches.
* **Host memory**: a cache allocated shareable (:func:`shareable_host_buffer`) lives in a memfd the owner keeps open;
  a reader opens ``/proc/<pid>/fd/<fd>`` (same host, same user, a pid namespace that sees the owner), checks it
  opened that memfd (its name carries a random token), and maps it read-only. Other host memory is offered to be
  read in place with ``process_vm_readv`` (:class:`CmaSegment`): the reader reads the owner's random probe bytes
  back (:func:`check_probe`) before it trusts the pid, and then reads rows where the regions say
  (:mod:`.cma_reads`).

Lifetimes: the owner makes its handles once, when its rank is created, and keeps its cache (an engine's cache lives
as long as the engine) and, for host memory, the memfd open for as long as the memory is mapped. A reader's opened
segments are tensors: the mapping (host) or the IPC mapping (GPU, through torch's cache of opened handles) ends when
the last tensor on it is dropped, which :class:`~.ipc_reads.IpcEngine` does when its engine is forgotten, refreshed
or closed. Torch's reference counter of a shared CUDA storage is per export, not per reader: it keeps the owner's
allocator from reusing the memory only once the owner frees the storage, which an engine does at exit.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import re
import secrets
import select
import threading
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from pd_transfer.handshake.host_identity import local_boot_id
from pd_transfer.handshake.messages import CmaSegment, CudaSegment, HostSegment, RankIpc
from pd_transfer.spec import KVRegion, MemoryPlace, memory_of
from pd_transfer.transfer import cma
from pd_transfer.transfer.errors import PeerDisconnected, TransferError

logger = logging.getLogger(__name__)

#: A shareable host buffer's memfd is named this prefix and 32 random hex digits.
SHARED_NAME_PREFIX = "pd-transfer-kv-"
_SHARED_NAME = re.compile(re.escape(SHARED_NAME_PREFIX) + r"[0-9a-f]{32}")
_IS_LEGACY_CUDA_IPC_CAPABLE = 10  # CUpointer_attribute, cuda.h
_PAGE = mmap.PAGESIZE

Segment = CudaSegment | HostSegment | CmaSegment
SourceT = TypeVar("SourceT")
#: Bytes of the probe a process offering its host memory to ``process_vm_readv`` holds.
PROBE_BYTES = 16


class IpcUnavailable(TransferError):
    """Same-host IPC cannot be used for this memory or this peer; the message says why."""


# ---------------------------------------------------------------------------- shareable host memory


@dataclass(frozen=True)
class _SharedMapping:
    """A memfd-backed mapping of this process: its memfd (open while the mapping lives) and its name."""

    start: int
    nbytes: int
    fd: int
    name: str


_shared: dict[int, _SharedMapping] = {}  # start address -> mapping
_shared_lock = threading.Lock()


def shareable_host_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed host memory (a uint8 tensor, page-aligned) in a memfd, so that :func:`export_cache` can
    offer caches in it to same-host readers. The memfd is closed once no tensor uses the memory any more."""
    if nbytes <= 0:
        raise ValueError(f"a shareable buffer needs a positive size, got {nbytes}")
    size = -(-nbytes // _PAGE) * _PAGE
    name = f"{SHARED_NAME_PREFIX}{secrets.token_hex(16)}"
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive as long as any view of it
    start = tensor.data_ptr()
    with _shared_lock:
        _shared[start] = _SharedMapping(start, size, fd, name)
    weakref.finalize(mapping, _forget_shared, start, fd)
    return tensor[:nbytes]


def _forget_shared(start: int, fd: int) -> None:
    with _shared_lock:
        _shared.pop(start, None)
    os.close(fd)


def _shared_mapping_of(address: int, nbytes: int) -> _SharedMapping | None:
    """The shareable mapping holding ``[address, address + nbytes)``, if any."""
    with _shared_lock:
        for mapping in _shared.values():
            if mapping.start <= address and address + nbytes <= mapping.start + mapping.nbytes:
                return mapping
    return None


# ---------------------------------------------------------------------------- exporting (the owner)


def export_cache(tensors: Sequence[torch.Tensor], regions: Sequence[KVRegion]) -> tuple[RankIpc | None, str]:
    """(the handles of the memory behind ``tensors``, "") for same-host readers, or (None, why it cannot be
    shared). Call once per rank: every call makes new CUDA IPC handles."""
    place = memory_of(list(regions))
    boot_id = local_boot_id()
    if not boot_id:
        return None, "this host has no readable boot id"
    storages = _distinct_storages(tensors)
    try:
        if place.is_host:
            segments = _host_segments(storages)
        else:
            segments = [_cuda_segment(storage, place.device_index) for storage in storages]
    except IpcUnavailable as error:
        return None, str(error)
    return RankIpc(boot_id=boot_id, pid=os.getpid(), pid_namespace=pid_namespace(), segments=segments), ""


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where it cannot be read): equal in processes that share one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _distinct_storages(tensors: Sequence[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The storages behind ``tensors``, each once."""
    found: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        found.setdefault(storage.data_ptr(), storage)
    return list(found.values())


def _host_segments(storages: Sequence[torch.UntypedStorage]) -> list[Segment]:
    """One memfd segment per shareable mapping holding the storages; where one is elsewhere, the whole cache offered
    to ``process_vm_readv`` instead (one :class:`CmaSegment`); ``IpcUnavailable`` where this host has no such
    call."""
    segments: dict[int, Segment] = {}
    for storage in storages:
        mapping = _shared_mapping_of(storage.data_ptr(), storage.nbytes())
        if mapping is None:
            return [_cma_segment()]
        segments[mapping.start] = HostSegment(
            base_address=mapping.start, nbytes=mapping.nbytes, pid=os.getpid(), fd=mapping.fd, name=mapping.name
        )
    return list(segments.values())


_probe_buffer: list[ctypes.Array[ctypes.c_char]] = []  # made once, held for the life of the process


def _probe() -> ctypes.Array[ctypes.c_char]:
    """This process's probe: random bytes it holds for as long as it runs."""
    with _shared_lock:
        if not _probe_buffer:
            _probe_buffer.append(ctypes.create_string_buffer(secrets.token_bytes(PROBE_BYTES), PROBE_BYTES))
        return _probe_buffer[0]


def _cma_segment() -> CmaSegment:
    why_not = cma.unavailable()
    if why_not:
        raise IpcUnavailable(why_not)
    probe = _probe()
    return CmaSegment(probe_address=ctypes.addressof(probe), probe=probe.raw)


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


def _cuda_segment(storage: torch.UntypedStorage, device_index: int) -> Segment:
    """A legacy CUDA IPC handle of ``storage``; ``IpcUnavailable`` for memory that cannot have one."""
    with torch.cuda.device(device_index):
        torch.cuda.current_stream().query()  # binds this device's context to the thread, for the driver call
        if legacy_ipc_capable(storage.data_ptr()) is False:
            raise IpcUnavailable(
                f"the cache on cuda:{device_index} is in memory from CUDA's virtual memory API (PyTorch's"
                " expandable_segments allocator, or vLLM's sleep-mode allocator), which a legacy CUDA IPC handle"
                " cannot share: NIXL moves it instead (allocate the cache without expandable segments or sleep"
                " mode for the CUDA IPC path)"
            )
        try:
            _, handle, nbytes, offset, counter, counter_offset, event, sync = storage._share_cuda_()
        except RuntimeError as error:
            raise IpcUnavailable(
                f"torch cannot make a CUDA IPC handle of the cache on cuda:{device_index}: {error}"
            ) from None
    return CudaSegment(
        base_address=storage.data_ptr(),
        nbytes=int(nbytes),
        device_uuid=device_uuid(device_index),
        handle=bytes(handle),
        offset_bytes=int(offset),
        ref_counter=bytes(counter),
        ref_counter_offset=int(counter_offset),
        event_handle=bytes(event),
        event_sync_required=bool(sync),
    )


def legacy_ipc_capable(pointer: int) -> bool | None:
    """Whether the driver says the GPU memory at ``pointer`` can have a legacy CUDA IPC handle (None: it could not
    be asked). Needs the pointer's device context current on this thread."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    value = ctypes.c_int(0)
    result = driver.cuPointerGetAttribute(
        ctypes.byref(value), ctypes.c_int(_IS_LEGACY_CUDA_IPC_CAPABLE), ctypes.c_uint64(pointer)
    )
    return None if result != 0 else bool(value.value)


def device_uuid(index: int) -> str:
    """The UUID of this process's GPU ``index`` (as torch prints it), the same in every process that sees it."""
    return str(torch.cuda.get_device_properties(index).uuid)


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


# ---------------------------------------------------------------------------- opening (the reader)


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
    if not _SHARED_NAME.fullmatch(segment.name):
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
