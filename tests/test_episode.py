"""actor.episode end to end through a real envd and a real InferenceService: infra failures, policy versions,
screenshots in the prompt, per-turn actor overhead."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import io
import json
import os
import signal
import socket
import time
import types

import gymnasium
import numpy as np
import pytest

from actor.envclient import EnvClient
from actor.episode import EpisodeContext, run_episode
from envd.server import EnvServer
from core.inference_client import InferenceClient
from inference_server.engine import LocalEngine
from inference_server.scripted import ScriptedEngine, fixed_answer
from inference_server.server import InferenceServer
from learner.admission import Admission
from learner.staleness import StalenessManager
from core.config import ActorConfig, EnvdConfig, GroupConfig, InferenceConfig
from core.model import CausalLM, DecoderConfig
from core.outcome import Fault, Outcome
from core.schema import Trajectory
from tars.fresh import shared_tokenizer

TOK = shared_tokenizer()


class StripesEnv(gymnasium.Env):
    """A frame that moves with each action of 1 (and stays for 0), rendered without pygame: screenshots for the actor."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 30}

    def __init__(self, render_mode=None):
        self.render_mode = render_mode
        self.observation_space = gymnasium.spaces.Discrete(100)
        self.action_space = gymnasium.spaces.Discrete(2)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return 0, {}

    def step(self, action):
        self.t += int(action)
        return self.t, float(action), self.t >= 4, False, {}

    def render(self):
        f = np.zeros((16, 16, 3), np.uint8)
        f[:, self.t % 16] = (255, 128, 7)
        return f


gymnasium.register("TarsEpisodeStripes-v0", entry_point=StripesEnv, max_episode_steps=50)


def answer(text: str):
    return fixed_answer(TOK.answer(text))


@contextlib.asynccontextmanager
async def stack(engine, envd_address: str | None = None, **actor_kw):
    """envd (in-process unless an address is given) + InferenceServer over `engine` + an EpisodeContext."""
    env_srv = None
    if envd_address is None:
        env_srv = EnvServer(dataclasses.replace(EnvdConfig(), host="127.0.0.1", port=0))
        await env_srv.start()
        envd_address = env_srv.address
    inf = InferenceServer(InferenceConfig(host="127.0.0.1", port=0), engine)
    await inf.start()
    cfg = ActorConfig(**{"rpc_timeout_s": 10.0, "retries": 1, **actor_kw})
    infer = InferenceClient([inf.address], timeout_s=10.0, retries=1)
    env = EnvClient(envd_address, "", 10.0, 1)
    try:
        yield EpisodeContext(cfg, TOK, infer, "test-actor"), env
    finally:
        await infer.close()
        await env.close()
        await inf.stop(0.5)
        if env_srv is not None:
            await env_srv.stop()
        engine.close()


def learner_admits(tr: Trajectory) -> bool:
    """The learner's own arrival filter (learner.admission.Admission.admit) on a minimal learner state."""
    stal = StalenessManager(batch_size=8, eta=100)
    stal.try_admit(1)
    adm = Admission(types.SimpleNamespace(mark_consumed=lambda ids: None), stal, max_lag=8, group=GroupConfig(),
                    episodes=io.StringIO(), archive=None, counters=collections.Counter())
    return adm.admit(tr, version=0)


def test_env_killed_mid_episode_is_infra_error_and_never_trained_on():
    from tars.bench.envd import Daemon

    with Daemon(workers=2) as d:
        class KillAfter(EnvClient):
            steps = 0

            async def step(self, *a, **kw):
                KillAfter.steps += 1
                if KillAfter.steps == 3:  # the daemon dies between the second and the third action
                    os.killpg(d.proc.pid, signal.SIGKILL)
                    d.proc.wait(10)
                return await super().step(*a, **kw)

        async def main():
            async with stack(ScriptedEngine(answer("wait()"), TOK.vocab_size), d.address,
                             env_options={"max_steps": "50"}, max_turns=8) as (ctx, env):
                env.__class__ = KillAfter
                return await run_episode(ctx, env, "killed-0001", "builtin/click", 7, 0)

        tr = asyncio.run(main())
    assert tr.outcome == "infra_error" and "envd" in tr.error
    assert tr.fault == Fault.ENVD and Trajectory.decode(tr.encode()).fault == Fault.ENVD   # typed, on the wire too
    assert len(tr.turns) == 2 and tr.ret == 0.0          # the two completed turns, no score for the failure
    Trajectory.decode(tr.encode())                        # still a valid trajectory on the wire
    assert learner_admits(tr) is False                    # kept out of the loss
    ok = dataclasses.replace(tr, outcome="truncated")
    assert learner_admits(ok) is True                     # (the same trajectory, not failed, would be trained on)


