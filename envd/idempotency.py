"""Idempotency keys of the RPCs that make a session (CreateSession, Restore, Fork): a retry gets the session its
first attempt created.

A client whose CreateSession reached envd but whose answer was lost (a connection reset, a proxy restart) retries
it; without a key the retry built a second session, and the first (its backend, a Chromium, a session slot and its
share of the host budget) was held by nobody until its lease ran out. A client therefore sends a request id of its
choosing (the request's request_id) and the same one with every retry. envd remembers, per client (the peer
without its port) and key, the creation it started:

  - done, session still open -> the same session again (its lease renewed)
  - still running            -> the retry waits for it (with a deadline; past it: ABORTED, retry again)
  - failed or cancelled      -> forgotten: the retry creates the session itself
  - session since closed     -> forgotten: the retry creates a new one (nothing is held twice)

Keys are remembered for `ttl_s` and at most `max_keys` of them (the oldest forgotten first, never one whose creation
is still running: with `max_keys` creations running at once a new keyed create is RESOURCE_EXHAUSTED, nothing is
made), so their memory is bounded whatever clients send; a key reused with another env id, options or seed is INVALID_ARGUMENT. A request
without a key is served as before.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import grpc

from core.v1 import env_pb2
from envd.admission import Status

MAX_KEY_LEN = 128          # bytes of a request id: a key is an id, not a payload
MAX_KEYS = 4096            # keys remembered at once (about a few hundred bytes each)


def fingerprint(request) -> str:
    """What a retry must repeat unchanged, the RPC included (a key of a Fork given to a Restore is another request):
    CreateSession's env id, options, seed and lease; Restore's env id, state and lease; Fork's session and run id."""
    if isinstance(request, env_pb2.RestoreRequest):
        h = hashlib.sha256(b"restore\0" + request.env_id.encode() + b"\0" + hashlib.sha256(request.state).digest())
        h.update(f"\0{request.lease_ttl_s!r}".encode())
        return h.hexdigest()
    if isinstance(request, env_pb2.ForkRequest):
        return hashlib.sha256(f"fork\0{request.session_id}\0{request.run_id}".encode()).hexdigest()
    h = hashlib.sha256(b"create\0" + request.env_id.encode())
    for k, v in sorted(request.options.items()):
        h.update(b"\0" + k.encode() + b"\0" + v.encode())
    h.update(f"\0{request.seed}\0{request.lease_ttl_s!r}".encode())
    return h.hexdigest()


@dataclass
class _Entry:
    fingerprint: str
    done: asyncio.Future         # finished once the first attempt has (whether it made the session or not)
    at: float                    # the clock (time.monotonic) when the key was first seen
    session_id: str = ""         # the id of what it made; "" if it failed or is still running. The id, not the
                                 # session: a key outlives its session by up to ttl_s and must not keep it in memory


class CreateKeys:
    """The remembered CreateSession keys of one daemon."""

    def __init__(self, ttl_s: float, wait_s: float, max_keys: int = MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.wait_s, self.max_keys, self.clock = ttl_s, wait_s, max(1, max_keys), clock
        self._keys: collections.OrderedDict[tuple[str, str], _Entry] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def _prune(self, now: float, room: int = 0) -> None:
        """Forget expired keys and, oldest first, enough others to leave `room` under max_keys; a creation still
        in progress is never forgotten (its retry must find it, or it would make a second session)."""
        over = len(self._keys) + room - self.max_keys
        for key in list(self._keys):   # oldest first (time.monotonic order)
            e = self._keys[key]
            if now - e.at < self.ttl_s and over <= 0:
                break
            if e.done.done():
                del self._keys[key]
                over -= 1

    async def create(self, owner: str, request, make: Callable[[], Awaitable], lookup: Callable[[str], Any]):
        """The session (envd.sessions.Session) for `request`: make() once per (owner, request_id); `lookup(id)` is
        the open session of that id, or None."""
        rid = request.request_id
        if not rid:
            return await make()
        if len(rid.encode()) > MAX_KEY_LEN:
            raise Status(grpc.StatusCode.INVALID_ARGUMENT, f"request_id longer than {MAX_KEY_LEN} bytes")
        key, fp = (owner, rid), fingerprint(request)
        self._prune(self.clock())
        while (e := self._keys.get(key)) is not None:
            if e.fingerprint != fp:
                raise Status(grpc.StatusCode.INVALID_ARGUMENT, "request_id reused for a different request (another "
                             "RPC, or its env id, options, seed, state, session or lease differ)")
            if not e.done.done():   # the first attempt is still creating it: its session is this request's too
                done, _ = await asyncio.wait({e.done}, timeout=self.wait_s)
                if not done:
                    raise Status(grpc.StatusCode.ABORTED, "the session of this request_id is still being created; "
                                                          "retry")
                continue   # look again: it may have been forgotten, or taken over by another retry, meanwhile
            if e.session_id and (s := lookup(e.session_id)) is not None:
                s.renew()   # the lease runs from this answer, as it does from a fresh session's
                return s
            del self._keys[key]   # failed, cancelled or closed since: this request creates it anew
        now = self.clock()
        self._prune(now, room=1)
        if len(self._keys) >= self.max_keys:   # every remembered key is a creation in progress
            raise Status(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{len(self._keys)} sessions with a request_id are being "
                                                             "created at once (envd's bound): retry later")
        mine = self._keys[key] = _Entry(fp, asyncio.get_running_loop().create_future(), now)
        try:
            s = await make()
            mine.session_id = s.id
            return s
        except BaseException:   # failed or cancelled: forgotten, so that a retry tries again
            if self._keys.get(key) is mine:
                del self._keys[key]
            raise
        finally:
            mine.done.set_result(None)
