"""LLM-as-judge outcome reward (actor/judge.py) through a real InferenceService: verdicts, rewards, failures."""
from __future__ import annotations

import asyncio

import pytest

from actor import judge as J
from actor.episode import EpisodeContext, run_episode
from core.inference_client import InferenceClient
from inference_server.engine import LocalEngine
from inference_server.scripted import ScriptedEngine
from core.config import InferenceConfig
from core.model import CausalLM, DecoderConfig
from core.outcome import Fault
from core.vision import VisionConfig
from test_episode import TOK, answer, stack


@pytest.mark.parametrize("text,want", [
    ("YES", ("yes", 1.0)), ("no.", ("no", 0.0)), ("Thought: done. Answer: Yes, it did; not NO", ("yes", 1.0)),
    ("Score: 0.75", ("score=0.75", 0.75)), ("reward=1", ("score=1", 1.0)), ("score: 1.5 so NO", ("no", 0.0)),
])
def test_parse_verdict(text, want):
    assert J.parse_verdict(text) == want


@pytest.mark.parametrize("text", ["", "maybe", "yesterday nothing", "score: high", None])
def test_unparseable_verdicts_are_errors(text):
    with pytest.raises(J.JudgeError):
        J.parse_verdict(text)


def test_judge_prompt_keeps_the_last_five_screenshots():
    steps = [J.Step(f"screen {i}", f"click(target='b{i}')", bytes([i]) if i != 3 else b"") for i in range(7)]
    ids, imgs = J.judge_prompt(TOK, "do it", steps, "final", b"F", 5, 16)
    img = TOK.image_id
    assert imgs == [bytes([2]), bytes([4]), bytes([5]), bytes([6]), b"F"]
    assert ids.count(img) == 5 * 16
    text = TOK.decode(ids)
    assert "Task: do it" in text and "Step 7: Screen: screen 6" in text and J.QUESTION in text
    assert J.judge_prompt(TOK, "x", steps, "f", b"F", 0, 16)[1] == []


class TwoVoices(ScriptedEngine):
    """The policy always says `policy`; a request whose prompt ends with the judge question gets `verdict`."""

    def __init__(self, policy: str, verdict: str):
        pol, ver = answer(policy), answer(verdict)

        def respond(ids, imgs):
            judge = J.QUESTION in TOK.decode(ids)
            self.judged += judge
            return (ver if judge else pol)(ids, imgs)

        self.judged = 0
        super().__init__(respond, TOK.vocab_size)


def run(engine, **kw):
    async def main():
        async with stack(engine, env_options={"max_steps": "3"}, max_turns=3, **kw) as (ctx, env):
            return await run_episode(ctx, env, "judged-0001", "builtin/click", 5, 0)
    return asyncio.run(main())


def test_yes_verdict_replaces_the_env_reward_and_is_logged():
    eng = TwoVoices("wait()", "YES")
    tr = run(eng, judge_mode="replace", judge_weight=2.0)
    assert eng.judged == 1 and tr.outcome == "truncated"
    assert tr.judge["verdict"] == "yes" and tr.judge["reward"] == 2.0 and tr.judge["mode"] == "replace"
    assert tr.ret == 2.0 and [t.reward for t in tr.turns] == [0.0, 0.0, 2.0]
    assert tr.encode() and type(tr).decode(tr.encode()).judge["verdict"] == "yes"


def test_no_verdict_adds_nothing_and_format_penalties_stay():
    eng = TwoVoices("gibberish", "NO")
    tr = run(eng, judge_mode="add", format_penalty=-0.1)
    assert tr.judge["verdict"] == "no" and tr.ret == pytest.approx(-0.3)


@pytest.mark.parametrize("on_error,outcome", [("infra_error", "infra_error"), ("env", "truncated")])
def test_unparseable_verdict_is_infra_error_or_falls_back(on_error, outcome):
    tr = run(TwoVoices("wait()", "hmm"), judge_mode="replace", judge_on_error=on_error)
    assert tr.outcome == outcome and "unparseable" in tr.judge["error"]
    if on_error == "infra_error":
        assert tr.error.startswith("judge:") and tr.fault == Fault.JUDGE
    else:
        assert tr.judge["fallback"] == "env" and tr.error == "" and tr.fault == Fault.NONE


def test_judge_server_down_is_infra_error():
    async def main():
        async with stack(ScriptedEngine(answer("wait()"), TOK.vocab_size), env_options={"max_steps": "2"},
                         max_turns=2, judge_mode="add", rpc_timeout_s=2.0) as (ctx, env):
            ctx.judge_infer = InferenceClient(["127.0.0.1:1"], timeout_s=2.0, retries=1)  # nothing listens there
            try:
                return await run_episode(ctx, env, "judged-0002", "builtin/click", 5, 0)
            finally:
                await ctx.judge_infer.close()

    tr = asyncio.run(main())
    assert tr.outcome == "infra_error" and "UNAVAILABLE" in tr.error and len(tr.turns) == 2
    assert tr.fault == Fault.JUDGE


def test_bad_judge_config_is_refused():
    from core.config import ActorConfig

    with pytest.raises(ValueError, match="judge_mode"):
        EpisodeContext(ActorConfig(judge_mode="sometimes"), TOK, None, "a")


def test_real_local_engine_with_a_vision_model_judges_with_screenshots():
    v = VisionConfig(grid=2, patch=4, image_token_id=TOK.image_id)
    dc = DecoderConfig(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096, extra=v.to_extra())
    eng = LocalEngine(InferenceConfig(max_context=4096), CausalLM(dc).init_weights(0, std=0.05).eval())

    async def main():
        async with stack(eng, env_options={"render": "1"}, image_history=1, image_tokens=v.tokens, max_turns=3,
                         max_new_tokens=4, judge_mode="replace", judge_images=5) as (ctx, env):
            return await run_episode(ctx, env, "judged-0003", "gym/TarsEpisodeStripes-v0", 1, 0)

    tr = asyncio.run(main())
    # An untrained model's verdict is noise: either it parsed (and is logged) or the episode is infra_error.
    if tr.outcome == "infra_error":
        assert tr.error.startswith("judge: unparseable") and "error" in tr.judge
    else:
        assert tr.judge["verdict"] in ("yes", "no") or tr.judge["verdict"].startswith("score=")
    assert eng.stats["requests"] == 4                    # three policy turns + one judge call
    assert eng.stats["images"] == 3 + 4                  # one per policy turn; the judge: 3 turns + the final screen
