"""UCX settings for reads over TCP (no RDMA, no shared memory between the two sides).

:data:`TCP_UCX_ENV` holds what ``pd-transfer bench transfer --tcp`` measured to help on that path; the user's own
``UCX_*`` variables always win (:func:`tcp_ucx_env`).
"""

from __future__ import annotations

import os

#: UCX over TCP only (``self`` for an agent's reads of its own memory).
TCP_UCX_ENV: dict[str, str] = {"UCX_TLS": "tcp,self"}


def tcp_ucx_env() -> dict[str, str]:
    """:data:`TCP_UCX_ENV` with any ``UCX_*`` variable already set in this process's environment left as it is."""
    return {key: os.environ.get(key, value) for key, value in TCP_UCX_ENV.items()}
