"""envd hands out sealed snapshots and restores only what it sealed (envd/snapshots.py).

A backend's snapshot is state its restore trusts (an episode's `success`, its step limit, a sandbox's limits): a
client that edits one, or writes one from scratch, is refused INVALID_ARGUMENT before the backend sees it; a daemon
with the same envd.snapshot_key restores another's snapshot, one with another key does not."""
from __future__ import annotations

import asyncio
import json
import threading

import grpc
import pytest

from core.v1 import common_pb2, env_pb2
from envd import registry
from envd.base import Env, Resources, StepResult
from envd.snapshots import MAGIC, SnapshotSeal
from envd_compliance import envd_client, until

HEAD = len(MAGIC) + 32


async def _snapshot(c) -> bytes:
    sid = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id="builtin/click", seed=1))).session_id
    await c.Reset(env_pb2.ResetRequest(session_id=sid, seed=1, run_id=c.run_id))
    return (await c.Snapshot(env_pb2.SessionRef(session_id=sid, run_id=c.run_id))).state


async def _restore(c, state: bytes):
    r = await c.Restore(env_pb2.RestoreRequest(env_id="builtin/click", state=state))
    return await c.Observe(env_pb2.SessionRef(session_id=r.session_id, run_id=c.run_id))


async def _refused(c, state: bytes) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _restore(c, state)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    return e.value.details()


def test_an_edited_or_made_up_snapshot_is_refused_and_a_sealed_one_restores():
    async def main():
        async with envd_client() as c:
            snap = await _snapshot(c)
            assert snap.startswith(MAGIC)
            obs = await _restore(c, snap)  # the daemon's own snapshot: a live, unfinished episode
            assert obs.outcome == common_pb2.Outcome.Value("RUNNING"), obs
            state = json.loads(snap[HEAD:])
            state["screen"]["done"] = state["screen"]["success"] = True  # "won" without a step
            state["max_steps"] = 10**9
            forged = json.dumps(state).encode()
            assert "seal does not match" in await _refused(c, snap[:HEAD] + forged)   # old seal, new state
            assert "no sealed header" in await _refused(c, forged)                    # no seal at all
            assert "seal does not match" in await _refused(c, SnapshotSeal(b"guess").seal("builtin/click", forged))
            with pytest.raises(grpc.aio.AioRpcError) as e:  # the state of one env restored as another
                await c.Restore(env_pb2.RestoreRequest(env_id="builtin/form", state=snap))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "builtin/form" in e.value.details()
            assert "no sealed header" in await _refused(c, b"")
            sessions = len(c.server.servicer.sessions)
        return sessions

    assert asyncio.run(main()) == 2  # the original and the one honest restore; refusals leave nothing behind


def test_daemons_with_one_snapshot_key_restore_each_others_snapshots():
    async def main():
        async with envd_client(snapshot_key="shared") as a:
            snap = await _snapshot(a)
        async with envd_client(snapshot_key="shared") as b:  # another daemon (or this one restarted), same key
            assert (await _restore(b, snap)).outcome == common_pb2.Outcome.Value("RUNNING")
        async with envd_client(snapshot_key="other") as c:
            assert "seal does not match" in await _refused(c, snap)
        async with envd_client() as d:  # no key set: a random one, so only its own snapshots
            assert "seal does not match" in await _refused(d, snap)

    asyncio.run(main())


class StuckEnv(Env):
    """A backend whose snapshot and restore block until the test lets them go; everything else is instant."""
    action_space = "wait"

    made: list["StuckEnv"] = []

    def __init__(self, name: str, options: dict[str, str]):
        self.release, self.closed = threading.Event(), threading.Event()
        StuckEnv.made.append(self)

    def resources(self, options=None) -> Resources:
        return Resources(10, 100)

    def reset(self, seed: int, options: dict[str, str]) -> StepResult:
        return StepResult(text="ok")

    def step(self, action) -> StepResult:
        return StepResult(text="ok")

    def snapshot(self) -> bytes:
        self.release.wait(30)
        return b"state"

    def restore(self, state: bytes) -> StepResult:
        self.release.wait(30)
        return StepResult(text="restored")

    def close(self) -> None:
        self.closed.set()


registry.register("test-stuck", StuckEnv)


def test_a_snapshot_that_hangs_retires_its_session():
    """A Snapshot past step_timeout_s answered INTERNAL but left the session registered with its call in flight:
    busy for as long as the backend hung, so the lease GC never collected it and its cap slot and budget were held
    for good. It is now retired like a session whose step hangs."""
    async def main():
        async with envd_client(step_timeout_s=0.3, gc_interval_s=0.05, lease_ttl_s=1.0) as c:
            sid = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id="test-stuck"))).session_id
            await c.Reset(env_pb2.ResetRequest(session_id=sid))
            env = c.server.servicer.sessions[sid].env
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.Snapshot(env_pb2.SessionRef(session_id=sid))
            assert e.value.code() == grpc.StatusCode.INTERNAL
            assert sid not in c.server.servicer.sessions
            assert (await c.Heartbeat(env_pb2.HeartbeatRequest(session_ids=[sid]))).unknown == [sid]
            env.release.set()   # the stuck call returns: the env is closed then, and its budget given back
            await until(lambda: env.closed.is_set() and not c.server.servicer.budget.used.pids,
                         "the env closed and its budget given back")

    asyncio.run(main())


def test_a_cancelled_fork_leaves_no_session_behind():
    """A Fork (or Restore) whose client gave up while the backend restored skipped the cleanup, which caught only
    Exceptions: the new session, whose id nobody got, held its slot, budget and sandbox until its lease ran out
    (the source's, up to 7 days). It is now retired on any exit, a cancelled RPC included."""
    async def main():
        async with envd_client(step_timeout_s=10) as c:
            sv = c.server.servicer
            src = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id="test-stuck",
                                                                      lease_ttl_s=7 * 24 * 3600))).session_id
            await c.Reset(env_pb2.ResetRequest(session_id=src))
            sv.sessions[src].env.release.set()  # the source snapshots at once; the fork's restore blocks
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.Fork(env_pb2.ForkRequest(session_id=src), timeout=0.5)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await until(lambda: list(sv.sessions) == [src], "the fork nobody got to be retired")
            for env in StuckEnv.made:
                env.release.set()
            fork = StuckEnv.made[-1]
            await until(lambda: fork.closed.is_set(), "the fork's env to be closed")
            assert (await c.Observe(env_pb2.SessionRef(session_id=src))).observation.text == "ok"

    asyncio.run(main())
