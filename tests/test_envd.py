"""envd daemon behaviour: caps, drain, auth, crash isolation, restarts, health, limits, control plane."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from envd import hints, registry
from envd.base import Action, ActionError, Env, Outcome, StepResult
from envd.server import ENV_SERVICE, serve
from envd_compliance import envd_client, expect_code, run, until
from core import rpc
from core.config import EnvdConfig
from core.v1 import common_pb2, control_pb2, control_pb2_grpc, env_pb2, env_pb2_grpc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


FRAGILE = ("wait", "crash", "hang", "slow")


class FragileEnv(Env):
    """Steps: wait (fine), crash (raises), hang (blocks until the test sets `release`, past any deadline), slow
    (checks steps never overlap); the kind rides in the target of a wait() (envd passes only known action types to
    a backend)."""

    closed: list[str] = []          # class-level: the tests check that envd closes what it created
    release = threading.Event()     # ends every "hang" step; a test that hangs a step sets it (in a finally)
    action_space = "wait | crash | hang | slow"

    def __init__(self, name: str, options: dict[str, str]):
        if name == "bad-options":
            raise ValueError("option 'x' must be an integer")
        if name == "broken":
            raise RuntimeError("cannot reach the browser")
        self.name, self.active = name, 0

    def reset(self, seed: int, options: dict[str, str]) -> StepResult:
        return StepResult(text=f"fragile {self.name} seed {seed}")

    def step(self, action: Action) -> StepResult:
        self.active += 1
        try:
            kind = action.target or action.type
            if kind == "crash":
                raise RuntimeError("segfault in the emulator")
            if kind == "hang":
                FragileEnv.release.wait(60.0)  # stuck until the test lets go (a fixed sleep raced a slow host)
            if kind == "slow":
                time.sleep(0.02)
                if self.active != 1:
                    raise AssertionError("two steps ran at once on one env")
            if kind not in ("wait", "hang", "slow"):
                raise ActionError(f"unsupported {kind!r}")
            return StepResult(text="ok", outcome=Outcome.RUNNING)
        finally:
            self.active -= 1

    def close(self) -> None:
        FragileEnv.closed.append(self.name)


registry.register("test-fragile", FragileEnv)


def _create(c, env_id="test-fragile/a", **kw):
    return c.CreateSession(env_pb2.CreateSessionRequest(env_id=env_id, **kw))


async def _started(c, env_id="test-fragile/a", **kw) -> str:
    sid = (await _create(c, env_id, **kw)).session_id
    await c.Reset(env_pb2.ResetRequest(session_id=sid))
    return sid


def _step(c, sid, kind="wait", **kw):
    """A FragileEnv step of `kind`; a kind FragileEnv does not know is sent as the action type itself."""
    a = env_pb2.Action(type="wait", target=kind) if kind in FRAGILE else env_pb2.Action(type=kind)
    return c.Step(env_pb2.StepRequest(session_id=sid, action=a, **kw))


def _control(c):
    return control_pb2_grpc.ControlServiceStub(c.channel)


async def _status(c) -> dict:
    return json.loads((await _control(c).Status(control_pb2.StatusRequest(), timeout=5)).metrics_json)


async def _health(channel, service="") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status


def test_action_from_proto_leaves_empty_fields_unset():
    a = env_pb2.Action(type="drag", point=[1, 2], end_point=[3, 4.5], raw="drag(...)")
    assert Action.from_proto(a) == Action("drag", point=(1.0, 2.0), end_point=(3.0, 4.5), raw="drag(...)")
    assert Action.from_proto(Action.from_proto(a).to_proto()) == Action.from_proto(a)
    assert Action.from_proto(env_pb2.Action(type="hotkey", key="ctrl c")) == Action("hotkey", key="ctrl c")
    assert Action.from_proto(env_pb2.Action(type="hotkey", key="ctrl c")).to_dict() == {"type": "hotkey", "key": "ctrl c"}
    for bad, why in ((env_pb2.Action(), "unknown action type"), (env_pb2.Action(type="teleport"), "unknown action type"),
                     (env_pb2.Action(type="click", point=[1]), r"must be \[x, y\]"),
                     (env_pb2.Action(type="drag", point=[1, 2], end_point=[1, 2, 3]), "end_point")):
        with pytest.raises(ActionError, match=why):
            Action.from_proto(bad)


def test_registry_resolution():
    registry.register("test-reg", lambda name, opts: FragileEnv(name, opts), ["x"])
    registry.register("test-reg/deep", lambda name, opts: FragileEnv("deep:" + name, opts))
    try:
        assert registry.make("test-reg/x", {}).name == "x"
        assert registry.make("test-reg/deep/y", {}).name == "deep:y"  # the longest prefix wins
        assert registry.make("test-reg/x", {}).env_id == "test-reg/x"
        with pytest.raises(KeyError, match="unknown env id"):
            registry.make("test-regx/x", {})
        ids = registry.list_env_ids()
        assert "test-reg/x" in ids and "test-reg/deep" in ids
    finally:
        registry.unregister("test-reg")
        registry.unregister("test-reg/deep")


def test_health_serving_and_ping():
    async def body():
        async with envd_client() as c:
            assert await _health(c.channel) == health_pb2.HealthCheckResponse.SERVING
            assert await _health(c.channel, ENV_SERVICE) == health_pb2.HealthCheckResponse.SERVING
            r = await c.Ping(env_pb2.PingRequest(payload=b"abc"))
            assert r.payload == b"abc" and r.run_id == c.run_id
    run(body())


def test_session_cap():
    async def body():
        async with envd_client(max_sessions=2) as c:
            a = await _started(c)
            await _started(c)
            await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, _create(c))
            await c.Close(env_pb2.SessionRef(session_id=a))
            await _started(c)
    run(body())


def test_create_errors():
    async def body():
        async with envd_client() as c:
            await expect_code(grpc.StatusCode.NOT_FOUND, _create(c, "nope/a"))
            await expect_code(grpc.StatusCode.INVALID_ARGUMENT, _create(c, "test-fragile/bad-options"))
            e = await expect_code(grpc.StatusCode.INTERNAL, _create(c, "test-fragile/broken"))
            assert "cannot reach the browser" in e.details()
            await expect_code(grpc.StatusCode.INVALID_ARGUMENT, _create(c, lease_ttl_s=-1))
            sid = (await _create(c)).session_id
            await expect_code(grpc.StatusCode.FAILED_PRECONDITION, _step(c, sid))  # no Reset yet
            assert not (await _status(c))["infra_errors"]
    run(body())


def test_drain_keeps_existing_sessions():
    async def body():
        async with envd_client() as c:
            sid = await _started(c)
            ctl = _control(c)
            await ctl.Command(control_pb2.CommandRequest(name="drain"), timeout=5)
            await expect_code(grpc.StatusCode.UNAVAILABLE, _create(c))
            await expect_code(grpc.StatusCode.UNAVAILABLE, c.Fork(env_pb2.ForkRequest(session_id=sid)))
            assert (await _step(c, sid)).outcome == common_pb2.RUNNING
            assert (await _status(c))["draining"] is True
            assert await _health(c.channel, ENV_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await _health(c.channel) == health_pb2.HealthCheckResponse.SERVING
            await ctl.Command(control_pb2.CommandRequest(name="undrain"), timeout=5)
            await _started(c)
            assert await _health(c.channel, ENV_SERVICE) == health_pb2.HealthCheckResponse.SERVING
    run(body())


def test_auth_token():
    async def body():
        async with envd_client(auth_token="s3cret") as c:  # the helper's channel carries the token
            assert (await c.Ping(env_pb2.PingRequest(payload=b"x"))).run_id == c.run_id
            for token in ("", "wrong"):
                ch = rpc.channel(c.server.address, token)
                try:
                    await expect_code(grpc.StatusCode.UNAUTHENTICATED,
                                      env_pb2_grpc.EnvServiceStub(ch).Ping(env_pb2.PingRequest(), timeout=5))
                    # health checks stay open: orchestrators' probes cannot send a token
                    assert await _health(ch) == health_pb2.HealthCheckResponse.SERVING
                finally:
                    await ch.close()
    run(body())


def test_backend_crash_is_infra_error_and_daemon_survives():
    async def body():
        async with envd_client() as c:
            sid = await _started(c, "test-fragile/crashy")
            other = await _started(c)
            r = await _step(c, sid, "crash")
            assert r.outcome == common_pb2.INFRA_ERROR and r.reward == 0.0
            info = json.loads(r.info_json)
            assert "segfault in the emulator" in info["error"] and info["op"] == "step"
            await expect_code(grpc.StatusCode.NOT_FOUND, _step(c, sid))
            assert (await _step(c, other)).outcome == common_pb2.RUNNING  # other sessions are unaffected
            assert await _health(c.channel) == health_pb2.HealthCheckResponse.SERVING
            await _started(c)
            assert (await _status(c))["infra_errors"] == 1
            # closed by a worker thread after the answer (was: a 50 ms sleep)
            await until(lambda: "crashy" in FragileEnv.closed, "the crashed env to be closed", every=0.01)
            await expect_code(grpc.StatusCode.INVALID_ARGUMENT, _step(c, other, "teleport"))
            assert (await _step(c, other)).outcome == common_pb2.RUNNING
    run(body())



def test_nonblocking_backends_skip_the_worker_pool_and_keep_their_errors():
    """builtin (nonblocking) resets and steps run on the event loop; a bad action is still INVALID_ARGUMENT and a
    crash still INFRA_ERROR, exactly as through the pool."""
    async def body():
        async with envd_client() as c:
            pool = c.server.servicer.workers
            calls = []
            real = pool.run

            async def counting(fn, *a, **kw):
                calls.append(kw.get("name"))
                return await real(fn, *a, **kw)

            pool.run = counting
            sid = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id="builtin/click"))).session_id
            await c.Reset(env_pb2.ResetRequest(session_id=sid, seed=3))
            r = await c.Step(env_pb2.StepRequest(session_id=sid, action=env_pb2.Action(type="wait")))
            assert r.outcome == common_pb2.RUNNING
            await expect_code(grpc.StatusCode.INVALID_ARGUMENT, c.Step(env_pb2.StepRequest(
                session_id=sid, action=env_pb2.Action(type="teleport"))))
            assert "reset" not in calls and "step" not in calls, calls
            env = c.server.servicer.sessions[sid].env
            env.step = lambda a: 1 / 0  # the backend breaks: INFRA_ERROR, not a crashed daemon
            r = await c.Step(env_pb2.StepRequest(session_id=sid, action=env_pb2.Action(type="wait")))
            assert r.outcome == common_pb2.INFRA_ERROR and "ZeroDivisionError" in json.loads(r.info_json)["error"]
            sid2 = await _started(c)  # a blocking backend still goes through the pool
            await _step(c, sid2)
            assert "step" in calls
    run(body())

def test_hanging_backend_times_out():
    async def body():
        FragileEnv.release.clear()
        async with envd_client(step_timeout_s=0.2) as c:
            try:
                sid = await _started(c, "test-fragile/hangs")
                env = c.server.servicer.sessions[sid].env
                r = await _step(c, sid, "hang")
                assert r.outcome == common_pb2.INFRA_ERROR and "took longer" in json.loads(r.info_json)["error"]
                # answered before the stuck call returned: it is still in step() (it returns only once released)
                assert env.active == 1 and "hangs" not in FragileEnv.closed
                await expect_code(grpc.StatusCode.NOT_FOUND, _step(c, sid))
            finally:
                FragileEnv.release.set()
            # The stuck thread is not interrupted; the env is closed once its call returns.
            await until(lambda: "hangs" in FragileEnv.closed, "the hung env to be closed once released")
    run(body())


def test_backend_calls_see_what_is_left_of_envds_deadline():
    """envd.base.call_time_left: a backend's own per-command timeout, cut to what is left of the daemon's deadline for
    the call it runs (a close runs however late, with its own timeouts); outside a worker it is the backend's own."""
    from envd.base import call_time_left
    from envd.sessions import Workers

    async def body():
        w = Workers(2)
        try:
            seen = await w.run(lambda: call_time_left(600.0), timeout=5.0)
            assert 4.0 < seen <= 5.0
            assert await w.run(lambda: call_time_left(1.5), timeout=5.0) == 1.5  # the backend's own is shorter
            assert await w.run(lambda: call_time_left(600.0), timeout=5.0, must_run=True) == 600.0
            gate = threading.Event()
            late = []

            def slow():
                gate.wait(10)
                late.append(call_time_left(600.0))  # after envd gave up on it: nothing left to wait for
            with pytest.raises(Exception, match="took longer"):
                await w.run(slow, timeout=0.2)
            gate.set()
            await until(lambda: late, "the late call to finish")
            assert late == [0.0]
            assert call_time_left(600.0) == 600.0
        finally:
            w.shutdown()
    run(body())


