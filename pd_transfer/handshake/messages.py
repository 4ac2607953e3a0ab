"""Side-channel messages: typed msgspec structs, one tagged union, msgpack on the wire; never pickle.

A decode process asks a prefill process for its metadata in two round trips::

    client -> server   Hello(protocol_version, client_nonce)
    server -> client   Challenge(server_nonce, auth_required)
    client -> server   GetMetadata(..., server_nonce, mac)      mac = HMAC(secret, server_nonce | request)
    server -> client   Metadata(engine, mac) | ErrorReply(code, message)

Since version 2, the proxy may end a prefill's lease early the same way (the client of the request is gone, or
its decode hop failed, so nobody will read those blocks)::

    client -> server   Hello(protocol_version, client_nonce)
    server -> client   Challenge(server_nonce, auth_required)
    client -> server   Release(engine_id, request_id, server_nonce, mac)
    server -> client   ReleaseReply(request_id, outcome) | ErrorReply(code, message)

Without a configured secret, ``mac`` fields are empty and ignored. The ``Challenge`` carries the version the
server will speak with this client (the client's own when the server supports it).

Since version 3, a prefill whose ranks offer their cache for same-host IPC (``RankMetadata.ipc``: CUDA IPC handles
of GPU memory, or shared host memory) names its host in the ``Challenge`` (``host``: boot id and a token file only
a process of the same user on the same host, sharing its ``/dev/shm``, can read). A client that reads the token
proves it in ``GetMetadata.host_proof`` (HMAC of the nonces under the token, :mod:`.host_identity`); only then does
the ``Metadata`` keep the ranks' ``ipc`` sections, so a remote peer is never sent a handle it cannot open.

Since version 4, a rank whose cache is in other host memory offers it to be read in place with ``process_vm_readv``
(:class:`CmaSegment`); a version 3 client is sent the rank without that offer.

Since version 5, a rank publishes what each of its transports offers under the transport's name
(``RankMetadata.offers``: :class:`TransportOffer`, the payload the transport's own,
:mod:`pd_transfer.connector.transports`); the same-host offers (``same_host``) are kept only for a client that proved it
runs on the prefill's host, as ``ipc`` was. The built-in same-host transports' payload is an encoded :class:`RankIpc`
(:func:`encode_rank_ipc`): a version 3 or 4 client is sent it as ``ipc`` (:meth:`RankMetadata.for_version`), and a
version 4 server's ``ipc`` reads as such an offer (:meth:`RankMetadata.with_offers`).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec
from msgspec import UNSET, UnsetType

from pd_transfer.spec import Address, Count, KVCacheLayout, KVRegion, ModelFingerprint, Name, ShortName

from .versions import CMA_VERSION, OFFERS_VERSION, PROTOCOL_VERSION

#: Largest frame the server or the client will try to decode (bytes).
MAX_FRAME_BYTES = 16 * 1024 * 1024
#: Largest frame a server accepts: a request is a Hello or a GetMetadata, whose bounded fields fit in 32 KiB. ZMQ
#: drops a larger frame at its length header, before any of it is buffered.
MAX_REQUEST_BYTES = 64 * 1024
#: Most TP ranks a message may name; a request for more than the engine serves is refused.
MAX_TP_RANKS = 1024
#: Most cache regions one rank may describe (layers x K/V, with room for engines that split them further).
MAX_REGIONS = 16384
#: Most transports one rank may publish offers of, and the largest offer (bytes).
MAX_OFFERS = 16
MAX_OFFER_BYTES = 4 * 1024 * 1024

Nonce = Annotated[bytes, msgspec.Meta(max_length=64)]
Mac = Annotated[bytes, msgspec.Meta(max_length=64)]
#: An opaque handle of another process's memory (a CUDA IPC handle, torch's reference-counter file name).
Handle = Annotated[bytes, msgspec.Meta(max_length=1024)]
FieldName = Annotated[str, msgspec.Meta(max_length=64)]
#: A transport's name: lowercase letters, digits and ``_``.
TransportName = Annotated[str, msgspec.Meta(max_length=64, pattern=r"^[a-z][a-z0-9_]*$")]
TpRank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_TP_RANKS)]

ErrorCode = Literal[
    "malformed",  # the frame did not decode as a message
    "too_large",  # the frame exceeded MAX_FRAME_BYTES
    "unsupported_version",  # the protocol versions do not overlap
    "unexpected_message",  # a valid message the server does not answer
    "auth_required",  # the server has a secret and the request carried no valid MAC
    "auth_failed",  # the MAC did not verify, or the nonce was unknown or reused
    "incompatible",  # the fingerprints differ; the message names the fields
    "unknown_rank",  # a requested TP rank is not served here
    "unknown_engine",  # a Release named another engine than the one served here
    "internal",  # the server failed; it keeps serving
]


class CudaSegment(msgspec.Struct, tag="cuda", frozen=True, forbid_unknown_fields=True):
    """Version 3: one CUDA allocation (a torch storage) of a rank's cache, shared through a legacy CUDA IPC handle as
    ``torch.multiprocessing`` shares a storage: ``handle`` of the allocation, the storage at ``offset_bytes`` in it,
    torch's cross-process reference counter (``ref_counter`` file, slot ``ref_counter_offset``) and the event the
    owner recorded when it made the handle. ``base_address`` is the storage's first byte in the owner's process."""

    base_address: Address
    nbytes: Count
    device_uuid: ShortName  # the owner's GPU (what ``torch.cuda.get_device_properties(i).uuid`` prints)
    handle: Handle
    offset_bytes: Count
    ref_counter: Handle
    ref_counter_offset: Count
    event_handle: Handle
    event_sync_required: bool


class HostSegment(msgspec.Struct, tag="memfd", frozen=True, forbid_unknown_fields=True):
    """Version 3: one mapping of host memory backed by a memfd of process ``pid``, open there as descriptor ``fd``:
    a same-host reader opens ``/proc/<pid>/fd/<fd>`` after checking that it is the memfd ``name``. ``base_address``
    is the mapping's first byte in the owner's process."""

    base_address: Address
    nbytes: Count
    pid: Count
    fd: Count
    name: ShortName


class CmaSegment(msgspec.Struct, tag="cma", frozen=True, forbid_unknown_fields=True):
    """Version 4: the rank's whole host cache, read in place from the owner's process (``RankIpc.pid``) with
    ``process_vm_readv``; the rank's regions say where. ``probe`` is random bytes the owner holds at
    ``probe_address``: a reader reads them back before it trusts that the pid is the owner."""

    probe_address: Address
    probe: Nonce


class RankIpc(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Version 3: a rank's cache memory, offered for same-host IPC: the owner's host (``boot_id``) and process
    (``pid`` in the pid namespace ``pid_namespace``, the inode of its ``/proc/self/ns/pid``: a reader in the same
    namespace notices it exited), and a segment per shared allocation, each covering whole regions (or, version 4,
    one :class:`CmaSegment` for the whole cache)."""

    boot_id: ShortName
    pid: Count
    pid_namespace: Count
    segments: Annotated[list[Union[CudaSegment, HostSegment, CmaSegment]], msgspec.Meta(max_length=MAX_REGIONS)]


