"""pd-transfer as a vLLM (0.32, CPU) KV connector (:mod:`.connector`); vLLM loads ``PdTransferConnector`` from here."""

from .connector import (
    BUSY_POLL_MS,
    PdTransferConnector,
    PdTransferHandshakeMetadata,
    PdTransferMetadata,
    PdTransferPromMetrics,
    PdTransferStats,
    limit_engine_spin,
    measure_packing,
)

__all__ = [
    "BUSY_POLL_MS",
    "PdTransferConnector",
    "PdTransferHandshakeMetadata",
    "PdTransferMetadata",
    "PdTransferPromMetrics",
    "PdTransferStats",
    "limit_engine_spin",
    "measure_packing",
]
