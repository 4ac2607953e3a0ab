"""Server nonces: issued per ``Hello``, single-use, expiring, and bounded in number."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from .auth import new_nonce


class NonceBook:
    """Outstanding server nonces. Not thread-safe: owned by the server's serving thread.

    A nonce is valid for ``ttl_s`` seconds after it is issued and for one ``consume``. When
    ``capacity`` nonces are outstanding the oldest is evicted, so memory stays bounded however
    many ``Hello`` messages arrive (a flood can evict a slow client's nonce; it then retries).
    """

    def __init__(self, ttl_s: float, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"nonce_ttl_s must be positive, got {ttl_s}")
        if capacity < 1:
            raise ValueError(f"max_outstanding_nonces must be at least 1, got {capacity}")
        self._ttl_s = ttl_s
        self._capacity = capacity
        self._clock = clock
        self._expiry: OrderedDict[bytes, float] = OrderedDict()  # nonce -> expiry time, oldest first
        self.evicted = 0  # nonces dropped for capacity before being used or expiring

    def __len__(self) -> int:
        return len(self._expiry)

    def issue(self) -> bytes:
        """A fresh nonce, remembered until consumed, expired or evicted."""
        now = self._clock()
        self._purge(now)
        while len(self._expiry) >= self._capacity:
            self._expiry.popitem(last=False)
            self.evicted += 1
        nonce = new_nonce()
        self._expiry[nonce] = now + self._ttl_s
        return nonce

    def consume(self, nonce: bytes) -> bool:
        """Forget ``nonce``; ``True`` if it was outstanding and not expired."""
        expiry = self._expiry.pop(nonce, None)
        return expiry is not None and self._clock() < expiry

    def _purge(self, now: float) -> None:
        # Nonces are issued in time order with one TTL, so the expired ones are at the front.
        while self._expiry:
            nonce, expiry = next(iter(self._expiry.items()))
            if expiry > now:
                break
            del self._expiry[nonce]
