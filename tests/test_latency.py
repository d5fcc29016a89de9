"""envd step_delay option (envd/latency.py): the distributions, the wrapper, and a delayed session through envd."""
from __future__ import annotations

import asyncio
import math
import random
import statistics
import time

import grpc
import pytest

from envd import builtin, latency
from envd.base import Action, ActionError
from envd_compliance import envd_client, expect_code, run
from core.v1 import common_pb2, env_pb2


def test_lognormal_median_spread_and_cap():
    d = latency.DelaySpec("lognormal:0.2,1.0,3")
    rng = random.Random(1)
    xs = [d.draw(rng) for _ in range(20000)]
    assert abs(statistics.median(xs) - 0.2) < 0.01            # median = MEDIAN
    p90 = sorted(xs)[int(0.9 * len(xs))]
    assert abs(p90 - 0.2 * math.exp(1.2816)) < 0.05           # p90 = median * e^(1.28 sigma)
    assert max(xs) == 3.0 and min(xs) > 0                     # capped, never negative


def test_pareto_and_fixed():
    d = latency.DelaySpec("pareto:0.1,1.5")
    rng = random.Random(2)
    xs = [d.draw(rng) for _ in range(20000)]
    assert min(xs) >= 0.1 and max(xs) <= latency.DEFAULT_CAP_S
    assert abs(sum(x > 0.2 for x in xs) / len(xs) - 0.5 ** 1.5) < 0.02   # P(X > 2 xm) = 2^-alpha
    assert latency.DelaySpec("fixed:0.05").draw(rng) == 0.05


@pytest.mark.parametrize("bad", ["", "gauss:1,2", "lognormal:0.1", "lognormal:a,b", "pareto:0.1,0", "fixed:-1",
                                 "lognormal:0.1,1,2,3", "lognormal:nan,1",
                                 # longer than MAX_CAP_S: a sleep that held its worker for an hour, or overflowed
                                 "fixed:3600", "fixed:1e300", "lognormal:0.2,1,3600", "pareto:0.1,1.5,31"])
def test_bad_specs_are_rejected(bad):
    with pytest.raises(ValueError):
        latency.DelaySpec(bad)


def test_draws_past_any_float_are_the_cap():
    """A huge sigma or a tiny alpha raised OverflowError in the step (INFRA_ERROR, the session closed)."""
    rng = random.Random(3)
    for spec in ("lognormal:0.01,1000,0.5", "pareto:0.01,1e-300,0.5"):
        d = latency.DelaySpec(spec)
        xs = [d.draw(rng) for _ in range(200)]
        assert all(0 <= x <= 0.5 for x in xs) and max(xs) == 0.5


def test_builtin_without_the_option_is_not_wrapped():
    assert isinstance(builtin.make("click", {}), builtin.BuiltinEnv)
    assert isinstance(builtin.make("click", {"step_delay": ""}), builtin.BuiltinEnv)


def test_wrapper_sleeps_reproducibly_and_answers_bad_actions_at_once():
    env = builtin.make("menu", {"step_delay": "fixed:0.05"})
    assert isinstance(env, latency.DelayedEnv) and not env.nonblocking
    t0 = time.perf_counter()
    r = env.reset(7)
    r = env.step(env.oracle_action())         # forwarded to the backend (hints and oracles keep working)
    assert time.perf_counter() - t0 >= 0.1 and env.slept_s == pytest.approx(0.1)
    assert r.outcome == "running"
    t0 = time.perf_counter()
    with pytest.raises(ActionError):
        env.step(Action("teleport"))
    assert env.slept_s == pytest.approx(0.1)  # no delay drawn for a rejected action; the session is unchanged
    assert env.step(env.oracle_action()).info["success"]
    # Same seed, same delays.
    a, b = (builtin.make("click", {"step_delay": "lognormal:0.001,1"}) for _ in range(2))
    a.reset(3), b.reset(3)
    assert a.slept_s == b.slept_s > 0


def test_delayed_session_through_envd_uses_the_pool_and_takes_its_time():
    async def body():
        async with envd_client(workers=4) as c:
            await expect_code(grpc.StatusCode.INVALID_ARGUMENT, c.CreateSession(env_pb2.CreateSessionRequest(
                env_id="builtin/click", options={"step_delay": "lognormal:1"})))
            # 1.5 s a call: the other session's step below must be answered within one slow step, on any host
            sid = (await c.CreateSession(env_pb2.CreateSessionRequest(
                env_id="builtin/click", options={"step_delay": "fixed:1.5"}))).session_id
            t0 = time.perf_counter()
            await c.Reset(env_pb2.ResetRequest(session_id=sid, seed=1))
            r = await c.Step(env_pb2.StepRequest(session_id=sid, action=env_pb2.Action(type="wait")))
            assert r.outcome == common_pb2.RUNNING
            assert time.perf_counter() - t0 >= 3.0 and r.step_ms >= 1500
            # A session sleeping in a worker does not hold up another session's step.
            other = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id="builtin/click"))).session_id
            await c.Reset(env_pb2.ResetRequest(session_id=other, seed=2))
            slow = c.Step(env_pb2.StepRequest(session_id=sid, action=env_pb2.Action(type="wait")))
            slow_task = asyncio.ensure_future(slow)
            r2 = await c.Step(env_pb2.StepRequest(session_id=other, action=env_pb2.Action(type="wait")))
            assert r2.outcome == common_pb2.RUNNING and not slow_task.done()
            assert (await slow_task).outcome == common_pb2.RUNNING
    run(body())