def test_a_retry_avoids_the_daemon_only_when_the_daemon_failed(monkeypatch):
    """An attempt that ended infra_error because envd failed marks that daemon down for new episodes; one whose
    backend failed leaves it in rotation (the next attempt may well land on it again). One whose inference failed
    is not rerun (test_an_episode_whose_inference_is_down_is_sent_at_once)."""
    from actor import main as M

    class Daemon:
        down = False

        def mark_down(self):
            self.down = True

    for fault, down in ((Fault.ENVD, True), (Fault.ENV, False)):
        daemon, outcomes = Daemon(), iter([Outcome.INFRA_ERROR, Outcome.TERMINATED])

        async def attempt(ctx, env, tid, env_id, seed, version, group):
            o = next(outcomes)
            return Trajectory(id=tid, env_id=env_id, outcome=o, fault=fault if o == Outcome.INFRA_ERROR else Fault.NONE,
                              tokens=np.zeros(0, np.int32), logprobs=np.zeros(0, np.float32),
                              versions=np.zeros(0, np.int32), mask=np.zeros(0, np.uint8), turns=[], ret=0.0)

        monkeypatch.setattr(M, "run_episode", attempt)
        actor = types.SimpleNamespace(acfg=types.SimpleNamespace(episode_attempts=2), _pick_env=lambda: daemon,
                                      ctx=None, _new_id=lambda: "a-1", version=0, stats=collections.Counter())
        tr = asyncio.run(M.Actor._episode(actor, "", 0, "builtin/click"))
        assert tr.outcome == Outcome.TERMINATED and tr.timings["attempts"] == 2
        assert daemon.down is down, fault


def test_an_episode_whose_inference_is_down_is_sent_at_once(tmp_path):
    """The SGLang server behind the inference front is gone: every generate answers UNAVAILABLE. After the client's
    unavailable_retry_s the episode ends infra_error with fault inference and the actor hands it on at once (on
    main it was rerun episode_attempts times, each waiting as long again, while nothing reached the learner, so
    `tars up` showed 0 episodes and 0 infra errors); the learner logs the fault and the run report counts it."""
    from actor import main as M
    from inference_server.sglang_engine import SGLangEngine
    from tars import report

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens: the SGLang server died
    engine = SGLangEngine(InferenceConfig(engine="sglang", sglang_urls=[dead]), [dead], health_thread=False)

    async def main():
        async with stack(engine, max_turns=2, max_new_tokens=4) as (ctx, env):
            ctx.infer.unavailable_retry_s = 0.5
            actor = types.SimpleNamespace(acfg=types.SimpleNamespace(episode_attempts=3), _pick_env=lambda: env, ctx=ctx,
                                          _new_id=lambda: "a-000000001", version=0, stats=collections.Counter())
            return await M.Actor._episode(actor, "", 0, "builtin/click"), actor.stats

    t0 = time.monotonic()
    tr, stats = asyncio.run(main())
    assert tr.outcome == Outcome.INFRA_ERROR and tr.fault == Fault.INFERENCE and "UNAVAILABLE" in tr.error, tr.error
    assert tr.timings["attempts"] == 1 and stats["infra_inference"] == 1 and not stats["episodes_retried"]
    assert time.monotonic() - t0 < 20
    with open(tmp_path / "episodes.jsonl", "w") as f:  # the learner's log of the arrival, read by `tars up`
        stal = StalenessManager(batch_size=8, eta=100)
        stal.try_admit(1)
        adm = Admission(types.SimpleNamespace(mark_consumed=lambda ids: None), stal, max_lag=8, group=GroupConfig(),
                        episodes=f, archive=None, counters=collections.Counter())
        assert adm.admit(tr, version=0) is False
    mon = report.Monitor(tmp_path)
    mon.poll()
    assert "infra_errors=1 (inference 1)" in mon.progress_line(1.0)
    rep = report.write_report(tmp_path, mon, wall_s=1.0, sft_used=False, sft_s=0.0, status="done")
    assert rep["episodes"] == 1 and rep["infra_errors"] == 1 and rep["infra_errors_by_fault"] == {"inference": 1}
    assert json.loads((tmp_path / "report.json").read_text())["infra_errors_by_fault"] == {"inference": 1}
    assert any("inference 1" in w for w in rep["warnings"])


