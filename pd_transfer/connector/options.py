"""Every knob of a prefill rank and of a decode rank, each in one frozen object built once at the process's edge (a
connector's config and the process's settings) and handed down whole, to the rank and to the transports it makes.

Each knob has one home here; the six a connector's config also sets take their defaults from
:class:`~pd_transfer.connector.config.ConnectorConfig` (written once, there). ``push`` and ``read_lanes`` left
``None`` follow the process's settings (``PD_TRANSFER_PUSH``, ``PD_TRANSFER_READ_LANES``), resolved by
:attr:`DecodeOptions.push_mode`, :attr:`PrefillOptions.push_mode` and :attr:`DecodeOptions.lane_count`, the only places
the ranks read them; ``settings`` has no default, so a caller that forgets to hand the process's settings down is a
type error instead of a rank running on defaults. ``transport`` is the connector's setting as written (``auto``,
``nixl``, ``ipc`` or transport names, :mod:`pd_transfer.connector.transports.registry`), resolved by the rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_transfer.connector.config import ConnectorConfig
from pd_transfer.settings import PushMode, Settings
from pd_transfer.transfer.digests import Verify, groups_to_verify
from pd_transfer.transfer.tcp import push_mode

#: The connector's defaults, where a rank's knob is also a connector setting.
_CONNECTOR = ConnectorConfig()
#: Default bytes of one slot group of a decode's staging area (one chunk a lane reads and restages at a time):
#: measured best among 0.5-16 MiB of a 512 MiB block 16 -> 64 pull on a 2-core host (see docs/benchmarks.md).
DEFAULT_STAGING_CHUNK_BYTES = 2 * 2**20
#: Threads a staged read runs per read lane: while one reads through the lane's agent, the others restage what they
#: read, so the agent never waits for a fix-up even where a fix-up takes twice a read (as on a loaded 2-core host:
#: 1, 2, 3, 4 threads per lane gave 0.50-0.76, 0.75-0.85, 0.98-1.13, 0.96 of the homogeneous read, load 13-19).
DEFAULT_STAGED_JOBS_PER_LANE = 3
#: Bytes of one chunk a prefill pushing through host memory gathers and writes at a time (one slot of its pool).
DEFAULT_PUSH_CHUNK_BYTES = 16 * 2**20
#: Bytes of a decode's landing area: a source's rows of a request beyond its part of it are read instead.
DEFAULT_LANDING_BYTES = 256 * 2**20


@dataclass(frozen=True, kw_only=True)
class DecodeOptions:
    """A decode rank's knobs (times in seconds, sizes in bytes).

    ``settings``: the process's (its agent's and lanes' timings, huge pages, the CPUs of the rank's threads).
    ``secret``: the side channel's HMAC secret (None: unauthenticated). ``handshake_timeout_s``: one side-channel
    attempt; ``handshake_failure_backoff_s``: how long fetches from a prefill whose side channel failed fail at once.
    ``read_timeout_s``: one request's reads; ``confirm_timeout_s``: waiting for the prefill's ``LeaseConfirm``.
    ``min_direct_run_bytes``: the shortest contiguous run read in place (None: the plan's default).
    ``pipeline_groups``: plane groups of an in-place read with a fix-up. ``staging_bytes``: each slot group of the
    staging area for plans that fix layouts up, the chunk a lane reads and restages at a time (0: in place).
    ``packed_staging_bytes``: where engine-packed blocks of another block size land before their regroup.
    ``read_lanes``: agents (and threads) a large read is split over (None: ``settings.read_lane_count``).
    ``staged_jobs_per_lane``: threads per lane of a staged read. ``push``: "on", "off" or "auto" (None:
    ``settings.push``; "auto": where reads would go over TCP, :func:`~pd_transfer.transfer.tcp.push_to`): ask
    prefill ranks to write instead of reading. ``push_staging``: have them write into a host landing area of
    ``push_landing_bytes``, copied into the cache after; None: where the cache is on a GPU; True on a host cache too
    (tests); False: a GPU cache is never pushed to. ``transport``: the transports engines are opened with, in order
    of preference ("auto": same-host IPC with engines that offer it, else NIXL; "nixl"; "ipc": same-host IPC or the
    engine is refused; or names, :mod:`pd_transfer.connector.transports.registry`). ``verify``: what of a request's rows
    a decode checks against the prefill's digests (:mod:`pd_transfer.transfer.digests`: "all", "sample", "off"; reads
    over ``tcp`` today, streamed or not).

    A bad ``push`` is refused here (``ValueError``), before any agent is made.
    """

    settings: Settings
    secret: bytes | str | None = None
    handshake_timeout_s: float = _CONNECTOR.handshake_timeout_s
    handshake_failure_backoff_s: float = _CONNECTOR.handshake_failure_backoff_s
    read_timeout_s: float = _CONNECTOR.read_timeout_s
    confirm_timeout_s: float = _CONNECTOR.confirm_timeout_s
    min_direct_run_bytes: int | None = None
    pipeline_groups: int = 8
    staging_bytes: int = DEFAULT_STAGING_CHUNK_BYTES
    packed_staging_bytes: int = 32 * 2**20
    read_lanes: int | None = None
    staged_jobs_per_lane: int = DEFAULT_STAGED_JOBS_PER_LANE
    push: str | None = None
    push_staging: bool | None = None
    push_landing_bytes: int = DEFAULT_LANDING_BYTES
    transport: str = _CONNECTOR.transport
    verify: Verify = _CONNECTOR.verify

    def __post_init__(self) -> None:
        push_mode(self.push, self.settings)  # raises ValueError for a mode that is none
        groups_to_verify(self.verify, 0, 0)  # and for a verify mode that is none

    @property
    def push_mode(self) -> PushMode:
        """The push mode this rank follows: ``push`` if given, else the process's (the one rule of both sides)."""
        return push_mode(self.push, self.settings)

    @property
    def lane_count(self) -> int:
        """The read lanes: ``read_lanes`` if given, else the process's."""
        return self.settings.read_lane_count if self.read_lanes is None else self.read_lanes

    @classmethod
    def from_config(cls, config: ConnectorConfig, settings: Settings) -> DecodeOptions:
        """A connector's decode options: its ``config`` (vLLM's ``kv_connector_extra_config``, checked) over the
        process's ``settings``."""
        return cls(
            settings=settings,
            secret=config.secret,
            handshake_timeout_s=config.handshake_timeout_s,
            handshake_failure_backoff_s=config.handshake_failure_backoff_s,
            read_timeout_s=config.read_timeout_s,
            confirm_timeout_s=config.confirm_timeout_s,
            push=config.push,
            transport=config.transport,
            verify=config.verify,
        )


