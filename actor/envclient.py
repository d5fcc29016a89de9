"""Async EnvService client for the actor: deadlines on every call, retries with backoff, restart detection, and idle
sessions kept for reuse.

Session reuse (actor.keep_sessions = N > 0): an episode that ended cleanly gives its session back instead of closing
it; the next episode of the same env id and options resets it with its own seed instead of creating a session. For
a browser that saves its start (~1 s of CPU for MiniWoB's Chromium against ~0.1 s for a reset). At most N idle
sessions are kept (the oldest closed first), each for at most `idle_s` (the actor and `tars eval` use half of
envd.lease_ttl_s: a lease only a step, reset or heartbeat renews); one whose reset fails (lease gone, daemon restarted) is closed and a new one created.
A session whose episode ended in an error or was cancelled is never reused."""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from dataclasses import dataclass, replace

import grpc

from core import rpc
from core.action import Action
from core.outcome import Outcome
from core.v1 import env_pb2, env_pb2_grpc


class EnvInfraError(RuntimeError):
    """The environment broke (daemon down, restarted, session lost): the episode is infra_error."""


class EnvBackendError(EnvInfraError):
    """envd answered a Reset INFRA_ERROR: the session's backend broke (envd closed the session), not the daemon."""


class EnvActionError(ValueError):
    """envd rejected the action (INVALID_ARGUMENT); the session still works."""


@dataclass
class Obs:
    text: str
    instruction: str
    reward: float
    outcome: Outcome
    images: list          # common_pb2.Image
    info_json: str
    step_ms: float
    width: int = 0        # the screen size coordinates refer to (0 = the env did not say)
    height: int = 0

    @property
    def success(self) -> bool:
        """The env's own verdict (info["success"]); False when it gives none or the info cannot be read."""
        try:
            return bool(json.loads(self.info_json or "{}").get("success", False))
        except (ValueError, AttributeError):
            return False


def _started(obs: Obs) -> Obs:
    """A Reset's observation, or EnvBackendError when envd reports that the backend broke during it (its answer
    then has no observation, and the session is gone): no episode may run on it."""
    if obs.outcome == Outcome.INFRA_ERROR:
        raise EnvBackendError(f"reset: the environment broke: {obs.info_json[:400]}")
    return obs


def _obs(r: env_pb2.StepResponse) -> Obs:
    o = r.observation
    return Obs(o.text, o.instruction, r.reward, Outcome.from_proto(r.outcome), list(o.images), r.info_json, r.step_ms,
               max(0, o.width), max(0, o.height))