def test_a_version_change_mid_episode_tags_each_token_with_its_version():
    dc = DecoderConfig(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048)
    model = CausalLM(dc).init_weights(0, std=0.05).eval()
    engine = LocalEngine(InferenceConfig(max_context=2048), model)
    new_weights = {k: v + 0.01 for k, v in model.hf_state_dict().items()}

    async def main():
        async with stack(engine, env_options={"max_steps": "50"}, max_turns=4, max_new_tokens=6,
                         on_parse_error="continue") as (ctx, env):
            real = ctx.infer.generate
            calls = []

            async def generate(*a, **kw):  # the learner publishes version 1 after the policy's second answer
                r = await real(*a, **kw)
                calls.append(r)
                if len(calls) == 2:
                    await asyncio.to_thread(engine.update_weights, 1, None, new_weights)
                return r

            ctx.infer.generate = generate
            return await run_episode(ctx, env, "versions-0001", "builtin/click", 3, 0), calls

    tr, calls = asyncio.run(main())
    assert tr.outcome != "infra_error" and len(tr.turns) == 4
    gen = tr.mask.astype(bool)
    assert (tr.versions[~gen] == -1).all()                    # prompt tokens carry no version
    for i, t in enumerate(tr.turns):
        want = 0 if i < 2 else 1
        assert (tr.versions[t.start:t.end] == want).all(), (i, tr.versions[t.start:t.end])
        assert tr.tokens[t.start:t.end].tolist() == calls[i].output_ids
        assert tr.logprobs[t.start:t.end] == pytest.approx(calls[i].logprobs)
    assert tr.versions_spanned == (0, 1)
    assert Trajectory.decode(tr.encode()).versions.tolist() == tr.versions.tolist()


def test_last_k_screenshots_go_to_the_engine_and_overhead_is_recorded():
    eng = ScriptedEngine(answer("type(content='1')"), TOK.vocab_size)
    seen = []
    respond = eng.respond
    eng.respond = lambda ids, imgs: (seen.append((list(ids), list(imgs))), respond(ids, imgs))[1]

    async def main():
        async with stack(eng, env_options={"render": "1"}, image_history=2, image_tokens=16, max_turns=6) as (ctx, env):
            return await run_episode(ctx, env, "shots-0001", "gym/TarsEpisodeStripes-v0", 1, 0)

    tr = asyncio.run(main())
    assert tr.outcome == "terminated" and len(tr.turns) == 4
    img = TOK.image_id
    for n, (ids, imgs) in enumerate(seen, 1):
        runs = sum(1 for i in range(len(ids)) if ids[i] == img and (i == 0 or ids[i - 1] != img))
        assert runs == n and len(imgs) == min(n, 2)            # one run per turn, only the last 2 images sent
        assert ids == tr.tokens[:len(ids)].tolist()            # each prompt extends the previous conversation
    refs = [t.obs_ref[7:] for t in tr.turns]
    assert len(set(refs)) == 4 and set(tr.images) == set(refs)  # every frame differs; each carried once
    assert seen[-1][1][-1] == tr.images[refs[-1]]
    assert len(tr.timings["actor_ms"]) == 4 and all(0 <= x < 1000 for x in tr.timings["actor_ms"])


def test_a_truncated_episode_ends_with_the_state_it_was_cut_in():
    """Cut by actor.max_turns after 3 turns: the trajectory ends with the prompt a 4th turn would have sent (mask 0,
    version -1), appended to the tokens as they were, and boot_at marks it for the learner's critic to bootstrap
    from; a terminated episode carries none."""
    def run(max_turns, text):
        eng = ScriptedEngine(answer(text), TOK.vocab_size)
        seen = []
        respond = eng.respond
        eng.respond = lambda ids, imgs: (seen.append(list(ids)), respond(ids, imgs))[1]

        async def main():
            async with stack(eng, max_turns=max_turns) as (ctx, env):
                return await run_episode(ctx, env, f"cut-{max_turns}", "gym/TarsEpisodeStripes-v0", 1, 0)
        return asyncio.run(main()), seen

    cut, seen3 = run(3, "type(content='0')")  # action 0: the frame never moves, the episode never ends by itself
    _, seen4 = run(4, "type(content='0')")
    assert cut.outcome == "truncated" and len(cut.turns) == 3
    assert cut.tokens.tolist() == seen4[3]                  # the final state: exactly the 4th turn's prompt
    assert cut.tokens[:len(seen3[2])].tolist() == seen3[2]  # earlier tokens untouched (never re-tokenised)
    end = cut.turns[-1].end
    assert cut.boot_at == len(cut.tokens) > end
    assert not cut.mask[end:].any() and (cut.versions[end:] == -1).all() and (cut.logprobs[end:] == 0).all()
    back = Trajectory.decode(cut.encode())
    assert back.boot_at == cut.boot_at and learner_admits(back)
    done, _ = run(6, "type(content='1')")
    assert done.outcome == "terminated" and done.boot_at == 0 and len(done.tokens) == done.turns[-1].end


