"""How a prefill rank holds and serves its blocks: every knob of a :class:`~.rank.PrefillRank` in one frozen object,
built once at the process's edge (a connector's config and the process's settings) and handed down whole.

``push`` left ``None`` follows the process's settings (``PD_TRANSFER_PUSH``), resolved by
:attr:`PrefillOptions.push_mode`, the only place the rank reads it; ``settings`` has no default, so a caller that
forgets to hand the process's settings down is a type error instead of a rank running on defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_transfer.connector.config import ConnectorConfig
from pd_transfer.connector.push_staging import DEFAULT_PUSH_CHUNK_BYTES
from pd_transfer.settings import PushMode, Settings
from pd_transfer.transfer.tcp import push_mode


@dataclass(frozen=True, kw_only=True)
class PrefillOptions:
    """A prefill rank's knobs (times in seconds, sizes in bytes).

    ``settings``: the process's (its agent's and writer's, the CPUs of the rank's threads). ``lease_seconds``: how
    long a finished request's blocks are held for their readers. ``push``: write for decode ranks that ask unless
    the mode is "off" (None: ``settings.push``). ``offer_ipc``: offer the cache to same-host decodes through IPC
    where it can be shared. ``push_staging``: push through a host staging pool of chunks of ``push_chunk_bytes``;
    None: where the cache is on a GPU; True on a host cache too (tests); False: a GPU cache is not pushed.

    A bad ``push`` is refused here (``ValueError``), before any agent is made.
    """

    settings: Settings
    lease_seconds: float = 30.0
    push: str | None = None
    offer_ipc: bool = True
    push_staging: bool | None = None
    push_chunk_bytes: int = DEFAULT_PUSH_CHUNK_BYTES

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
            offer_ipc=config.transport != "nixl",
        )