def test_steps_of_one_session_are_serialised():
    async def body():
        async with envd_client(workers=8) as c:
            sid = await _started(c)
            rs = await asyncio.gather(*(_step(c, sid, "slow") for _ in range(8)))
            assert all(r.outcome == common_pb2.RUNNING for r in rs)
            assert (await _status(c))["steps"] == 8
    run(body())


def test_run_id_mismatch():
    async def body():
        async with envd_client() as c:
            sid = await _started(c)
            e = await expect_code(grpc.StatusCode.FAILED_PRECONDITION, _step(c, sid, run_id="0123abcd"))
            assert "daemon restarted" in e.details()
            await expect_code(grpc.StatusCode.FAILED_PRECONDITION,
                              c.Observe(env_pb2.SessionRef(session_id=sid, run_id="0123abcd")))
            assert (await _step(c, sid, run_id=c.run_id)).outcome == common_pb2.RUNNING
    run(body())


def test_oversize_message_rejected():
    async def body():
        async with envd_client(max_message_bytes=64 << 10) as c:
            big = rpc.channel(c.server.address, max_message_bytes=4 << 20)  # the client would send it
            try:
                stub = env_pb2_grpc.EnvServiceStub(big)
                await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  stub.Ping(env_pb2.PingRequest(payload=b"x" * (128 << 10)), timeout=5))
                assert (await stub.Ping(env_pb2.PingRequest(payload=b"x" * 1024), timeout=5)).payload
            finally:
                await big.close()
            assert await _health(c.channel) == health_pb2.HealthCheckResponse.SERVING
    run(body())