def test_the_bootstrap_marker_is_checked_on_the_wire():
    """A boot_at that is not a truncated episode's final prompt is an invalid trajectory (the stream NACKs it
    "invalid"), in a frame as in a Trajectory."""
    from core.schema import InvalidTrajectory

    base = dict(id="x", env_id="e", tokens=np.arange(6, dtype=np.int32), logprobs=np.zeros(6, np.float32),
                versions=np.array([-1, -1, 0, -1, -1, -1], np.int32), mask=np.array([0, 0, 1, 0, 0, 0], np.uint8),
                turns=[], ret=0.0)
    assert Trajectory(outcome="truncated", boot_at=6, **base).validate().boot_at == 6
    assert Trajectory.decode(Trajectory(outcome="truncated", boot_at=3, **base).encode()).boot_at == 3
    assert Trajectory.decode(Trajectory(outcome="truncated", **base).encode()).boot_at == 0
    for outcome, boot_at, why in (("terminated", 6, "only a truncated"), ("truncated", 7, "only a truncated"),
                                  ("truncated", 2, "generated tokens after")):
        with pytest.raises(InvalidTrajectory, match=why):
            Trajectory(outcome=outcome, boot_at=boot_at, **base).validate()
        bad = Trajectory(outcome="truncated", boot_at=6, **base).to_dict()
        bad.update(outcome=outcome, boot_at=boot_at)
        with pytest.raises(InvalidTrajectory, match=why) as e:
            Trajectory.from_dict(bad)
        assert e.value.kind == "invalid"


# ---- the context: a prompt that would not fit is a truncation, not an infra error -----------------------------------
def _recording(engine):
    """The engine, recording the input ids of every request it is given (those it refuses too)."""
    seen = []
    submit = engine.submit

    def rec(input_ids, *a, **kw):
        seen.append(list(input_ids))
        return submit(input_ids, *a, **kw)
    engine.submit = rec
    return seen


def test_a_prompt_that_would_overflow_the_context_on_turn_3_truncates_the_episode_there():
    """inference.max_context (EpisodeContext.max_context) leaves room for two turns: the third turn's prompt is never
    sent; the episode ends truncated ("context") with the tokens of turns 1-2 as they were and that prompt as its final
    state (boot_at past it), is admitted by the learner and trained on with its bootstrap (on main the server refused
    the prompt and the episode was an infra_error, rerun and never trained on)."""
    from learner.ppo import PPOTrainer
    from learner.policy import TrainPolicy
    from core.config import LearnerConfig

    def run(max_context):
        eng = ScriptedEngine(answer("type(content='0')"), TOK.vocab_size)  # the frame never moves: never ends
        seen = _recording(eng)

        async def main():
            async with stack(eng, max_turns=4, on_context_full="truncate") as (ctx, env):
                ctx.max_context = max_context
                return await run_episode(ctx, env, f"ctx-{max_context}", "gym/TarsEpisodeStripes-v0", 1, 0)
        return asyncio.run(main()), seen

    full, seen_full = run(0)  # 0: no limit known
    assert full.outcome == "truncated" and len(seen_full) == 4
    limit = len(seen_full[2]) + ActorConfig().max_new_tokens - 1   # turn 3's prompt is one token too long
    cut, seen = run(limit)
    assert len(seen) == 2 and seen == seen_full[:2]                # the third prompt never reached the server
    assert cut.outcome == Outcome.TRUNCATED and cut.fault == Fault.NONE and cut.truncated_by == "context"
    assert full.truncated_by == "max_turns"
    assert "exceeds max_context" in cut.error and len(cut.turns) == 2
    assert cut.tokens.tolist() == seen_full[2]                     # turns 1-2 untouched + turn 3's prompt, once
    end = cut.turns[-1].end
    assert cut.boot_at == len(cut.tokens) > end and not cut.mask[end:].any()
    back = Trajectory.decode(cut.encode())
    assert back.truncated_by == "context" and back.boot_at == cut.boot_at and learner_admits(back)
    # The learner trains on it: its generated tokens, and the critic's value of the state it was cut in.
    dc = DecoderConfig(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2)
    pol = TrainPolicy.from_config(dc, seed=0)
    stats = PPOTrainer(pol, TrainPolicy.from_config(dc, value_head=True, seed=1), LearnerConfig(), 0).step([back], 0)
    assert stats["tokens"] == int(back.mask[1:].sum()) > 0 and stats["bootstrapped"] == 1
    assert not stats["nonfinite_steps"] and not stats["policy_step_skipped"]