class TransportOffer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Version 5: what one transport of a rank offers decodes, opaque to the side channel (``payload``: the transport's
    own encoding). ``same_host``: for decodes on this host only, sent only to a client that proved it runs here."""

    transport: TransportName
    payload: Annotated[bytes, msgspec.Meta(max_length=MAX_OFFER_BYTES)]
    same_host: bool = False


#: The built-in same-host transports whose offer is an encoded :class:`RankIpc`, in the order a version 3 or 4 client
#: is sent one of them as ``ipc``; version 3 knows no ``host_cma``.
LEGACY_IPC_TRANSPORTS = ("cuda_ipc", "host_ipc", "host_cma")


class RankMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One TP rank of an engine: its NIXL agent, where its cache lives in its process, and what its transports offer
    (``offers``, version 5: absent on the wire for older clients, which get the same-host offer as ``ipc``)."""

    tp_rank: TpRank
    agent_name: Name
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=4 * 1024 * 1024)]  # nixl_agent.get_agent_metadata()
    layout: KVCacheLayout
    regions: Annotated[list[KVRegion], msgspec.Meta(max_length=MAX_REGIONS)]
    ipc: RankIpc | None = None  # versions 3 and 4 only: the same-host offer
    offers: Union[Annotated[list[TransportOffer], msgspec.Meta(max_length=MAX_OFFERS)], UnsetType] = UNSET

    def offer(self, transport: str) -> bytes | None:
        """The payload this rank offers under ``transport`` (None: no such offer)."""
        if isinstance(self.offers, UnsetType):
            return None
        return next((offer.payload for offer in self.offers if offer.transport == transport), None)

    def without_same_host(self) -> RankMetadata:
        """This rank as a client that has not proved it is on the same host sees it: no same-host offer."""
        if isinstance(self.offers, UnsetType) or not any(offer.same_host for offer in self.offers):
            return self if self.ipc is None else msgspec.structs.replace(self, ipc=None)
        kept = [offer for offer in self.offers if not offer.same_host]
        return msgspec.structs.replace(self, ipc=None, offers=kept)

    def for_version(self, version: int) -> RankMetadata:
        """This rank as a client speaking protocol ``version`` can decode it: before version 5, without ``offers``
        and with the first built-in same-host offer as ``ipc`` (before version 4, not one read by
        ``process_vm_readv``: :class:`CmaSegment`)."""
        if version >= OFFERS_VERSION or isinstance(self.offers, UnsetType):
            return self
        legacy = LEGACY_IPC_TRANSPORTS if version >= CMA_VERSION else LEGACY_IPC_TRANSPORTS[:2]
        payload = next((p for name in legacy if (p := self.offer(name)) is not None), None)
        ipc = None if payload is None else decode_rank_ipc(payload)
        return msgspec.structs.replace(self, ipc=ipc, offers=UNSET)

    def with_offers(self) -> RankMetadata:
        """This rank as a version 5 client reads it: a version 4 server's ``ipc`` as the offer of the transport its
        segments are for (segments of mixed kinds: no offer)."""
        if self.ipc is None:
            return self
        kinds = {type(segment) for segment in self.ipc.segments}
        transport = _LEGACY_IPC_KINDS.get(kinds.pop()) if len(kinds) == 1 else None
        offers = [] if transport is None else [TransportOffer(transport, encode_rank_ipc(self.ipc), same_host=True)]
        return msgspec.structs.replace(self, ipc=None, offers=offers)


