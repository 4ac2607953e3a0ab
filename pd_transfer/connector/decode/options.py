"""How a decode rank connects, reads and confirms: every knob of a :class:`~.rank.DecodeRank` in one frozen object,
built once at the process's edge (a connector's config and the process's settings) and handed down whole.

Each knob has one home here. ``push`` and ``read_lanes`` left ``None`` follow the process's settings
(``PD_TRANSFER_PUSH``, ``PD_TRANSFER_READ_LANES``), resolved by :attr:`DecodeOptions.push_mode` and
:attr:`DecodeOptions.lane_count`, the only places the rank reads them; ``settings`` has no default, so a caller that
forgets to hand the process's settings down is a type error instead of a rank running on defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_transfer.connector.config import ConnectorConfig
from pd_transfer.connector.push_staging import DEFAULT_LANDING_BYTES
from pd_transfer.settings import PushMode, Settings
from pd_transfer.spec import TransportSetting
from pd_transfer.transfer.tcp import push_mode

from .reads import DEFAULT_STAGED_JOBS_PER_LANE
from .staging import DEFAULT_STAGING_CHUNK_BYTES


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
    (tests); False: a GPU cache is never pushed to. ``transport``: "auto" (same-host IPC with engines that offer it,
    else NIXL), "nixl", "ipc" (engines that cannot be read through IPC are refused).

    A bad ``push`` is refused here (``ValueError``), before any agent is made.
    """

    settings: Settings
    secret: bytes | str | None = None
    handshake_timeout_s: float = 5.0
    handshake_failure_backoff_s: float = 10.0
    read_timeout_s: float = 30.0
    confirm_timeout_s: float = 5.0
    min_direct_run_bytes: int | None = None
    pipeline_groups: int = 8
    staging_bytes: int = DEFAULT_STAGING_CHUNK_BYTES
    packed_staging_bytes: int = 32 * 2**20
    read_lanes: int | None = None
    staged_jobs_per_lane: int = DEFAULT_STAGED_JOBS_PER_LANE
    push: str | None = None
    push_staging: bool | None = None
    push_landing_bytes: int = DEFAULT_LANDING_BYTES
    transport: TransportSetting = "auto"

    def __post_init__(self) -> None:
        push_mode(self.push, self.settings)  # raises ValueError for a mode that is none

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
        )