def test_a_conversation_that_outgrows_the_context_goes_on_in_a_new_segment():
    """actor.on_context_full=window (the default): where turn 3's prompt would not fit, the turn starts a new segment,
    a first prompt with the earlier turns' actions as text and the new observation, sent alone; turn 4 extends it.
    Nothing before the seam is re-tokenised, the episode runs to max_turns, the learner admits it, and it computes
    the second segment's logprobs as those of that segment alone (a text checkpoint's segments)."""
    import torch

    from learner.batch import collate
    from learner.policy import TrainPolicy

    def run(max_context):
        eng = ScriptedEngine(answer("type(content='0')"), TOK.vocab_size)  # the frame never moves: never ends
        seen = _recording(eng)

        async def main():
            async with stack(eng, max_turns=4) as (ctx, env):
                ctx.max_context = max_context
                return await run_episode(ctx, env, f"win-{max_context}", "gym/TarsEpisodeStripes-v0", 1, 0)
        return asyncio.run(main()), seen

    full, seen_full = run(0)
    limit = len(seen_full[2]) + ActorConfig().max_new_tokens - 1   # turn 3's whole conversation is one token too long
    tr, seen = run(limit)
    assert tr.truncated_by == "max_turns" and len(tr.turns) == 4 and len(seen) == 4, tr.error
    assert seen[:2] == seen_full[:2] and len(tr.segments) == 1
    seg = tr.segments[0]
    assert tr.tokens[:len(seen[1])].tolist() == seen[1]              # turns 1-2 as they were sent
    assert tr.tokens[seg:seg + len(seen[2])].tolist() == seen[2]     # the new segment's first prompt, sent alone
    assert seen[3][:len(seen[2])] == seen[2] and len(seen[2]) < len(seen_full[2])   # turn 4 extends it
    assert "Previous steps:" in TOK.decode(seen[2]) and "type(content='0')" in TOK.decode(seen[2])
    assert all(len(r) + ActorConfig().max_new_tokens <= limit for r in seen)
    back = Trajectory.decode(tr.encode())
    assert back.segments == [seg] and learner_admits(back)
    dc = DecoderConfig(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2)
    pol = TrainPolicy.from_config(dc, seed=0)
    b = collate([back], pad_id=0)
    assert b.mask[0, seg] == 0 and b.images is not None
    with torch.no_grad():
        lp = pol.token_logprobs(b.tokens, b.valid, vl=b.images)
        alone = pol.token_logprobs(b.tokens[:, seg:], b.valid[:, seg:])
        joined = pol.token_logprobs(b.tokens, b.valid)
    assert torch.allclose(lp[0, seg + 1:], alone[0, 1:], atol=1e-5)   # segment 2 sees nothing of segment 1
    assert torch.allclose(lp[0, 1:seg], joined[0, 1:seg], atol=1e-5)   # segment 1 is the start of the row
    assert not torch.allclose(lp[0, seg + 1:], joined[0, seg + 1:], atol=1e-3)
    # on_context_full=truncate keeps the old cut
    eng = ScriptedEngine(answer("type(content='0')"), TOK.vocab_size)

    async def cut():
        async with stack(eng, max_turns=4, on_context_full="truncate") as (ctx, env):
            ctx.max_context = limit
            return await run_episode(ctx, env, "cut", "gym/TarsEpisodeStripes-v0", 1, 0)
    assert asyncio.run(cut()).truncated_by == "context"


def test_the_servers_context_answer_is_the_same_truncation_never_retried():
    """The actor does not know the server's context (or its config says more): the server answers INVALID_ARGUMENT
    "exceeds max_context" to turn 3. That is the same truncation, the episode is not rerun and no call is retried,
    and the actor keeps the server's limit, so its next episode stops before sending the prompt (on main: an
    infra_error with fault inference)."""
    from actor import main as M

    dc = DecoderConfig(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048)

    def run(max_context, episodes=1):
        model = CausalLM(dc).init_weights(0, std=0.05).eval()
        eng = LocalEngine(InferenceConfig(max_context=max_context), model)
        seen = _recording(eng)

        async def main():
            async with stack(eng, env_options={"max_steps": "50"}, max_turns=4, max_new_tokens=4,
                             temperature=0.0, on_context_full="truncate") as (ctx, env):
                actor = types.SimpleNamespace(acfg=types.SimpleNamespace(episode_attempts=3), _pick_env=lambda: env,
                                              ctx=ctx, _new_id=lambda: f"s-{len(seen):09d}", version=0,
                                              stats=collections.Counter())
                out = [await M.Actor._episode(actor, "", 0, "builtin/click") for _ in range(episodes)]
                return out, actor.stats, ctx
        return asyncio.run(main()), seen

    (full, _, _), seen_full = run(2048)
    assert len(seen_full) == 4 and full[0].outcome == Outcome.TRUNCATED
    limit = len(seen_full[2]) + 4 - 1
    (trs, stats, ctx), seen = run(limit, episodes=2)
    tr = trs[0]
    assert tr.outcome == Outcome.TRUNCATED and tr.fault == Fault.NONE, tr.error
    assert tr.truncated_by == "context" and full[0].truncated_by == "max_turns"
    assert f"exceeds max_context {limit}" in tr.error and len(tr.turns) == 2
    assert tr.tokens.tolist() == seen[2] == seen_full[2]       # ends with exactly the prompt the server refused
    assert tr.boot_at == len(tr.tokens) and learner_admits(Trajectory.decode(tr.encode()))
    assert tr.timings["attempts"] == 1 and not stats["episodes_retried"] and not stats["infra_inference"]
    assert ctx.infer.retried == 0 and ctx.max_context == limit
    # The second episode (the same seed) knows the limit: it stops before sending the prompt that cannot fit.
    assert len(seen) == 3 + 2 and trs[1].truncated_by == "context" and trs[1].tokens.tolist() == seen_full[2]


