"""Session state, the worker pool that runs blocking backend calls, paged session listings, and StepResult -> proto
conversion for envd.

Backends are synchronous and not thread-safe, so every call on one Env goes through its session's asyncio.Lock and
runs in a bounded thread pool with a deadline. A call whose deadline passed (or whose RPC was cancelled) keeps
running in its thread: Python cannot kill it. `Workers.run` therefore remembers the session's in-flight call and
lets the next call on the same Env start only once it has finished.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

from envd.admission import Status
from envd.base import Env, Outcome, Resources, StepResult, call_deadline
from core.v1 import env_pb2

log = logging.getLogger("envd")

# What a backend may report; it never reports INFRA_ERROR, it raises (and the daemon reports that).
_REPORTABLE = (Outcome.RUNNING, Outcome.TERMINATED, Outcome.TRUNCATED)
MAX_LEASE_TTL_S = 7 * 24 * 3600.0


def lease_ttl(requested: float, default: float) -> float:
    """The lease a request's lease_ttl_s asks for (0: `default`). Capped: an absurd lease overflows
    lease_expires_unix_ms (int64); a session nobody renews must still expire. INVALID_ARGUMENT outside the range."""
    if requested < 0 or not math.isfinite(requested) or requested > MAX_LEASE_TTL_S:
        raise Status(grpc.StatusCode.INVALID_ARGUMENT, f"lease_ttl_s must be in [0, {MAX_LEASE_TTL_S:.0f}], got {requested}")
    return requested or default


class BackendTimeout(Exception):
    """A backend call ran past its deadline; its thread may still be running."""


class NotStarted(Status):
    """A backend call waited for a worker past its deadline and was dropped before it started: other sessions'
    calls held every worker. Nothing ran and the session is fine: ABORTED, which gRPC never sends itself, so a
    client may retry even a Step on it."""

    def __init__(self, what: str):
        super().__init__(grpc.StatusCode.ABORTED, f"{what}: no envd worker was free (envd.workers busy with other "
                                                  "sessions' calls); it never started, retry it")


@dataclass(eq=False)
class Session:
    id: str
    env_id: str
    env: Env
    options: dict[str, str]
    ttl_s: float
    client_id: str = ""                 # what the client says it is (shown in listings; it decides nothing)
    owner: str = ""                     # who the per-client cap counts it against: the creator's peer address
    charge: Resources = field(default_factory=Resources)   # what it holds of the host budget (envd.budget)
    seed: int = 0                       # default seed for a Reset that sends 0
    hint_policy: str = ""               # scripted baseline whose next action every result carries (envd.hints)
    hint_rng: Any = None                # its random stream (random.Random), seeded from the session's seed
    expires: float = 0.0                # time.monotonic() deadline of the lease
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last: StepResult | None = None      # the latest reset/step/restore result (None until the first reset)
    inflight: concurrent.futures.Future | None = None
    created: float = field(default_factory=time.monotonic)
    steps: int = 0                      # steps over the session's life, all episodes
    episodes: int = 0
    closed: bool = False

    def renew(self, ttl_s: float = 0.0) -> None:
        # max(): a heartbeat asking for a long lease must not be shortened by the next step's default renewal.
        self.expires = max(self.expires, time.monotonic() + (ttl_s or self.ttl_s))

    def expired(self, now: float) -> bool:
        return self.expires <= now

    @property
    def busy(self) -> bool:
        return self.lock.locked() or (self.inflight is not None and not self.inflight.done())

    @property
    def episode_over(self) -> bool:
        return self.last is not None and self.last.outcome.ended

    def lease_expires_unix_ms(self) -> int:
        return int((time.time() + (self.expires - time.monotonic())) * 1000)

    def close_quietly(self) -> None:
        """Close the env from whatever thread this runs in; a failing close is logged, never raised."""
        try:
            self.env.close()
        except Exception as e:
            log.warning("closing session %s (%s) failed: %s: %s", self.id, self.env_id, type(e).__name__, e)

    def describe(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "id": self.id, "env_id": self.env_id, "client_id": self.client_id, "owner": self.owner,
            "pids": self.charge.pids, "memory_mb": self.charge.memory_mb, "age_s": round(now - self.created, 3),
            "lease_left_s": round(self.expires - now, 3), "steps": self.steps, "episodes": self.episodes,
            "outcome": self.last.outcome if self.last is not None else "", "busy": self.busy,
        }


LIST_PAGE_MAX = 500              # sessions in one sessions_list reply (the default page is 100) ...
LIST_PAGE_BYTES = 1 << 20        # ... and at most about this much JSON, whatever the sessions hold


def list_page(sessions: list[Session], args: dict[str, str]) -> dict:
    """One page of a session listing (the ControlService's sessions_list), oldest first: args offset (0) and limit
    (100, at most LIST_PAGE_MAX); a page also ends before it passes LIST_PAGE_BYTES of JSON. next_offset is where
    the next page starts (None after the last); sessions that end between two pages shift the later ones back.
    ValueError on a malformed offset or limit."""
    try:
        offset, limit = int(args.get("offset", 0)), int(args.get("limit", 100))
    except (TypeError, ValueError):
        raise ValueError(f"offset and limit must be integers, got {args.get('offset')!r}, {args.get('limit')!r}") \
            from None
    if offset < 0 or not 1 <= limit <= LIST_PAGE_MAX:
        raise ValueError(f"offset must be >= 0 and limit in [1, {LIST_PAGE_MAX}], got offset={offset} limit={limit}")
    page, size = [], 0
    for s in sessions[offset:offset + limit]:
        d = s.describe()
        size += len(json.dumps(d, default=str))
        if page and size > LIST_PAGE_BYTES:
            break
        page.append(d)
    end = offset + len(page)
    return {"sessions": page, "total": len(sessions), "offset": offset,
            "next_offset": end if end < len(sessions) else None}


class LatencyWindow:
    """The last `size` latencies (ms); percentiles are computed on demand (status calls are rare, steps are not)."""

    def __init__(self, size: int):
        self._v: collections.deque[float] = collections.deque(maxlen=max(1, size))

    def add(self, ms: float) -> None:
        self._v.append(ms)

    def __len__(self) -> int:
        return len(self._v)

    def percentile(self, q: float) -> float:
        if not self._v:
            return 0.0
        v = sorted(self._v)
        return v[min(len(v) - 1, int(q / 100.0 * len(v)))]


class Workers:
    """A bounded thread pool for blocking backend calls, each with a deadline."""

    def __init__(self, n: int):
        self.pool = concurrent.futures.ThreadPoolExecutor(max(1, n), thread_name_prefix="envd-backend")
        self._running = 0
        self._count_lock = threading.Lock()

    @property
    def running(self) -> int:
        """Backend calls executing right now (including abandoned ones still stuck in their thread)."""
        return self._running

    def _job(self, fn: Callable, args: tuple, timed: bool, deadline: float | None = None) -> Any:
        with self._count_lock:
            self._running += 1
        call_deadline(deadline)  # backends cut their own waits to it (envd.base.call_time_left)
        try:
            if not timed:
                return fn(*args)
            t0 = time.perf_counter()  # measured in the thread: backend time only, no queueing or loop latency
            r = fn(*args)
            return r, (time.perf_counter() - t0) * 1e3
        finally:
            call_deadline(None)
            with self._count_lock:
                self._running -= 1

    async def run(self, fn: Callable, *args: Any, timeout: float, session: Session | None = None,
                  orphan: Callable[[Any], None] | None = None, timed: bool = False, name: str = "",
                  must_run: bool = False) -> Any:
        """fn(*args) in a worker thread; with `timed`, (result, ms inside fn). BackendTimeout past `timeout` s
        once it started; NotStarted if it is still queued then (the time went to other sessions' calls: its own
        backend is not to blame), and it is dropped, as it is when the caller is cancelled first, unless `must_run`
        (a close: it runs however late).

        With `session`, first wait for the session's previous call if it is still running (the Env is not
        thread-safe). `orphan(result)` is called in the worker if the call finishes after its deadline, so that a
        late result that owns resources (a freshly built Env) can be released.
        """
        if session is not None and session.inflight is not None and not session.inflight.done():
            await self._wait(session.inflight, timeout, "the previous call on this session is still running")
        # A close (must_run) runs however late, with its backend's own timeouts; any other call ends with its deadline.
        cf = self.pool.submit(self._job, fn, args, timed, None if must_run else time.monotonic() + timeout)
        if session is not None:
            session.inflight = cf
        what = name or getattr(fn, "__name__", str(fn))
        try:
            return await self._wait(cf, timeout, f"{what} took longer than {timeout:g}s")
        except (BackendTimeout, asyncio.CancelledError) as e:
            if not must_run and cf.cancel():   # still queued: it never runs
                if isinstance(e, BackendTimeout):
                    raise NotStarted(what) from None
                raise
            if orphan is not None:
                cf.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or _safe(orphan, f.result()))
            raise

    @staticmethod
    async def _wait(cf: concurrent.futures.Future, timeout: float, what: str) -> Any:
        fut = asyncio.wrap_future(cf)
        # shield(): on timeout the thread keeps running; nobody may then read the future, so consume its exception
        # to keep "exception was never retrieved" noise out of the log.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            raise BackendTimeout(what) from None

    def shutdown(self) -> None:
        # Threads stuck in a backend cannot be joined; queued work is dropped.
        self.pool.shutdown(wait=False, cancel_futures=True)


def _safe(fn: Callable[[Any], None], arg: Any) -> None:
    try:
        fn(arg)
    except Exception:
        log.exception("cleanup of a late backend result failed")


# ---- wire conversion ----------------------------------------------------------------------------------------

def check_result(r: object) -> StepResult:
    """A backend that breaks the StepResult contract is treated like a crashing one. The outcome comes back as an
    Outcome even where the backend wrote its string value."""
    if not isinstance(r, StepResult):
        raise TypeError(f"backend returned {type(r).__name__}, not a StepResult")
    if r.outcome not in _REPORTABLE:
        raise RuntimeError(f"backend reported outcome {str(r.outcome)!r}" + (f": {r.info}" if r.info else ""))
    r.outcome = Outcome(r.outcome)
    if not math.isfinite(float(r.reward)):
        raise RuntimeError(f"backend returned a non-finite reward {r.reward!r}")
    return r


def to_response(r: StepResult, step_ms: float, lease_ms: int, reward: float | None = None,
                images: bool = True) -> env_pb2.StepResponse:
    """images False (a session created with screenshots=0): none are sent, whatever the backend returned."""
    obs = env_pb2.Observation(text=r.text, step=r.step, width=r.width, height=r.height, instruction=r.instruction)
    for im in r.images if images else ():
        obs.images.add(data=im.data, mime=im.mime, sha256=im.sha256, width=im.width, height=im.height)
    return env_pb2.StepResponse(
        observation=obs, reward=float(r.reward if reward is None else reward), outcome=r.outcome.to_proto(),
        info_json=json.dumps(r.info, default=str) if r.info else "", lease_expires_unix_ms=lease_ms, step_ms=step_ms,
    )
