"""envd's EnvService: stateful Env sessions served over gRPC (tars.v1.EnvService), and their lease GC.

The process around it (listening, health, drain, signals, exit, the ControlService's commands) is envd/server.py;
session state and the worker pool are envd/sessions.py.

Error contract (see proto/tars/v1/env.proto and envd/base.py):
  unknown session / env id -> NOT_FOUND            malformed action or options -> INVALID_ARGUMENT
  session cap, per-client cap, host budget -> RESOURCE_EXHAUSTED      draining -> UNAVAILABLE
  backend lacks snapshots -> UNIMPLEMENTED         request from before a daemon restart -> FAILED_PRECONDITION
  a crashing or hanging backend never raises: Reset/Step/Observe answer outcome INFRA_ERROR and the session is gone.
  Snapshot (Fork's too) answers INTERNAL then, and the session is gone as well.
  a call that waited past its deadline for a worker held by other sessions' calls, and never ran -> ABORTED (the
  session is kept; even a Step may be retried).
"""
from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
import secrets
import time

import grpc

from envd import hints, registry
from envd.base import Action, ActionError, Outcome
from envd.admission import Admission, Status as _Status, peer_identity, rpc as _rpc
from envd.idempotency import CreateKeys
from envd.servicer_snapshots import SnapshotRPCs
from envd.snapshots import SnapshotSeal
from envd.sessions import (BackendTimeout, LatencyWindow, NotStarted, Session, Workers, check_result, lease_ttl,
                           to_response)
from core import telemetry
from core.config import EnvdConfig
from core.session_options import SCREENSHOTS
from core.v1 import env_pb2, env_pb2_grpc

log = logging.getLogger("envd")

ENV_SERVICE = env_pb2.DESCRIPTOR.services_by_name["EnvService"].full_name