def test_a_first_prompt_that_does_not_fit_is_counted_and_dropped_by_the_learner(tmp_path):
    """The first prompt alone overflows the context: truncated ("context") with no generated token, its prompt as the
    final state; the learner drops it at arrival, counted no_generated_tokens (a PPO step on it alone is a
    non-finite update), and the run report counts it as truncated by the context."""
    from tars import report

    eng = ScriptedEngine(answer("wait()"), TOK.vocab_size)
    seen = _recording(eng)

    async def main():
        async with stack(eng) as (ctx, env):
            ctx.max_context = 8
            return await run_episode(ctx, env, "tiny-ctx-1", "builtin/click", 3, 0)

    tr = Trajectory.decode(asyncio.run(main()).encode())
    assert not seen and tr.outcome == Outcome.TRUNCATED and tr.truncated_by == "context" and tr.turns == []
    assert len(tr.tokens) > 8 and tr.boot_at == len(tr.tokens) and not tr.mask.any()
    counters = collections.Counter()
    with open(tmp_path / "episodes.jsonl", "w") as f:
        stal = StalenessManager(batch_size=8, eta=100)
        stal.try_admit(1)
        adm = Admission(types.SimpleNamespace(mark_consumed=lambda ids: None), stal, max_lag=8, group=GroupConfig(),
                        episodes=f, archive=None, counters=counters)
        assert adm.admit(tr, version=0) is False
    assert counters["no_generated_tokens"] == 1 and adm.masked == [tr.id]
    mon = report.Monitor(tmp_path)
    mon.poll()
    rep = report.write_report(tmp_path, mon, wall_s=1.0, sft_used=False, sft_s=0.0, status="done")
    assert rep["truncated"] == 1 and rep["truncated_by"] == {"context": 1} and rep["infra_errors"] == 0


def test_every_action_of_an_answer_runs_until_one_ends_the_episode():
    # three actions a turn: turn 1 runs all three (t=3, reward 3); in turn 2 the first ends the episode (t=4) and
    # the other two never reach envd. The turn's reward is the sum of the rewards of the actions that ran.
    stepped = []

    class Recording(EnvClient):
        async def step(self, sid, run_id, action, raw=""):
            stepped.append(action.content)
            return await super().step(sid, run_id, action, raw)

    eng = ScriptedEngine(answer("type(content='1')\ntype(content='1')\ntype(content='1')"), TOK.vocab_size)

    async def main():
        async with stack(eng, max_turns=6, max_new_tokens=64) as (ctx, env):
            rec = Recording(env.address, "", 10.0, 1)
            try:
                return await run_episode(ctx, rec, "multi-0001", "gym/TarsEpisodeStripes-v0", 1, 0)
            finally:
                await rec.close()

    tr = asyncio.run(main())
    assert tr.outcome == "terminated" and len(tr.turns) == 2 and stepped == ["1"] * 4
    assert [t.reward for t in tr.turns] == [3.0, 1.0] and tr.ret == 4.0
    assert [t.action["ran"] for t in tr.turns] == [3, 1] and len(tr.turns[0].action["then"]) == 2


def test_a_new_segment_leaves_out_the_oldest_steps_its_context_cannot_hold():
    """A long episode windows again and again; each new segment's first prompt carries the earlier turns as text, which
    grows with every turn. Where all of it would not fit, the oldest steps are left out (as UI-TARS keeps only its last
    turns) and the episode goes on to max_turns; the steps kept keep their numbers. (It was cut "context" instead.)"""
    eng = ScriptedEngine(answer("type(content='0')"), TOK.vocab_size)  # the frame never moves: never ends
    seen_full = _recording(eng)

    async def main(max_context, turns):
        async with stack(eng, max_turns=turns) as (ctx, env):
            ctx.max_context = max_context
            return await run_episode(ctx, env, f"long-{max_context}", "gym/TarsEpisodeStripes-v0", 1, 0)
    asyncio.run(main(0, 3))
    limit = len(seen_full[2]) + ActorConfig().max_new_tokens - 1   # two turns fit a segment, not three
    eng2 = ScriptedEngine(answer("type(content='0')"), TOK.vocab_size)
    eng, seen = eng2, _recording(eng2)
    tr = asyncio.run(main(limit, 16))
    assert tr.truncated_by == "max_turns" and len(tr.turns) == 16 and len(seen) == 16, tr.error
    assert all(len(r) + ActorConfig().max_new_tokens <= limit for r in seen)
    assert len(tr.segments) >= 3 and learner_admits(Trajectory.decode(tr.encode()))
    last = TOK.decode(seen[-1])
    assert "left out)" in last and "Step 15:" in last and "Step 1:" not in last