def test_control_status_and_session_commands():
    async def body():
        async with envd_client() as c:
            sid = await _started(c)
            for _ in range(5):
                await _step(c, sid)
            st = await _control(c).Status(control_pb2.StatusRequest(), timeout=5)
            assert st.role == "envd" and st.run_id == c.run_id
            m = json.loads(st.metrics_json)
            assert m["sessions"] == 1 and m["steps"] == 5 and m["infra_errors"] == 0 and m["draining"] is False
            assert 0 < m["step_ms_p50"] <= m["step_ms_p99"]
            ctl = _control(c)
            listed = json.loads((await ctl.Command(control_pb2.CommandRequest(name="sessions_list"),
                                                   timeout=5)).result_json)["sessions"]
            assert [s["id"] for s in listed] == [sid] and listed[0]["steps"] == 5
            await expect_code(grpc.StatusCode.INVALID_ARGUMENT, ctl.Command(
                control_pb2.CommandRequest(name="sessions_kill"), timeout=5))
            r = await ctl.Command(control_pb2.CommandRequest(name="sessions_kill", args={"id": "nope"}), timeout=5)
            assert not r.ok
            r = await ctl.Command(control_pb2.CommandRequest(name="sessions_kill", args={"id": sid}), timeout=5)
            assert r.ok
            await expect_code(grpc.StatusCode.NOT_FOUND, _step(c, sid))
            await expect_code(grpc.StatusCode.UNIMPLEMENTED, ctl.Command(control_pb2.CommandRequest(name="nope"), timeout=5))
    run(body())