class EnvServicer(SnapshotRPCs, env_pb2_grpc.EnvServiceServicer):
    def __init__(self, cfg: EnvdConfig, run_id: str):
        self.cfg, self.run_id = cfg, run_id
        if cfg.unsandboxed_envs:
            log.warning("envd.unsandboxed_envs is deprecated and ignored: desktop and hybrid are always served now, "
                        "their GUI apps run in the sandbox (envd/desktop_apps.py)")
        self.sessions: dict[str, Session] = {}
        self.workers = Workers(cfg.workers)
        self.draining = False
        self.latency = LatencyWindow(cfg.latency_window)
        self.seal = SnapshotSeal(cfg.snapshot_key)  # what Snapshot hands out, Restore checks (envd/snapshots.py)
        self.counters: collections.Counter[str] = collections.Counter()
        self._tasks: set[asyncio.Task] = set()   # background closes, tracked so shutdown can await them
        # Session caps and the host budget; closes give budget back, so a session that does not fit waits for them.
        self.admission = Admission(cfg, self.sessions, lambda: [t for t in self._tasks if not t.done()])
        self.budget = self.admission.budget
        self.create_keys = CreateKeys(cfg.lease_ttl_s, wait_s=2 * cfg.step_timeout_s + 1.0)  # retried creates
        self._gc: asyncio.Task | None = None
        self.step_seconds = telemetry.histogram("tars.env.step.duration", "s", "envd backend step latency")
        telemetry.observe("tars.envd.sessions", lambda: len(self.sessions), description="open sessions")
        telemetry.observe("tars.envd.steps", lambda: self.counters["steps"], description="steps served", kind="counter")
        telemetry.observe("tars.envd.draining", lambda: int(self.draining), description="1 while draining")

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start_gc(self) -> None:
        self._gc = asyncio.get_running_loop().create_task(self._gc_loop(), name="envd-gc")

    async def _gc_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.gc_interval_s)
            try:
                now = time.monotonic()
                for s in list(self.sessions.values()):
                    # A busy session is mid-call (its lease is renewed when the call ends); collecting it would race.
                    if s.expired(now) and not s.busy:
                        log.info("session %s (%s) lease expired", s.id, s.env_id)
                        self.counters["sessions_expired"] += 1
                        self._retire(s)
            except Exception:  # one bad pass must not end lease collection for the daemon's lifetime
                log.exception("envd lease GC pass failed")

    async def shutdown(self, timeout: float) -> None:
        """Stop the GC, close every env (bounded by `timeout`), release the pool."""
        if self._gc is not None:
            self._gc.cancel()
            await asyncio.gather(self._gc, return_exceptions=True)
        for s in list(self.sessions.values()):
            self._retire(s)
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
            if pending:
                log.warning("%d env(s) did not close within %.1fs", len(pending), timeout)
        self.workers.shutdown()

    def _retire(self, s: Session) -> None:
        """Forget the session now (later calls: NOT_FOUND) and close its env in the background."""
        if s.closed:
            return
        s.closed = True
        self.sessions.pop(s.id, None)
        self.counters["sessions_closed"] += 1
        t = asyncio.get_running_loop().create_task(self._dispose(s))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _dispose(self, s: Session) -> None:
        """Close the env, then give its share of the host budget back (its processes are gone by then)."""
        try:
            async with s.lock:  # a call still running on this env finishes first
                cf = s.inflight
                if cf is not None and not cf.done():
                    # The env is stuck in a call past its deadline and is not thread-safe: close it from that
                    # worker thread when (if ever) the call returns, instead of holding a task until then. Its
                    # budget stays taken until then: its processes may still be running.
                    cf.add_done_callback(lambda _: (s.close_quietly(), self.budget.give_back(s)))
                    return
                await self.workers.run(s.env.close, timeout=self.cfg.step_timeout_s, session=s, must_run=True)
        except Exception as e:
            log.warning("closing session %s (%s) failed: %s: %s", s.id, s.env_id, type(e).__name__, e)
        self.budget.give_back(s)

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _check_run(self, run_id: str) -> None:
        if run_id and run_id != self.run_id:
            raise _Status(grpc.StatusCode.FAILED_PRECONDITION,
                          f"daemon restarted: request is for run {run_id}, this daemon is run {self.run_id}")

    def _check_accepting(self) -> None:
        if self.draining:
            raise _Status(grpc.StatusCode.UNAVAILABLE, "envd is draining: no new sessions")

    def _lookup(self, session_id: str) -> Session | None:
        s = self.sessions.get(session_id)
        if s is not None and s.expired(time.monotonic()) and not s.busy:
            # Enforced here too, not only by the GC, so an expired lease reads the same whatever gc_interval_s is.
            self.counters["sessions_expired"] += 1
            self._retire(s)
        return None if s is None or s.closed else s

    def _get(self, session_id: str) -> Session:
        s = self._lookup(session_id)
        if s is None:
            raise _Status(grpc.StatusCode.NOT_FOUND, f"unknown session {session_id!r} (expired, closed or never created)")
        return s

    @staticmethod
    def _alive(s: Session) -> None:
        # Re-checked after acquiring the lock: the session may have been closed while we waited for it.
        if s.closed:
            raise _Status(grpc.StatusCode.NOT_FOUND, f"session {s.id!r} was closed")

    def _ttl(self, requested: float) -> float:
        return lease_ttl(requested, self.cfg.lease_ttl_s)

    async def _open(self, env_id: str, options: dict[str, str], ttl_s: float, client_id: str = "",
                    seed: int = 0, owner: str = "") -> Session:
        self._check_accepting()
        self.admission.check(owner, client_id)
        options, hint = hints.split_options(options)
        make = functools.partial(registry.make, remote=True)
        if hint:
            try:
                hints.check(hint)
            except ValueError as e:
                raise _Status(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        with self.admission.building(owner):
            try:
                env = await self.workers.run(make, env_id, options, timeout=self.cfg.step_timeout_s,
                                             orphan=lambda e: e.close())
            except KeyError as e:
                raise _Status(grpc.StatusCode.NOT_FOUND, str(e.args[0]) if e.args else f"unknown env id {env_id!r}")
            except ValueError as e:
                raise _Status(grpc.StatusCode.INVALID_ARGUMENT, f"{env_id}: {e}")
            except _Status:
                raise  # NotStarted: the pool was busy, nothing ran
            except Exception as e:
                log.warning("creating %s failed: %s: %s", env_id, type(e).__name__, e)
                raise _Status(grpc.StatusCode.INTERNAL, f"{env_id}: {type(e).__name__}: {e}")
            try:  # charged before the session exists (a fresh env has started nothing its reset would not restart)
                need = env.resources()
                await self.admission.charge(need, f"a new {env_id} session")
            except BaseException:
                self._close_env(env)
                raise
        s = Session(id=secrets.token_hex(12), env_id=env_id, env=env, options=options, ttl_s=ttl_s,
                    client_id=client_id, owner=owner, charge=need, seed=seed, hint_policy=hint,
                    hint_rng=hints.stream(hint, env_id, seed) if hint else None)
        s.renew()
        self.sessions[s.id] = s
        self.counters["sessions_created"] += 1
        return s

    def _close_env(self, env) -> None:
        """Close an env that never became a session, in the background (in a worker thread)."""
        t = asyncio.get_running_loop().create_task(self.workers.run(env.close, timeout=self.cfg.step_timeout_s,
                                                                    must_run=True))
        self._tasks.add(t)
        t.add_done_callback(self._closed_env)

    def _closed_env(self, t: asyncio.Task) -> None:
        self._tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.warning("closing a refused env failed: %s: %s", type(t.exception()).__name__, t.exception())

    def _created(self, s: Session) -> env_pb2.CreateSessionResponse:
        return env_pb2.CreateSessionResponse(session_id=s.id, run_id=self.run_id,
                                             lease_expires_unix_ms=s.lease_expires_unix_ms(),
                                             action_space=s.env.action_space)

    def _crash(self, s: Session, op: str, e: BaseException) -> env_pb2.StepResponse:
        """The backend broke: end the session and report INFRA_ERROR (never a reward of 0 to learn from). A call that
        never started (NotStarted: the pool was busy with other sessions' calls) broke nothing: raised as it is, the
        session kept."""
        if isinstance(e, NotStarted):
            raise e
        self.counters["infra_errors"] += 1
        log.warning("session %s (%s) %s failed, closing it: %s: %s", s.id, s.env_id, op, type(e).__name__, e)
        self._retire(s)
        info = {"error": f"{type(e).__name__}: {e}", "op": op, "env_id": s.env_id, "session_id": s.id}
        return env_pb2.StepResponse(outcome=Outcome.INFRA_ERROR.to_proto(), reward=0.0, info_json=json.dumps(info))

    async def _drive(self, s: Session, op: str, invalid: tuple[type[Exception], ...], fn, *args):
        """Run one episode-advancing backend call. Returns (StepResult, ms) or an INFRA_ERROR StepResponse."""
        if s.hint_policy:  # computed right after the call, in the same thread: the env is not thread-safe
            fn = functools.partial(hints.with_hint, s.env, s.hint_policy, s.hint_rng, fn)
        try:
            if s.env.nonblocking and (s.inflight is None or s.inflight.done()):
                # Pure in-memory backends (microseconds a call) run on the event loop: the hop through the worker
                # pool would cost ten times the call itself.
                t0 = time.perf_counter()
                r = fn(*args)
                ms = (time.perf_counter() - t0) * 1e3
            else:
                r, ms = await self.workers.run(fn, *args, timeout=self.cfg.step_timeout_s, session=s, timed=True,
                                               name=op)
            return check_result(r), ms
        except invalid as e:
            self.counters["action_errors"] += 1
            raise _Status(grpc.StatusCode.INVALID_ARGUMENT, f"{op}: {e}")
        except (BackendTimeout, Exception) as e:
            return self._crash(s, op, e)

    # ---- EnvService --------------------------------------------------------------------------------------------
    @_rpc
    async def CreateSession(self, request, context):
        with telemetry.server_span("envd.create_session", context, {"tars.env_id": request.env_id}):
            owner, ttl = peer_identity(context.peer()), self._ttl(request.lease_ttl_s)
            s = await self.create_keys.create(owner, request, lambda: self._open(
                request.env_id, dict(request.options), ttl, request.client_id, request.seed, owner=owner),
                self._lookup)
            return self._created(s)

    @_rpc
    async def Reset(self, request, context):
        with telemetry.server_span("envd.reset", context):
            return await self._reset(request)

    async def _reset(self, request):
        self._check_run(request.run_id)
        s = self._get(request.session_id)
        async with s.lock:
            self._alive(s)
            s.renew()
            options = hints.split_options(dict(request.options))[0]
            if SCREENSHOTS in options:
                self.counters["action_errors"] += 1
                raise _Status(grpc.StatusCode.INVALID_ARGUMENT, f"reset: {SCREENSHOTS} is a session option: give it "
                                                                "to CreateSession")
            if options:  # new limits take their share of the host budget before the sandbox gets them
                try:
                    need = s.env.resources(options)
                except ValueError as e:
                    self.counters["action_errors"] += 1
                    raise _Status(grpc.StatusCode.INVALID_ARGUMENT, f"reset: {e}")
                await self.admission.charge(need.most(s.charge), f"session {s.id}", s)
            # ValueError too: a reset fails on malformed options, which is the caller's fault, not an infra error.
            # Seed 0 means "the session's seed" (proto3 has no unset): CreateSession's seed, itself 0 by default.
            if s.hint_policy:  # an episode's hints follow from its seed, on a fresh session or a reused one
                s.hint_rng = hints.stream(s.hint_policy, s.env_id, request.seed or s.seed)
            try:
                out = await self._drive(s, "reset", (ValueError,), s.env.reset, request.seed or s.seed, options)
            except NotStarted:
                raise  # it never ran: the episode goes on
            except _Status:
                s.last = None  # a refused Reset may have ended the last episode: none runs until a Reset succeeds
                raise
            if isinstance(out, env_pb2.StepResponse):
                return out
            r, ms = out
            if options:
                await self.admission.charge(s.env.resources(), f"session {s.id}", s)  # what it now has: no more
            s.last, s.episodes = r, s.episodes + 1
            s.renew()
            self.counters["resets"] += 1
            return to_response(r, ms, s.lease_expires_unix_ms(), images=s.env.screenshots)

    @_rpc
    async def Step(self, request, context):
        with telemetry.server_span("envd.step", context) as sp:
            r = await self._step(request)
            if sp.is_recording():
                sp.set_attributes({"tars.step_ms": r.step_ms, "tars.outcome": int(r.outcome)})
            return r

    async def _step(self, request):
        self._check_run(request.run_id)
        s = self._get(request.session_id)
        if not request.action.type:
            raise _Status(grpc.StatusCode.INVALID_ARGUMENT, "action.type is empty")
        # Decoded once, here; a malformed action is answered like one the backend rejects, at the same point.
        try:
            action, malformed = Action.from_proto(request.action), None
        except ActionError as e:
            action, malformed = None, e
        async with s.lock:
            self._alive(s)
            if s.last is None:
                raise _Status(grpc.StatusCode.FAILED_PRECONDITION, f"session {s.id} has no episode: Reset it first")
            if s.episode_over:
                raise _Status(grpc.StatusCode.FAILED_PRECONDITION,
                              f"the episode of session {s.id} is over ({s.last.outcome}): Reset it first")
            s.renew()
            if malformed is not None:
                self.counters["action_errors"] += 1
                raise _Status(grpc.StatusCode.INVALID_ARGUMENT, f"step: {malformed}")
            out = await self._drive(s, "step", (ActionError,), s.env.step, action)
            if isinstance(out, env_pb2.StepResponse):
                return out
            r, ms = out
            s.last, s.steps = r, s.steps + 1
            s.renew()
            self.counters["steps"] += 1
            self.latency.add(ms)
            self.step_seconds.record(ms / 1e3)
            return to_response(r, ms, s.lease_expires_unix_ms(), images=s.env.screenshots)

    @_rpc
    async def Observe(self, request, context):
        self._check_run(request.run_id)
        s = self._get(request.session_id)
        async with s.lock:
            self._alive(s)
            s.renew()
            try:
                r, ms = await self.workers.run(s.env.observe, timeout=self.cfg.step_timeout_s, session=s, timed=True,
                                               name="observe")
                r = check_result(r)
            except NotImplementedError:
                # The backend cannot re-render: the last result is the current screen.
                if s.last is None:
                    raise _Status(grpc.StatusCode.FAILED_PRECONDITION, f"session {s.id} has no episode: Reset it first")
                r, ms = s.last, 0.0
            except ActionError as e:
                raise _Status(grpc.StatusCode.FAILED_PRECONDITION, f"observe: {e}")
            except (BackendTimeout, Exception) as e:
                return self._crash(s, "observe", e)
            # reward 0: looking again earns nothing; the reward was reported by the step that produced it.
            return to_response(r, ms, s.lease_expires_unix_ms(), reward=0.0, images=s.env.screenshots)

    @_rpc
    async def Close(self, request, context):
        self._check_run(request.run_id)
        s = self._get(request.session_id)
        self._retire(s)
        return env_pb2.CloseResponse()

    @_rpc
    async def Heartbeat(self, request, context):
        ttl = self._ttl(request.lease_ttl_s) if request.lease_ttl_s else 0.0
        alive, unknown = [], []
        for sid in request.session_ids:
            s = self._lookup(sid)
            if s is None:
                unknown.append(sid)
            else:
                s.renew(ttl)
                alive.append(sid)
        return env_pb2.HeartbeatResponse(alive=alive, unknown=unknown, run_id=self.run_id)

    @_rpc
    async def ListEnvs(self, request, context):
        # Listing may import backends (slow, blocking): off the event loop.
        ids = await self.workers.run(registry.list_env_ids, timeout=self.cfg.step_timeout_s)
        return env_pb2.ListEnvsResponse(env_ids=ids)

    async def Ping(self, request, context):
        # Deliberately bare (no wrapper, no locks): benchmarks use it as the raw RPC baseline.
        return env_pb2.PingResponse(payload=request.payload, run_id=self.run_id)
