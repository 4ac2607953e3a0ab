"""What routing reads of a client request: its prompt (read once, :mod:`pd_transfer.proxy.prompt`), its session, the
engines' token ids of a text or chat prompt, and what the policies derive from those, kept for both pools."""

from __future__ import annotations

import xxhash

from pd_transfer.proxy.kv.block_hash import BlockHasher
from pd_transfer.proxy.prompt import Prompt
from pd_transfer.proxy.routing.prefix_tree import text_chunks, token_chunks

#: The longest prompt (tokens) whose ids routing reads: 64k tokens, beyond which a longer shared prefix changes no
#: choice.
MAX_HASHED_TOKENS = 65536


class RouteRequest:
    """One request as the pools see it: ``prompt``, and ``session_name`` (the session header's value, if sent).
    Derived values are computed on first use, once per request (both pools and the local prefill read them)."""

    def __init__(self, prompt: Prompt, session_name: str | None = None) -> None:
        self.prompt = prompt
        self._session_name = session_name
        self._sent: list[int] | bool | None = False  # False: not looked at yet
        self._tokenized: list[int] | None = None  # the engines' ids of a text or chat prompt (.tokenize)
        self._chunks: list[int] | None = None
        self._keys: tuple[BlockHasher, list[int]] | None = None  # the block keys of token_ids(), and by whom

    def session(self) -> int | None:
        """The session's key (a 64-bit hash: the proxy keeps no client string), or None when the request names none:
        the session header's value, else the body's ``user``."""
        name = self._session_name
        if not name:
            user = self.prompt.body.get("user")
            name = user if isinstance(user, str) else None
        if not name:
            return None
        return xxhash.xxh3_64_intdigest(name.encode("utf-8", "surrogatepass"))

    def sent_ids(self) -> list[int] | None:
        """The token ids the client sent (their first :data:`MAX_HASHED_TOKENS`), or None for text and chat."""
        if self._sent is False:
            ids = self.prompt.sent_ids()
            self._sent = ids[:MAX_HASHED_TOKENS] if ids is not None else None
        return self._sent if isinstance(self._sent, list) else None

    def token_ids(self) -> list[int] | None:
        """The prompt's token ids: the client's, else the ones the engines gave for its text (:meth:`set_token_ids`),
        else None."""
        sent = self.sent_ids()
        return sent if sent is not None else self._tokenized

    def set_token_ids(self, tokens: list[int]) -> None:
        """The engines' token ids of a text or chat prompt (:mod:`pd_transfer.proxy.tokenize`)."""
        self._tokenized = tokens[:MAX_HASHED_TOKENS]
        self._keys = None

    def block_keys(self, hasher: BlockHasher) -> list[int]:
        """The keys of the full blocks of :meth:`token_ids` (none without ids), hashed by ``hasher`` once per
        request."""
        cached = self._keys
        if cached is not None and cached[0] is hasher:
            return cached[1]
        tokens = self.token_ids()
        keys = hasher.keys(tokens) if tokens is not None else []
        self._keys = (hasher, keys)
        return keys

    def chunks(self) -> list[int]:
        """The prompt's chained chunk names for a prefix tree (its text, or the token ids the client sent; never the
        engines' ids, so that a failed tokenization does not change a prompt's names)."""
        if self._chunks is None:
            tokens = self.sent_ids()
            self._chunks = token_chunks(tokens) if tokens is not None else text_chunks(self.prompt.text())
        return self._chunks
