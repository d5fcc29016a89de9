"""Pieces of the receiver's io loop (core/stream/receiver.py): how it receives, and when it ticks (credit, held
notices, WAL batches, actor expiry).

A tick costs ~100 us (a held notice and a CREDIT to pack and send, the actors to walk); one per burst of messages
was 5-7 us per trajectory. So the loop ticks every `every` messages or every max_s seconds, whichever comes first,
and at once when it must (a WAL sync finished, the socket went quiet, an actor is down to half its credit). `every`
adapts: it doubles while the loop is CPU-bound (a burst of messages found more waiting), up to half the credit
window (the actor still has the other half to send while a tick is owed), and drops back to the minimum as soon as a
poll finds nothing.
"""
from __future__ import annotations

import collections
import threading
import time

import zmq

MIN_EVERY = 32   # messages between ticks while the io thread keeps up
MAX_S = 0.005    # the longest a tick waits while messages keep coming


def recv_message(sock) -> list:
    """One multipart message (raises zmq.Again if none): the identity, tag and body frames as bytes, the payload and
    image frames as zero-copy memoryviews of libzmq's buffers (decoded from there; the WAL batch keeps the payload by
    reference until the syncer has written it). One recv_multipart call: per-frame recv and RCVMORE lookups cost
    more than the rest of the receive."""
    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
    return [f.bytes if i < 3 else f.buffer for i, f in enumerate(frames)]


class TickPacer:
    def __init__(self, credits: int, now: float, min_every: int = MIN_EVERY, max_s: float = MAX_S):
        self.min_every, self.max_s = min_every, max_s
        self.max_every = max(min_every, credits // 2)
        self.every = min_every
        self.since = 0          # messages handled since the last tick
        self.last = now

    def wait(self, now: float, poll_timeout: float) -> float:
        """How long the next poll may block: never past a tick that is owed."""
        if self.since:
            return min(poll_timeout, max(0.0, self.last + self.max_s - now))
        return poll_timeout

    def due(self, got: int, burst_full: bool, now: float, urgent: bool) -> bool:
        """After a poll that handled `got` messages (burst_full: it stopped with more waiting): tick now?"""
        if burst_full:
            self.every = min(self.every * 2, self.max_every)
        elif not got:
            self.every = self.min_every
        self.since += got
        if not got or urgent or self.since >= self.every or now - self.last >= self.max_s:
            self.since, self.last = 0, now
            return True
        return False


class Throttled:
    """Rate-limited warnings, one per reason per `every_s`: a flood of bad frames must not flood the log too."""

    def __init__(self, log, every_s: float):
        self.log, self.every_s = log, every_s
        self.last: dict[str, float] = {}     # reason -> when last logged
        self.suppressed: dict[str, int] = {}  # reason -> warnings left out since

    def __call__(self, reason: str, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self.last.get(reason, -1e9) >= self.every_s:
            n = self.suppressed.pop(reason, 0)
            self.log.warning(msg + (f" (+{n} similar suppressed)" if n else ""), *args)
            self.last[reason] = now
        else:
            self.suppressed[reason] = self.suppressed.get(reason, 0) + 1


class HandOver:
    """The bounded queue from the io thread to the training thread. put() queues without waking anyone; wake(), once
    the io thread has handled a burst of messages, wakes the consumer once for everything queued since. Waking it at
    every put (queue.Queue) made the two threads trade the GIL once per trajectory: the woken consumer takes the GIL
    at the io thread's next release (a numpy reduction in validate, a socket call) and the io thread waits for it back,
    which cost the learner process ~30 us per trajectory (docs/benchmarks.md, "One wake-up per burst")."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._unannounced = 0   # put since the last wake()

    def put(self, item) -> None:
        """io thread: raises OverflowError when full (the receiver checks full() first)."""
        with self._cond:
            if len(self._items) >= self.maxsize:
                raise OverflowError(f"hand-over queue full ({self.maxsize})")
            self._items.append(item)
            self._unannounced += 1

    def wake(self) -> None:
        """io thread, after a burst: wake as many waiting consumers as items were put since the last wake."""
        if self._unannounced:  # read without the lock: only the io thread writes it
            with self._cond:
                self._cond.notify(self._unannounced)
                self._unannounced = 0

    def get(self, timeout: float):
        """The oldest item, or None after `timeout` seconds without one (an item put and not yet announced is
        taken at once: wake() only ends waits)."""
        deadline = None
        with self._cond:
            while not self._items:
                if deadline is None:
                    deadline = time.monotonic() + timeout
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._items.popleft()

    def qsize(self) -> int:
        return len(self._items)

    def full(self) -> bool:
        return len(self._items) >= self.maxsize
