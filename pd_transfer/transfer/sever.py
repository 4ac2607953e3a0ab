"""Severing a stalled peer: this process's TCP connections to the host of a peer whose transfer stalled, shut down.

A NIXL transfer past its timeout is not over (:meth:`.agent.TransferAgent._drained`): over UCX's TCP transport its
bytes wait in a connection a network cut stalled, and land whenever it resumes, in memory the caller may have given
to another request. Closing our end of the connection is the only way to make sure nothing lands later: UCX then reads
an end of stream, fails the endpoint and the transfer ends with an error at once; the kernel answers whatever the peer
sends afterwards with a reset. NIXL 1.5 cannot force-close an endpoint (a flushing close waits for the stalled
transfer), so this shuts down (``shutdown(SHUT_RDWR)``, on a duplicate of the descriptor: UCX still owns and closes
it; found through ``/proc/self/net/tcp`` and ``/proc/self/fd``) the sockets of this process that UCX may use with that
host:

- every connection this process opened to it (UCX's to the peer's listener, and also the side channel's and the
  ``tcp`` transport's: both reconnect, and a stalled one of those would fail too);
- every connection it accepted on a UCX listener (the peer's own connections to us, that its WRITEs come over),
  UCX's listeners being the ones that appeared while this process made its NIXL agents (:func:`noting_listeners`);
  connections accepted on other listeners (an HTTP server's, say, from a proxy on that host) are left alone.

Never this host's own addresses (loopback included): same-host transfers do not run over a cut wire, and severing
there would hit the process's local clients. Linux only (``/proc/self/fd``); elsewhere nothing is severed.
"""

from __future__ import annotations

import ctypes
import functools
import ipaddress
import logging
import os
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_UCX_LISTENERS: set[int] = set()  # local ports of the listeners that appeared while NIXL agents were made
_PEER_HOSTS: dict[str, str] = {}  # peer agent name -> the host it was reached at


def note_peer(peer: str, host: str) -> None:
    """Peer agent ``peer`` was reached at ``host`` (its side channel's address): :func:`sever_peer` severs that."""
    with _LOCK:
        _PEER_HOSTS[peer] = host


def forget_peer(peer: str) -> None:
    """Drop what :func:`note_peer` noted of ``peer`` (an agent removed it)."""
    with _LOCK:
        _PEER_HOSTS.pop(peer, None)


def sever_peer(peer: str) -> int:
    """:func:`sever_host` of the host ``peer`` was reached at (0 when it was not noted)."""
    with _LOCK:
        host = _PEER_HOSTS.get(peer)
    return 0 if host is None else sever_host(host)


@contextmanager
def noting_listeners() -> Iterator[None]:
    """Note the TCP listeners this process opened while inside the block (a NIXL agent being made: UCX's)."""
    before = _listening_ports()
    try:
        yield
    finally:
        appeared = _listening_ports() - before
        with _LOCK:
            _UCX_LISTENERS.update(appeared)


def sever_host(host: str) -> int:
    """Shut down this process's TCP connections to ``host`` that UCX may use (see the module's doc); returns how
    many. Nothing for a host that resolves to none or to one of this host's own addresses."""
    return sever_addresses({address for address in _resolve(host) if not _is_local(address)})


def sever_addresses(addresses: set[str]) -> int:
    """:func:`sever_host` of the hosts at ``addresses`` (as :func:`_normal` spells them), whoever they are."""
    if not addresses:
        return 0
    with _LOCK:
        ucx_listeners = set(_UCX_LISTENERS)
    mine = list(_descriptors(_tcp_sockets()))
    listening = {entry.local_port for _, entry in mine if entry.state == _LISTEN}
    severed = 0
    for fd, entry in mine:
        if entry.peer not in addresses or entry.state == _LISTEN:
            continue
        if entry.local_port in listening and entry.local_port not in ucx_listeners:
            continue  # accepted on a listener of another server
        if _shutdown(fd, entry.inode):
            severed += 1
    return severed


_LISTEN = 0x0A  # TCP_LISTEN in /proc/net/tcp's "st" column


@dataclass(frozen=True)
class _Socket:
    local_port: int
    peer: str
    state: int
    inode: int


def _tcp_sockets() -> dict[int, _Socket]:
    """This network namespace's TCP sockets by inode (``/proc/self/net/tcp``, ``tcp6``)."""
    found: dict[int, _Socket] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            try:
                local, remote, state, inode = fields[1], fields[2], int(fields[3], 16), int(fields[9])
                found[inode] = _Socket(
                    int(local.split(":")[1], 16), proc_net_address(remote.split(":")[0]), state, inode
                )
            except ValueError:
                continue
    return found


def proc_net_address(text: str) -> str:
    """An address as ``/proc/net/tcp`` spells it (32-bit words in host order), as :func:`_normal` spells it."""
    raw = bytes.fromhex(text)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    return _normal(str(ipaddress.ip_address(words)))


def _descriptors(sockets: dict[int, _Socket]) -> Iterator[tuple[int, _Socket]]:
    """This process's descriptors of ``sockets`` (``/proc/self/fd``)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:[") and (entry := sockets.get(int(target[8:-1]))) is not None:
            yield int(name), entry


def _shutdown(fd: int, inode: int) -> bool:
    """``shutdown(SHUT_RDWR)`` on a duplicate of ``fd`` if it still is socket ``inode`` (not closed and reused)."""
    try:
        duplicate = os.dup(fd)
    except OSError:
        return False
    try:
        if os.fstat(duplicate).st_ino != inode:
            return False
        return _libc().shutdown(duplicate, socket.SHUT_RDWR) == 0
    finally:
        os.close(duplicate)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shutdown.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.shutdown.restype = ctypes.c_int
    return libc


def _listening_ports() -> set[int]:
    """The local ports of this process's listening TCP sockets."""
    sockets = _tcp_sockets()
    return {entry.local_port for _, entry in _descriptors(sockets) if entry.state == _LISTEN}


def _resolve(host: str) -> set[str]:
    try:
        return {_normal(str(info[4][0])) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return set()


def _normal(address: str) -> str:
    """``address`` as one spelling: an IPv4-mapped IPv6 address as its IPv4 address."""
    try:
        parsed = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return str(parsed.ipv4_mapped)
    return str(parsed)


def _is_local(address: str) -> bool:
    """Whether ``address`` is one of this host's (it can be bound to)."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return True  # not an address: never severed
    if parsed.is_loopback:
        return True
    family = socket.AF_INET6 if parsed.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((address, 0))
        return True
    except OSError:
        return False