#: The built-in same-host transport an older server's ``ipc`` offer is for, by the kind of its segments.
_LEGACY_IPC_KINDS: dict[type, str] = {CudaSegment: "cuda_ipc", HostSegment: "host_ipc", CmaSegment: "host_cma"}


class EngineMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything a decode process needs to read from a prefill engine."""

    engine_id: Name
    fingerprint: ModelFingerprint
    tp_size: Count
    ranks: Annotated[list[RankMetadata], msgspec.Meta(max_length=MAX_TP_RANKS)]  # the ranks asked for, by tp_rank


class Hello(msgspec.Struct, tag="hello", frozen=True, forbid_unknown_fields=True):
    protocol_version: int = PROTOCOL_VERSION
    client_nonce: Nonce = b""


class HostIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Version 3: the prefill's host, named in a ``Challenge`` when a rank offers IPC: its boot id and the path of a
    token file only a process of the same user on the same host (sharing its ``/dev/shm``) can read."""

    boot_id: ShortName
    token_path: Annotated[str, msgspec.Meta(max_length=256)]


class Challenge(msgspec.Struct, tag="challenge", frozen=True, forbid_unknown_fields=True):
    protocol_version: int
    server_nonce: Nonce
    auth_required: bool
    host: HostIdentity | None = None  # version 3: present when a rank offers same-host IPC


