"""Same-host memory sharing, below the connector: a rank's cache offered to readers on its host (CUDA IPC handles,
memfd segments, or in place with ``process_vm_readv``), and a prefill engine's memory opened or read in place by a
decode. No connector types: the connector's same-host transports (:mod:`pd_transfer.connector.transports.ipc`) use what
this package exports here, never its modules.

* :mod:`.common`: the refusal (:class:`IpcUnavailable`), memfd naming, pid namespace and GPU identities;
* :mod:`.exporting`: the owner's half (:func:`export_cache`, :func:`shareable_host_buffer`);
* :mod:`.opening`: the reader's half (segments opened, probes checked, owners watched);
* :mod:`.ipc_engine`: an engine opened through IPC and the row copies out of it;
* :mod:`.cma_engine`: an engine read in place, its reads cut into ``process_vm_readv`` calls.
"""

from .cma_engine import MIN_DIRECT_ROW_BYTES, CmaEngine, CmaSource
from .common import IpcUnavailable, pid_namespace
from .exporting import ExportKind, export_cache, shareable_host_buffer
from .ipc_engine import IpcEngine, IpcSource
from .opening import gpu_reach

__all__ = [
    "MIN_DIRECT_ROW_BYTES",
    "CmaEngine",
    "CmaSource",
    "ExportKind",
    "IpcEngine",
    "IpcSource",
    "IpcUnavailable",
    "export_cache",
    "gpu_reach",
    "pid_namespace",
    "shareable_host_buffer",
]
