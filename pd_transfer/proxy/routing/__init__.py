"""How the proxy picks a backend of each role: the policies, one module each, named in one registry (``registry``:
name -> builder -> what it needs), their contract (``policy``), what they read of a request (``request``), session
affinity, the pools and their backends' health (``pool``), the local prefill, and the routing built from the
proxy's config (``setup``).

``DRAINING_HEADER`` is handed on from ``pool`` (the stand-ins and vLLM's drain name it here).
"""

from pd_transfer.proxy.routing.pool import DRAINING_HEADER

__all__ = ["DRAINING_HEADER"]
