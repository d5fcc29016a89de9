"""A compliance suite for envd backends, run over a real envd on port 0 (in the spirit of dm_env_rpc's suite).

A backend's test subclasses `EnvCompliance` under a `Test*` name and sets:
  env_id          the id to create, e.g. "builtin/click"
  valid_action    tars.v1.Action fields as a dict, or callable(observation: env_pb2.Observation) -> such a dict
  invalid_action  tars.v1.Action fields as a dict, for an action envd answers with INVALID_ARGUMENT
  options         CreateSession options (optional)
  max_episode_steps  valid steps after which an episode is expected to have ended (else the end test is skipped)

Also used by tests/test_envd.py for its server/client helpers (`envd_client`, `run`, `code_of`).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any, Callable

import grpc
import pytest

from envd.server import EnvServer
from core import rpc
from core.proc import wait_for
from core.config import EnvdConfig
from core.v1 import common_pb2, env_pb2, env_pb2_grpc

ENDED = (common_pb2.TERMINATED, common_pb2.TRUNCATED)
VALID_OUTCOMES = (common_pb2.RUNNING, *ENDED)
DEADLINE = 10.0  # every test RPC has one; a hung daemon fails the test instead of hanging it


def run(coro, timeout: float = 60.0):
    """Run one async test body on a fresh loop (pytest-asyncio is not a dependency)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def occupy_pid(pid: int) -> subprocess.Popen | None:
    """A host 'sleep 60' in a session of its own given the freed number `pid` (ns_last_pid: root only), or None when
    that cannot be arranged (not root, or the number went to another process first): a stand-in for whatever host
    process gets a freed pid next. The caller kills it."""
    try:
        for _ in range(50):
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
            victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
            if victim.pid == pid:
                return victim
            victim.kill()
            victim.wait()
    except OSError:
        pass
    return None


def assert_untouched(victim: subprocess.Popen | None, wait_s: float = 0.2) -> None:
    """The host process occupy_pid gave a freed number still runs after wait_s (nothing signalled it); no-op when
    there is none."""
    if victim is None:
        return
    try:
        code = victim.wait(wait_s)
    except subprocess.TimeoutExpired:
        return
    raise AssertionError(f"a host process given a freed pid was signalled (exit {code})")


def release(victim: subprocess.Popen | None) -> None:
    """End the host process occupy_pid started, if any."""
    if victim is not None:
        victim.kill()
        victim.wait()


def _fork(ref: env_pb2.SessionRef) -> env_pb2.ForkRequest:
    return env_pb2.ForkRequest(session_id=ref.session_id, run_id=ref.run_id)


def code_of(e: BaseException) -> grpc.StatusCode | None:
    return e.code() if isinstance(e, grpc.aio.AioRpcError) else None


def dir_left_by_a_killed_daemon(setup: str, timeout_s: float = 120.0) -> pathlib.Path:
    """Run `setup` (Python that binds `path`: a session's private directory) in a child process that then SIGKILLs
    itself, as a killed envd dies: nothing is closed. Returns the path once no process names it any more (the
    session's programs die with their parent)."""
    from envd import proctree

    repo = pathlib.Path(__file__).resolve().parents[1]
    code = f"import os, signal\n{setup}\nprint(path, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)"
    p = subprocess.run([sys.executable, "-c", code], cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)},
                       capture_output=True, text=True, timeout=timeout_s)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    path = pathlib.Path(p.stdout.strip().splitlines()[-1])
    wait_for(lambda: not proctree.mentioning(str(path)), 20, f"the killed daemon's programs naming {path} to end",
             every=0.05)
    return path


