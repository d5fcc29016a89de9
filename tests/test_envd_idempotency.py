"""CreateSession idempotency keys (envd/idempotency.py): a retried create gets the session its first attempt made."""
from __future__ import annotations

import asyncio
import gc
import weakref
import time

import grpc
import pytest

from actor.envclient import EnvClient
from envd import registry
from envd.base import Env, StepResult
from envd.idempotency import MAX_KEY_LEN, CreateKeys
from envd_compliance import envd_client, run
from core.v1 import env_pb2


class SlowMakeEnv(Env):
    """Takes options["make_s"] seconds to create (a browser starting); counts what exists."""
    made: list["SlowMakeEnv"] = []
    action_space = "wait"

    def __init__(self, name: str, options: dict[str, str]):
        if name == "broken":
            raise RuntimeError("cannot start the browser")
        time.sleep(float(options.get("make_s", "0")))
        SlowMakeEnv.made.append(self)

    def reset(self, seed, options):
        return StepResult(text="x")

    def step(self, action):
        return StepResult(text="x")

    def close(self):
        pass


registry.register("test-slowmake", SlowMakeEnv)


class SlowSnapEnv(SlowMakeEnv):
    """SlowMakeEnv with snapshots; "slow" takes 0.6 s to make however it is made (a restored session has no options
    of its own to say so)."""

    def __init__(self, name: str, options: dict[str, str]):
        super().__init__(name, {**options, "make_s": "0.6"} if name == "slow" else options)

    def snapshot(self) -> bytes:
        return b"state"

    def restore(self, state: bytes) -> StepResult:
        return StepResult(text="x")


registry.register("test-slowsnap", SlowSnapEnv)


async def _lossy_proxy(target: str, lose_after_s: float):
    """A TCP proxy whose first connection is reset instead of carrying the server's bytes sent more than
    `lose_after_s` after it opened: an answer lost after envd did the work (a NAT or proxy dropping the connection)."""
    seen = [0]

    async def handle(cr, cw):
        seen[0] += 1
        first, t0 = seen[0] == 1, time.monotonic()
        host, port = target.rsplit(":", 1)
        sr, sw = await asyncio.open_connection(host, int(port))

        async def pump(r, w, from_server):
            try:
                while data := await r.read(65536):
                    if first and from_server and time.monotonic() - t0 > lose_after_s:
                        cw.transport.abort()
                        sw.transport.abort()
                        return
                    w.write(data)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                w.close()

        await asyncio.gather(pump(cr, sw, False), pump(sr, cw, True))

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, f"127.0.0.1:{srv.sockets[0].getsockname()[1]}"


def test_a_create_whose_answer_was_lost_gets_the_same_session_on_retry():
    # The answer of the first CreateSession is lost (connection reset after envd created the session); the actor's
    # client retries (UNAVAILABLE). Before: the retry built a second backend, the first held for its whole lease.
    async def body():
        SlowMakeEnv.made.clear()
        async with envd_client(lease_ttl_s=60.0) as c:
            srv, addr = await _lossy_proxy(c.server.address, 0.3)
            ec = EnvClient(addr, timeout_s=10.0, retries=3)
            try:
                sid, _ = await ec.create("test-slowmake/a", 0, {"make_s": "0.6"})
                sessions = c.server.servicer.sessions
                assert list(sessions) == [sid]
                assert len(SlowMakeEnv.made) == 1
            finally:
                await ec.close()
                srv.close()
    run(body())


@pytest.mark.parametrize("call", ["fork", "restore"])
def test_a_fork_or_restore_whose_answer_was_lost_gets_the_same_session_on_retry(call):
    # As for a create: the EnvClient's retry repeats the request id, so envd answers with the session its first
    # attempt made instead of making (and holding for a lease) a second one.
    async def body():
        SlowMakeEnv.made.clear()
        async with envd_client(lease_ttl_s=60.0) as c:
            src = await c.CreateSession(env_pb2.CreateSessionRequest(env_id="test-slowsnap/slow"), timeout=10)
            state = (await c.Snapshot(env_pb2.SessionRef(session_id=src.session_id), timeout=10)).state
            srv, addr = await _lossy_proxy(c.server.address, 0.3)
            ec = EnvClient(addr, timeout_s=10.0, retries=3)
            try:
                if call == "fork":
                    sid, _ = await ec.fork(src.session_id, src.run_id)
                else:
                    sid, _ = await ec.restore("test-slowsnap/slow", state)
                assert set(c.server.servicer.sessions) == {src.session_id, sid}
                assert len(SlowMakeEnv.made) == 2
            finally:
                await ec.close()
                srv.close()
    run(body())


