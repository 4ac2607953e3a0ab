"""pd-transfer as a vLLM (0.31 and 0.32, CPU) KV connector: the only package that imports vLLM.

Load it with::

    --kv-transfer-config '{"kv_connector": "PdTransferConnector",
                           "kv_connector_module_path": "pd_transfer.integrations.vllm",
                           "kv_role": "kv_both", "kv_buffer_device": "cpu",
                           "kv_connector_extra_config": {"side_channel_host": "127.0.0.1",
                                                         "side_channel_port": 5600}}'

vLLM imports this package and takes ``PdTransferConnector`` from it. ``kv_connector_extra_config`` is read by
:class:`~pd_transfer.connector.config.ConnectorConfig` (unknown keys are refused; ``VLLM_NIXL_SIDE_CHANNEL_HOST``
/ ``_PORT`` are the fallbacks of the side channel's address).

Any other vLLM version is refused when vLLM imports this package: :mod:`.compat` is imported first and raises
:class:`~pd_transfer.integrations.vllm_versions.UnsupportedVllmVersion`, naming the supported range.

Modules:

* :mod:`.compat`: the version check on load, and what differs between the supported versions.
* :mod:`.connector`: ``PdTransferConnector`` and the messages it passes through vLLM (step metadata, handshake
  metadata).
* :mod:`.cpu_cache`: vLLM's CPU KV cache tensors described as a layout and a cache.
* :mod:`.cpu_packing`: the CPU attention backend's packing of K and V in a block, measured with vLLM's kernel.
* :mod:`.engine_spin`: ``engine_spin_s``, the shortened busy-wait of vLLM's shared-memory queues.
* :mod:`.stats`: stats through vLLM's connector stats hooks and the ``vllm:pd_transfer_*`` metrics.
* :mod:`.offload`: ``PdOffloadConnector`` (the offload tiers as a second connector, from this same module path) and
  its halves, configuration, KV events and metrics.
"""

from .compat import SUPPORTED_RANGE, VLLM_VERSION, UnsupportedVllmVersion  # first: refuses another vLLM
from .connector import PdTransferConnector, PdTransferHandshakeMetadata, PdTransferMetadata
from .cpu_cache import describe_cpu_cache
from .cpu_packing import attention_isa, measure_packing
from .engine_spin import BUSY_POLL_MS, limit_engine_spin
from .offload.connector import PdOffloadConnector as PdOffloadConnector
from .stats import PdTransferPromMetrics, PdTransferStats

__all__ = [
    "BUSY_POLL_MS",
    "SUPPORTED_RANGE",
    "VLLM_VERSION",
    "PdTransferConnector",
    "PdTransferHandshakeMetadata",
    "PdTransferMetadata",
    "PdTransferPromMetrics",
    "PdTransferStats",
    "UnsupportedVllmVersion",
    "attention_isa",
    "describe_cpu_cache",
    "limit_engine_spin",
    "measure_packing",
]