async def until(pred, what: str, timeout: float = 10.0, every: float = 0.02) -> None:
    """core.proc.wait_for inside a coroutine: poll pred() without blocking the loop; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(every)


async def expect_code(code: grpc.StatusCode, awaitable) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await awaitable
    assert ei.value.code() == code, f"expected {code}, got {ei.value.code()}: {ei.value.details()}"
    return ei.value


class Client:
    """A connected EnvService stub plus the in-process server behind it."""

    def __init__(self, server: EnvServer, channel: grpc.aio.Channel):
        self.server, self.channel = server, channel
        self.stub = env_pb2_grpc.EnvServiceStub(channel)
        self.run_id = server.run_id

    def __getattr__(self, name: str):
        # client.Step(req) == stub.Step(req, timeout=DEADLINE)
        method = getattr(self.stub, name)
        return lambda req, **kw: method(req, timeout=kw.pop("timeout", DEADLINE), **kw)


@contextlib.asynccontextmanager
async def envd_client(cfg: EnvdConfig | None = None, **overrides: Any):
    """Start an EnvServer on 127.0.0.1:0, yield a Client, stop the server on exit."""
    cfg = dataclasses.replace(cfg or EnvdConfig(), host="127.0.0.1", port=0, **overrides)
    server = EnvServer(cfg)
    await server.start()
    channel = rpc.channel(server.address, cfg.auth_token)
    try:
        yield Client(server, channel)
    finally:
        await channel.close()
        await server.stop(grace=0.2)


class EnvCompliance:
    env_id: str = ""
    options: dict[str, str] = {}
    valid_action: dict | Callable[[env_pb2.Observation], dict] | None = None
    invalid_action: dict | None = None
    max_episode_steps: int = 50
    seed: int = 7

    # ---- helpers ------------------------------------------------------------------------------------------------
    def action(self, obs: env_pb2.Observation) -> env_pb2.Action:
        a = self.valid_action(obs) if callable(self.valid_action) else self.valid_action
        assert a, "set valid_action on the compliance subclass"
        return env_pb2.Action(**a)

    envd_overrides: dict = {}   # envd settings a backend needs

    def client(self, **overrides):
        return envd_client(gc_interval_s=0.05, **{**self.envd_overrides, **overrides})

    async def create(self, c: Client, **kw) -> str:
        r = await c.CreateSession(env_pb2.CreateSessionRequest(env_id=self.env_id, options=self.options,
                                                               seed=self.seed, **kw))
        assert r.session_id and r.run_id == c.run_id
        return r.session_id

    async def reset(self, c: Client, sid: str, seed: int | None = None) -> env_pb2.StepResponse:
        r = await c.Reset(env_pb2.ResetRequest(session_id=sid, seed=self.seed if seed is None else seed,
                                               options=self.options, run_id=c.run_id))
        assert r.outcome == common_pb2.RUNNING, f"reset gave {common_pb2.Outcome.Name(r.outcome)}: {r.info_json}"
        return r

    async def step(self, c: Client, sid: str, obs: env_pb2.Observation) -> env_pb2.StepResponse:
        r = await c.Step(env_pb2.StepRequest(session_id=sid, action=self.action(obs), run_id=c.run_id))
        self.check_response(r)
        return r

    @staticmethod
    def check_response(r: env_pb2.StepResponse) -> None:
        assert r.outcome in VALID_OUTCOMES, f"outcome {common_pb2.Outcome.Name(r.outcome)}: {r.info_json}"
        assert math.isfinite(r.reward)
        assert r.step_ms >= 0 and r.lease_expires_unix_ms > 0
        if r.info_json:
            assert isinstance(json.loads(r.info_json), dict)
        assert r.observation.text or r.observation.images, "an observation must have text or a screenshot"
        for im in r.observation.images:
            assert im.sha256 == hashlib.sha256(im.data).hexdigest() and im.mime

    async def run_episode(self, c: Client, sid: str) -> list[env_pb2.StepResponse]:
        out = [await self.reset(c, sid)]
        while out[-1].outcome == common_pb2.RUNNING and len(out) <= self.max_episode_steps:
            out.append(await self.step(c, sid, out[-1].observation))
        return out

    # ---- the suite ----------------------------------------------------------------------------------------------
    def test_list_envs(self):
        async def body():
            async with self.client() as c:
                ids = (await c.ListEnvs(env_pb2.ListEnvsRequest())).env_ids
                assert any(self.env_id == e or self.env_id.startswith(e + "/") for e in ids), ids
        run(body())

    def test_reset_step_observe_close(self):
        async def body():
            async with self.client() as c:
                sid = await self.create(c)
                r0 = await self.reset(c, sid)
                self.check_response(r0)
                r1 = await self.step(c, sid, r0.observation)
                seen = await c.Observe(env_pb2.SessionRef(session_id=sid, run_id=c.run_id))
                assert seen.observation.text == r1.observation.text and seen.reward == 0.0
                await c.Close(env_pb2.SessionRef(session_id=sid))
                await expect_code(grpc.StatusCode.NOT_FOUND, c.Step(env_pb2.StepRequest(
                    session_id=sid, action=self.action(r0.observation))))
                await expect_code(grpc.StatusCode.NOT_FOUND, c.Close(env_pb2.SessionRef(session_id=sid)))
        run(body())

    def test_lease_expiry(self):
        async def body():
            async with self.client() as c:
                sid = await self.create(c, lease_ttl_s=0.2)
                await asyncio.sleep(0.5)
                await expect_code(grpc.StatusCode.NOT_FOUND, c.Reset(env_pb2.ResetRequest(session_id=sid)))
                hb = await c.Heartbeat(env_pb2.HeartbeatRequest(session_ids=[sid]))
                assert list(hb.unknown) == [sid] and not hb.alive and hb.run_id == c.run_id
        run(body())

    def test_heartbeat_keeps_alive(self):
        async def body():
            async with self.client() as c:
                # 3 s in all, twice the 1.5 s lease. (A 0.4 s lease failed on a loaded host: one stall between two
                # heartbeats longer than the lease lets it expire, as it should.)
                sid = await self.create(c, lease_ttl_s=1.5)
                for _ in range(20):
                    hb = await c.Heartbeat(env_pb2.HeartbeatRequest(session_ids=[sid, "no-such-session"]))
                    assert list(hb.alive) == [sid], "the heartbeats did not keep the session alive"
                    assert list(hb.unknown) == ["no-such-session"]
                    await asyncio.sleep(0.15)
                await self.reset(c, sid)
        run(body())

    def test_invalid_action_keeps_session(self):
        async def body():
            async with self.client() as c:
                sid = await self.create(c)
                r0 = await self.reset(c, sid)
                await expect_code(grpc.StatusCode.INVALID_ARGUMENT, c.Step(env_pb2.StepRequest(
                    session_id=sid, action=env_pb2.Action(**self.invalid_action))))
                await expect_code(grpc.StatusCode.INVALID_ARGUMENT, c.Step(env_pb2.StepRequest(
                    session_id=sid, action=env_pb2.Action())))
                await self.step(c, sid, r0.observation)
        run(body())

    def test_unknown_session_and_env(self):
        async def body():
            async with self.client() as c:
                ref = env_pb2.SessionRef(session_id="no-such-session")
                for call in (c.Observe(ref), c.Close(ref), c.Snapshot(ref), c.Fork(_fork(ref)),
                             c.Reset(env_pb2.ResetRequest(session_id="no-such-session")),
                             c.Step(env_pb2.StepRequest(session_id="no-such-session", action=env_pb2.Action(type="wait"))),
                             c.CreateSession(env_pb2.CreateSessionRequest(env_id="no-such-backend/x"))):
                    await expect_code(grpc.StatusCode.NOT_FOUND, call)
        run(body())

    def test_concurrent_sessions(self, n: int = 16):
        async def one(c: Client) -> int:
            sid = await self.create(c)
            r = await self.reset(c, sid)
            steps = 0
            while r.outcome == common_pb2.RUNNING and steps < 3:
                r = await self.step(c, sid, r.observation)
                steps += 1
            await c.Close(env_pb2.SessionRef(session_id=sid, run_id=c.run_id))
            return steps

        async def body():
            async with self.client() as c:
                steps = await asyncio.gather(*(one(c) for _ in range(n)))
                assert all(s >= 1 for s in steps)
                assert not c.server.servicer.sessions
        run(body())

    def test_outcome_labels(self):
        async def body():
            async with self.client() as c:
                sid = await self.create(c)
                for r in await self.run_episode(c, sid):
                    self.check_response(r)
        run(body())

    def test_step_after_episode_end(self):
        async def body():
            async with self.client() as c:
                sid = await self.create(c)
                last = (await self.run_episode(c, sid))[-1]
                if last.outcome == common_pb2.RUNNING:
                    pytest.skip(f"{self.env_id}: no episode end within {self.max_episode_steps} valid steps")
                await expect_code(grpc.StatusCode.FAILED_PRECONDITION, c.Step(env_pb2.StepRequest(
                    session_id=sid, action=self.action(last.observation))))
                r = await self.reset(c, sid)  # a reset starts a new episode on the same session
                await self.step(c, sid, r.observation)
        run(body())

    def test_snapshot_restore(self):
        async def body():
            async with self.client() as c:
                sid = await self.create(c)
                r0 = await self.reset(c, sid)
                ref = env_pb2.SessionRef(session_id=sid, run_id=c.run_id)
                try:
                    snap = await c.Snapshot(ref)
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.UNIMPLEMENTED, e
                    await expect_code(grpc.StatusCode.UNIMPLEMENTED, c.Fork(_fork(ref)))
                    assert list(c.server.servicer.sessions) == [sid]  # failed forks leave nothing behind
                    return
                assert snap.env_id == self.env_id
                restored = await c.Restore(env_pb2.RestoreRequest(env_id=self.env_id, state=snap.state))
                forked = await c.Fork(_fork(ref))
                want = (await c.Observe(ref)).observation
                for other in (restored.session_id, forked.session_id):
                    assert other != sid
                    got = (await c.Observe(env_pb2.SessionRef(session_id=other))).observation
                    assert (got.text, got.instruction, got.step) == (want.text, want.instruction, want.step)
                    await self.step(c, other, got)  # the copy is a live session
                await self.step(c, sid, r0.observation)  # and the original is untouched
        run(body())
