"""One request's pull as a decode rank reads it: which remote blocks land in which local ones, for how many tokens."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import DuplicateBlockIds
from .params import first_repeat


@dataclass(frozen=True, slots=True)
class PullRequest:
    """The KV of ``num_tokens`` tokens of request ``request_id`` (the prefill's id, under which it holds the
    blocks), in ``remote_block_ids`` on the prefill, to be read into ``local_block_ids`` (both in token order).

    Raises ``DuplicateBlockIds`` when a remote id repeats (each block holds one range of the tokens: the ids are
    corrupt). Whether the ids fit a remote engine's cache is checked against its plan when it is read. The lists
    are kept as given, not copied: leave them unchanged while the request is read.
    """

    request_id: str
    remote_block_ids: list[int]
    local_block_ids: list[int]
    num_tokens: int

    def __post_init__(self) -> None:
        repeat = first_repeat(self.remote_block_ids)
        if repeat is not None:
            raise DuplicateBlockIds(self.request_id, "remote_block_ids", *repeat)
