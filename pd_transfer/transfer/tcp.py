"""UCX settings for reads over TCP (no RDMA, no shared memory between the two sides).

Over TCP, UCX emulates a READ with active messages: the target answers with its data in messages of at most
``UCX_TCP_TX_SEG_SIZE`` bytes (UCX's default 8 KiB), each one a copy into a send buffer, a ``send`` and, on the
reader, a ``recv`` into a buffer of ``UCX_TCP_RX_SEG_SIZE`` (default 64 KiB) and a copy out, every one of them
paid on the target's progress thread and the reader's. :data:`TCP_SEGMENT_ENV` raises both, so that a 512 MiB read
takes 8 times fewer messages; ``pd-transfer bench transfer --only-tcp`` measured what it gives (docs/benchmarks.md).

A sender's TX segment must fit the receiver's RX segment: a peer left at UCX's defaults (RX 64 KiB) that received a
larger message would corrupt its heap (seen with TX 256 KiB). TX therefore stays at 64 KiB, which every peer at
UCX's defaults accepts, and RX is raised, which costs nothing to a peer that sends less.

UCX reads its configuration from the environment when a context is made: :func:`apply_tcp_defaults` puts these
values into this process's environment before an agent is made, leaving any ``UCX_*`` variable the user set as it
is; ``PD_TRANSFER_TCP_SEGMENTS=0`` leaves UCX's own sizes. They only concern UCX's tcp transport: reads over CMA on
one host do not change.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

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


#: Whether decode ranks ask prefill ranks to push (write) instead of reading: "auto" (default; where reads would go
#: over TCP, :func:`push_to`), "on" or "off".
PUSH_ENV = "PD_TRANSFER_PUSH"
PUSH_MODES = ("auto", "on", "off")
#: UCX transport names that cannot read one-sidedly: with ``UCX_TLS`` naming nothing else, reads go over TCP.
_NOT_ONE_SIDED = {"tcp", "self", "sockcm", "tcp_sockcm", "rdmacm"}
_RDMA_DEVICES = Path("/sys/class/infiniband")


def reads_over_tcp(ucx_tls: str) -> bool:
    """Whether UCX's transports ``ucx_tls`` (a ``UCX_TLS`` value) leave reads between two processes to TCP: only
    when it lists transports and none of them reads one-sidedly (``cma``, ``rc``, shared memory...)."""
    names = {name.strip().lower() for name in ucx_tls.split(",") if name.strip()}
    if not names or any(name.startswith("^") for name in names):
        return False
    return names <= _NOT_ONE_SIDED and "tcp" in names


def push_mode(mode: str | None = None) -> str:
    """``mode``, or ``PD_TRANSFER_PUSH``, else "auto"; raises ``ValueError`` naming the variable for another value."""
    chosen = (os.environ.get(PUSH_ENV, "") if mode is None else mode).strip().lower() or "auto"
    if chosen not in PUSH_MODES:
        raise ValueError(f"{PUSH_ENV} must be one of {', '.join(PUSH_MODES)}, not {chosen[:40]!r}")
    return chosen


def push_to(host: str, mode: str) -> bool:
    """Whether a decode rank asks the prefill whose side channel is at ``host`` to push, in ``mode``: "auto" pushes
    where reads would go over TCP: ``UCX_TLS`` names only TCP, or, unset, this host has no RDMA device and ``host``
    is not one of its own addresses (on one host UCX reads with CMA)."""
    if mode != "auto":
        return mode == "on"
    transports = os.environ.get("UCX_TLS", "").strip()
    if transports:
        return reads_over_tcp(transports)
    return not rdma_devices() and not is_local_address(host)


def rdma_devices() -> bool:
    """Whether this host has an RDMA device (``/sys/class/infiniband``)."""
    try:
        return any(_RDMA_DEVICES.iterdir())
    except OSError:
        return False


def is_local_address(host: str) -> bool:
    """Whether ``host`` names this host (loopback, or an address a socket here can bind). An unresolvable name
    counts as local: nothing is pushed to what cannot be told apart."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return True
    for family, _, _, _, address in infos:
        ip = ipaddress.ip_address(str(address[0]).split("%")[0])
        if ip.is_loopback or ip.is_unspecified:
            return True
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((str(ip), 0))
                return True
            except OSError:
                continue
    return False


def push_accepted() -> bool:
    """Whether a prefill rank writes for decode ranks that ask: unless ``PD_TRANSFER_PUSH=off``."""
    return os.environ.get(PUSH_ENV, "").strip().lower() != "off"
