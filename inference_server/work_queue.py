"""The hand-off between LocalEngine's callers and its scheduler thread: waiting requests and pending weight updates.

Callers (any thread) put requests and weight updates in; the one scheduler thread waits for work and takes it out
between two steps. Everything here happens under one condition variable, so a take sees the requests and updates
that arrived before it together, in one consistent snapshot. The request side is bounded (max_requests, then
QueueFull; requests cancelled while waiting give their places up first); weight updates are few by construction
(update_weights serialises them) and always accepted.
Accepted and refused requests are counted into the engine's stats under the same lock, so the counts never lag
behind what the scheduler has already seen (and concurrent submitters never lose a count).
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

from inference_server.engine_types import EngineClosed, QueueFull, Request, WeightUpdate


@dataclass
class Work:
    """What the scheduler takes in one go: every pending weight update, then the requests it has room for."""

    updates: list[WeightUpdate] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)


class WorkQueue:
    def __init__(self, max_requests: int, stats: collections.Counter):
        self.max_requests = max_requests
        self.stats = stats                # the engine's counters: "requests", "rejected_queue_full"
        self._cv = threading.Condition()
        self._requests: collections.deque[Request] = collections.deque()
        self._updates: collections.deque[WeightUpdate] = collections.deque()
        self._closed = False

    # ---- the callers' side ---------------------------------------------------------------------------
    def put_request(self, req: Request) -> None:
        """Queue a request; EngineClosed once closed, QueueFull when max_requests are already waiting."""
        with self._cv:
            if self._closed:
                raise EngineClosed("engine closed")
            if len(self._requests) >= self.max_requests:
                # Requests their callers cancelled while waiting (a deadline passed, the client went away) would
                # hold their places until the scheduler has room to take them: they go now, not a live request.
                live = collections.deque(r for r in self._requests if not r.future.cancelled())
                self.stats["cancelled"] += len(self._requests) - len(live)
                self._requests = live
            if len(self._requests) >= self.max_requests:
                self.stats["rejected_queue_full"] += 1
                raise QueueFull(f"{len(self._requests)} requests waiting (max_queue={self.max_requests})")
            self._requests.append(req)
            self.stats["requests"] += 1
            self._cv.notify()

    def put_update(self, upd: WeightUpdate) -> None:
        """Queue a weight update; EngineClosed once closed."""
        with self._cv:
            if self._closed:
                raise EngineClosed("engine closed")
            self._updates.append(upd)
            self._cv.notify()

    def close(self) -> None:
        """Refuse new work from now on and wake the scheduler; what is queued stays until drain()."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def waiting(self) -> int:
        """Requests queued and not yet taken by the scheduler."""
        return len(self._requests)

    # ---- the scheduler's side ------------------------------------------------------------------------
    def wait(self, timeout: float) -> bool:
        """Block up to timeout seconds until there is work or the queue is closed; True if so."""
        with self._cv:
            if not self._ready():
                self._cv.wait(timeout)
            return self._ready()

    def take(self, room: int) -> Work | None:
        """Every pending update plus up to `room` waiting requests (oldest first); None once closed."""
        with self._cv:
            if self._closed:
                return None
            updates = list(self._updates)
            self._updates.clear()
            n = min(max(0, room), len(self._requests))
            return Work(updates, [self._requests.popleft() for _ in range(n)])

    def take_updates(self) -> list[WeightUpdate]:
        """Every pending update, closed or not (to install updates while no scheduler thread runs)."""
        with self._cv:
            updates = list(self._updates)
            self._updates.clear()
            return updates

    def drain(self) -> Work:
        """Everything still queued, to fail it on close."""
        with self._cv:
            work = Work(list(self._updates), list(self._requests))
            self._updates.clear()
            self._requests.clear()
            return work

    def _ready(self) -> bool:
        return self._closed or bool(self._requests) or bool(self._updates)