def test_serve_writes_ready_file_and_stops(tmp_path):
    ready = tmp_path / "envd.ready"

    async def body():
        stop = asyncio.Event()
        task = asyncio.create_task(serve(EnvdConfig(port=0), str(ready), stop))
        await until(ready.exists, "the ready file", 15, every=0.01)  # was 2 s
        info = json.loads(ready.read_text())
        assert info["role"] == "envd" and info["pid"] == os.getpid()
        ch = rpc.channel(info["address"])
        stub = env_pb2_grpc.EnvServiceStub(ch)
        sid = (await stub.CreateSession(env_pb2.CreateSessionRequest(env_id="test-fragile/served"), timeout=5)).session_id
        assert (await stub.Ping(env_pb2.PingRequest(), timeout=5)).run_id == info["run_id"]
        await ch.close()
        stop.set()
        await asyncio.wait_for(task, 5)
        assert "served" in FragileEnv.closed and sid

    run(body())


def test_main_exits_cleanly_on_sigterm(tmp_path):
    ready = tmp_path / "envd.ready"
    code = ("import sys; from envd.server import main; from core.config import EnvdConfig; "
            f"sys.exit(main(EnvdConfig(port=0), {str(ready)!r}))")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 15
        while not ready.exists():
            assert p.poll() is None, p.stderr.read().decode()
            assert time.monotonic() < deadline, "envd did not become ready"
            time.sleep(0.02)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_hint_policy_option_gives_the_scripted_action_and_never_reaches_the_backend():
    """hint_policy=oracle: every running result carries the oracle's next action, grounded; playing it wins; the option is
    the daemon's (backends never see it); an unknown policy is INVALID_ARGUMENT; a backend without an oracle says so."""
    async def body():
        async with envd_client() as c:
            sid = (await c.CreateSession(env_pb2.CreateSessionRequest(
                env_id="builtin/menu", options={"hint_policy": "oracle", "strict_targets": "1"}))).session_id
            assert "hint_policy" not in c.server.servicer.sessions[sid].options
            r = await c.Reset(env_pb2.ResetRequest(session_id=sid, seed=11, options={"hint_policy": "oracle"}))
            env = c.server.servicer.sessions[sid].env
            for _ in range(2):
                hint = json.loads(r.info_json)["hint_action"]
                # the oracle's action, with the point of the widget it names (envd.hints.grounded)
                assert Action.from_dict(hint) == hints.grounded(env, env.oracle_action())
                assert Action.from_dict(hint).point == env.ground(env.oracle_action().target) is not None
                r = await c.Step(env_pb2.StepRequest(session_id=sid, action=Action.from_dict(hint).to_proto()))
            assert r.outcome == common_pb2.TERMINATED and r.reward == 1.0 and "hint_action" not in json.loads(r.info_json)
            await expect_code(grpc.StatusCode.INVALID_ARGUMENT, c.CreateSession(env_pb2.CreateSessionRequest(
                env_id="builtin/click", options={"hint_policy": "psychic"})))
            sid = (await c.CreateSession(env_pb2.CreateSessionRequest(
                env_id="test-fragile/a", options={"hint_policy": "oracle"}))).session_id
            r = await c.Reset(env_pb2.ResetRequest(session_id=sid, seed=1))
            assert "has no oracle" in json.loads(r.info_json)["hint_error"]
    run(body())


