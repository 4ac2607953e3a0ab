"""The owner's half of same-host IPC: handles of a rank's cache memory, made once when the rank is created
(:func:`export_cache`, once per kind offered), for readers on the same host (:mod:`.opening` opens them). Torch and
the standard library only: no engine, no transport.

* **GPU memory**: one legacy CUDA IPC handle per torch storage, made as ``torch.multiprocessing`` shares a CUDA
  storage (``UntypedStorage._share_cuda_``). Memory from CUDA's virtual memory API (PyTorch's expandable segments,
  vLLM's sleep-mode allocator) cannot be shared by a legacy handle: the driver says so
  (``CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE``) and the export is refused with that reason; NIXL moves such
  caches.
* **Host memory**: a cache allocated shareable (:func:`shareable_host_buffer`) lives in a memfd the owner keeps open
  for as long as the memory is mapped. Any host memory is offered to be read in place with ``process_vm_readv``
  (:class:`CmaSegment`), with random probe bytes the reader reads back before it trusts the pid.

The owner keeps its cache (an engine's cache lives as long as the engine). Torch's reference counter of a shared CUDA
storage is per export, not per reader: it keeps the owner's allocator from reusing the memory only once the owner
frees the storage, which an engine does at exit.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from pd_transfer.handshake.host_identity import local_boot_id
from pd_transfer.handshake.messages import CmaSegment, CudaSegment, HostSegment, RankIpc
from pd_transfer.spec import KVRegion, memory_of
from pd_transfer.transfer import cma

from .common import SHARED_NAME_PREFIX, IpcUnavailable, device_uuid, pid_namespace

_IS_LEGACY_CUDA_IPC_CAPABLE = 10  # CUpointer_attribute, cuda.h
_PAGE = mmap.PAGESIZE
#: Bytes of the probe a process offering its host memory to ``process_vm_readv`` holds.
PROBE_BYTES = 16

Segment = CudaSegment | HostSegment | CmaSegment


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


#: What a cache can be offered as: GPU memory through CUDA IPC handles, host memory in a memfd, or host memory read in
#: place with ``process_vm_readv``.
ExportKind = Literal["cuda", "memfd", "cma"]


def export_cache(
    tensors: Sequence[torch.Tensor], regions: Sequence[KVRegion], kind: ExportKind
) -> tuple[RankIpc | None, str]:
    """(the memory behind ``tensors`` offered as ``kind``, "") for same-host readers, or (None, why it cannot be
    offered so). Call once per rank and kind: every call makes new CUDA IPC handles."""
    place = memory_of(list(regions))
    if (kind == "cuda") == place.is_host:
        return None, f"the cache is in {place}"
    boot_id = local_boot_id()
    if not boot_id:
        return None, "this host has no readable boot id"
    storages = _distinct_storages(tensors)
    try:
        if kind == "memfd":
            segments = _memfd_segments(storages)
        elif kind == "cma":
            segments = [_cma_segment()]
        else:
            segments = [_cuda_segment(storage, place.device_index) for storage in storages]
    except IpcUnavailable as error:
        return None, str(error)
    return RankIpc(boot_id=boot_id, pid=os.getpid(), pid_namespace=pid_namespace(), segments=segments), ""


def _distinct_storages(tensors: Sequence[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The storages behind ``tensors``, each once."""
    found: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        found.setdefault(storage.data_ptr(), storage)
    return list(found.values())


def _memfd_segments(storages: Sequence[torch.UntypedStorage]) -> list[Segment]:
    """One memfd segment per shareable mapping holding the storages; ``IpcUnavailable`` where one is elsewhere."""
    segments: dict[int, Segment] = {}
    for storage in storages:
        mapping = _shared_mapping_of(storage.data_ptr(), storage.nbytes())
        if mapping is None:
            raise IpcUnavailable("the cache is not in shareable host memory (a memfd)")
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