def test_sft_on_a_windowed_text_trajectory_trains_each_segment_alone():
    """`tars sft` on stored trajectories: a text trajectory with segments binds to a text checkpoint (no images), the
    segment's first token is not a loss token, and the loss is that of the segments as separate examples."""
    import torch

    from learner.data import sft_examples
    from learner.policy import TrainPolicy
    from learner.sft import bind_images, sft_backward

    rng = np.random.default_rng(0)
    n, seg = 40, 22
    mask = np.zeros(n, np.uint8)
    mask[10:20] = mask[30:38] = 1
    tr = Trajectory(id="w", env_id="x", outcome="terminated", tokens=rng.integers(5, 60, n).astype(np.int32),
                    logprobs=np.where(mask, -1.0, 0).astype(np.float32), versions=np.where(mask, 0, -1).astype(np.int32),
                    mask=mask, turns=[], ret=1.0, segments=[seg])
    dc = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2)
    pol = TrainPolicy.from_config(dc, seed=0)
    (ex,) = bind_images(pol, sft_examples([tr]))
    assert ex[2].starts == [0, seg] and ex[1][seg] == 0
    parts = [(tr.tokens[:seg].tolist(), mask[:seg].tolist()), (tr.tokens[seg:].tolist(), mask[seg:].tolist())]

    def grads(examples):
        pol.zero_grad()
        loss = sft_backward(pol, examples, 0, 4096, torch.device("cpu"), None)
        return float(loss), [p.grad.clone() for p in pol.parameters() if p.grad is not None]
    l1, g1 = grads([ex])
    l2, g2 = grads(parts)
    assert l1 == pytest.approx(l2, rel=1e-5) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g1, g2))


class ResetBreaksEnv(StripesEnv):
    """Stripes whose `breaks_at`-th reset (per instance, 1-based) raises: envd answers that Reset INFRA_ERROR."""

    breaks_at = 1

    def reset(self, *, seed=None, options=None):
        self.resets = getattr(self, "resets", 0) + 1
        if self.resets == self.breaks_at:
            raise RuntimeError("the backend died during reset")
        return super().reset(seed=seed, options=options)


gymnasium.register("TarsEpisodeResetBreaks-v0", entry_point=ResetBreaksEnv, max_episode_steps=50)


def test_an_episode_whose_reset_broke_the_backend_is_infra_error_of_the_env():
    """envd answers a Reset whose backend crashed INFRA_ERROR with no observation, and closes the session: no
    episode runs on that (the model was asked on an empty screen, and an unparseable answer then made it a trained
    truncated episode; a parseable one stepped a closed session and blamed the daemon, fault envd)."""
    eng = ScriptedEngine(answer("garbage"), TOK.vocab_size)
    asked = []
    respond = eng.respond
    eng.respond = lambda ids, imgs: (asked.append(1), respond(ids, imgs))[1]

    async def main():
        async with stack(eng, max_turns=3, on_parse_error="stop") as (ctx, env):
            return await run_episode(ctx, env, "reset-broke", "gym/TarsEpisodeResetBreaks-v0", 1, 0)

    tr = asyncio.run(main())
    assert tr.outcome == "infra_error" and tr.fault == Fault.ENV and "died during reset" in tr.error
    assert not tr.turns and not asked and not learner_admits(tr)


def test_a_kept_session_whose_reset_broke_is_replaced():
    """actor.keep_sessions: a kept session whose Reset answers INFRA_ERROR (its backend died while idle) is dropped
    and a new session started, as for a kept session whose lease ran out."""
    async def main():
        ResetBreaksEnv.breaks_at = 2   # each instance: its first reset works, its second breaks
        try:
            async with stack(ScriptedEngine(answer("type(content='1')"), TOK.vocab_size), max_turns=8) as (ctx, env):
                env.keep_sessions = 1
                trs = [await run_episode(ctx, env, f"kept-{i}", "gym/TarsEpisodeResetBreaks-v0", 1, 0)
                       for i in range(2)]
                return trs, env.created, env.reused
        finally:
            ResetBreaksEnv.breaks_at = 1

    trs, created, reused = asyncio.run(main())
    assert [t.outcome for t in trs] == ["terminated", "terminated"] and trs[1].ret == trs[0].ret == 4.0
    assert created == 2 and reused == 0


