"""One request's pull as a decode rank reads it (:class:`PullRequest`: which remote blocks land in which local ones, for
how many tokens), what a transport's reads of it moved (:class:`ReadTotals`) and what the whole pull did
(:class:`PullStats`); a request streamed while the prefill computes it (:class:`StreamRequest`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pd_transfer.connector.errors import DuplicateBlockIds
from pd_transfer.connector.params import first_repeat


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


@dataclass(frozen=True, slots=True)
class StreamRequest:
    """The KV of ``num_tokens`` tokens of request ``request_id`` (the prefill's id of it, or the stream id both legs
    were given), streamed into ``local_block_ids`` (in token order) while the prefill computes it: its blocks there
    are learnt from the prefill, the first ``skip_blocks`` of them left out (a prefix the decode holds already). Keep
    the list unchanged while the request is streamed."""

    request_id: str
    local_block_ids: list[int]
    num_tokens: int
    skip_blocks: int = 0


@dataclass(frozen=True)
class PullStats:
    """What one request's pull moved (bytes, seconds) and how."""

    request_id: str
    bytes: int
    descriptors: int  # rows posted, before NIXL merges adjacent ones
    read_seconds: float  # first post to last DONE
    postprocess_seconds: float  # fixing layouts up, summed over plane groups (overlaps the reads)
    postprocess_exposed_seconds: float  # of which after the last read: what the fix-up adds to the pull
    seconds: float  # whole pull, handshake excluded when cached
    connect_seconds: float = 0.0  # reaching the engine: handshake, NIXL peers and warm-up on first contact, else ~0
    confirm_seconds: float = 0.0  # after the reads, waiting for the prefill's lease confirmation (0: hold window)
    pushed_peers: tuple[str, ...] = ()  # prefill ranks that wrote the request instead of being read (push)
    pushed_bytes: int = 0  # of ``bytes``, what they wrote
    transport: str = "nixl"  # what moved it: the name of the transport its engine was opened with
    layers_streamed: int = 0  # streamed: the layers that arrived one by one (every source's)
    last_layer_seconds: float = 0.0  # streamed: from the last layer's arrival to the pull's end (the tail)

    @property
    def gbps(self) -> float:
        """GiB/s over the whole pull."""
        return self.bytes / self.seconds / 2**30 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class ReadTotals:
    """What one request's reads moved (bytes) and took (seconds)."""

    bytes: int
    descriptors: int  # rows posted, before NIXL merges adjacent ones
    read_seconds: float  # first post to last DONE
    postprocess_seconds: float  # fixing layouts up, summed over plane groups or chunks (overlaps the reads)
    postprocess_exposed_seconds: float  # of which after the last read: what the fix-up adds to the pull
    pushed_peers: tuple[str, ...] = ()  # source ranks (agents) that wrote instead: their leases are confirmed
    pushed_bytes: int = 0  # of ``bytes``, what they wrote
    layers_streamed: int = 0  # streamed: the layers that arrived one by one (every source's)
    last_layer_seconds: float = 0.0  # streamed: from the last layer's arrival to the pull's end (the tail)
    streamed_as: str = ""  # streamed: the prefill's id of the request (its reports name it so)

    def stats(self, request_id: str, seconds: float) -> PullStats:
        """The stats of request ``request_id``'s pull of ``seconds`` whose reads moved these totals."""
        return PullStats(
            request_id=request_id,
            bytes=self.bytes,
            descriptors=self.descriptors,
            read_seconds=self.read_seconds,
            postprocess_seconds=self.postprocess_seconds,
            postprocess_exposed_seconds=self.postprocess_exposed_seconds,
            seconds=seconds,
            pushed_peers=self.pushed_peers,
            pushed_bytes=self.pushed_bytes,
            layers_streamed=self.layers_streamed,
            last_layer_seconds=self.last_layer_seconds,
        )

    @classmethod
    def overlapped(
        cls, total_bytes: int, descriptors: int, read_started: float, reads_done: float, post_seconds: float
    ) -> ReadTotals:
        """Totals of reads whose fix-up ran beside them: the exposed part is what is left after the last read
        (``perf_counter`` seconds; called once the fix-up finished)."""
        return cls(
            bytes=total_bytes,
            descriptors=descriptors,
            read_seconds=reads_done - read_started,
            postprocess_seconds=post_seconds,
            postprocess_exposed_seconds=time.perf_counter() - reads_done,
        )
