"""How far a prefill rank's requests have been written into its cache, for decodes that stream them layer by layer
while the prefill computes (issue 41): a request's blocks and how many of its layers hold every token's KV.

The engine tells the board (through its :class:`~pd_transfer.connector.prefill.rank.PrefillRank`):

* ``computing(request_id, block_ids, alias)``: the request is being computed into these blocks, no layer written yet;
  called again (a preempted request computed again, maybe into other blocks) it starts a new *generation*: whatever a
  reader streamed of the one before is void. ``alias``: another name readers know it by (the stream id the proxy gave
  both legs of a request, before the engine named it);
* ``written(request_id, layers)``: its first ``layers`` layers (in the cache's layer order) hold every token's KV;
* ``held(request_id, block_ids)``: it finished and its lease started (every layer written); also for requests nobody
  streamed, so that a reader who asks after the prefill finished streams them at once;
* ``ended(request_id, reason)``: its blocks are the engine's again, or will be (aborted, freed, released, expired): no
  more layers come, and streams not yet complete are refused.

A reader :meth:`StreamBoard.wait` s for the progress it needs, bounded. A stream ends well only if the request's
generation did not change from its first layer to its last and the request is held then (:meth:`StreamBoard.complete`):
the lease keeps the blocks from then on until the reader reports, as for any read.

Memory: one entry per request computing or held, plus at most :data:`ENDED_KEPT` ended ones (so that a late reader
hears why, rather than waiting for a request that will not come), and as many aliases. Thread-safe: every method takes
one condition's lock.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Protocol

#: Ended requests remembered (oldest forgotten first).
ENDED_KEPT = 4096


@dataclass(frozen=True)
class Progress:
    """What a request has written: its ``block_ids``, the ``layers`` (of ``num_layers``) holding every token's KV, its
    ``generation`` (a new one each time it is computed again), whether its lease started (``held``), and why no more
    layers come (``ended``; None while they may)."""

    block_ids: tuple[int, ...]
    layers: int
    num_layers: int
    generation: int
    held: bool = False
    ended: str | None = None

    @property
    def complete(self) -> bool:
        """Every layer written and the lease started: what a stream's last layer needs to end well."""
        return self.held and self.ended is None and self.layers >= self.num_layers


class HoldObserver(Protocol):
    """What a board tells an observer (:meth:`StreamBoard.observe`), on the thread that told the board, outside its
    lock: a request held in its blocks, a request's blocks the engine's again."""

    def held(self, request_id: str, block_ids: tuple[int, ...]) -> None: ...

    def ended(self, request_id: str) -> None: ...


class StreamBoard:
    """The progress of a prefill rank's requests, ``num_layers`` layers each (see the module's docstring)."""

    def __init__(self, num_layers: int) -> None:
        if num_layers <= 0:
            raise ValueError(f"a cache of {num_layers} layers")
        self.num_layers = num_layers
        self._cond = threading.Condition()
        self._going: dict[str, Progress] = {}
        self._ended: OrderedDict[str, Progress] = OrderedDict()
        self._aliases: OrderedDict[str, str] = OrderedDict()  # alias -> request id
        self._generations = 0
        self._observers: list[HoldObserver] = []

    def observe(self, observer: HoldObserver) -> None:
        """Tell ``observer`` of every hold and end from now on."""
        with self._cond:
            self._observers.append(observer)

    # ------------------------------------------------------------------ the engine's side
    def computing(self, request_id: str, block_ids: Iterable[int], alias: str | None = None) -> Progress:
        """``request_id`` is being computed into ``block_ids`` (a new generation; nothing written yet); readers may
        also name it ``alias``."""
        with self._cond:
            self._alias(request_id, alias)
            self._generations += 1
            progress = Progress(tuple(block_ids), 0, self.num_layers, self._generations)
            self._going[request_id] = progress
            self._ended.pop(request_id, None)
            self._cond.notify_all()
            return progress

    def _alias(self, request_id: str, alias: str | None) -> None:
        if alias is not None and alias != request_id:
            self._aliases[alias] = request_id
            self._aliases.move_to_end(alias)
            while len(self._aliases) > ENDED_KEPT + len(self._going) + 1:
                self._aliases.popitem(last=False)

    def written(self, request_id: str, layers: int) -> None:
        """The first ``layers`` layers of ``request_id`` hold every token's KV (ignored for a request not computing,
        or no more layers than already said)."""
        with self._cond:
            progress = self._going.get(request_id)
            if progress is None or progress.held or layers <= progress.layers:
                return
            self._going[request_id] = replace(progress, layers=min(layers, self.num_layers))
            self._cond.notify_all()

    def held(self, request_id: str, block_ids: Iterable[int], alias: str | None = None) -> None:
        """``request_id`` finished in ``block_ids`` and its lease started: every layer is written. Blocks other than
        those it was computed into start a new generation. ``alias``: as :meth:`computing` takes it."""
        blocks = tuple(block_ids)
        with self._cond:
            self._alias(request_id, alias)
            progress = self._going.get(request_id)
            if progress is None or progress.block_ids != blocks:
                self._generations += 1
                generation = self._generations
            else:
                generation = progress.generation
            self._going[request_id] = Progress(blocks, self.num_layers, self.num_layers, generation, held=True)
            self._ended.pop(request_id, None)
            self._cond.notify_all()
            observers = list(self._observers)
        for observer in observers:
            observer.held(request_id, blocks)

    def ended(self, request_id: str, reason: str) -> None:
        """No more layers of ``request_id`` come and its blocks are (or will be) the engine's: ``reason`` says why."""
        with self._cond:
            progress = self._going.pop(request_id, None)
            if progress is None:
                return
            self._ended[request_id] = replace(progress, ended=reason)
            while len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)
            self._cond.notify_all()
            observers = list(self._observers)
        for observer in observers:
            observer.ended(request_id)

    # ------------------------------------------------------------------ readers
    def resolve(self, name: str) -> str:
        """The request ``name`` stands for (an alias's request, else ``name`` itself)."""
        with self._cond:
            return self._aliases.get(name, name)

    def progress(self, request_id: str) -> Progress | None:
        """What ``request_id`` (or an alias of it) has written now (None: unknown here)."""
        with self._cond:
            return self._find(request_id)

    def _find(self, name: str) -> Progress | None:
        request_id = self._aliases.get(name, name)
        return self._going.get(request_id) or self._ended.get(request_id)

    def wait(self, request_id: str, until: Callable[[Progress], bool], timeout_s: float) -> Progress | None:
        """``request_id``'s (or its alias's) progress once ``until(progress)`` holds or it ended; None if neither
        happened in ``timeout_s`` (``until`` is called under the board's lock: keep it a plain test)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                progress = self._find(request_id)
                if progress is not None and (progress.ended is not None or until(progress)):
                    return progress
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def complete(self, request_id: str, generation: int) -> bool:
        """Whether a stream of ``request_id`` that began at ``generation`` ends well now: the same generation, every
        layer written, the lease started."""
        with self._cond:
            progress = self._going.get(request_id)
            return progress is not None and progress.generation == generation and progress.complete

    @property
    def computing_requests(self) -> int:
        """Requests being computed (not yet held)."""
        with self._cond:
            return sum(1 for progress in self._going.values() if not progress.held)
