"""Server nonces that a flood cannot evict: verified without being stored, remembered only once used.

A nonce is ``issued_at (8 bytes, ms of the server's clock) | random (8 bytes) | tag (16 bytes)``, where ``tag`` is
a truncated HMAC-SHA256 of the first 16 bytes under a key that never leaves this process. Issuing one stores
nothing, so any number of ``Hello`` messages costs no memory and pushes out no other client's nonce. A nonce is
accepted once, within ``ttl_s`` of its issue: used nonces are kept until they expire, and only after the request
that used it proved it knows the shared secret (the server checks the request's MAC first), so only
authenticated peers can fill that store. When it is full, new requests are refused as ``busy`` rather than an
older entry being dropped (dropping one would allow its replay).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

from .auth import NONCE_BYTES

NonceCheck = Literal["ok", "unknown", "expired", "reused", "busy"]

_STAMP_BYTES = 8
_RANDOM_BYTES = 8
_TAG_BYTES = NONCE_BYTES - _STAMP_BYTES - _RANDOM_BYTES


class NonceBook:
    """Issues and checks one server's nonces. Not thread-safe: owned by the server's serving thread.

    ``ttl_s``: seconds a nonce stays valid after issue. ``capacity``: used nonces remembered at once (each until
    its own expiry). ``clock``: seconds, monotonic within the process.
    """

    def __init__(self, ttl_s: float, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"nonce_ttl_s must be positive, got {ttl_s}")
        if capacity < 1:
            raise ValueError(f"max_outstanding_nonces must be at least 1, got {capacity}")
        self._ttl_s = ttl_s
        self._capacity = capacity
        self._clock = clock
        self._key = secrets.token_bytes(32)
        self._used: OrderedDict[bytes, float] = OrderedDict()  # nonce -> expiry, oldest first
        self.refused_busy = 0  # authenticated requests refused because the used-nonce store was full

    def __len__(self) -> int:
        """Used nonces still remembered (issued ones are never stored)."""
        return len(self._used)

    def issue(self) -> bytes:
        """A fresh nonce of ``NONCE_BYTES`` bytes; stores nothing."""
        stamp = max(0, int(self._clock() * 1000)).to_bytes(_STAMP_BYTES, "big")
        body = stamp + secrets.token_bytes(_RANDOM_BYTES)
        return body + self._tag(body)

    def check(self, nonce: bytes) -> NonceCheck:
        """Whether ``nonce`` may be used now: issued here, within its TTL, not used before. Changes nothing."""
        if len(nonce) != NONCE_BYTES:
            return "unknown"
        body, tag = nonce[: _STAMP_BYTES + _RANDOM_BYTES], nonce[_STAMP_BYTES + _RANDOM_BYTES :]
        if not hmac.compare_digest(tag, self._tag(body)):
            return "unknown"
        now = self._clock()
        issued = int.from_bytes(body[:_STAMP_BYTES], "big") / 1000
        if not issued - 0.001 <= now < issued + self._ttl_s:
            return "expired"
        self._purge(now)
        if nonce in self._used:
            return "reused"
        if len(self._used) >= self._capacity:
            return "busy"
        return "ok"

    def consume(self, nonce: bytes) -> NonceCheck:
        """``check``, and on ``ok`` remember the nonce as used until it expires. Call it only for requests whose
        MAC verified."""
        outcome = self.check(nonce)
        if outcome == "ok":
            issued = int.from_bytes(nonce[:_STAMP_BYTES], "big") / 1000
            self._used[nonce] = issued + self._ttl_s
        elif outcome == "busy":
            self.refused_busy += 1
        return outcome

    def _tag(self, body: bytes) -> bytes:
        return hmac.new(self._key, body, hashlib.sha256).digest()[:_TAG_BYTES]

    def _purge(self, now: float) -> None:
        # Entries are added in consumption order, and consumption follows issue within one TTL, so expired entries
        # gather at the front; an entry out of order stays until those before it expire (bounded by capacity).
        while self._used:
            nonce, expiry = next(iter(self._used.items()))
            if expiry > now:
                break
            del self._used[nonce]
