"""UCX settings for reads over TCP (no RDMA, no shared memory between the two sides).

Over TCP, UCX emulates a READ with active messages: the target answers with its data in messages of at most
``UCX_TCP_TX_SEG_SIZE`` bytes (UCX's default 8 KiB), each one a copy into a send buffer, a ``send`` and, on the
reader, a ``recv`` into a buffer of ``UCX_TCP_RX_SEG_SIZE`` (default 64 KiB) and a copy out, every one of them
paid on the target's progress thread and the reader's. :data:`TCP_SEGMENT_ENV` raises both, so that a 512 MiB read
takes 8 times fewer messages; ``pd-transfer bench transfer --only-tcp`` measured what it gives (docs/benchmarks.md).

A sender's TX segment must fit the receiver's RX segment: a peer left at UCX's defaults (RX 64 KiB) that received a
larger message would corrupt its heap (seen with TX 256 KiB). TX therefore stays at 64 KiB, which every peer at
UCX's defaults accepts, and RX is raised, which costs nothing to a peer that sends less.

UCX reads its configuration from the environment when a context is made: the process's edge puts these values
into its environment once, before the first agent (:func:`pd_transfer.settings.apply_process_defaults`), leaving any
``UCX_*`` variable the user set as it is; ``PD_TRANSFER_TCP_SEGMENTS=0`` leaves UCX's own sizes. They only concern
UCX's tcp transport: reads over CMA on one host do not change.

Push (:mod:`pd_transfer.connector.transports.nixl.push_writer`) is decided here too: :func:`push_mode` (one source,
the same for a prefill and a decode) and, in mode "auto", :func:`push_to`.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path
from typing import cast

from pd_transfer.settings import TCP_SEGMENT_ENV, PushMode, Settings

#: UCX over TCP only (``self`` for an agent's reads of its own memory), with pd-transfer's segment sizes.
TCP_UCX_ENV: dict[str, str] = {"UCX_TLS": "tcp,self", **TCP_SEGMENT_ENV}


def tcp_ucx_env(settings: Settings) -> dict[str, str]:
    """:data:`TCP_UCX_ENV` with any of its variables ``settings`` holds (the user set them) as they are there."""
    own = {
        "UCX_TLS": settings.ucx_tls,
        "UCX_TCP_TX_SEG_SIZE": settings.ucx_tcp_tx_seg_size,
        "UCX_TCP_RX_SEG_SIZE": settings.ucx_tcp_rx_seg_size,
    }
    return {key: own[key] or value for key, value in TCP_UCX_ENV.items()}


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


def push_mode(configured: str | None, settings: Settings) -> PushMode:
    """Whether decode ranks ask prefill ranks to write instead of reading ("auto": where reads would go over TCP,
    :func:`push_to`; "on"; "off") and prefill ranks accept (unless "off"): ``configured`` (a connector's ``push``, a
    rank's argument) if given, else ``settings.push`` (``PD_TRANSFER_PUSH``). The one rule both sides follow.
    Raises ``ValueError`` for another value."""
    if configured is None:
        return settings.push
    chosen = configured.strip().lower()
    if chosen not in PUSH_MODES:
        raise ValueError(f"push must be one of {', '.join(PUSH_MODES)}, not {configured[:40]!r}")
    return cast(PushMode, chosen)


def push_to(host: str, mode: str, ucx_tls: str | None) -> bool:
    """Whether a decode rank asks the prefill whose side channel is at ``host`` to push, in ``mode``: "auto" pushes
    where reads would go over TCP: ``ucx_tls`` (``UCX_TLS``) names only TCP, or, unset, this host has no RDMA device
    and ``host`` is not one of its own addresses (on one host UCX reads with CMA)."""
    if mode != "auto":
        return mode == "on"
    if ucx_tls:
        return reads_over_tcp(ucx_tls)
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
