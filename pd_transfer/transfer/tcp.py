"""UCX settings for reads over TCP (no RDMA, no shared memory between the two sides).

Over TCP, UCX emulates a READ with active messages: the target answers with its data in messages of at most
``UCX_TCP_TX_SEG_SIZE`` bytes (UCX's default 8 KiB), each one a copy into a send buffer, a ``send`` and, on the
reader, a ``recv`` into a buffer of ``UCX_TCP_RX_SEG_SIZE`` (default 64 KiB) and a copy out, every one of them
paid on the target's progress thread and the reader's. :data:`TCP_SEGMENT_ENV` raises both, so that a 512 MiB read
takes 8 times fewer messages; ``pd-transfer bench transfer --only-tcp`` measured what it gives (README, "Over TCP").

A sender's TX segment must fit the receiver's RX segment: a peer left at UCX's defaults (RX 64 KiB) that received a
larger message would corrupt its heap (seen with TX 256 KiB). TX therefore stays at 64 KiB, which every peer at
UCX's defaults accepts, and RX is raised, which costs nothing to a peer that sends less.

UCX reads its configuration from the environment when a context is made: :func:`apply_tcp_defaults` puts these
values into this process's environment before an agent is made, leaving any ``UCX_*`` variable the user set as it
is; ``PD_TRANSFER_TCP_SEGMENTS=0`` leaves UCX's own sizes. They only concern UCX's tcp transport: reads over CMA on
one host do not change.
"""

from __future__ import annotations

import os

#: Switch of :func:`apply_tcp_defaults` ("0": off; anything else or unset: on).
SWITCH_ENV = "PD_TRANSFER_TCP_SEGMENTS"

#: Segment sizes for UCX's tcp transport (UCX memory units).
TCP_SEGMENT_ENV: dict[str, str] = {"UCX_TCP_TX_SEG_SIZE": "64k", "UCX_TCP_RX_SEG_SIZE": "256k"}

#: UCX over TCP only (``self`` for an agent's reads of its own memory), with pd-transfer's segment sizes.
TCP_UCX_ENV: dict[str, str] = {"UCX_TLS": "tcp,self", **TCP_SEGMENT_ENV}


def tcp_ucx_env() -> dict[str, str]:
    """:data:`TCP_UCX_ENV` with any ``UCX_*`` variable already set in this process's environment left as it is."""
    return {key: os.environ.get(key, value) for key, value in TCP_UCX_ENV.items()}


def apply_tcp_defaults() -> dict[str, str]:
    """Unless ``PD_TRANSFER_TCP_SEGMENTS=0``, set :data:`TCP_SEGMENT_ENV` in ``os.environ`` where unset (children
    inherit it); returns what is in force (nothing when switched off)."""
    if os.environ.get(SWITCH_ENV, "").strip() == "0":
        return {}
    for key, value in TCP_SEGMENT_ENV.items():
        if not os.environ.get(key, "").strip():
            os.environ[key] = value
    return {key: os.environ[key] for key in TCP_SEGMENT_ENV}