def test_a_tars_vision_answer_that_samples_the_image_placeholder_ends_the_episode_as_a_parse_error():
    """With screenshots shown, a sampled <|image|> placeholder is a run the engine binds a screenshot to, or refuses
    (a run that is not grid**2 long: INVALID_ARGUMENT on every later request). It made the next turn's request fail,
    and the episode infra_error (fault inference, never trained on, so never discouraged); now generation stops on it
    and it is a parse error that ends the episode, as a VL vision token is."""
    from core.vision import VisionConfig, bind

    v = VisionConfig(grid=2, patch=4, image_token_id=TOK.image_id)

    class Binding(ScriptedEngine):   # the local engine's binding rule in front of the scripted answers
        def submit(self, input_ids, params=None, trajectory_id="", max_stale_versions=None, on_token=None, images=()):
            bind(list(input_ids), list(images), v)
            self.stops = list(params.stop_token_ids)
            return super().submit(input_ids, params, trajectory_id, max_stale_versions, on_token, images)

    ok = TOK.answer("type(content='0')")
    stray = ok[:2] + [TOK.image_id] + ok[2:]
    asked = []
    eng = Binding(lambda ids, imgs: (asked.append(1), stray if len(asked) == 2 else ok)[1], TOK.vocab_size)

    async def main():
        async with stack(eng, env_options={"render": "1"}, image_history=2, image_tokens=v.tokens, max_turns=4,
                         max_new_tokens=32) as (ctx, env):
            return await run_episode(ctx, env, "stray-placeholder", "gym/TarsEpisodeStripes-v0", 1, 0)

    tr = asyncio.run(main())
    assert TOK.image_id in eng.stops and len(asked) == 2
    assert tr.outcome == "truncated" and tr.truncated_by == "parse_error" and tr.fault == Fault.NONE
    last = tr.turns[-1]
    assert last.parse_error.startswith("the model wrote a vision token")
    assert tr.tokens[last.start:last.end].tolist() == stray[:3] and tr.boot_at == len(tr.tokens)
    assert learner_admits(Trajectory.decode(tr.encode()))


def test_demonstrations_are_the_actors_tokens_under_the_runs_env_options():
    """SFT trains on what RL will show: the quickstart's demonstrator (confused:0:1) under its actor.env_options
    (strict_targets=1, a click on a label not on screen is rejected) and max_turns 3, replayed by the actor through
    envd and the inference server, gives the demonstration's ids and loss mask token for token, the "Invalid action."
    note after a rejected click included. The builtin demonstrations ignored actor.env_options: 0 of 200 carried the
    note while envd rejected an action in 70 of them."""
    import random

    from tars.demos import demonstrations

    opts = {"strict_targets": "1"}
    found = []
    for seed in range(60):   # one episode per seed: its env seed is the first draw of random.Random(seed)
        (toks, mask), = demonstrations(TOK, ["builtin/mixed"], 1, "confused:0:1", seed, 3, env_options=opts)
        if "Invalid action." in TOK.decode(toks, skip_special=False):
            found.append((seed, toks, mask))
    assert len(found) >= 5, f"{len(found)} of 60 demonstrations show a rejected action"

    answers: list[list[int]] = []
    eng = ScriptedEngine(lambda _ids, _imgs: answers.pop(0), TOK.vocab_size)

    async def main():
        out = []
        async with stack(eng, env_options=opts, max_turns=3) as (ctx, env):
            for seed, toks, mask in found[:5]:
                answers[:] = [[]]
                for t, m, prev in zip(toks, mask, [0] + mask):
                    if m and not prev:
                        answers.append([])
                    if m:
                        answers[-1].append(t)
                del answers[0]
                tr = await run_episode(ctx, env, f"demo-{seed}", "builtin/mixed", random.Random(seed).randrange(1 << 30), 0)
                out.append((toks, mask, tr))
        return out

    for toks, mask, tr in asyncio.run(main()):
        assert any(t.parse_error for t in tr.turns)                    # envd rejected one of the demonstrated actions
        assert tr.tokens[:len(toks)].tolist() == toks
        assert tr.mask[:len(mask)].tolist() == mask
        assert tr.outcome != "truncated" or tr.mask[len(mask):].sum() == 0   # nothing generated past the demonstration


def test_the_steps_left_out_are_the_fewest_that_fit_found_in_log_renders(monkeypatch):
    """_prompt leaves out the fewest oldest steps that make a new segment's first prompt fit (all of them when none
    does), the same answer as trying one more step at a time, with O(log steps) renders instead of one per step."""
    import math

    from actor import episode as ep

    rng = np.random.default_rng(0)
    for case in range(300):
        n = int(rng.integers(1, 200))
        sizes = np.sort(rng.integers(1, 50, n))[::-1]            # what each step adds to the prompt
        base, limit = int(rng.integers(10, 100)), int(rng.integers(50, 3000))
        calls = []

        def once(ctx, *a, history=None, skip=0, **kw):
            calls.append(skip)
            return ep._Prompt(ids=[0] * (base + int(sum(len(h) for h in history[skip:]))), new_segment=True)

        monkeypatch.setattr(ep, "_prompt_once", once)
        history = ["x" * int(s) for s in sizes]
        ctx = types.SimpleNamespace(max_context=limit + 24, cfg=types.SimpleNamespace(max_new_tokens=24))
        got = ep._prompt(ctx, history=history)
        want = next((k for k in range(n + 1) if base + sum(sizes[k:]) <= limit), n)
        assert len(got.ids) == base + sum(sizes[want:]), (case, want)
        assert len(calls) <= 2 + math.ceil(math.log2(n + 1)), (case, len(calls))
