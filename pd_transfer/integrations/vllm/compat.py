"""What differs between the vLLM versions the connectors support, and the refusal of any other version on load.

Imported first by the package (``__init__``): :data:`VLLM_VERSION` is checked by
:func:`~pd_transfer.integrations.vllm_versions.check_vllm_version` before any module of the package imports vLLM's
connector API, so an unsupported vLLM stops at load with :class:`UnsupportedVllmVersion` (raised out of vLLM's
``importlib.import_module`` of ``kv_connector_module_path``), never later at a request.

The differences between 0.31 and 0.32 that reach the connectors (read from both releases' sources; the signatures
of ``KVConnectorBase_V1`` are checked statically by ``tests/unit/test_vllm_api.py``):

* ``vllm.v1.metrics.cache_hit_source`` is new in 0.32: the source of external prompt-cache hits, which a connector
  names with ``_cache_hit_source`` or splits with ``get_external_cache_hit_sources``. 0.31 counts external hits
  under one label and reads neither: :class:`CacheHitSource` is a stand-in with the members we name there.
"""

from __future__ import annotations

from enum import StrEnum

import vllm

from pd_transfer.integrations.vllm_versions import SUPPORTED_RANGE, UnsupportedVllmVersion, check_vllm_version

__all__ = ["SUPPORTED_RANGE", "VLLM_VERSION", "CacheHitSource", "UnsupportedVllmVersion"]


def _running_version() -> str:
    """The running vLLM's version string, checked (raises :class:`UnsupportedVllmVersion` outside the range)."""
    version = str(getattr(vllm, "__version__", "unknown"))
    check_vllm_version(version)
    return version


#: the running vLLM's version, inside :data:`SUPPORTED_RANGE` (checked when this module is imported)
VLLM_VERSION = _running_version()

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # vLLM 0.31: external hits are not split by source, nothing reads one

    class CacheHitSource(StrEnum):  # type: ignore[no-redef]  # the stand-in of vLLM 0.32's enum
        """The members of vLLM 0.32's ``CacheHitSource`` that the connectors name (unread on vLLM 0.31)."""

        HOST = "host"
        P2P = "p2p"
        DISK = "disk"