class EnvClient:
    """One envd daemon. An episode keeps its session on the daemon that created it (sessions are stateful)."""

    def __init__(self, address: str, auth_token: str = "", timeout_s: float = 30.0, retries: int = 3,
                 keep_sessions: int = 0, idle_s: float = 20.0, lease_ttl_s: float = 60.0):
        self.address, self.timeout_s, self.retries = address, timeout_s, retries
        self.keep_sessions, self.idle_s, self.lease_ttl_s = keep_sessions, idle_s, lease_ttl_s
        self._idle: list[tuple[tuple, str, str, float]] = []   # (env id and options, session, run, since), oldest first
        self.created = self.reused = 0   # sessions this client created, and episodes that reused a kept one
        self.channel = rpc.channel(address, auth_token)
        self.stub = env_pb2_grpc.EnvServiceStub(self.channel)
        self.inflight = 0
        self.down_until = 0.0     # monotonic time before which new episodes avoid this daemon (it failed us)

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self.down_until

    def mark_down(self, cooldown_s: float = 2.0) -> None:
        self.down_until = time.monotonic() + cooldown_s

    async def _call(self, method, request, idempotent: bool):
        delay = 0.05
        for attempt in range(self.retries + 1):
            try:
                self.inflight += 1
                return await method(request, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise EnvActionError(e.details()) from None
                # A Step is not idempotent: retrying it after the daemon may have applied it would double-step.
                # gRPC itself answers UNAVAILABLE (a dropped connection) and RESOURCE_EXHAUSTED (a response over the
                # size limit) after the handler ran; only ABORTED, which gRPC never makes and envd sends for a call
                # it did not start (envd/sessions.py Workers.run), says for certain that nothing was applied.
                retry = code in rpc.RETRYABLE and (idempotent or code == grpc.StatusCode.ABORTED)
                if not retry or attempt == self.retries:
                    raise EnvInfraError(f"envd {self.address}: {code.name}: {e.details()}") from None
                await asyncio.sleep(delay * (1 + random.random()))
                delay *= 2
            finally:
                self.inflight -= 1

    async def create(self, env_id: str, seed: int, options: dict[str, str]) -> tuple[str, str]:
        # One request id for this create, sent unchanged by every retry of it: a retry whose first attempt made a
        # session whose answer was lost (a reset connection) gets that session, not a second one (envd/idempotency.py).
        req = env_pb2.CreateSessionRequest(env_id=env_id, seed=seed, options=options, request_id=uuid.uuid4().hex)
        r = await self._call(self.stub.CreateSession, req, True)
        return r.session_id, r.run_id

    async def reset(self, sid: str, run_id: str, seed: int) -> Obs:
        return _obs(await self._call(self.stub.Reset, env_pb2.ResetRequest(session_id=sid, seed=seed, run_id=run_id), True))

    async def step(self, sid: str, run_id: str, action: Action, raw: str = "") -> Obs:
        """Step with `action`; `raw` (the model's whole answer) replaces the action's own text for envd's logs."""
        a = (replace(action, raw=raw) if raw else action).to_proto()
        return _obs(await self._call(self.stub.Step, env_pb2.StepRequest(session_id=sid, action=a, run_id=run_id), False))

    # Snapshot, Restore and Fork: branch an episode's state (search over actions, replaying a prefix, several
    # continuations of one page). Restore and Fork make a session, so each carries a request id that its retries
    # repeat, as create's does: a retry after a lost answer gets the session the first attempt made.
    async def snapshot(self, sid: str, run_id: str) -> bytes:
        """The session's state, sealed by the daemon (envd/snapshots.py): restore takes it back on that daemon, or on
        one sharing its envd.snapshot_key. A backend without snapshots (UNIMPLEMENTED) is an EnvInfraError."""
        return (await self._call(self.stub.Snapshot, env_pb2.SessionRef(session_id=sid, run_id=run_id), True)).state

    async def restore(self, env_id: str, state: bytes) -> tuple[str, str]:
        """A new session of `env_id` in the state `snapshot` returned -> (session id, run id). A state that is not
        the daemon's (forged, another env id) is an EnvActionError (INVALID_ARGUMENT)."""
        req = env_pb2.RestoreRequest(env_id=env_id, state=state, request_id=uuid.uuid4().hex)
        r = await self._call(self.stub.Restore, req, True)
        self.created += 1
        return r.session_id, r.run_id

    async def fork(self, sid: str, run_id: str) -> tuple[str, str]:
        """A new session in `sid`'s current state (snapshot and restore in one call on the daemon) -> (session id,
        run id). Close it like any other (close_session, or release)."""
        req = env_pb2.ForkRequest(session_id=sid, run_id=run_id, request_id=uuid.uuid4().hex)
        r = await self._call(self.stub.Fork, req, True)
        self.created += 1
        return r.session_id, r.run_id

    async def observe(self, sid: str, run_id: str) -> Obs:
        """The session's current observation, without acting."""
        return _obs(await self._call(self.stub.Observe, env_pb2.SessionRef(session_id=sid, run_id=run_id), True))

    async def open(self, env_id: str, seed: int, options: dict[str, str]) -> tuple[str, str, Obs]:
        """A session of `env_id` reset to `seed`: an idle one kept by `release` when there is one, else a new one."""
        key = (env_id, tuple(sorted(options.items())))
        now = time.monotonic()
        for k, (kk, sid, run_id, since) in reversed(list(enumerate(self._idle))):
            if kk != key or now - since > self.idle_s:
                continue
            del self._idle[k]
            try:
                obs = _started(await self.reset(sid, run_id, seed))
                self.reused += 1
                return sid, run_id, obs
            except (EnvInfraError, EnvActionError):   # its lease ran out, the daemon restarted, its backend broke
                # while it was idle: start a new one
                await self.close_session(sid)
            except BaseException:   # cancelled (an actor stopping): taken from the pool, so closed here or leaked
                await self.close_session(sid)
                raise
            break
        await self._expire()
        sid, run_id = await self.create(env_id, seed, options)
        self.created += 1
        try:
            return sid, run_id, _started(await self.reset(sid, run_id, seed))
        except BaseException:
            await self.close_session(sid)
            raise

    async def release(self, sid: str, run_id: str, env_id: str, options: dict[str, str], reuse: bool) -> None:
        """The end of an episode's use of a session: kept idle for the next `open` when `reuse` (the episode ended
        cleanly) and keep_sessions allows, else closed."""
        if not (reuse and self.keep_sessions > 0):
            await self.close_session(sid)
            return
        self._idle.append(((env_id, tuple(sorted(options.items()))), sid, run_id, time.monotonic()))
        await self._expire()

    async def _expire(self) -> None:
        now = time.monotonic()
        old = [e for i, e in enumerate(self._idle) if now - e[3] > self.idle_s or i < len(self._idle) - self.keep_sessions]
        if old:
            self._idle = [e for e in self._idle if e not in old]
            await asyncio.gather(*(self.close_session(e[1]) for e in old))

    @contextlib.asynccontextmanager
    async def keepalive(self, sid: str):
        """Renew `sid`'s lease (every lease_ttl_s / 3) while the caller waits on something else, e.g. a generate
        that outlasts the lease while inference restarts: only a step, a reset or a heartbeat renews it, and a
        session lost to its lease then would be a healthy episode thrown away and its daemon blamed."""
        async def beat():
            while True:
                await asyncio.sleep(self.lease_ttl_s / 3)
                try:
                    await self.stub.Heartbeat(env_pb2.HeartbeatRequest(session_ids=[sid]),
                                              timeout=min(5.0, self.timeout_s))
                except grpc.aio.AioRpcError:
                    pass  # the next step says whether the session is gone

        task = asyncio.create_task(beat())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def close_session(self, sid: str) -> None:
        try:
            await self.stub.Close(env_pb2.SessionRef(session_id=sid), timeout=min(5.0, self.timeout_s))
        except grpc.aio.AioRpcError:
            pass  # the lease collects what we could not close

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        await asyncio.gather(*(self.close_session(e[1]) for e in idle))
        await self.channel.close()


class RecordingEnv:
    """An EnvClient for one episode (what actor.episode uses of it) that keeps the last observation it returned
    (`obs`: its info, its screenshot): `tars eval` reads the final info, a demonstrator the hint in each one."""

    def __init__(self, env: EnvClient):
        self.env, self.obs = env, None

    async def open(self, *a):
        sid, run_id, self.obs = await self.env.open(*a)
        return sid, run_id, self.obs

    async def step(self, *a, **kw):
        self.obs = await self.env.step(*a, **kw)
        return self.obs

    async def release(self, *a, **kw):
        await self.env.release(*a, **kw)

    def keepalive(self, sid: str):
        return self.env.keepalive(sid)
