"""Messages between a decode reader and a prefill sender, carried as NIXL notifications (or, for a transport that
carries them itself, on its own connection: :mod:`pd_transfer.connector.transports.seam`).

Tagged msgspec structs, msgpack on the wire; anything that does not decode is dropped and logged.

Decode -> prefill: ``CheckRows`` (read checks: before a read, the rows whose digest it wants), ``ReadDone`` (attached
to the last read; carries ``reply_to`` when the reader wants a ``LeaseConfirm``), ``ReadFailed`` (gave up, or will
never read), ``ReleaseUnread`` (no decode rank reads this prefill rank's copy), ``LeaseHeartbeat`` (still coming:
extend the lease).
Prefill -> decode: ``LeaseConfirm`` (were the blocks still held when the ``ReadDone`` arrived?), ``RowDigest`` (the
digest of the rows a ``CheckRows`` names: read checks).

Push (the prefill writes instead of the decode reading; see :mod:`.transports.nixl.push_writer`): decode -> prefill
``PushSetup`` (once per prefill rank: the reader's memory and the plan's rows) and ``PushOrder`` (per request);
prefill -> decode ``PushReady`` (the setup's answer: a prefill that does not know these messages never answers, and is
read from) and ``PushOutcome`` (a successful one rides on the WRITE, so it arrives after the data).
"""

from __future__ import annotations

from typing import Union

import msgspec

#: Largest notification payload we decode (bytes).
MAX_NOTIFICATION_BYTES = 64 * 1024
#: The name under which a prefill rank's metadata offers read checks (beside its transports' offers, taken by none):
#: a decode may then send it ``CheckRows``. Its payload names the digest.
READ_CHECKS_OFFER = "read_checks"
READ_CHECKS_DIGEST = b"xxh3-64"


