"""The output journal: every event of a request, kept so a dropped client can resume its stream.

Each request's events are numbered from 1 in the order they were produced. A running request's events
are always kept (its live readers follow them); a completed one's are kept for ``ttl_s`` after it
completed, while the journal's total size stays within ``max_bytes`` (oldest completed request evicted
first) and less under host memory pressure. ``follow(entry, after=N)`` yields every event with index
> N exactly once, then waits for live ones until the request completes.

The journal is plain data with an injected clock (no tasks of its own): the service sweeps it.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

EVENT_OVERHEAD_BYTES = 64  # list slot + str header per event, so many tiny events still count
PRESSURE_TTL_S = 10.0  # under host memory pressure completed requests are kept this long at most


class RequestIdInUse(Exception):
    """A running request already has this id."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        super().__init__(f"request id {rid!r} belongs to a request that is still running")


@dataclass(eq=False)
class Entry:
    """One request's events."""

    rid: str
    created: float
    events: list[str] = field(default_factory=list)
    nbytes: int = 0
    done_at: float | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def done(self) -> bool:
        """True once the request completed (no more events)."""
        return self.done_at is not None

    def _notify(self) -> None:
        """Wake every follower (each waits on the event that was current when it looked)."""
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()


class Journal:
    """Events of running and recently completed requests, bounded in bytes and time."""

    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        """Keep completed requests ``ttl_s`` seconds, all requests within ``max_bytes`` where possible."""
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self._running: dict[str, Entry] = {}
        self._completed: OrderedDict[str, Entry] = OrderedDict()  # in completion order, oldest first
        self.nbytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._running) + len(self._completed)

    def open(self, rid: str) -> Entry:
        """Start the journal of a new request; a completed request of the same id is replaced.

        Raises:
            RequestIdInUse: a running request has this id.
        """
        if rid in self._running:
            raise RequestIdInUse(rid)
        self._drop(rid)
        entry = Entry(rid=rid, created=self.clock())
        self._running[rid] = entry
        return entry

    def append(self, entry: Entry, data: str) -> int:
        """Record one event of a running request; returns its index (1, 2, ...)."""
        if entry.done:
            raise ValueError(f"request {entry.rid} has completed: no more events")
        entry.events.append(data)
        size = len(data) + EVENT_OVERHEAD_BYTES
        entry.nbytes += size
        if self._running.get(entry.rid) is entry:
            self.nbytes += size
        entry._notify()
        self._fit()
        return len(entry.events)

    def finish(self, entry: Entry) -> None:
        """Mark a request completed: its events are now kept for ttl_s, within the byte budget."""
        if entry.done:
            return
        entry.done_at = self.clock()
        if self._running.get(entry.rid) is entry:
            del self._running[entry.rid]
            self._completed[entry.rid] = entry
        entry._notify()
        self.sweep()

    def get(self, rid: str) -> Entry | None:
        """The journal of a running or retained request; None when unknown or expired."""
        self.sweep()
        return self._running.get(rid) or self._completed.get(rid)

    def sweep(self, pressure: bool = False) -> None:
        """Evict completed requests past their TTL (a short one under memory pressure) or over the budget."""
        ttl = min(self.ttl_s, PRESSURE_TTL_S) if pressure else self.ttl_s
        now = self.clock()
        while self._completed:
            rid, entry = next(iter(self._completed.items()))
            if entry.done_at is not None and now - entry.done_at < ttl:
                break
            self._evict(rid)
        self._fit()

    def _fit(self) -> None:
        """Evict the oldest completed requests while over the byte budget (running ones stay)."""
        while self.nbytes > self.max_bytes and self._completed:
            self._evict(next(iter(self._completed)))

    def _evict(self, rid: str) -> None:
        entry = self._completed.pop(rid)
        self.nbytes -= entry.nbytes
        self.evicted += 1

    def _drop(self, rid: str) -> None:
        if rid in self._completed:
            self.nbytes -= self._completed.pop(rid).nbytes

    async def follow(self, entry: Entry, after: int = 0) -> AsyncIterator[list[tuple[int, str]]]:
        """Yield every event with index > ``after`` as ``(index, data)``, live until the request completes: all
        those already there at once (a follower that fell behind catches up in one write, not one per token)."""
        i = max(after, 0)
        while True:
            changed = entry._changed  # taken before reading: an append after this point sets it
            if i < len(entry.events):
                ready = entry.events[i:]
                yield list(enumerate(ready, i + 1))
                i += len(ready)
            if entry.done:
                return
            await changed.wait()
