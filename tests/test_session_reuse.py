"""Idle envd sessions kept for reuse (actor.keep_sessions, actor/envclient.py): the next episode of the same env id
and options resets a kept session with its own seed instead of creating one; what it sees is what a new session
would show; failed episodes, expired idles and sessions the daemon lost are never reused."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses

from actor.envclient import EnvClient, EnvInfraError
from actor.episode import run_episode
from core.config import EnvdConfig
from core.outcome import Outcome
from envd.server import EnvServer
from inference_server.scripted import ScriptedEngine, fixed_answer
from tars.fresh import shared_tokenizer
from test_episode import stack as episode_stack

TOK = shared_tokenizer()


class Counting(EnvClient):
    creates = 0                                  # CreateSession calls, counted apart from the client's own figure

    async def create(self, *a):
        self.creates += 1
        return await super().create(*a)


@contextlib.asynccontextmanager
async def stack(keep: int, idle_s: float = 20.0, text: str = "wait()"):
    """test_episode's stack over an envd whose sessions the test can count, with a counting, session-keeping client."""
    env_srv = EnvServer(dataclasses.replace(EnvdConfig(), host="127.0.0.1", port=0))
    await env_srv.start()
    engine = ScriptedEngine(fixed_answer(TOK.answer(text)), TOK.vocab_size)
    try:
        async with episode_stack(engine, env_srv.address, max_turns=2, keep_sessions=keep) as (ctx, env):
            env.__class__ = Counting
            env.keep_sessions, env.idle_s = keep, idle_s
            yield ctx, env, env_srv.servicer.sessions
    finally:
        await env_srv.stop()


def first_prompt(tr) -> list[int]:
    return tr.tokens[:tr.turns[0].start].tolist()


def test_episodes_reuse_a_kept_session_and_see_what_a_new_one_shows():
    seeds = [3, 11, 3, 42]

    async def main(keep: int):
        async with stack(keep) as (ctx, env, sessions):
            trs = [await run_episode(ctx, env, f"t-{i}", "builtin/click", s, 0) for i, s in enumerate(seeds)]
            assert env.created == env.creates
            return trs, env.created, env.reused, len(sessions)

    fresh, created0, reused0, open0 = asyncio.run(main(0))
    kept, created1, reused1, open1 = asyncio.run(main(2))
    assert (created0, reused0, open0) == (4, 0, 0)           # every episode its own session, all closed
    assert (created1, reused1, open1) == (1, 3, 1)           # one session, reset three times, kept idle at the end
    for a, b in zip(fresh, kept):
        assert a.outcome == b.outcome == Outcome.TRUNCATED
        assert first_prompt(a) == first_prompt(b)            # a reused session shows the seed's own first screen
    assert first_prompt(kept[0]) == first_prompt(kept[2]) != first_prompt(kept[1])


def test_env_ids_and_options_do_not_share_sessions_and_the_pool_is_bounded():
    async def main():
        async with stack(keep=1) as (ctx, env, sessions):
            for i, e in enumerate(["builtin/click", "builtin/form", "builtin/click"]):
                await run_episode(ctx, env, f"t-{i}", e, i, 0)
            n_before = env.created
            ctx.cfg = dataclasses.replace(ctx.cfg, env_options={"max_steps": "5"})   # other options: a new session
            await run_episode(ctx, env, "t-x", "builtin/click", 9, 0)
            return n_before, env.created, env.reused, len(sessions)

    n_before, created, reused, still_open = asyncio.run(main())
    # keep_sessions=1: form's episode closed click's idle session (only the newest is kept), so all three create
    assert n_before == 3 and reused == 0
    assert created == 4 and still_open == 1


def test_an_expired_idle_session_is_closed_and_not_reused():
    async def main():
        async with stack(keep=4, idle_s=0.0) as (ctx, env, sessions):
            await run_episode(ctx, env, "t-0", "builtin/click", 1, 0)
            await asyncio.sleep(0.01)
            await run_episode(ctx, env, "t-1", "builtin/click", 2, 0)
            return env.created, env.reused, len(sessions)

    created, reused, still_open = asyncio.run(main())
    assert (created, reused, still_open) == (2, 0, 0)       # idle for longer than idle_s (0): each one closed


