"""The proxy's side of ``Release`` (protocol version 2): tell a prefill engine that nobody will read the blocks it
holds for a request, so that it frees them now instead of at the end of their lease.

One exchange on a fresh DEALER socket, one attempt, bounded by ``timeout_s``: ``Hello`` -> ``Challenge``, then
``Release`` -> ``ReleaseReply``. With a secret the ``Release`` carries an HMAC over the server's single-use nonce,
as a ``GetMetadata`` does, so a peer without the secret cannot release anything. Releasing is idempotent: a request
no longer held (read, expired, released before) is answered ``not_held``. Blocking: call it off an event loop.
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from .auth import as_secret, new_nonce, signed_request_mac
from .endpoints import peer_name
from .errors import HandshakeError, HandshakeTimeout
from .link import AttemptFailed, greet, open_link, receive, unexpected
from .messages import Release, ReleaseOutcome, ReleaseReply
from .versions import PROTOCOL_VERSION, RELEASE_VERSION

logger = logging.getLogger(__name__)


class Releaser:
    """Sends ``Release`` messages; one ZMQ context for all of them. Thread-safe (each call has its own socket).

    ``secret``: the side channel's shared secret (``None``: the servers have none). ``timeout_s``: bound of one
    release, connection to reply.
    """

    def __init__(self, secret: bytes | str | None = None, timeout_s: float = 1.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self._secret = as_secret(secret)
        self.timeout_s = timeout_s
        self._context = zmq.Context()

    def release(
        self, host: str, port: int, engine_id: str, request_id: str, *, read_possible: bool = True
    ) -> ReleaseOutcome:
        """Ask the prefill engine ``engine_id`` whose side channel is ``host:port`` to free ``request_id``'s blocks.
        ``read_possible``: a decode may be reading them now (see ``Release``).

        Returns ``releasing`` or ``not_held``. Raises ``HandshakeTimeout`` (no answer within ``timeout_s``, or the
        connection refused), ``HandshakeRefused`` (code ``unsupported_version`` from a version 1 server,
        ``unknown_engine``, ...), ``AuthenticationError`` or ``HandshakeError``.
        """
        peer = peer_name(host, port)
        deadline = time.monotonic() + self.timeout_s
        try:
            link = open_link(self._context, host, int(port))
        except zmq.ZMQError as exc:
            raise HandshakeError(f"release at {peer}: cannot open a socket ({exc}); releaser closed?") from exc
        try:
            challenge = greet(
                link,
                peer,
                deadline,
                self.timeout_s,
                version=PROTOCOL_VERSION,
                accepted=frozenset(range(RELEASE_VERSION, PROTOCOL_VERSION + 1)),
                client_nonce=new_nonce(),
                has_secret=self._secret is not None,
            )
            message = Release(
                protocol_version=challenge.protocol_version,
                engine_id=engine_id,
                request_id=request_id,
                server_nonce=challenge.server_nonce,
                read_possible=read_possible,
            )
            if self._secret is not None:
                message = msgspec.structs.replace(message, mac=signed_request_mac(self._secret, message))
            link.send(message, deadline)
            reply = receive(link, peer, deadline, "ReleaseReply", self.timeout_s)
            if not isinstance(reply, ReleaseReply):
                raise unexpected(peer, reply, "ReleaseReply", PROTOCOL_VERSION)
            if reply.request_id != request_id:
                raise HandshakeError(f"release at {peer}: the reply names another request than {request_id!r}")
            return reply.outcome
        except AttemptFailed as exc:
            raise HandshakeTimeout(peer, 1, self.timeout_s, [exc.reason]) from None
        except zmq.ContextTerminated as exc:
            raise HandshakeError(f"release at {peer} aborted: the releaser was closed") from exc
        finally:
            link.close()

    def close(self) -> None:
        """Release the ZMQ context; releases in flight fail. Call once no release runs."""
        self._context.term()
