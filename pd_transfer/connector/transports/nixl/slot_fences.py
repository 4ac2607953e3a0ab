"""When a staging slot group may be read into again, and where the fix-ups that read from it run.

On the CPU a lane scatters a chunk before it reads the next one, on the same thread: nothing to order, and one
group per lane is enough. On an accelerator the scatter is only queued: each lane queues its fix-ups on a stream
of its own, records an event per group once the group's scatter is queued, and waits for that event (on the host,
for that event only: never a device-wide synchronize) before the next read into the group; two groups per lane let
a lane read a chunk while the scatter of the one before runs. ``wait_for(stream)``, when given, is called on each
lane's stream before a request's first fix-up on it, so that the fix-ups can wait for other work (an engine's
stream still using blocks the request overwrites: ``stream.wait_event(...)``) on the device, not on the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

#: A hook given each lane's stream before a request's fix-ups are queued on it (accelerators only).
StreamHook = Callable[["torch.cuda.Stream"], None]


def mark(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded on ``device``'s current stream (None on the CPU, where work is done when queued)."""
    if device.type == "cpu":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def after_mark(event: torch.cuda.Event | None) -> None:
    """Make this thread's current stream wait for ``event`` (on the device; nothing to do for None)."""
    if event is not None:
        torch.cuda.current_stream().wait_event(event)


class SlotFences:
    """Fences on ``groups`` slot groups of a staging area on ``device``, and the lanes' streams there."""

    def __init__(self, device: torch.device, groups: int, *, wait_for: StreamHook | None = None) -> None:
        self.device = device
        self.on_host = device.type == "cpu"
        self.depth = 1 if self.on_host else 2  # groups per lane
        self.lanes = max(1, groups // self.depth)
        self.wait_for = wait_for
        self._events: list[torch.cuda.Event | None] = [None] * groups
        self._streams: dict[int, torch.cuda.Stream] = {}

    def lane_groups(self, lane: int) -> range:
        """The slot groups lane ``lane`` reads into, in turn."""
        if not 0 <= lane < self.lanes:
            raise ValueError(f"lane {lane} of {self.lanes}")
        return range(lane * self.depth, (lane + 1) * self.depth)

    def mark(self) -> torch.cuda.Event | None:
        """:func:`mark` on this area's device: lanes given it as ``after`` run their fix-ups after what was queued
        so far (a copy of the request's block ids)."""
        return mark(self.device)

    @contextlib.contextmanager
    def lane(self, lane: int, *, after: torch.cuda.Event | None = None) -> Iterator[None]:
        """Run a request's fix-ups of lane ``lane`` inside: on an accelerator, queued on the lane's stream (after
        the event ``after`` and ``wait_for``), and on leaving waits until the last fix-up from each of the lane's
        groups has run."""
        if self.on_host:
            yield
            return
        stream = self._streams.get(lane)
        if stream is None:
            stream = self._streams[lane] = torch.cuda.Stream(self.device)
        if after is not None:
            stream.wait_event(after)
        if self.wait_for is not None:
            self.wait_for(stream)
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            for group in self.lane_groups(lane):
                self.wait_free(group)

    def filled(self, group: int) -> None:
        """The fix-up that reads ``group`` has been queued (on the current stream)."""
        if self.on_host:
            return
        event = self._events[group]
        if event is None:
            event = self._events[group] = torch.cuda.Event()
        event.record()

    def wait_free(self, group: int) -> None:
        """Wait (this thread only) until the last fix-up queued from ``group`` has run: it may be read into."""
        event = self._events[group]
        if event is not None:
            event.synchronize()