def test_a_session_the_daemon_lost_is_replaced_by_a_new_one():
    async def main():
        async with stack(keep=2) as (ctx, env, sessions):
            await run_episode(ctx, env, "t-0", "builtin/click", 1, 0)
            (sid,) = list(sessions)
            other = EnvClient(env.address, "", 5.0, 0)
            await other.close_session(sid)                   # gone on the daemon (a lease ran out, a kill)
            await other.close()
            tr = await run_episode(ctx, env, "t-1", "builtin/click", 2, 0)
            return tr, env.created, env.reused

    tr, created, reused = asyncio.run(main())
    assert tr.outcome == Outcome.TRUNCATED and not tr.error
    assert created == 2 and reused == 0


def test_a_failed_episode_does_not_give_its_session_back():
    class FailingStep(Counting):
        async def step(self, *a, **kw):
            raise EnvInfraError("envd test: UNAVAILABLE: injected")

    async def main():
        async with stack(keep=2) as (ctx, env, sessions):
            env.__class__ = FailingStep
            tr = await run_episode(ctx, env, "t-0", "builtin/click", 1, 0)
            return tr, len(env._idle), len(sessions)

    tr, idle, still_open = asyncio.run(main())
    assert tr.outcome == Outcome.INFRA_ERROR
    assert idle == 0 and still_open == 0                     # closed, not kept


def test_close_closes_the_idle_sessions():
    async def main():
        async with stack(keep=2) as (ctx, env, sessions):
            await run_episode(ctx, env, "t-0", "builtin/click", 1, 0)
            await run_episode(ctx, env, "t-1", "builtin/form", 1, 0)
            n = len(sessions)
            await env.close()
            return n, len(sessions)

    n, after = asyncio.run(main())
    assert n == 2 and after == 0


def test_an_episode_cancelled_while_it_resets_a_kept_session_closes_it():
    """An actor stopping cancels its episodes; one inside open(), resetting a session it took from the pool, closes
    that session rather than leaving it on envd until its lease runs out."""
    async def main():
        async with stack(1) as (ctx, env, sessions):
            await run_episode(ctx, env, "t-0", "builtin/click", 1, 0)
            assert len(env._idle) == 1 and len(sessions) == 1
            gate, real_reset = asyncio.Event(), env.reset

            async def slow_reset(*a):
                gate.set()
                await asyncio.sleep(30)
                return await real_reset(*a)

            env.reset = slow_reset
            t = asyncio.create_task(run_episode(ctx, env, "t-1", "builtin/click", 2, 0))
            await asyncio.wait_for(gate.wait(), 10)
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
            return len(env._idle), len(sessions)

    assert asyncio.run(main()) == (0, 0)


def test_a_generate_longer_than_the_lease_keeps_the_session():
    """Only a step, a reset or a heartbeat renews a session's lease; the episode heartbeats while it waits for
    inference, so a generate slower than the lease (inference restarting) does not cost a healthy session."""
    import threading
    from concurrent.futures import Future

    from test_episode import stack as episode_stack

    class Slow(ScriptedEngine):
        n = 0

        def submit(self, *a, **kw):
            f, self.n = super().submit(*a, **kw), self.n + 1
            if self.n != 2:                              # the second turn's generate takes 2.5 leases
                return f
            g = Future()
            threading.Timer(2.5, lambda: g.set_result(f.result())).start()
            return g

    async def main():
        env_srv = EnvServer(dataclasses.replace(EnvdConfig(), host="127.0.0.1", port=0, lease_ttl_s=1.0,
                                                gc_interval_s=0.1))
        await env_srv.start()
        try:
            async with episode_stack(Slow(fixed_answer(TOK.answer("wait()")), TOK.vocab_size), env_srv.address,
                                     max_turns=3) as (ctx, env):
                env.lease_ttl_s = 1.0
                return await run_episode(ctx, env, "t-lease", "builtin/click", 7, 0)
        finally:
            await env_srv.stop()

    tr = asyncio.run(main())
    assert tr.outcome != Outcome.INFRA_ERROR and len(tr.turns) == 3, (tr.outcome, tr.error)
