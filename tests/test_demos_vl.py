"""Demonstrations with screenshots (tars/demos_vl.py): a scripted demonstrator played through the actor's own episode
loop for a policy shown screenshots, written at points in the checkpoint's coordinates (actor.uitars.Vision.demo_answer,
actor.parsing.from_screen), grounded by envd (envd.hints.grounded), and trained on with their images by tars sft."""
from __future__ import annotations

import json
import pathlib
import random
import subprocess
import sys

import numpy as np
import pytest

from actor.parsing import from_screen, parse_response, to_screen
from actor.uitars import Vision
from core.action import Action
from envd import builtin, hints
from envd.png import encode_rgb

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _png(w: int, h: int) -> bytes:
    return encode_rgb(bytes(w * h * 3), w, h)


@pytest.mark.parametrize("mode", ["absolute", "relative"])
@pytest.mark.parametrize("size", [(160, 210), (640, 400), (1280, 720), (1920, 1080)])
def test_from_screen_inverts_to_screen(mode, size):
    rng = random.Random(0)
    w, h = size
    for _ in range(200):
        p = (rng.uniform(0, w - 1), rng.uniform(0, h - 1))
        back = to_screen(from_screen(p, mode, w, h), mode, w, h)
        assert back == pytest.approx(p, abs=1e-6)
    with pytest.raises(ValueError, match="mode"):
        from_screen((1, 1), "screen", w, h)


@pytest.mark.parametrize("coords, form", [("absolute", "<point>"), ("relative", "start_box='(")])
def test_a_demonstrated_click_parses_back_to_its_point(coords, form):
    """The demonstrator's click, written in model coordinates in the checkpoint's point form, goes back through the
    actor's parser and coordinate map to within one model unit of the element's centre."""
    vis = Vision(None, 2, coords)
    w, h = 160, 210
    shot = _png(w, h)
    rng = random.Random(1)
    for _ in range(50):
        p = (rng.uniform(2, w - 3), rng.uniform(2, h - 3))
        text = vis.demo_answer("computer", Action("click", target="[7]", point=p), (w, h), shot)
        assert form in text and "target" not in text
        thought, acts = parse_response(text)
        (a,) = vis.to_screen(acts, (w, h), shot)
        unit = w / 1000 if coords == "relative" else 1.0   # one model unit in screen pixels (absolute: the resize)
        assert a.type == "click" and abs(a.point[0] - p[0]) <= unit and abs(a.point[1] - p[1]) <= unit * h / w + 1


def test_a_demonstrated_type_into_a_field_clicks_it_first():
    vis = Vision(None, 2, "absolute")
    text = vis.demo_answer("computer", Action("type", target="[9]", content="it's\nok", point=(80.0, 60.0)),
                           (160, 210), _png(160, 210))
    _, acts = parse_response(text)
    assert [a.type for a in acts] == ["click", "type"] and acts[1].content == "it's\nok" and not acts[1].target
    # the text styles show the element list: the action names its element, as the text demonstrations do
    assert vis.demo_answer("tiny", Action("type", target="[9]", content="x", point=(80.0, 60.0)), (160, 210),
                           _png(160, 210)) == "type(target='[9]', content='x')"
    # a click at a point (noisy's random click) is written in the model's coordinates in every style: the actor
    # maps every answer's points back to the screen
    for style in ("tiny", "computer"):
        text = vis.demo_answer(style, Action("click", point=(100.0, 50.0)), (160, 210), _png(160, 210))
        _, acts = parse_response(text)
        (a,) = vis.to_screen(acts, (160, 210), _png(160, 210))
        assert a.point == pytest.approx((100.0, 50.0), abs=1.0)
    # a screenshot policy cannot be shown an element the backend could not ground
    with pytest.raises(ValueError, match="no point on the screen"):
        vis.demo_answer("computer", Action("click", target="[3]"), (160, 210), _png(160, 210))


def test_envd_grounds_a_hint_that_names_an_element():
    """The oracle's hint carries the centre of the widget it names; a click at that point alone does what the
    named click does (the click task is won), and the target stays for clients that step with it."""
    rng = random.Random(0)
    for seed in range(20):
        env = builtin.make("click")
        r = env.reset(seed)
        a = hints.next_action(env, "oracle", r, rng)
        assert a.target and a.point is not None
        box = next(e["box"] for e in r.info["elements"] if e["label"] == a.target)
        assert a.point == ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2)
        r2 = env.step(Action("click", point=a.point))
        assert r2.info["success"] and r2.reward == 1.0
    # a target the page does not have stays ungrounded
    env = builtin.make("click")
    env.reset(0)
    assert hints.grounded(env, Action("click", target="no such label")).point is None


