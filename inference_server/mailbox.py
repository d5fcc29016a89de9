"""Handing results from the engine's thread to an event loop: one Mailbox per loop, woken once per batch of posts,
and the waiters the gRPC handlers await (inference_server/server.py)."""
from __future__ import annotations

import asyncio
import collections
import logging

log = logging.getLogger("tars.inference.server")


class Mailbox:
    """Calls posted from any thread, run in order on one event loop; the loop is woken once per batch of posts.

    post() appends, then arms a wake-up unless one is pending; _drain disarms before it empties the deque, so a
    post that races with a drain is either seen by it or arms the next one (an extra, empty drain at worst)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._q: collections.deque = collections.deque()
        self._armed = False

    def post(self, fn, *args) -> None:
        self._q.append((fn, args))
        if not self._armed:
            self._armed = True
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nobody is left to hear the result
                pass

    def _drain(self) -> None:
        self._armed = False
        q = self._q
        while q:
            fn, args = q.popleft()
            try:
                fn(*args)
            except Exception:
                log.exception("posted callback failed")


def settle(waiter: asyncio.Future, fut) -> None:
    """Copy a finished concurrent Future's outcome onto the loop's waiter (unless it expired or was cancelled)."""
    if waiter.done():
        return
    if fut.cancelled():
        waiter.cancel()
    elif fut.exception() is not None:
        waiter.set_exception(fut.exception())
    else:
        waiter.set_result(fut.result(0))  # done: no wait


def expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(asyncio.TimeoutError())


def wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