class GetMetadata(msgspec.Struct, tag="get_metadata", frozen=True, forbid_unknown_fields=True):
    protocol_version: int
    fingerprint: ModelFingerprint
    tp_ranks: Annotated[list[TpRank], msgspec.Meta(max_length=MAX_TP_RANKS)] | None  # None: every rank served
    client_nonce: Nonce
    server_nonce: Nonce
    mac: Mac = b""
    #: version 3: HMAC of the nonces under the host token the ``Challenge`` named (empty: no proof, or not wanted)
    host_proof: Mac = b""


class Metadata(msgspec.Struct, tag="metadata", frozen=True, forbid_unknown_fields=True):
    protocol_version: int
    engine: EngineMetadata
    mac: Mac = b""  # HMAC(secret, client_nonce | encoded engine): the server proves it knows the secret


class Release(msgspec.Struct, tag="release", frozen=True, forbid_unknown_fields=True):
    """Version 2: free the blocks the prefill engine ``engine_id`` holds for ``request_id`` (nobody will read them).

    ``read_possible``: a decode may have been given the request's params and be reading now (the client left while
    the decode hop ran); the prefill then keeps the blocks to the end of the hold window it promised decodes, or
    until the reader reports, whichever is first. False: no decode has the params (the decode hop was never sent,
    or it ended), so the blocks are freed at once.

    Answered with ``ReleaseReply``. Authenticated like ``GetMetadata``: ``mac`` covers the message encoded with
    ``mac=b""`` under the server nonce of the ``Challenge``."""

    protocol_version: int
    engine_id: Name
    request_id: Name
    server_nonce: Nonce
    read_possible: bool = True
    mac: Mac = b""


#: ``releasing``: the blocks were held and are being freed (unless a reader already reported: then they end as
#: read); ``not_held``: nothing is held for that request here (already freed, read, expired, or never held).
ReleaseOutcome = Literal["releasing", "not_held"]


class ReleaseReply(msgspec.Struct, tag="release_reply", frozen=True, forbid_unknown_fields=True):
    protocol_version: int
    request_id: Name
    outcome: ReleaseOutcome


class ErrorReply(msgspec.Struct, tag="error", frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    code: ErrorCode
    message: Name
    #: "incompatible": the fingerprint fields that differ (omitted on the wire when empty)
    fields: Annotated[list[FieldName], msgspec.Meta(max_length=16)] = []


Message = Union[Hello, Challenge, GetMetadata, Metadata, Release, ReleaseReply, ErrorReply]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_engine_encoder = msgspec.msgpack.Encoder()
_rank_ipc_decoder = msgspec.msgpack.Decoder(RankIpc)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(frame: bytes) -> Message:
    """Decode one frame; raises ``msgspec.DecodeError`` / ``ValueError`` on anything malformed."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {len(frame)} bytes exceeds the limit of {MAX_FRAME_BYTES}")
    return _decoder.decode(frame)


def encode_rank_ipc(ipc: RankIpc) -> bytes:
    """The payload of a built-in same-host transport's offer."""
    return _encoder.encode(ipc)


def decode_rank_ipc(payload: bytes) -> RankIpc:
    """A built-in same-host transport's offer; ``msgspec.DecodeError`` / ``ValidationError`` if malformed."""
    return _rank_ipc_decoder.decode(payload)


def encode_engine(engine: EngineMetadata) -> bytes:
    """Canonical bytes of an engine's metadata (what the reply MAC covers)."""
    return _engine_encoder.encode(engine)