def _miniwob_here() -> bool:
    from envd import miniwob_chromium

    return not miniwob_chromium.missing()


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> pathlib.Path:
    from tests.hf_dirs import make_vl_checkpoint

    d = tmp_path_factory.mktemp("vl") / "ckpt"
    make_vl_checkpoint(d, arch="qwen2_5_vl", max_pixels=64 * 28 * 28, min_pixels=4 * 28 * 28)
    return d


SETS = ["actor.env_ids=[miniwob/click-button,miniwob/enter-text,miniwob/login-user]", "actor.image_history=2",
        "actor.env_options.screenshots=1", "actor.max_new_tokens=64", "inference.max_context=8192"]


def _answers(tokens, mask) -> list[list[int]]:
    out, cur = [], []
    for t, m in zip(tokens, mask):
        if m:
            cur.append(t)
        elif cur:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


@pytest.mark.skipif(not _miniwob_here(), reason="MiniWoB needs Debian chromium, chromium-driver, socat and bubblewrap")
def test_oracle_demonstrations_with_screenshots_through_the_actor(vl_dir):
    """The oracle through the actor's episodes on MiniWoB with a Qwen2.5-VL checkpoint: every example carries its
    screenshots (one image run per turn, a new segment at the third: image_history 2), its answers are clicks at
    points (no element names: the policy sees no element list), and each kept episode was won by those answers as
    the actor parsed them and mapped them to the screen. The examples bind to the model's images and score."""
    import torch

    from core import config as C
    from core.chat import ChatTokenizer
    from learner.data import ExampleImages
    from learner.policy import TrainPolicy
    from learner.sft import answer_scores, bind_images
    from tars.demos import source

    cfg = C.load("miniwob", overrides=SETS)
    tok = ChatTokenizer.load(vl_dir)
    ex = source(cfg, 6)(tok)
    assert len(ex) == 6   # the oracle wins these tasks: a demonstration written at a wrong point would lose
    for toks, mask, im in ex:
        assert isinstance(im, ExampleImages)
        answers = [tok.decode(a) for a in _answers(toks, mask)]
        assert len(im.image_refs) == len(answers) and set(im.image_refs) <= set(im.images)
        assert im.segments == ([] if len(answers) <= 2 else [im.segments[0]]) and all(s > 0 for s in im.segments)
        for text in answers:
            _, acts = parse_response(text)
            assert acts[0].type == "click" and acts[0].point is not None and not acts[0].target
    assert sum(len(_answers(t, m)) for t, m, _ in ex) > len(ex)   # enter-text and login-user take several turns
    policy = TrainPolicy.load(vl_dir)
    bound = bind_images(policy, ex)
    s = answer_scores(policy, bound, tok.pad_id, torch.device("cpu"))
    assert np.isfinite(s["nll"]) and s["nll"] > 0