def test_same_request_id_same_session_other_id_new_session_no_id_as_before():
    async def body():
        SlowMakeEnv.made.clear()
        async with envd_client() as c:
            def create(rid, **kw):
                return c.CreateSession(env_pb2.CreateSessionRequest(env_id="test-slowmake/a", request_id=rid, **kw),
                                       timeout=10)
            a = await create("k1")
            assert (await create("k1")).session_id == a.session_id
            assert len(SlowMakeEnv.made) == 1
            b = await create("k2")
            assert b.session_id != a.session_id and len(SlowMakeEnv.made) == 2
            x, y = await create(""), await create("")
            assert x.session_id != y.session_id and len(SlowMakeEnv.made) == 4
            # A key reused for another request is the client's mistake, not a session to hand out.
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await create("k1", seed=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await create("k" * (MAX_KEY_LEN + 1))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # Closed since: the key does not hand out a dead session; a new one is made.
            await c.Close(env_pb2.SessionRef(session_id=a.session_id), timeout=10)
            again = await create("k1")
            assert again.session_id != a.session_id and again.session_id in c.server.servicer.sessions
    run(body())


def test_a_retry_during_the_creation_waits_for_it():
    async def body():
        SlowMakeEnv.made.clear()
        async with envd_client() as c:
            req = env_pb2.CreateSessionRequest(env_id="test-slowmake/a", options={"make_s": "0.5"}, request_id="k")
            first = asyncio.ensure_future(c.CreateSession(req, timeout=10))
            deadline = time.monotonic() + 10
            while not len(c.server.servicer.create_keys):   # the first attempt is creating: its key is known
                assert time.monotonic() < deadline and not first.done()
                await asyncio.sleep(0.01)
            second = await c.CreateSession(req, timeout=10)
            assert (await first).session_id == second.session_id
            assert len(SlowMakeEnv.made) == 1 and len(c.server.servicer.sessions) == 1
    run(body())


def test_a_failed_creation_is_not_remembered():
    async def body():
        async with envd_client() as c:
            req = env_pb2.CreateSessionRequest(env_id="test-slowmake/broken", request_id="k")
            for _ in range(2):   # each retry tries again, and fails again, rather than replaying a stale answer
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.CreateSession(req, timeout=10)
                assert e.value.code() == grpc.StatusCode.INTERNAL
            assert len(c.server.servicer.create_keys) == 0
    run(body())


class _S:
    def __init__(self, sid: str = ""):
        self.id = sid

    def renew(self):
        pass


def test_keys_are_bounded_in_count_and_time():
    async def body():
        now = [0.0]
        keys = CreateKeys(ttl_s=0.2, wait_s=1.0, max_keys=3, clock=lambda: now[0])
        made = []

        async def make():
            made.append(_S(f"s{len(made)}"))
            return made[-1]

        def lookup(sid):
            return next((s for s in made if s.id == sid), None)

        for i in range(50):
            await keys.create("peer", env_pb2.CreateSessionRequest(env_id="e", request_id=f"k{i}"), make, lookup)
            assert len(keys) <= 3
        # the newest are remembered, the oldest forgotten
        s = await keys.create("peer", env_pb2.CreateSessionRequest(env_id="e", request_id="k49"), make, lookup)
        assert s is made[49] and len(made) == 50
        # keys are per client: another peer's same key is another session
        await keys.create("other", env_pb2.CreateSessionRequest(env_id="e", request_id="k49"), make, lookup)
        assert len(made) == 51
        now[0] += 0.25
        await keys.create("peer", env_pb2.CreateSessionRequest(env_id="e", request_id="k49"), make, lookup)
        assert len(made) == 52 and len(keys) == 1   # past ttl_s: forgotten
    run(body())


def test_a_remembered_key_does_not_keep_its_closed_session_in_memory():
    """A key outlives its session by up to ttl_s: it holds the session's id, so a closed session (its env, its last
    observation) is freed at once rather than when the key expires."""

    async def body():
        keys = CreateKeys(ttl_s=60.0, wait_s=1.0)
        live = {}

        async def make():
            s = live["s1"] = _S("s1")
            return s

        ref = weakref.ref(await keys.create("peer", env_pb2.CreateSessionRequest(env_id="e", request_id="k"), make,
                                            live.get))
        assert ref() is live["s1"] and len(keys) == 1
        del live["s1"]          # closed: the daemon no longer holds it
        gc.collect()
        assert ref() is None and len(keys) == 1
        again = await keys.create("peer", env_pb2.CreateSessionRequest(env_id="e", request_id="k"), make, live.get)
        assert again is live["s1"] and again is not None   # the key found no open session: made anew
    run(body())


def test_a_creation_in_progress_is_not_forgotten_at_the_key_bound():
    """With max_keys creations running, a new keyed create is refused (nothing made) rather than evicting one of
    them, whose retry would then have made a second session; once they are done, old keys make room again."""

    async def body():
        keys = CreateKeys(ttl_s=60.0, wait_s=5.0, max_keys=2)
        made, gate = [], asyncio.Event()

        async def slow_make():
            await asyncio.wait_for(gate.wait(), 10)
            made.append(_S(f"s{len(made)}"))
            return made[-1]

        def lookup(sid):
            return next((s for s in made if s.id == sid), None)

        req = lambda k: env_pb2.CreateSessionRequest(env_id="e", request_id=k)  # noqa: E731
        first = [asyncio.ensure_future(keys.create("peer", req(k), slow_make, lookup)) for k in ("a", "b")]
        await asyncio.sleep(0)
        with pytest.raises(Exception, match="being created at once") as e:
            await keys.create("peer", req("c"), slow_make, lookup)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        retry = asyncio.ensure_future(keys.create("peer", req("a"), slow_make, lookup))  # a's answer was lost
        gate.set()
        a, b = await asyncio.gather(*first)
        assert await retry is a and len(made) == 2
        c = await keys.create("peer", req("c"), slow_make, lookup)   # "a", done, is forgotten to make room
        assert len(made) == 3 and c is made[2] and len(keys) == 2
    run(body())


def test_restore_and_fork_with_a_request_id_make_one_session_each():
    """Restore and Fork make a session as CreateSession does: a retry of either (its answer lost) gets the session
    the first attempt made (before: a second one, held by nobody until its lease ran out). A Fork's retry gets its
    fork even after the source closed; a key is one request: given to another RPC it is INVALID_ARGUMENT."""

    async def body():
        async with envd_client() as c:
            sessions = c.server.servicer.sessions
            src = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id="builtin/click", seed=1))).session_id
            await c.Reset(env_pb2.ResetRequest(session_id=src, seed=1))
            state = (await c.Snapshot(env_pb2.SessionRef(session_id=src))).state
            restore = env_pb2.RestoreRequest(env_id="builtin/click", state=state, request_id="r1")
            a, b = await c.Restore(restore), await c.Restore(restore)
            assert a.session_id == b.session_id and len(sessions) == 2
            other = await c.Restore(env_pb2.RestoreRequest(env_id="builtin/click", state=state, request_id="r2"))
            assert other.session_id not in (a.session_id, src) and len(sessions) == 3
            fork = env_pb2.ForkRequest(session_id=src, request_id="f1")
            f1, f2 = await c.Fork(fork), await c.Fork(fork)
            assert f1.session_id == f2.session_id and len(sessions) == 4
            await c.Close(env_pb2.SessionRef(session_id=src))
            assert (await c.Fork(fork)).session_id == f1.session_id and len(sessions) == 3
            for wrong in (c.Fork(env_pb2.ForkRequest(session_id=a.session_id, request_id="r1")),
                          c.CreateSession(env_pb2.CreateSessionRequest(env_id="builtin/click", request_id="f1")),
                          c.Restore(env_pb2.RestoreRequest(env_id="builtin/click", state=state, lease_ttl_s=30,
                                                           request_id="r1"))):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await wrong
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
            assert len(sessions) == 3
    run(body())
