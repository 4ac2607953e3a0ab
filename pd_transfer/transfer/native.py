"""The NIXL binding's names this package relies on: its exception classes, and quiet native logging.

NIXL raises one class per status (``nixlBackendError``, ``nixlNotFoundError``, ``nixlRemoteDisconnectError``, ...)
from its compiled binding module; the transfer layer matches them by class. Logging defaults are applied when the
first agent is made, never at import.
"""

from __future__ import annotations

import logging
import os

from nixl._api import nixlBind

NixlBackendError: type[Exception] = nixlBind.nixlBackendError
NixlNotFoundError: type[Exception] = nixlBind.nixlNotFoundError
NixlRemoteDisconnectError: type[Exception] = nixlBind.nixlRemoteDisconnectError
NixlRegDList = nixlBind.nixlRegDList

_QUIETED = False


def quiet_native_logs() -> None:
    """Lower NIXL's and UCX's default log levels unless the user chose their own: NIXL logs every agent and
    backend at INFO, and UCX's exit-time pool warnings are noise for users. UCX reads ``UCX_LOG_LEVEL`` when a
    UCX backend starts, so this must run before an agent is made; NIXL's Python logger is configured when
    ``nixl`` is imported, so its level is set here directly. Idempotent."""
    global _QUIETED
    if _QUIETED:
        return
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    if "NIXL_LOG_LEVEL" not in os.environ:
        logging.getLogger("nixl").setLevel(logging.WARNING)
    _QUIETED = True