@pytest.mark.skipif(not _miniwob_here(), reason="MiniWoB needs Debian chromium, chromium-driver, socat and bubblewrap")
def test_sft_cli_trains_a_vl_checkpoint_on_demonstrations_with_screenshots(vl_dir, tmp_path):
    """`tars sft --model VLDIR --demos N` with screenshots shown: every demonstration is trained on with its images,
    and the policy writes demonstrated answers on pages of their own (sft.val_episodes) better after it than before."""
    out = tmp_path / "sft"
    sets = [x for s in SETS + ["sft.batch_size=4", "sft.lr=0.003", "sft.val_episodes=3"] for x in ("--set", s)]
    r = subprocess.run([sys.executable, "-m", "tars.cli", "sft", "--preset", "miniwob", "--model", str(vl_dir),
                        "--out", str(out), "--demos", "6", "--steps", "20", *sets],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((out / "sft.json").read_text())
    assert m["demonstrations"] == 6 and m["with_screenshots"] == 6, m
    assert "6 examples, 6 with screenshots" in r.stdout + r.stderr
    assert "without envd.auth_token" not in r.stderr   # the demonstrations' own envd takes a token of its own
    assert m["val"][-1]["nll"] < m["val"][0]["nll"], m["val"]


def test_demonstrations_with_screenshots_refuse_the_confused_demonstrator(vl_dir):
    from core import config as C
    from tars.demos_vl import trajectories

    from core.chat import ChatTokenizer
    from tars.demos import source

    with pytest.raises(ValueError, match="hint_policy='confused:0.5': expected one of"):
        trajectories(C.load(None), None, 4, "confused:0.5", lambda e: iter(range(4)))
    cfg = C.load(None, overrides=["sft.demonstrator=confused:0.5"])
    with pytest.raises(ValueError, match="sft.demonstrator=confused:0.5: a policy shown screenshots"):
        source(cfg, 4)(ChatTokenizer.load(vl_dir))


def test_noisy_hint_policy_mixes_the_oracle_and_random_turn_by_turn():
    """hint_policy=noisy:P (the demonstrator the SFT warm start uses): P=1 is the oracle, P=0 the backend's random
    action, both grounded; anything but a number in [0, 1] is refused."""
    env = builtin.make("menu")
    for seed in range(5):
        r = env.reset(seed)
        assert hints.next_action(env, "noisy:1", r, random.Random(seed)) == hints.grounded(env, env.oracle_action())
        g = random.Random(seed)
        g.random()   # the draw that chose random
        assert hints.next_action(env, "noisy:0", r, random.Random(seed)) == hints.grounded(env, env.random_action(g))
    picks = [hints.next_action(env, "noisy:0.5", r, rng) == hints.grounded(env, env.oracle_action())
             for rng in [random.Random(0)] for _ in range(400)]
    assert 0.4 < np.mean(picks) < 0.85   # about half the oracle's (a random click may also pick its widget)
    for ok in ("oracle", "random", "noisy:0", "noisy:0.25", "noisy:1"):
        hints.check(ok)
    for bad in ("noisy", "noisy:", "noisy:1.5", "noisy:-0.1", "noisy:x", "psychic", "Oracle"):
        with pytest.raises(ValueError, match="hint_policy"):
            hints.check(bad)


def test_a_reused_sessions_hints_follow_the_seed_of_its_reset():
    """envd reseeds a session's hint stream at every Reset: the noisy demonstrator's episode on seed s is the same on
    a fresh session and on one that played other episodes before (it followed the session's history)."""
    import asyncio

    from actor.envclient import EnvClient
    from envd_compliance import envd_client

    def hints_of(obs):
        return json.loads(obs.info_json)["hint_action"]

    async def episode(ec, sid, run_id, seed):
        obs, out = await ec.reset(sid, run_id, seed), []
        while obs.outcome == "running" and len(out) < 6:
            out.append(hints_of(obs))
            obs = await ec.step(sid, run_id, Action.from_dict(out[-1]))
        return out

    async def main():
        async with envd_client() as c:
            ec = EnvClient(c.server.address, timeout_s=10.0, retries=1)
            try:
                opts = {hints.OPTION: "noisy:0.5"}
                sid, run_id = await ec.create("builtin/menu", 7, opts)
                reused = [await episode(ec, sid, run_id, seed) for seed in (7, 8, 9)]
                fresh = []
                for seed in (7, 8, 9):
                    sid, run_id = await ec.create("builtin/menu", seed, opts)
                    fresh.append(await episode(ec, sid, run_id, seed))
                return reused, fresh
            finally:
                await ec.close()

    reused, fresh = asyncio.run(main())
    assert reused == fresh and len({json.dumps(x) for x in fresh}) == 3


class _Crashing(builtin.BuiltinEnv):
    """builtin/click whose backend raises on its first Step: on odd seeds ("odd"), or always ("all")."""

    def __init__(self, name: str, options=None):
        super().__init__("click")
        self.which = name

    def reset(self, seed, options=None):
        self.crash = self.which == "all" or seed % 2 == 1
        return super().reset(seed, options)

    def step(self, action):
        if self.crash:
            raise RuntimeError("the backend crashed")
        return super().step(action)


def test_a_demonstration_that_ends_in_an_infra_error_is_left_out(vl_dir):
    """A backend that crashes mid-episode costs that demonstration, not the others; when every one crashes the error
    says so, with the first crash."""
    from core import config as C
    from core.chat import ChatTokenizer
    from envd import registry
    from tars.demos_vl import trajectories

    registry.register("test-democrash", _Crashing)
    tok = ChatTokenizer.load(vl_dir)
    cfg = C.load(None, overrides=["actor.env_ids=[test-democrash/odd]", "actor.max_new_tokens=64"])
    trs = trajectories(cfg, tok, 6, "oracle", lambda e: iter(range(100)))
    assert len(trs) == 3 and all(t.success for t in trs)   # seeds 0, 2, 4 won; 1, 3, 5 crashed
    cfg = C.load(None, overrides=["actor.env_ids=[test-democrash/all]", "actor.max_new_tokens=64"])
    with pytest.raises(ValueError, match="6 ended as infrastructure errors .the first: test-democrash/all: .*crashed"):
        trajectories(cfg, tok, 6, "oracle", lambda e: iter(range(100)))
    # episodes whose first prompt does not fit the context (as the actor would cut them) give none either: said so
    cfg = C.load(None, overrides=["actor.env_ids=[builtin/click]", "inference.max_context=128"])
    with pytest.raises(ValueError, match="none took a turn; 4 ended before their first answer .the first: builtin/click: "
                                         "context: prompt"):
        trajectories(cfg, tok, 4, "noisy:0.5", lambda e: iter(range(100)))


class _Counted(builtin.BuiltinEnv):
    """builtin/click that counts the sessions alive at once."""
    live = peak = 0

    def __init__(self, name: str, options=None):
        super().__init__("click")
        _Counted.live += 1
        _Counted.peak = max(_Counted.peak, _Counted.live)

    def close(self):
        _Counted.live -= 1
        super().close()


def test_one_tasks_demonstrations_roll_on_several_sessions_and_do_not_depend_on_how_many(vl_dir):
    """Episode i's seed is drawn before anything runs, so 1 or 3 sessions at once give the same demonstrations;
    with 3, one task's episodes run on 3 sessions (they ran one after the other on one)."""
    from core import config as C
    from core.chat import ChatTokenizer
    from envd import registry
    from tars.demos_vl import trajectories

    registry.register("test-democount", _Counted)
    tok = ChatTokenizer.load(vl_dir)
    cfg = C.load(None, overrides=["actor.env_ids=[test-democount/a]", "actor.max_new_tokens=64"])
    runs = {}
    for w in (1, 3):
        _Counted.live = _Counted.peak = 0
        runs[w] = trajectories(cfg, tok, 9, "noisy:0.5", lambda e: iter(range(1000, 2000, 7)), workers=w)
        assert _Counted.peak == w and _Counted.live == 0
    assert len(runs[1]) == len(runs[3]) == 9
    # the same episodes (the id holds the index; the screens, so the prompts' tokens, depend on the seed)
    same = [(t.id, t.success, t.tokens.tolist(), [x.output for x in t.turns]) for t in runs[1]]
    assert same == [(t.id, t.success, t.tokens.tolist(), [x.output for x in t.turns]) for t in runs[3]]
    assert len({tuple(x[2]) for x in same}) == 9


def test_default_sessions_one_per_env_id_and_per_core_up_to_a_bound(monkeypatch):
    """Each session is a browser, and envd refuses sessions past its host budget: the per-core share is bounded."""
    import tars.demos_vl as D
    from core import config as C

    seen = []

    async def fake_roll(cfg, tok, env_ids, episodes, demonstrator, keep_all, seeds_of, workers):
        seen.append(workers)
        return []

    monkeypatch.setattr(D, "_roll", fake_roll)
    one = C.load(None, overrides=["actor.env_ids=[builtin/click]"])
    many = C.load(None, overrides=["actor.env_ids=[" + ",".join([f"builtin/{t}" for t in builtin.TASKS] * 3) + "]"])
    for cores, cfg, episodes, want in ((2, one, 100, 2), (64, one, 100, D.MAX_PER_CORE_SESSIONS), (64, one, 3, 3),
                                       (None, one, 100, 1), (2, many, 100, 3 * len(builtin.TASKS))):
        monkeypatch.setattr(D.os, "cpu_count", lambda c=cores: c)
        D.trajectories(cfg, None, episodes, "oracle", lambda e: iter(range(10)))
        assert seen[-1] == want, (cores, episodes)