def test_an_error_echoing_a_long_client_field_keeps_its_code():
    """A status message travels in a header: one echoing a long model-written field (a click target the page lacks,
    thousands of unknown option names) passed the peer's metadata limit and arrived as RESOURCE_EXHAUSTED, so the
    model's mistake read as an envd failure. Messages are now cut to about 1 KiB."""
    async def body():
        async with envd_client() as c:
            sid = (await c.CreateSession(env_pb2.CreateSessionRequest(
                env_id="builtin/click", options={"strict_targets": "1"}))).session_id
            await c.Reset(env_pb2.ResetRequest(session_id=sid, seed=1))
            e = await expect_code(grpc.StatusCode.INVALID_ARGUMENT, c.Step(env_pb2.StepRequest(
                session_id=sid, action=env_pb2.Action(type="click", target="按钮" * 950))))
            assert "no element labelled" in e.details() and len(e.details().encode()) < 1100
            e = await expect_code(grpc.StatusCode.INVALID_ARGUMENT, c.CreateSession(env_pb2.CreateSessionRequest(
                env_id="terminal", options={f"opt{i:06d}": "1" for i in range(20000)})))
            assert "unknown" in e.details() and len(e.details().encode()) < 1100
    run(body())


class CountingEnv(Env):
    """Counts the steps applied; from the second on, its observation is bigger than the daemon may send."""
    action_space = "wait"
    nonblocking = True

    def __init__(self, name: str, options: dict[str, str]):
        self.applied = 0

    def reset(self, seed: int, options: dict[str, str]) -> StepResult:
        self.applied = 0
        return StepResult(text="0")

    def step(self, action: Action) -> StepResult:
        self.applied += 1
        return StepResult(text=str(self.applied) + ("x" * (256 << 10) if self.applied >= 2 else ""))

    def close(self) -> None:
        pass