class RowCheck(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which of the rows a decode rank read from this prefill rank it checks (read checks:
    :mod:`.prefill.read_checks`, :mod:`.decode.read_checks`): its plan's units of ``unit_heads`` heads x
    ``unit_tokens`` tokens x ``head_size`` of heads ``[first_global_head, +num_heads)``, of ``num_tokens`` tokens in
    ``block_ids`` (this rank's), listed as the plan lists them (plane, token unit, head unit), and of those
    ``[first_unit, end_unit)``. The prefill digests those rows of its cache; a shape names no address."""

    first_global_head: int
    num_heads: int
    unit_heads: int
    unit_tokens: int
    head_size: int
    block_ids: list[int]
    num_tokens: int
    first_unit: int
    end_unit: int


class ReadDone(msgspec.Struct, tag="read_done", frozen=True, forbid_unknown_fields=True):
    """A decode rank finished reading a request's blocks from this prefill rank."""

    request_id: str
    reader_engine_id: str
    reader_rank: int
    expected_readers: int  # decode ranks that read from this prefill rank for this request
    # the reader's NIXL connection metadata (no memory): when set, the prefill answers with LeaseConfirm
    reply_to: bytes = b""


class CheckRows(msgspec.Struct, tag="check_rows", frozen=True, forbid_unknown_fields=True):
    """A decode rank is about to read a request from this prefill rank (read checks): digest the rows ``check`` names
    and answer ``RowDigest`` (by NIXL to ``reply_to``, the reader's connection metadata, or on the transport's own
    connection), while the read runs. Sent only to a rank that offers read checks (:data:`READ_CHECKS_OFFER`)."""

    request_id: str
    reader_engine_id: str
    reader_rank: int
    check: RowCheck
    reply_to: bytes = b""


class ReadFailed(msgspec.Struct, tag="read_failed", frozen=True, forbid_unknown_fields=True):
    """A decode rank gave up on a request's blocks (it counts as done for freeing)."""

    request_id: str
    reader_engine_id: str
    reader_rank: int
    expected_readers: int
    reason: str


class ReleaseUnread(msgspec.Struct, tag="release_unread", frozen=True, forbid_unknown_fields=True):
    """No decode rank reads this prefill rank's copy of a request (its heads are read from another rank
    holding the same ones: replicated KV heads, MLA): free it now. Sent by decode rank 0."""

    request_id: str
    reader_engine_id: str


class LeaseHeartbeat(msgspec.Struct, tag="lease_heartbeat", frozen=True, forbid_unknown_fields=True):
    """A decode still means to read a request (it is queued): extend the request's lease."""

    request_id: str
    reader_engine_id: str
    reader_rank: int


class LeaseConfirm(msgspec.Struct, tag="lease_confirm", frozen=True, forbid_unknown_fields=True):
    """The prefill's answer to a ``ReadDone`` carrying ``reply_to``: ``ok`` only if the request's blocks
    were still held (not expired, freed or unknown) when the ``ReadDone`` arrived. The prefill never frees
    held blocks before their readers report or the lease ends, so ``ok`` proves the read saw live blocks."""

    request_id: str
    ok: bool
    reason: str


class RowDigest(msgspec.Struct, tag="row_digest", frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The prefill's answer to a ``CheckRows`` (whatever the lease: a ``LeaseConfirm`` comes apart): ``digest``, the
    XXH3-64 of the rows it names as the cache holds them, unless ``changed`` says why not (a block holding them
    changed after the request was held) or ``refused`` (the check does not fit this rank)."""

    request_id: str
    digest: int | None = None
    changed: str = ""
    refused: str = ""


class PushPlan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One source of a decode rank's plan (:class:`~pd_transfer.topology.plan.SourcePlan`), as the prefill rank it
    names rebuilds it: its scalars and both grids, each packed by :func:`.transports.nixl.push_plans.pack_rows`.
    "local" is the decode's side, "remote" the prefill's, as in the plan."""

    remote_rank: int
    first_global_head: int
    num_heads: int
    unit_heads: int
    unit_tokens: int
    head_size: int
    unit_bytes: int
    num_planes: int
    local_block_size: int
    remote_block_size: int
    local_num_blocks: int
    remote_num_blocks: int
    local_rows: bytes
    remote_rows: bytes


class PushSetup(msgspec.Struct, tag="push_setup", frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A decode rank asks to be written to: its NIXL agent's metadata *with* its memory, and the plan's rows.

    With ``landing_rows`` (a decode whose cache is on a GPU: :mod:`.transports.nixl.push_staging`), the prefill writes
    an order's rows not to the plan's local rows but back to back, in the order's row order, from byte
    ``landing_address`` of the decode's host memory (``landing_rows`` rows of the plan's ``unit_bytes`` at most; a
    larger order is refused with ``may_read``). The two fields are left out where unset (``omit_defaults``), so a setup
    without them decodes in a prefill that predates them; one with them does not (it is dropped there, never answered,
    and the decode reads).
    """

    reader_engine_id: str
    reader_rank: int
    agent_metadata: bytes
    plan: PushPlan
    landing_address: int = 0
    landing_rows: int = 0


class PushReady(msgspec.Struct, tag="push_ready", frozen=True, forbid_unknown_fields=True):
    """The prefill's answer to a ``PushSetup``: ``ok`` when it will write this reader's orders. It comes from the
    rank's writing agent, so it names the rank's own agent (the one the setup went to)."""

    prefill_agent: str
    ok: bool
    reason: str


class PushOrder(msgspec.Struct, tag="push_order", frozen=True, forbid_unknown_fields=True):
    """Write a held request's blocks to the reader, as its plan would read them (block ids as in the params: the
    prefill's ``remote_block_ids``, the decode's ``local_block_ids``)."""

    request_id: str
    expected_readers: int  # as in ReadDone (the reader is the one whose PushSetup the prefill took)
    remote_block_ids: list[int]
    local_block_ids: list[int]
    num_tokens: int
    timeout_ms: int  # the prefill gives up writing after this long (from when the order arrives)


class PushOutcome(msgspec.Struct, tag="push_outcome", frozen=True, forbid_unknown_fields=True):
    """How an order ended: ``ok`` (attached to the WRITE: the data is there, and the lease was held and pinned
    throughout), or not, with ``may_read`` when the decode should read the request itself instead."""

    prefill_agent: str  # the rank's own agent, as in PushReady
    request_id: str
    ok: bool
    reason: str = ""
    may_read: bool = False
    setup_again: bool = False  # the prefill no longer has this reader's setup: send it again


#: What a reader reports about a request (counted towards freeing it).
ReaderReport = Union[ReadDone, ReadFailed, ReleaseUnread]
PeerMessage = Union[
    ReadDone,
    CheckRows,
    ReadFailed,
    ReleaseUnread,
    LeaseHeartbeat,
    LeaseConfirm,
    RowDigest,
    PushSetup,
    PushReady,
    PushOrder,
    PushOutcome,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(PeerMessage)


def encode(message: PeerMessage) -> bytes:
    return _encoder.encode(message)


def decode(payload: bytes) -> PeerMessage:
    """Raises ``msgspec.DecodeError`` or ``ValueError`` on anything malformed."""
    if len(payload) > MAX_NOTIFICATION_BYTES:
        raise ValueError(f"notification of {len(payload)} bytes exceeds {MAX_NOTIFICATION_BYTES}")
    return _decoder.decode(payload)
