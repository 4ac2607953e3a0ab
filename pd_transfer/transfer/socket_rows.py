"""Scattered rows over a stream socket with the C library's ``sendmsg`` / ``recvmsg``: up to :data:`IOV_MAX` rows a
call, straight from and into the memory they live in (no copy in user space, no Python object per row). Rows are
:data:`~pd_transfer.transfer.cma.IOVEC` arrays (base address, length); the bytes on the wire are the rows' bytes in
order, nothing between them, so a sender's rows and a receiver's may be cut differently (rows adjacent on one side
merged there). Close the socket only where no call runs on it (see :func:`_move`). The socket must be blocking (no
Python timeout: Python would make it non-blocking); a call that a peer's silence stalls returns when the socket's
``SO_SNDTIMEO`` / ``SO_RCVTIMEO`` (if set) runs out, or at once when another thread shuts the socket down (how a
reader with a deadline stops a receive).

Errors: a peer that closed or reset the connection raises :class:`~.errors.PeerDisconnected`; a stall past the
socket's timeout :class:`~.errors.TransferTimeout`; any other failure :class:`~.errors.TransferError` with its errno.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import socket
import struct

import numpy as np

from .cma import IOVEC
from .errors import PeerDisconnected, TransferError, TransferTimeout

#: The most iovec entries one call takes (Linux's ``UIO_MAXIOV``).
IOV_MAX = 1024
_MSG_WAITALL = 0x100
_MSG_NOSIGNAL = 0x4000
_GONE = {errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN, errno.ESHUTDOWN, errno.EBADF}


class _MsgHdr(ctypes.Structure):
    """``struct msghdr`` (Linux, 64-bit)."""

    _fields_ = [
        ("msg_name", ctypes.c_void_p),
        ("msg_namelen", ctypes.c_uint32),
        ("msg_iov", ctypes.c_void_p),
        ("msg_iovlen", ctypes.c_size_t),
        ("msg_control", ctypes.c_void_p),
        ("msg_controllen", ctypes.c_size_t),
        ("msg_flags", ctypes.c_int),
    ]


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    for name in ("sendmsg", "recvmsg"):
        call = getattr(libc, name)
        call.argtypes = [ctypes.c_int, ctypes.POINTER(_MsgHdr), ctypes.c_int]
        call.restype = ctypes.c_ssize_t
    return libc


def send_rows(sock: socket.socket, rows: np.ndarray) -> int:
    """Send the bytes of ``rows`` (:data:`IOVEC`, read while sent: keep them unchanged) in order; the bytes sent."""
    return _move(sock, rows, "sendmsg", _MSG_NOSIGNAL)


def receive_rows(sock: socket.socket, rows: np.ndarray) -> int:
    """Receive exactly the bytes of ``rows`` (:data:`IOVEC`, written in order); the bytes received."""
    return _move(sock, rows, "recvmsg", _MSG_WAITALL)


def set_send_timeout(sock: socket.socket, seconds: float) -> None:
    """Make a send on ``sock`` that moves nothing for ``seconds`` fail (``SO_SNDTIMEO``); the socket stays blocking."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("@ll", whole, int((seconds - whole) * 1e6)))


def _move(sock: socket.socket, rows: np.ndarray, name: str, flags: int) -> int:
    """Run ``sendmsg`` or ``recvmsg`` over ``rows`` until every byte moved, up to :data:`IOV_MAX` rows a call, a call
    that moved part of a row going on from there."""
    if rows.dtype != IOVEC:
        raise TypeError(f"rows must be an IOVEC array, not {rows.dtype}")
    call = getattr(_libc(), name)
    header = _MsgHdr()
    total = int(rows["length"].sum()) if len(rows) else 0
    index, offset, moved = 0, 0, 0
    while index < len(rows):
        chunk = np.array(rows[index : index + IOV_MAX])  # a copy: its first entry may start inside a row
        chunk["base"][0] += np.uint64(offset)
        chunk["length"][0] -= np.uint64(offset)
        if not chunk["length"].any():  # rows of no bytes only: no call (it would wait for a byte, or for room)
            index += len(chunk)
            continue
        header.msg_iov = chunk.ctypes.data
        header.msg_iovlen = len(chunk)
        fd = sock.fileno()  # each call: -1 once the socket is closed (whose number may be another's by now)
        if fd < 0:
            raise PeerDisconnected(f"{name}: the socket was closed after {moved} of {total} bytes")
        done = call(fd, ctypes.byref(header), flags)
        if done < 0:
            code = ctypes.get_errno()
            if code == errno.EINTR:
                continue
            raise _error(name, code, moved, total)
        if done == 0 and chunk["length"].sum() > 0:
            raise PeerDisconnected(f"{name}: the peer closed the connection after {moved} of {total} bytes")
        moved += done
        ends = np.cumsum(chunk["length"], dtype=np.uint64)
        whole = int(np.searchsorted(ends, np.uint64(done), side="right"))  # entries of the chunk now complete
        offset = (done - int(ends[whole - 1]) if whole else offset + done) if whole < len(chunk) else 0
        index += whole
    return moved


def _error(name: str, code: int, moved: int, total: int) -> TransferError:
    where = f"{name}: {os.strerror(code)} after {moved} of {total} bytes"
    if code in (errno.EAGAIN, errno.EWOULDBLOCK):
        return TransferTimeout(f"{where} (the peer moved nothing for the socket's timeout)")
    if code in _GONE:
        return PeerDisconnected(where)
    return TransferError(f"{where} (errno {code})")