registry.register("test-counting", CountingEnv)


def test_a_step_whose_answer_is_too_big_is_not_sent_again():
    """gRPC answers RESOURCE_EXHAUSTED for a response over the size limit, after the backend applied the step; the
    actor's client retried Step on that code, and one action was applied four times. A call that changes state is
    now retried only on ABORTED, which envd alone sends, for a call it never started."""
    from actor.envclient import EnvClient, EnvInfraError
    from core.action import Action as CoreAction

    async def body():
        async with envd_client(max_message_bytes=128 << 10) as c:
            ec = EnvClient(c.server.address, timeout_s=10, retries=3)
            try:
                sid, run_id, _ = await ec.open("test-counting", 1, {})
                await ec.step(sid, run_id, CoreAction("wait"))
                with pytest.raises(EnvInfraError, match="RESOURCE_EXHAUSTED"):
                    await ec.step(sid, run_id, CoreAction("wait"))
                assert c.server.servicer.sessions[sid].env.applied == 2
            finally:
                await ec.close()
    run(body())


def test_a_call_that_never_got_a_worker_is_aborted_and_its_session_kept():
    """Time a call spent queued behind other sessions' stuck calls counted against its deadline: a healthy session
    was answered INFRA_ERROR and closed for another backend's hang. A call still queued at its deadline is now
    dropped and answered ABORTED; its session stays and works once a worker is free."""
    async def body():
        FragileEnv.release.clear()
        async with envd_client(workers=2, step_timeout_s=0.3) as c:
            stuck = [await _started(c, f"test-fragile/stuck{i}") for i in range(2)]
            healthy = await _started(c, "test-fragile/healthy")
            try:
                hangs = [asyncio.ensure_future(_step(c, sid, "hang")) for sid in stuck]
                await until(lambda: c.server.servicer.workers.running >= 2, "both workers stuck", every=0.01)
                # both workers stay stuck until released, however long the healthy call takes to arrive
                e = await expect_code(grpc.StatusCode.ABORTED, _step(c, healthy))
                assert "never started" in e.details() and healthy in c.server.servicer.sessions
                assert all(r.outcome == common_pb2.INFRA_ERROR for r in await asyncio.gather(*hangs))  # they did hang
            finally:
                FragileEnv.release.set()
            await until(lambda: not c.server.servicer.workers.running, "the released workers to finish", every=0.01)
            assert (await _step(c, healthy)).outcome == common_pb2.RUNNING
            assert "healthy" not in FragileEnv.closed
    run(body())


class BulkyEnv(CountingEnv):
    """A CountingEnv whose snapshot is 2 MiB."""

    def snapshot(self) -> bytes:
        return b"s" * (2 << 20)


registry.register("test-bulky", BulkyEnv)


def test_a_snapshot_over_the_message_limit_is_refused_clearly_and_the_session_kept():
    """A snapshot bigger than envd.max_message_bytes could never be sent: gRPC answered RESOURCE_EXHAUSTED ("Sent
    message larger than max"), a code clients retry (core.rpc.RETRYABLE), each retry packing the state again. It is
    now FAILED_PRECONDITION naming the size and the setting, and the session goes on."""
    async def body():
        async with envd_client(max_message_bytes=1 << 20) as c:
            sid = await _started(c, "test-bulky")
            e = await expect_code(grpc.StatusCode.FAILED_PRECONDITION, c.Snapshot(env_pb2.SessionRef(session_id=sid)))
            size = re.fullmatch(r"snapshot of (\d+) bytes > envd.max_message_bytes", e.details())
            assert size and int(size.group(1)) > 2 << 20, e.details()   # the state, sealed (envd/snapshots.py)
            assert (await _step(c, sid)).outcome == common_pb2.RUNNING
    run(body())
