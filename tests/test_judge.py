"""LLM-as-judge outcome reward (actor/judge.py) through a real InferenceService: verdicts, rewards, failures."""
from __future__ import annotations

import asyncio

import re

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
from envd.base import Env
from test_episode import TOK, answer, stack


@pytest.mark.parametrize("text,want", [
    ("YES", ("yes", 1.0)), ("no.", ("no", 0.0)), ("Thought: done. Answer: Yes, it did; not NO", ("yes", 1.0)),
    ("Score: 0.75", ("score=0.75", 0.75)), ("reward=1", ("score=1", 1.0)), ("score: 1.5 so NO", ("no", 0.0)),
    ("Score: 10/10, NO", ("no", 0.0)), ("Score: 15. NO", ("no", 0.0)), ("score: 1. done", ("score=1", 1.0)),
    ("Score: 0.", ("score=0", 0.0)),
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


def test_replace_drops_the_env_rewards_of_a_turn_whose_later_action_was_rejected():
    """Each answer: an action that runs (reward 1) and one the env rejects (9 is outside its action space). With
    judge_mode=replace and a NO verdict such a turn keeps only its format penalty; it kept the 1 of the action that
    ran (return 2.7 for a NO)."""
    async def main():
        async with stack(TwoVoices("type(content='1')\ntype(content='9')", "NO"), max_turns=6, max_new_tokens=64,
                         judge_mode="replace", format_penalty=-0.1) as (ctx, env):
            return await run_episode(ctx, env, "judged-rejected", "gym/TarsEpisodeStripes-v0", 1, 0)

    tr = asyncio.run(main())
    assert tr.outcome == "terminated" and tr.judge["verdict"] == "no" and len(tr.turns) == 4
    assert all(t.parse_error for t in tr.turns[:3]) and [t.action["ran"] for t in tr.turns] == [1, 1, 1, 1]
    assert [t.reward for t in tr.turns] == [-0.1, -0.1, -0.1, 0.0] and tr.ret == pytest.approx(-0.3)


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
            # nothing listens there
            ctx.judge = J.JudgeModel(InferenceClient(["127.0.0.1:1"], timeout_s=2.0, retries=1), ctx.tok, ctx.vision)
            try:
                return await run_episode(ctx, env, "judged-0002", "builtin/click", 5, 0)
            finally:
                await ctx.judge.infer.close()

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
    # The engine samples unseeded (an OS-seeded stream), so the random model may end the episode early (a sampled
    # vision token is a parse error that stops it): count by the turns it took, up to max_turns=3.
    n = len(tr.turns)
    assert 1 <= n <= 3
    assert eng.stats["requests"] == n + 1                # the policy's turns + one judge call
    assert eng.stats["images"] == n + (n + 1)            # one per policy turn; the judge: every turn + the final screen


# ---- a vision-language checkpoint (Qwen2.5-VL): the judge's runs are sized and framed as the actor's turns -------
VL_SIZES = [(56, 56), (112, 56), (84, 112), (200, 120), (320, 200), (140, 140)]   # six screenshots, six pad counts


def _png(w: int, h: int, k: int) -> bytes:
    import numpy as np

    from envd.png import encode_png

    f = np.zeros((h, w, 3), np.uint8)
    f[:, (k * 13) % w] = (255, 64 + k, 7)
    return encode_png(f)


class SizesEnv(Env):
    """A screen whose screenshot has another size at every step (VL_SIZES in turn); any action is accepted."""

    def __init__(self, name, options):
        self.steps = 0

    def _obs(self):
        from envd.base import Outcome as O, Screenshot, StepResult

        w, h = VL_SIZES[self.steps % len(VL_SIZES)]
        return StepResult(text=f"step {self.steps}", instruction="look around", reward=0.25, outcome=O.RUNNING,
                          images=[Screenshot(_png(w, h, self.steps), width=w, height=h)], width=w, height=h,
                          step=self.steps)

    def reset(self, seed, options):
        self.steps = 0
        return self._obs()

    def step(self, action):
        self.steps += 1
        return self._obs()



@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    from tests.hf_dirs import make_vl_checkpoint

    d = tmp_path_factory.mktemp("judge-vl")
    make_vl_checkpoint(d, max_pixels=64 * 28 * 28, min_pixels=4 * 28 * 28)
    return d


@pytest.fixture(scope="module")
def vl_tok(vl_dir):
    from core.chat import ChatTokenizer

    return ChatTokenizer.load(vl_dir)


def _vl_steps():
    shots = [_png(w, h, k) for k, (w, h) in enumerate(VL_SIZES)]
    return [J.Step(f"screen {i}", "wait()", shots[i]) for i in range(5)], shots


def _check_vl_request(tok, spec, ids, imgs, want):
    """The judge request fits the engine's binding rule: its images are `want`, every framed run's pad count is
    spec.image_tokens of its own image, and there is no other run."""
    from core.vlm import bind_runs, png_size

    assert imgs == want
    sizes = [png_size(b) for b in imgs]
    runs = bind_runs(ids, sizes, spec)                 # ValueError if a run does not fit its image
    assert [e - s for s, e in runs] == [spec.image_tokens(w, h) for w, h in sizes]
    assert ids.count(tok.vision_start_id) == ids.count(tok.vision_end_id) == len(want)


def test_vl_judge_prompt_sizes_each_run_for_its_own_screenshot(vl_tok):
    from actor.uitars import resolve
    from core.config import ActorConfig

    vis = resolve(ActorConfig(), vl_tok)
    steps, shots = _vl_steps()
    ids, imgs = J.judge_prompt(vl_tok, "look", steps, "final", shots[5], 5, 16, vis)
    _check_vl_request(vl_tok, vis.spec, ids, imgs, shots[1:])
    assert len({vis.tokens(b) for b in imgs}) > 1      # the sizes differ, so one fixed count could not fit them all
    text = vl_tok.decode(ids)
    assert "Task: look" in text and "Step 5: Screen: screen 4" in text and J.QUESTION in text
    # an unreadable screenshot is a judge error with a clear message, not a crash
    bad = [*steps[:4], J.Step("s", "wait()", b"\x89PNG not really")]
    with pytest.raises(ValueError, match="not a readable"):
        J.judge_prompt(vl_tok, "look", bad, "final", shots[5], 5, 16, vis)


def test_vl_episode_judge_request_binds_the_last_five_screenshots(vl_tok):
    """A whole episode on a VL checkpoint (scripted engine): 5 turns on screens of 5 sizes + a final one; the judge's
    request carries the last 5 of those 6 screenshots, each run sized for its image, and its YES is the verdict."""
    from envd import registry
    from test_episode_vl import stack as vl_stack

    spec_ids = []

    def respond(ids, imgs):
        judge = J.QUESTION in vl_tok.decode(ids)
        spec_ids.append((judge, list(ids), [bytes(b) for b in imgs]))
        return vl_tok.answer("YES" if judge else "wait()")

    registry.register("judgesizes", SizesEnv, ["screen"])
    try:
        async def main():
            async with vl_stack(vl_tok, ScriptedEngine(respond, vl_tok.vocab_size), max_turns=5,
                                judge_mode="replace", judge_images=5) as (ctx, env):
                return ctx, await run_episode(ctx, env, "judged-vl-01", "judgesizes/screen", 1, 0)

        ctx, tr = asyncio.run(main())
    finally:
        registry.unregister("judgesizes")
    judged = [(ids, imgs) for j, ids, imgs in spec_ids if j]
    assert len(judged) == 1 and len(spec_ids) == 6
    assert tr.judge["verdict"] == "yes" and tr.outcome == "truncated"
    shots = [imgs[-1] for j, _, imgs in spec_ids if not j]   # the screenshot each policy turn was shown
    from core.vlm import png_size

    assert [png_size(b) for b in shots] == VL_SIZES[:5]
    ids, imgs = judged[0]
    assert png_size(imgs[-1]) == VL_SIZES[5]          # the final screen, never shown to the policy
    _check_vl_request(vl_tok, ctx.vision.spec, ids, imgs, shots[1:] + [imgs[-1]])


def test_vl_judge_request_is_accepted_by_the_real_local_engine(vl_dir, vl_tok):
    """J.ask (the Vision resolved from the tokenizer's checkpoint) through a real InferenceServer over
    LocalEngine(cfg, VL_DIR): the engine binds the 5 images to the prompt's 5 runs and answers; an untrained model's
    answer is noise, so it either parses or is an unparseable-verdict error, never a refused request."""
    from actor.uitars import resolve
    from core.config import ActorConfig
    from inference_server.server import InferenceServer

    eng = LocalEngine(InferenceConfig(max_context=4096), str(vl_dir))
    cfg = ActorConfig(judge_max_new_tokens=4, rpc_timeout_s=30.0)
    steps, shots = _vl_steps()

    async def main():
        srv = InferenceServer(InferenceConfig(host="127.0.0.1", port=0), eng)
        await srv.start()
        infer = InferenceClient([srv.address], timeout_s=30.0, retries=1)
        try:
            judge = J.JudgeModel(infer, vl_tok, resolve(cfg, vl_tok))
            return await J.ask(judge, cfg, "vl-judge", "look", steps, "final", shots[5])
        except J.JudgeError as e:
            return e
        finally:
            await infer.close()
            await srv.stop(0.5)
            eng.close()

    out = asyncio.run(main())
    if isinstance(out, J.JudgeError):
        assert "unparseable" in str(out), out                # not "judge inference failed: INVALID_ARGUMENT"
    else:
        assert out.verdict in ("yes", "no") or out.verdict.startswith("score=")
    assert eng.stats["requests"] == 1 and eng.stats["images"] == 5


def test_a_judge_prompt_over_the_budget_leaves_out_the_oldest_steps_then_cuts_the_screens():
    steps = [J.Step(f"screen {i} " + "x" * 200, f"click(target='b{i}')", bytes([i + 1])) for i in range(8)]
    full, _ = J.judge_prompt(TOK, "do it", steps, "final", b"F", 5, 4)
    ids, imgs = J.judge_prompt(TOK, "do it", steps, "final", b"F", 5, 4, budget=len(full) // 2)
    text = TOK.decode(ids)
    assert len(ids) <= len(full) // 2 and "earlier steps not shown" in text and "Step 8: Screen: screen 7" in text
    assert "Step 1: Screen" not in text and J.QUESTION in text and imgs[-1] == b"F"
    assert len(imgs) == ids.count(TOK.image_id) // 4          # a left-out step's screenshot went with it
    cut, _ = J.judge_prompt(TOK, "do it", steps, "final " + "y" * 3000, b"", 0, 4, budget=len(full) // 3)
    assert len(cut) <= len(full) // 3 and "..." in TOK.decode(cut)
    with pytest.raises(J.JudgeError, match="server takes"):
        J.judge_prompt(TOK, "do it " * 200, steps, "final", b"", 0, 4, budget=20)


def test_a_long_episodes_judge_prompt_leaves_out_the_fewest_steps_in_few_tokenizations(monkeypatch):
    """The fewest oldest steps are left out (one fewer does not fit), found by bisection: about log2(steps)
    tokenizations of the prompt, not one per step left out."""
    steps = [J.Step(f"screen {i} " + "x" * 100, f"click(target='b{i}')") for i in range(300)]
    full, _ = J.judge_prompt(TOK, "do it", steps, "final", b"", 0, 4)
    real, calls = J._prompt, []
    monkeypatch.setattr(J, "_prompt", lambda *a: calls.append(a) or real(*a))
    budget = len(full) // 5
    ids, _ = J.judge_prompt(TOK, "do it", steps, "final", b"", 0, 4, budget=budget)
    drop = int(re.search(r"\((\d+) earlier steps not shown\)", TOK.decode(ids)).group(1))
    assert len(ids) <= budget < len(real(TOK, "do it", steps, "final", b"", 0, 4, None, drop - 1, 0)[0])
    assert len(calls) <= 11, len(calls)                       # 1 + ceil(log2(300)); one per step left out: ~240


def test_the_judge_fits_its_prompt_to_the_limit_its_server_answers():
    """A judge server whose context is unknown to the actor refuses a long prompt with its limit; the judge fits
    the prompt to it and asks once more, so a long episode is judged instead of becoming an infra error."""
    class Limited(ScriptedEngine):
        max_context = 0

        def submit(self, input_ids, params=None, *a, **kw):
            if params is not None and len(input_ids) + params.max_new_tokens > self.max_context:
                raise ValueError(f"prompt ({len(input_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                                 f"exceeds max_context {self.max_context}")
            return super().submit(input_ids, params, *a, **kw)

    steps = [J.Step(f"screen {i} " + "x" * 300, f"click(target='b{i}')") for i in range(8)]
    eng = Limited(answer("YES"), TOK.vocab_size)
    full, _ = J.judge_prompt(TOK, "do it", steps, "final", b"", 0, 0)

    async def main():
        from core.config import ActorConfig
        from inference_server.server import InferenceServer
        cfg = ActorConfig(judge_max_new_tokens=8)
        eng.max_context = len(full) // 2
        srv = InferenceServer(InferenceConfig(host="127.0.0.1", port=0, max_context=4096), eng)
        await srv.start()
        c = InferenceClient([srv.address], timeout_s=10.0, retries=0)
        try:
            judge = J.JudgeModel(c, TOK, None)
            got = await J.ask(judge, cfg, "t", "do it", steps, "final", b"")
            assert judge.max_context == eng.max_context  # learnt once: the next episode's prompt fits at once
            return got
        finally:
            await c.close()
            await srv.stop(0.5)
            eng.close()

    assert asyncio.run(main()).verdict == "yes"


# ---- a judge of its own (actor.judge_model / actor.judge_inference) ---------------------------------------------
@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    from tests.hf_dirs import make_checkpoint

    d = tmp_path_factory.mktemp("judge-llama")
    make_checkpoint(d, arch="llama", seed=3, vocab_size=400)  # another family, template and vocabulary
    return d


def test_a_judge_of_its_own_is_asked_on_its_servers_in_its_own_tokens(judge_dir):
    """The policy (which would answer NO) is never asked; the judge's server gets the judge prompt in the judge's
    tokenizer and chat template, and its YES, decoded by that tokenizer, is the verdict."""
    import dataclasses

    from core.chat import ChatTokenizer
    from inference_server.server import InferenceServer

    jtok = ChatTokenizer.load(judge_dir)
    asked = []

    def respond(ids, imgs):
        asked.append(list(ids))
        return jtok.answer("YES")

    policy = TwoVoices("wait()", "NO")

    async def main():
        async with stack(policy, env_options={"max_steps": "3"}, max_turns=3, judge_mode="replace") as (ctx, env):
            srv = InferenceServer(InferenceConfig(host="127.0.0.1", port=0), ScriptedEngine(respond, jtok.vocab_size))
            await srv.start()
            acfg = dataclasses.replace(ctx.cfg, judge_model=str(judge_dir), judge_inference=srv.address)
            ctx.judge = J.open_judge(acfg, ctx.tok, ctx.vision)
            try:
                return await run_episode(ctx, env, "judged-own", "builtin/click", 5, 0)
            finally:
                await ctx.judge.infer.close()
                await srv.stop(0.5)

    tr = asyncio.run(main())
    assert policy.judged == 0 and len(asked) == 1
    assert J.QUESTION in jtok.decode(asked[0]) and J.QUESTION not in TOK.decode(asked[0])
    assert jtok.first_prompt("", ["x"])[:3] == asked[0][:3]  # the judge's chat template opens the prompt
    assert tr.judge["verdict"] == "yes" and tr.ret == 1.0


def test_open_judge_needs_servers_for_a_judge_model_and_falls_back_to_the_policy(judge_dir):
    from core.config import ActorConfig

    vis = object()

    async def main():
        assert J.open_judge(ActorConfig(judge_model=str(judge_dir)), TOK, vis) is None        # judge_mode off
        assert J.open_judge(ActorConfig(judge_mode="add"), TOK, vis) is None                  # the policy judges
        with pytest.raises(ValueError, match="actor.judge_inference"):
            J.open_judge(ActorConfig(judge_mode="add", judge_model=str(judge_dir)), TOK, vis)
        copy = J.open_judge(ActorConfig(judge_mode="add", judge_inference="127.0.0.1:1, 127.0.0.1:2"), TOK, vis)
        assert copy.tok is TOK and copy.vision is vis   # servers of a copy of the policy: its tokenizer
        own = J.open_judge(ActorConfig(judge_mode="add", judge_model=str(judge_dir), judge_inference="127.0.0.1:1"),
                           TOK, vis)
        assert own.tok.path and own.tok is not TOK and not own.vision.vl
        await copy.infer.close()
        await own.infer.close()
    asyncio.run(main())


def test_a_vision_language_judge_of_a_text_policy_sizes_each_run_for_its_own_processor(vl_dir):
    """A text policy (TOK: no image runs of its own) judged by a Qwen2.5-VL checkpoint: the judge's Vision is its own
    checkpoint's, so its prompt carries the last five screenshots, each run sized by its processor."""
    from core.config import ActorConfig

    async def main():
        own = J.open_judge(ActorConfig(judge_mode="add", judge_model=str(vl_dir), judge_inference="127.0.0.1:1"),
                           TOK, None)
        await own.infer.close()
        return own

    own = asyncio.run(main())
    assert own.vision.vl and own.tok.vision_start_id >= 0
    steps, shots = _vl_steps()
    ids, imgs = J.judge_prompt(own.tok, "look", steps, "final", shots[5], 5, 16, own.vision)
    _check_vl_request(own.tok, own.vision.spec, ids, imgs, shots[1:])
