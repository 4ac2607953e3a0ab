"""``kv_transfer_params``, checked at the edge.

Requests carry an untyped dict from the client (through the proxy), with the keys of vLLM's NixlConnector.
vLLM checks none of it, and a malformed dict can hang a request or kill the engine; here every value is
checked once, with a message naming the key and what is wrong, and turned into a typed struct:

* ``{"do_remote_decode": true, ...}`` (proxy -> prefill): :class:`RemoteDecodeRequest`, compute the prompt
  and hold its KV for a decode engine;
* ``{"do_remote_prefill": true, "remote_engine_id": ..., ...}`` (proxy -> decode, as returned by the
  prefill): :class:`RemotePrefill`, load the prompt's KV from that prefill engine;
* neither flag (or no dict at all): ``None``.

Keys read: ``do_remote_prefill``, ``do_remote_decode``, ``remote_engine_id``, ``remote_request_id``,
``remote_block_ids`` (a list of distinct ints, or one such list per KV cache group: exactly one group accepted),
``remote_host``, ``remote_port``, ``tp_size``; optional ``remote_num_tokens``, ``remote_block_size``, and
vLLM's ``dcp_size`` / ``pp_size`` (only 1), ``transfer_mode`` (only ``"pull"``),
``remote_blocks_expiry_time`` (type only), and ours: ``remote_hold_seconds``, ``remote_hold_until`` and
``remote_incarnation`` (the hold window, below), and ``stream_id`` (below). Other keys are ignored, so that newer
proxies keep working.

**Streamed requests** (issue 41: both legs sent at once). The prefill's leg carries ``{"do_remote_decode": true,
"stream_id": ID}``: its KV is offered layer by layer while it is computed, readers naming it ``ID``. The decode's
leg carries ``do_remote_prefill`` with the prefill's ``remote_engine_id``, ``remote_host``, ``remote_port`` and
``tp_size`` (known from its earlier answers), ``stream_id``: ``ID`` (also as ``remote_request_id``) and no
``remote_block_ids``: the decode learns them from the prefill when it computes the request.

**The hold window.** A prefill promises to hold the blocks for ``remote_hold_seconds`` from when it made the
params (``remote_hold_until``: the same end in Unix seconds), unless its readers reported first, and only as the
incarnation ``remote_incarnation`` (a digest of its ranks' NIXL agent names: a restarted prefill has another).
Monotonic clocks differ between hosts and wall clocks may be skewed, so the decode takes the earlier of two
ends, each on its own monotonic clock (:meth:`RemotePrefill.trust_deadline`): its receipt time plus the
duration (late by the params' time in transit) and the wall-clock end converted at receipt (off by the clock
skew), less :data:`HOLD_MARGIN_S`. That is sound as long as either the transit or the skew stays under the
margin. A read that ended before that deadline needs no ``LeaseConfirm``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence

import msgspec

from .metadata import RemoteRef

MAX_BLOCK_ID = 2**31 - 1  # NIXL descriptor indices are int32
MAX_ID_CHARS = 1024
MAX_HOST_CHARS = 255
MAX_HOLD_SECONDS = 3600.0  # longest hold window a decode believes
HOLD_MARGIN_S = 0.5  # taken off the hold window: the params' transit, or the hosts' clock skew
INCARNATION_CHARS = 32


class InvalidTransferParams(ValueError):
    """``kv_transfer_params`` are malformed; ``key`` names the offending key (None: the dict as a whole)."""

    def __init__(self, key: str | None, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"kv_transfer_params: {key}: {problem}" if key else f"kv_transfer_params: {problem}")


class RepeatedBlockIds(InvalidTransferParams):
    """``remote_block_ids`` names one block twice (entries ``first`` and ``again``): the list is corrupt, as each
    block holds one range of the prompt's tokens. ``ref`` is the prefill's request the params name (all else in
    them is valid), so that the decode can tell it to free the blocks it will never read."""

    def __init__(self, block_id: int, first: int, again: int) -> None:
        self.block_id = block_id
        self.first = first
        self.again = again
        self.ref: RemoteRef | None = None
        super().__init__("remote_block_ids", f"block {block_id} repeats (entries {first} and {again})")


def first_repeat(block_ids: Sequence[int]) -> tuple[int, int, int] | None:
    """(block id, index of its first entry, index of the entry repeating it) of the first repeated id, or None."""
    seen: dict[int, int] = {}
    for index, block in enumerate(block_ids):
        first = seen.setdefault(int(block), index)
        if first != index:
            return int(block), first, index
    return None


class RemotePrefill(msgspec.Struct, frozen=True, kw_only=True):
    """Decode side: the prompt's KV was computed by a remote prefill engine; load it from there."""

    engine_id: str
    request_id: str  # the prefill engine's id of the request (its blocks are held under it)
    block_ids: tuple[int, ...]  # the prefill's blocks, in token order
    host: str  # the prefill engine's side channel
    port: int
    tp_size: int
    num_tokens: int | None  # tokens of KV the prefill holds (remote_num_tokens, else the prompt length)
    block_size: int | None  # the prefill's block size, when the params say
    hold_seconds: float | None = None  # the hold window from when the params were made, when the params say
    hold_until: float | None = None  # its end, Unix seconds
    incarnation: str | None = None  # the prefill incarnation promising it (:func:`incarnation_token`)
    stream: bool = False  # streamed while the prefill computes it: ``block_ids`` empty, learnt from the prefill

    def trust_deadline(self, received: float, wall_now: float, margin_s: float = HOLD_MARGIN_S) -> float | None:
        """Until when (the ``received`` clock: this host's ``time.monotonic``) a read of these blocks that has
        ended needs no confirmation, given that the params arrived at ``received`` (``wall_now``: ``time.time()``
        then); None without a window. The earlier of the transit-bound and the wall-clock-bound ends, less
        ``margin_s`` (see the module docstring)."""
        if self.hold_seconds is None or self.hold_until is None or self.incarnation is None:
            return None
        by_transit = received + self.hold_seconds
        by_wall = received + (self.hold_until - wall_now)
        return min(by_transit, by_wall) - margin_s


class RemoteDecodeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Prefill side: compute the prompt, then hold its KV for a remote decode engine to read; with ``stream_id``,
    offer it layer by layer while it is computed to a decode that names it so."""

    stream_id: str | None = None


def _int(params: Mapping[str, object], key: str, *, low: int, high: int | None = None, required: bool) -> int | None:
    value = params.get(key)
    if value is None:
        if required:
            raise InvalidTransferParams(key, "missing" if key not in params else "must not be null")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTransferParams(key, f"expected an integer, got {type(value).__name__} {value!r:.60}")
    if value < low or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"in {low}..{high}"
        raise InvalidTransferParams(key, f"must be {bounds}, got {value}")
    return value


def _str(params: Mapping[str, object], key: str, *, limit: int = MAX_ID_CHARS) -> str:
    value = params.get(key)
    if value is None:
        raise InvalidTransferParams(key, "missing" if key not in params else "must not be null")
    if not isinstance(value, str):
        raise InvalidTransferParams(key, f"expected a string, got {type(value).__name__} {value!r:.60}")
    if not value.strip():
        raise InvalidTransferParams(key, "must not be empty")
    if len(value) > limit:
        raise InvalidTransferParams(key, f"longer than {limit} characters")
    return value


def _flag(params: Mapping[str, object], key: str) -> bool:
    value = params.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidTransferParams(key, f"expected true or false, got {type(value).__name__} {value!r:.60}")
    return value


def _block_ids(params: Mapping[str, object]) -> tuple[int, ...]:
    key = "remote_block_ids"
    value = params.get(key)
    if value is None:
        raise InvalidTransferParams(key, "missing" if key not in params else "must not be null")
    if not isinstance(value, list | tuple):
        raise InvalidTransferParams(key, f"expected a list of block ids, got {type(value).__name__} {value!r:.60}")
    if value and all(isinstance(group, list | tuple) for group in value):
        if len(value) != 1:
            raise InvalidTransferParams(key, f"{len(value)} KV cache groups; only one is supported")
        value = value[0]
    if not value:
        raise InvalidTransferParams(key, "no block ids")
    for index, block in enumerate(value):
        if isinstance(block, bool) or not isinstance(block, int):
            raise InvalidTransferParams(
                key, f"entry {index} is {type(block).__name__} {block!r:.60}, expected a block id (integer)"
            )
        if block < 0:
            raise InvalidTransferParams(key, f"entry {index} is negative ({block})")
        if block > MAX_BLOCK_ID:
            raise InvalidTransferParams(key, f"entry {index} ({block}) is beyond any cache (max {MAX_BLOCK_ID})")
    repeat = first_repeat(value)
    if repeat is not None:
        raise RepeatedBlockIds(*repeat)
    return tuple(value)


def incarnation_token(agent_names: Iterable[str]) -> str:
    """A digest (``INCARNATION_CHARS`` hex digits) naming one incarnation of a prefill engine: of its ranks' NIXL
    agent names in rank order (each made unique when the agent starts)."""
    digest = hashlib.sha256("\n".join(agent_names).encode())
    return digest.hexdigest()[:INCARNATION_CHARS]


def _seconds(params: Mapping[str, object], key: str, *, high: float) -> float | None:
    value = params.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidTransferParams(key, f"expected a finite number, got {type(value).__name__} {value!r:.60}")
    if not 0 <= value <= high:
        raise InvalidTransferParams(key, f"must be in 0..{high:g}, got {value}")
    return float(value)


def _hold_window(params: Mapping[str, object]) -> tuple[float | None, float | None, str | None]:
    """(``remote_hold_seconds``, ``remote_hold_until``, ``remote_incarnation``), each None when absent."""
    seconds = _seconds(params, "remote_hold_seconds", high=MAX_HOLD_SECONDS)
    until = _seconds(params, "remote_hold_until", high=2.0**40)
    incarnation = params.get("remote_incarnation")
    if incarnation is not None:
        incarnation = _str(params, "remote_incarnation", limit=INCARNATION_CHARS)
    return seconds, until, incarnation


def parse_transfer_params(
    params: object, *, prompt_len: int | None, local_block_size: int
) -> RemotePrefill | RemoteDecodeRequest | None:
    """Check a request's ``kv_transfer_params`` and type them; raises ``InvalidTransferParams`` (a
    ``ValueError``) naming the key and the problem, never ``KeyError`` / ``TypeError``.

    ``prompt_len`` (tokens in this engine's prompt; None: unknown, skip the checks against it) bounds the
    tokens and blocks a remote prefill may claim; ``local_block_size`` must nest with a remote block size.
    """
    if local_block_size < 1:
        raise ValueError(f"local_block_size must be at least 1, got {local_block_size}")
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise InvalidTransferParams(None, f"expected a JSON object, got {type(params).__name__}")
    for key in params:
        if not isinstance(key, str):
            raise InvalidTransferParams(None, f"key {key!r:.60} is not a string")
    remote_prefill = _flag(params, "do_remote_prefill")
    remote_decode = _flag(params, "do_remote_decode")
    if remote_prefill and remote_decode:
        raise InvalidTransferParams("do_remote_prefill", "do_remote_prefill and do_remote_decode are both true")
    stream_id = None if params.get("stream_id") is None else _str(params, "stream_id")
    if remote_decode:
        return RemoteDecodeRequest(stream_id=stream_id)
    if not remote_prefill:
        return None

    engine_id = _str(params, "remote_engine_id")
    request_id = _str(params, "remote_request_id")
    host = _str(params, "remote_host", limit=MAX_HOST_CHARS)
    if any(c.isspace() for c in host):
        raise InvalidTransferParams("remote_host", f"contains whitespace: {host!r:.60}")
    port = _int(params, "remote_port", low=1, high=65535, required=True)
    tp_size = _int(params, "tp_size", low=1, required=True)
    for key in ("pp_size", "dcp_size"):
        size = _int(params, key, low=1, required=False)
        if size not in (None, 1):
            raise InvalidTransferParams(key, f"{size} is not supported (only 1)")
    mode = params.get("transfer_mode")
    if mode is not None and mode != "pull":
        raise InvalidTransferParams("transfer_mode", f"only 'pull' is supported, got {mode!r:.60}")
    expiry = params.get("remote_blocks_expiry_time")
    if expiry is not None and (isinstance(expiry, bool) or not isinstance(expiry, int | float)):
        raise InvalidTransferParams("remote_blocks_expiry_time", f"expected a number, got {type(expiry).__name__}")
    stream = stream_id is not None and params.get("remote_block_ids") is None
    try:
        block_ids = () if stream else _block_ids(params)
    except RepeatedBlockIds as error:
        assert port is not None and tp_size is not None
        error.ref = RemoteRef(
            remote_engine_id=engine_id,
            remote_host=host,
            remote_port=port,
            remote_request_id=request_id,
            remote_tp_size=tp_size,
        )
        raise
    block_size = _int(params, "remote_block_size", low=1, required=False)
    if block_size is not None and block_size % local_block_size and local_block_size % block_size:
        raise InvalidTransferParams(
            "remote_block_size",
            f"{block_size} and the local block size {local_block_size} do not nest (one must divide the other)",
        )
    num_tokens = _int(params, "remote_num_tokens", low=1, required=False)
    hold_seconds, hold_until, incarnation = _hold_window(params)
    if prompt_len is not None:
        if prompt_len < 0:
            raise ValueError(f"prompt_len must be non-negative, got {prompt_len}")
        if num_tokens is not None and num_tokens > prompt_len:
            raise InvalidTransferParams(
                "remote_num_tokens", f"{num_tokens} tokens, more than this request's prompt ({prompt_len} tokens)"
            )
        if num_tokens is None:
            if prompt_len == 0:
                raise InvalidTransferParams("remote_block_ids", "the prompt is empty: there is no KV to load")
            num_tokens = prompt_len
    if num_tokens is not None and not stream:
        if block_size is not None:
            needed = -(-num_tokens // block_size)
            if len(block_ids) != needed:
                amount = "too many" if len(block_ids) > needed else "too few"
                raise InvalidTransferParams(
                    "remote_block_ids",
                    f"{amount} blocks: {num_tokens} tokens in blocks of {block_size} need {needed},"
                    f" got {len(block_ids)}",
                )
        elif len(block_ids) > num_tokens:
            raise InvalidTransferParams(
                "remote_block_ids", f"too many blocks: {len(block_ids)} blocks for {num_tokens} tokens"
            )
    assert port is not None and tp_size is not None
    return RemotePrefill(
        engine_id=engine_id,
        request_id=request_id,
        block_ids=block_ids,
        host=host,
        port=port,
        tp_size=tp_size,
        num_tokens=num_tokens,
        block_size=block_size,
        hold_seconds=hold_seconds,
        hold_until=hold_until,
        incarnation=incarnation,
        stream=stream,
    )


def remote_prefill_params(
    *,
    engine_id: str,
    request_id: str,
    block_ids: list[int],
    host: str,
    port: int,
    tp_size: int,
    num_tokens: int | None,
    block_size: int,
    hold_seconds: float | None = None,
    incarnation: str | None = None,
    wall_now: float | None = None,
) -> dict[str, object]:
    """What a prefill returns for a finished ``do_remote_decode`` request: NixlConnector's keys (block ids
    as one list per KV cache group), plus ``remote_block_size``; ``remote_num_tokens`` when known; the hold
    window (``remote_hold_seconds`` from now, ``remote_hold_until`` = ``wall_now`` (Unix seconds) plus that,
    ``remote_incarnation``) when ``hold_seconds``, ``incarnation`` and ``wall_now`` are given."""
    params: dict[str, object] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": [list(block_ids)],
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
        "remote_block_size": block_size,
    }
    if num_tokens is not None:
        params["remote_num_tokens"] = num_tokens
    if hold_seconds is not None and incarnation is not None and wall_now is not None:
        params["remote_hold_seconds"] = hold_seconds
        params["remote_hold_until"] = wall_now + hold_seconds
        params["remote_incarnation"] = incarnation
    return params
