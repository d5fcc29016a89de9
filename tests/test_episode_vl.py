"""A vision-language checkpoint's episodes (actor/uitars.py) through a real envd and a real InferenceService over the
scripted engine: the UI-TARS prompt, screenshots as framed image runs, every action of a turn in order with its
coordinates mapped to the screen, and segments + image_refs that satisfy the VL contract (docs/actor.md)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import threading

import numpy as np
import pytest

from actor.envclient import EnvClient
from actor.episode import EpisodeContext, run_episode
from actor.uitars import resolve
from core.chat import ChatTokenizer
from core.config import ActorConfig, EnvdConfig, InferenceConfig
from core.inference_client import InferenceClient
from core.vlm import VLSpec, png_size
from envd import registry
from envd.base import Action, ActionError, Env, Outcome, Screenshot, StepResult
from envd.png import encode_png
from envd.server import EnvServer
from inference_server.scripted import ScriptedEngine
from inference_server.server import InferenceServer
from tests.hf_dirs import make_vl_checkpoint

SCREEN_W, SCREEN_H = 320, 200


class ScreenEnv(Env):
    """A 320x200 screen whose screenshot changes with every step; it records the actions it receives. Clicks give
    0.25 each, finished() ends the episode with 1; a click off the screen is rejected. `noscreen` leaves the
    observation's width/height unset (the actor then reads the screenshot's own size)."""

    received: list = []
    lock = threading.Lock()

    def __init__(self, name, options):
        self.name, self.steps = name, 0

    def _obs(self, reward=0.0, outcome=Outcome.RUNNING) -> StepResult:
        f = np.zeros((SCREEN_H, SCREEN_W, 3), np.uint8)
        f[:, (self.steps * 7) % SCREEN_W] = (255, 128, 7)
        size = (0, 0) if self.name == "noscreen" else (SCREEN_W, SCREEN_H)
        png = b"\x89PNG not really" if self.name == "badshot" else encode_png(f)
        return StepResult(text=f"step {self.steps}", instruction="click the stripe", reward=reward, outcome=outcome,
                          images=[Screenshot(png, width=SCREEN_W, height=SCREEN_H)],
                          width=size[0], height=size[1], step=self.steps)

    def reset(self, seed, options):
        self.steps = 0
        return self._obs()

    def step(self, action: Action) -> StepResult:
        with ScreenEnv.lock:
            ScreenEnv.received.append((action.type, action.point))
        if action.type == "finished":
            self.steps += 1
            return self._obs(1.0, Outcome.TERMINATED)
        if action.type != "click" or action.point is None:
            raise ActionError(f"unsupported {action.type}")
        action.check_on_screen(SCREEN_W, SCREEN_H)
        self.steps += 1
        return self._obs(0.25)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    registry.register("vlscreen", ScreenEnv, ["screen", "noscreen", "badshot"])
    yield
    registry.unregister("vlscreen")


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("vl")
    make_vl_checkpoint(d, max_pixels=64 * 28 * 28, min_pixels=4 * 28 * 28)
    return d


@pytest.fixture(scope="module")
def tok(vl_dir):
    return ChatTokenizer.load(vl_dir)


class Recorder:
    """A scripted engine answering `answers[i]` to its i-th request (the last one after that; text, or the output
    ids as a list); keeps each request and its stop_token_ids."""

    def __init__(self, tok, answers):
        self.tok, self.answers, self.requests, self.stops = tok, answers, [], []
        self.engine = ScriptedEngine(self._respond, tok.vocab_size)
        submit = self.engine.submit

        def recording(input_ids, params=None, *a, **kw):
            self.stops.append(tuple(params.stop_token_ids) if params else ())
            return submit(input_ids, params, *a, **kw)

        self.engine.submit = recording

    def _respond(self, ids, images):
        self.requests.append((list(ids), [bytes(b) for b in images]))
        a = self.answers[min(len(self.requests) - 1, len(self.answers) - 1)]
        return list(a) if isinstance(a, list) else self.tok.answer(a)


@contextlib.asynccontextmanager
async def stack(tok, engine, **actor_kw):
    env_srv = EnvServer(dataclasses.replace(EnvdConfig(), host="127.0.0.1", port=0))
    await env_srv.start()
    # the context of the tiny VL checkpoint (4096): the front refuses longer prompts by their length (server.py)
    inf = InferenceServer(InferenceConfig(host="127.0.0.1", port=0, max_context=4096), engine)
    await inf.start()
    cfg = ActorConfig(**{"rpc_timeout_s": 10.0, "retries": 1, "max_new_tokens": 200, **actor_kw})
    infer = InferenceClient([inf.address], timeout_s=10.0, retries=1)
    env = EnvClient(env_srv.address, "", 10.0, 1)
    try:
        yield EpisodeContext(cfg, tok, infer, "test-actor"), env
    finally:
        await infer.close()
        await env.close()
        await inf.stop(0.5)
        await env_srv.stop()
        engine.close()


def episode(tok, answers, env_id="vlscreen/screen", **actor_kw):
    """One episode; a test env is no GUI prefix the default knows, so it names the UI-TARS prompt (builtin uses auto)."""
    if env_id.startswith("vlscreen"):
        actor_kw.setdefault("system_prompt", "computer")
    rec = Recorder(tok, answers)
    ScreenEnv.received = []

    async def main():
        async with stack(tok, rec.engine, **actor_kw) as (ctx, env):
            return ctx, await run_episode(ctx, env, "vl-0001", env_id, 1, 0)

    ctx, tr = asyncio.run(main())
    return ctx, tr, rec


def runs(tok, ids):
    """(start, pad count) of each framed image run in ids."""
    out, i = [], 0
    while i < len(ids):
        if ids[i] == tok.vision_start_id:
            j = i + 1
            while j < len(ids) and ids[j] == tok.image_id:
                j += 1
            assert j < len(ids) and ids[j] == tok.vision_end_id, "a run must end with <|vision_end|>"
            out.append((i, j - i - 1))
            i = j
        i += 1
    return out


def test_a_vl_checkpoint_resolves_to_uitars_defaults(vl_dir, tok):
    v = resolve(ActorConfig(), tok)
    assert v.vl and v.image_history == 5 and v.coordinates == "absolute"
    assert v.style("auto", "miniwob/click-button") == "computer" and v.style("auto", "terminal/ls") == "tiny"
    assert v.style("browser", "miniwob/x") == "browser"
    with pytest.raises(ValueError, match="coordinates"):
        resolve(ActorConfig(coordinates="pixels"), tok)


def test_a_qwen2_vl_checkpoint_answers_in_thousandths_by_default(tmp_path):
    """UI-TARS-1.0 / Qwen2-VL write relative 0..1000 points (start_box='(x,y)'): auto must not map them as pixels
    of the resized screenshot (UI-TARS-1.5's rule), which put (500,500) on a 1920x1080 screen at (497, 495)."""
    make_vl_checkpoint(tmp_path, arch="qwen2_vl")
    t = ChatTokenizer.load(tmp_path)
    v = resolve(ActorConfig(), t)
    assert v.vl and v.coordinates == "relative"
    assert resolve(ActorConfig(coordinates="absolute"), t).coordinates == "absolute"   # said explicitly: kept


@pytest.mark.parametrize("env_id", ["vlscreen/screen", "vlscreen/noscreen"])
def test_every_action_of_a_turn_reaches_envd_in_order_with_screen_coordinates(tok, env_id):
    spec = VLSpec.load(tok.path)
    # the model saw the 320x200 screenshot resized to 280x168 (64*28*28 max pixels): (140,84) is the screen's centre
    assert spec.resized(SCREEN_W, SCREEN_H) == (280, 168)
    two = ("<think>ignore me</think>\nThought: the stripe is in the middle\n"
           "Action: click(point='<point>140 84</point>')\n\nclick(point='<point>70 42</point>')")
    ctx, tr, rec = episode(tok, [two, "Thought: done\nAction: finished(content='ok')"], env_id=env_id, max_turns=4)
    assert ScreenEnv.received == [("click", (160.0, 100.0)), ("click", (80.0, 50.0)), ("finished", None)]
    assert tr.outcome == "terminated" and len(tr.turns) == 2
    assert tr.turns[0].reward == pytest.approx(0.5) and tr.turns[0].action["ran"] == 2   # 0.25 + 0.25
    assert tr.turns[0].action["point"] == [160.0, 100.0] and tr.turns[0].action["then"][0]["point"] == [80.0, 50.0]
    assert tr.ret == pytest.approx(1.5)
    # the UI-TARS-1.5 computer-use prompt with the task inside, the screenshot as one framed run of its own size
    first_ids, first_imgs = rec.requests[0]
    text = tok.decode(first_ids, skip_special=False)
    assert "You are a GUI agent" in text and "point='<point>x1 y1</point>'" in text and "click the stripe" in text
    assert "step 0" not in text   # UI-TARS reads the pixels, not the env's text
    # where UI-TARS's own inference code puts it: the first user message opens with the prompt (after the template's
    # default system message, if it has one: this one has none); the screenshot follows the prompt in that message
    assert text.startswith("<|im_start|>user\nYou are a GUI agent") and "<|im_start|>system" not in text
    assert text.index("## User Instruction") < text.index("<|vision_start|>") < text.index("<|im_start|>assistant")
    assert [n for _, n in runs(tok, first_ids)] == [spec.image_tokens(SCREEN_W, SCREEN_H)] and len(first_imgs) == 1
    assert tr.segments == [] and len(tr.image_refs) == 2
    tr.validate(tok.vocab_size)


def test_relative_coordinates_are_thousandths_of_the_screen(tok):
    ctx, tr, rec = episode(tok, ["Action: click(start_box='(500,250)')", "Action: finished()"], coordinates="relative")
    assert ScreenEnv.received == [("click", (160.0, 50.0)), ("finished", None)]
    assert "start_box='<|box_start|>(x1,y1)<|box_end|>'" in tok.decode(rec.requests[0][0], skip_special=False)


def test_a_rejected_action_stops_the_turn_and_costs_the_format_penalty(tok):
    # the second click is off the screen (absolute 300 > 280 wide resized image -> x = 342.9 on a 320 screen)
    bad = "Action: click(point='<point>140 84</point>')\nclick(point='<point>300 10</point>')\nclick(point='<point>1 1</point>')"
    ctx, tr, rec = episode(tok, [bad, "Action: finished()"], max_turns=3, format_penalty=-0.1)
    assert [a for a, _ in ScreenEnv.received] == ["click", "click", "finished"]   # the third never ran
    t = tr.turns[0]
    assert t.reward == pytest.approx(0.25 - 0.1) and t.parse_error and t.action["ran"] == 1


def test_a_long_episode_starts_segments_that_satisfy_the_contract(tok):
    k = 2
    ctx, tr, rec = episode(tok, ["Thought: go\nAction: click(point='<point>140 84</point>')"], image_history=k,
                           max_turns=5)
    assert tr.outcome == "truncated" and tr.truncated_by == "max_turns" and len(tr.turns) == 5
    tr.validate(tok.vocab_size)
    spec = VLSpec.load(tok.path)
    toks = tr.tokens.tolist()
    bounds = [0, *tr.segments, len(toks)]
    # 5 turns + the bootstrap state = 6 screenshots, 2 per segment
    assert len(tr.segments) == 2 and len(tr.image_refs) == 6 and tr.boot_at == len(toks)
    refs = iter(tr.image_refs)
    for a, b in zip(bounds, bounds[1:]):
        seg = toks[a:b]
        seg_runs = runs(tok, seg)
        assert 1 <= len(seg_runs) <= k
        for _, n in seg_runs:   # each framed run is bound to its ref's image, of the right pad count
            h = next(refs)
            data = tr.images[h]
            assert hashlib.sha256(data).hexdigest() == h
            assert n == spec.image_tokens(*png_size(data))
        assert seg[:5] == toks[:5]   # every segment opens with its own first prompt (the chat template's start)
    assert next(refs, None) is None
    assert len(set(tr.image_refs)) == 6   # every screenshot differs
    # each request carried only its segment's ids (a prefix of it) and exactly the images of the runs in them
    segment_of = lambda ids: next(a for a in bounds[:-1] if toks[a:a + len(ids)] == ids)  # noqa: E731
    ref_at = {a + s: h for (a, s), h in zip([(a, s) for a, b in zip(bounds, bounds[1:])
                                             for s, _ in runs(tok, toks[a:b])], tr.image_refs)}
    for ids, imgs in rec.requests:
        a = segment_of(ids)
        assert [tr.images[ref_at[a + s]] for s, _ in runs(tok, ids)] == imgs
    assert [segment_of(ids) for ids, _ in rec.requests] == [0, 0, tr.segments[0], tr.segments[0], tr.segments[1]]
    # a new segment's first prompt carries the earlier turns' thoughts and actions as text
    later = tok.decode(toks[tr.segments[1]:], skip_special=False)
    assert later.count("Action: click(point='<point>140 84</point>')") == 5 and "Previous steps" in later
    # the learner trains on every turn's answer, each inside one segment
    for t in tr.turns:
        assert tr.mask[t.start:t.end].all() and not any(t.start < s < t.end for s in tr.segments)


def test_text_observations_without_a_screenshot_are_shown_as_text(tok):
    # builtin tasks have no screenshot: the UI-TARS prompt shows the element list as text, and no image run
    ctx, tr, rec = episode(tok, ["Action: wait()"], env_id="builtin/click", max_turns=2)
    ids, imgs = rec.requests[0]
    assert imgs == [] and runs(tok, ids) == [] and "You are a GUI agent" in tok.decode(ids)
    assert tok.decode(ids, skip_special=False).startswith("<|im_start|>user\nYou are a GUI agent")
    assert tr.image_refs == [] and tr.segments == []



def test_known_numbers_without_a_processor_use_uitars_limits():
    # a text checkpoint told its coordinates are absolute (UI-TARS-1.5 served elsewhere): the model saw a 1920x1080
    # screenshot at UI-TARS's MAX_PIXELS, i.e. 1932x1092, so (966,546) is the centre and (1932,1092) the far corner
    import io

    from PIL import Image

    from actor.uitars import Vision
    from core.action import Action as A

    b = io.BytesIO()
    Image.new("RGB", (1920, 1080)).save(b, "PNG")
    shot = b.getvalue()
    v = Vision(None, 0, "absolute")
    got = v.to_screen([A("click", point=(966, 546)), A("drag", point=(0, 0), end_point=(1932, 1092))], (1920, 1080), shot)
    assert got[0].point == pytest.approx((960.0, 540.0))
    assert got[1].point == (0.0, 0.0) and got[1].end_point == pytest.approx((1920.0, 1080.0))
    # a screen reported at another size than the screenshot (a HiDPI capture): mapped to the screen's pixels
    assert v.to_screen([A("click", point=(966, 546))], (960, 540), shot)[0].point == pytest.approx((480.0, 270.0))
    assert Vision(None, 0, "relative").to_screen([A("click", point=(250, 500))], (1920, 1080), shot)[0].point == \
        pytest.approx((480.0, 540.0))
    assert Vision(None, 0, "screen").to_screen([A("click", point=(7, 9))], (1920, 1080), shot)[0].point == (7, 9)


def test_an_unreadable_screenshot_is_envds_fault_not_a_crash(tok):
    ctx, tr, rec = episode(tok, ["Action: wait()"], env_id="vlscreen/badshot")
    assert tr.outcome == "infra_error" and tr.fault == "envd" and "cannot be read" in tr.error
    assert rec.requests == [] and tr.turns == []


@pytest.mark.parametrize("token", ["<|image_pad|>", "<|vision_end|>"])
def test_a_vision_token_the_model_writes_ends_the_episode_as_a_parse_error(tok, token):
    """A VL checkpoint's requests stop on its vision tokens; an answer with one (here from an engine that went on
    past it: the actor cuts there, as the stop asks) is a parse error with the format penalty that ends the episode
    as truncated/parse_error, with no further request: its tokens stay in the trajectory, the stray token last, and
    the learner binds it (learner/batch.py)."""
    from learner.batch import binding_error

    spec = VLSpec.load(tok.path)
    vid = tok.hf.convert_tokens_to_ids(token)
    stray = tok.encode("Thought: a") + [vid] + tok.encode(" click") + [tok.eot_id]
    ctx, tr, rec = episode(tok, ["Action: click(point='<point>140 84</point>')", stray, "Action: finished()"],
                           max_turns=5, on_parse_error="continue", format_penalty=-0.3)
    assert len(rec.requests) == 2     # no request past the stray token
    assert all(set(spec.special_ids) <= set(s) and set(tok.stop_ids) <= set(s) for s in rec.stops), rec.stops
    assert set(spec.special_ids) == {spec.image_token_id, spec.vision_start_token_id, spec.vision_end_token_id,
                                     tok.hf.convert_tokens_to_ids("<|video_pad|>")}
    assert tr.outcome == "truncated" and tr.truncated_by == "parse_error", (tr.outcome, tr.truncated_by, tr.error)
    t = tr.turns[-1]
    assert len(tr.turns) == 2 and t.reward == pytest.approx(-0.3) and tr.ret == pytest.approx(0.25 - 0.3)
    assert t.parse_error.startswith("the model wrote a vision token") and token in t.parse_error
    assert tr.tokens[t.start:t.end].tolist() == stray[:stray.index(vid) + 1]   # cut right after it
    assert tr.mask[t.start:t.end].all() and (tr.versions[t.start:t.end] >= 0).all()
    assert np.allclose(tr.logprobs[t.start:t.end], -0.1)
    assert np.flatnonzero(tr.mask)[-1] == t.end - 1
    tr.validate(tok.vocab_size)
    assert tr.boot_at == len(tr.tokens) > t.end   # the state it was cut in, for the critic
    assert binding_error(tr, spec) is None