@dataclass(frozen=True, kw_only=True)
class PrefillOptions:
    """A prefill rank's knobs (times in seconds, sizes in bytes).

    ``settings``: the process's (its agent's and writer's, the CPUs of the rank's threads). ``lease_seconds``: how
    long a finished request's blocks are held for their readers. ``push``: write for decode ranks that ask unless
    the mode is "off" (None: ``settings.push``). ``transport``: the transports whose offers the rank publishes and
    whose writers it runs (as :attr:`DecodeOptions.transport`; NIXL always: the rank's agent serves reads and carries
    the notifications; "nixl": nothing else, so no same-host offer). ``push_staging``: push through a host staging
    pool of chunks of ``push_chunk_bytes``; None: where the cache is on a GPU; True on a host cache too (tests);
    False: a GPU cache is not pushed. ``secret``: the side channel's HMAC secret, which transports with connections of
    their own ask of a decode too (None: unauthenticated). ``listen_host``: where such transports listen (the side
    channel's host: decodes reach the rank where they reach its side channel).

    A bad ``push`` is refused here (``ValueError``), before any agent is made.
    """

    settings: Settings
    lease_seconds: float = _CONNECTOR.lease_seconds
    push: str | None = None
    transport: str = _CONNECTOR.transport
    push_staging: bool | None = None
    push_chunk_bytes: int = DEFAULT_PUSH_CHUNK_BYTES
    secret: bytes | str | None = None
    listen_host: str = "localhost"

    def __post_init__(self) -> None:
        push_mode(self.push, self.settings)  # raises ValueError for a mode that is none

    @property
    def push_mode(self) -> PushMode:
        """The push mode this rank follows: ``push`` if given, else the process's (the one rule of both sides)."""
        return push_mode(self.push, self.settings)

    @classmethod
    def from_config(cls, config: ConnectorConfig, settings: Settings) -> PrefillOptions:
        """A connector's prefill options: its ``config`` over the process's ``settings``."""
        return cls(
            settings=settings,
            lease_seconds=config.lease_seconds,
            push=config.push,
            transport=config.transport,
            secret=config.secret,
            listen_host=config.side_channel_host,
        )
