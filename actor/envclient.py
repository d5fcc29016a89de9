"""Async EnvService client for the actor: deadlines on every call, retries with backoff, restart detection."""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, replace

import grpc

from core import rpc
from core.action import Action
from core.outcome import Outcome
from core.v1 import env_pb2, env_pb2_grpc


class EnvInfraError(RuntimeError):
    """The environment broke (daemon down, restarted, session lost): the episode is infra_error."""


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


def _obs(r: env_pb2.StepResponse) -> Obs:
    o = r.observation
    return Obs(o.text, o.instruction, r.reward, Outcome.from_proto(r.outcome), list(o.images), r.info_json, r.step_ms,
               max(0, o.width), max(0, o.height))


class EnvClient:
    """One envd daemon. An episode keeps its session on the daemon that created it (sessions are stateful)."""

    def __init__(self, address: str, auth_token: str = "", timeout_s: float = 30.0, retries: int = 3):
        self.address, self.timeout_s, self.retries = address, timeout_s, retries
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
                retry = code in rpc.RETRYABLE and (idempotent or code == grpc.StatusCode.RESOURCE_EXHAUSTED)
                if not retry or attempt == self.retries:
                    raise EnvInfraError(f"envd {self.address}: {code.name}: {e.details()}") from None
                await asyncio.sleep(delay * (1 + random.random()))
                delay *= 2
            finally:
                self.inflight -= 1

    async def create(self, env_id: str, seed: int, options: dict[str, str]) -> tuple[str, str]:
        r = await self._call(self.stub.CreateSession, env_pb2.CreateSessionRequest(env_id=env_id, seed=seed, options=options), True)
        return r.session_id, r.run_id

    async def reset(self, sid: str, run_id: str, seed: int) -> Obs:
        return _obs(await self._call(self.stub.Reset, env_pb2.ResetRequest(session_id=sid, seed=seed, run_id=run_id), True))

    async def step(self, sid: str, run_id: str, action: Action, raw: str = "") -> Obs:
        """Step with `action`; `raw` (the model's whole answer) replaces the action's own text for envd's logs."""
        a = (replace(action, raw=raw) if raw else action).to_proto()
        return _obs(await self._call(self.stub.Step, env_pb2.StepRequest(session_id=sid, action=a, run_id=run_id), False))

    async def close_session(self, sid: str) -> None:
        try:
            await self.stub.Close(env_pb2.SessionRef(session_id=sid), timeout=min(5.0, self.timeout_s))
        except grpc.aio.AioRpcError:
            pass  # the lease collects what we could not close

    async def close(self) -> None:
        await self.channel.close()
