"""The session option `screenshots=0` (core.session_options): observations without screenshots, for a text policy.
envd.registry.make takes it out before the backend's own parser and sets Env.screenshots; the backends that capture
screenshots (MiniWoB++, the browser, the desktop, gym's render) skip the capture; envd sends no image for such a
session whatever a backend returns; a Reset cannot change it; the actor refuses it for a policy that is shown
screenshots."""
from __future__ import annotations

import os
import shutil

import grpc
import pytest

from actor import uitars
from core.action import Action
from core.config import ActorConfig
from core.session_options import split_screenshots
from core.v1 import env_pb2
from envd import registry
from envd.base import Env, Outcome, Screenshot, StepResult
from envd_compliance import envd_client, expect_code, run

PNG = b"\x89PNG\r\n\x1a\nnot really"


@pytest.mark.parametrize("value, on", [("1", True), ("0", False), ("true", True), ("Off", False), (" no ", False),
                                       ("yes", True)])
def test_the_option_parses_its_forms_and_leaves_the_rest(value, on):
    rest, got = split_screenshots({"screenshots": value, "boxes": "0"})
    assert got is on and rest == {"boxes": "0"}
    assert split_screenshots({"boxes": "0"}) == ({"boxes": "0"}, True)


@pytest.mark.parametrize("value", ["2", "", "maybe", "none"])
def test_a_bad_value_is_refused_naming_the_option(value):
    with pytest.raises(ValueError, match=r"screenshots=.*expected 1 or 0"):
        split_screenshots({"screenshots": value})
    with pytest.raises(ValueError, match="screenshots"):
        registry.check_options("builtin/click", {"screenshots": value}, remote=True)
    with pytest.raises(ValueError, match="screenshots"):
        registry.make("builtin/click", {"screenshots": value})


class _AlwaysShoots(Env):
    """A backend that knows nothing of the option: it returns a screenshot on every observation."""

    def __init__(self, options):
        self.options = options

    def _r(self, step: int) -> StepResult:
        return StepResult(text=f"step {step}", images=[Screenshot(PNG, width=4, height=3)], width=4, height=3,
                          step=step, outcome=Outcome.RUNNING)

    def reset(self, seed, options=None):
        self.n = 0
        return self._r(0)

    def step(self, action):
        self.n += 1
        return self._r(self.n)

    def observe(self):
        return self._r(self.n)


@pytest.fixture
def shooter():
    registry.register("test-shoots", lambda name, options: _AlwaysShoots(options), [""])
    yield
    registry.unregister("test-shoots")


def test_every_backend_takes_it_before_its_own_parser(shooter):
    for env_id in ("builtin/click", "test-shoots"):   # builtin's parser refuses names it does not know
        registry.check_options(env_id, {"screenshots": "0"}, remote=True)
        env = registry.make(env_id, {"screenshots": "0"})
        assert env.screenshots is False
        assert registry.make(env_id, {}).screenshots is True
    assert registry.make("test-shoots", {"screenshots": "0", "x": "1"}).options == {"x": "1"}   # not passed on
    # A wrapper (builtin's step_delay) hands it to the backend it wraps.
    env = registry.make("builtin/click", {"step_delay": "fixed:0.001", "screenshots": "0"})
    assert env.inner.screenshots is False and env.screenshots is False


def test_envd_sends_no_image_for_such_a_session_and_a_reset_cannot_change_it(shooter):
    async def body():
        async with envd_client() as c:
            on = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id="test-shoots"))).session_id
            off = (await c.CreateSession(env_pb2.CreateSessionRequest(
                env_id="test-shoots", options={"screenshots": "0"}))).session_id
            for sid, n in ((on, 1), (off, 0)):
                rs = [await c.Reset(env_pb2.ResetRequest(session_id=sid, seed=1)),
                      await c.Step(env_pb2.StepRequest(session_id=sid, action=env_pb2.Action(type="wait"))),
                      await c.Observe(env_pb2.SessionRef(session_id=sid))]
                assert [len(r.observation.images) for r in rs] == [n] * 3
                assert [r.observation.text for r in rs] == ["step 0", "step 1", "step 1"]
                assert all((r.observation.width, r.observation.height) == (4, 3) for r in rs)
            e = await expect_code(grpc.StatusCode.INVALID_ARGUMENT, c.Reset(env_pb2.ResetRequest(
                session_id=on, seed=2, options={"screenshots": "0"})))
            assert "session option" in e.details() and "CreateSession" in e.details()
            e = await expect_code(grpc.StatusCode.INVALID_ARGUMENT, c.CreateSession(env_pb2.CreateSessionRequest(
                env_id="test-shoots", options={"screenshots": "sometimes"})))
            assert "screenshots" in e.details()
            # The session goes on after the refused Reset, still with its images.
            r = await c.Reset(env_pb2.ResetRequest(session_id=on, seed=3))
            assert len(r.observation.images) == 1
    run(body())


def test_gym_render_is_skipped():
    import gymnasium

    from test_gym_backend import StripesEnv  # noqa: F401  (registers TarsTestStripes-v0)

    assert "TarsTestStripes-v0" in gymnasium.registry
    for shots, n in (("1", 1), ("0", 0)):
        env = registry.make("gym/TarsTestStripes-v0", {"render": "1", "screenshots": shots})
        calls = []
        real = env.env.render
        env.env.render = lambda: calls.append(1) or real()
        r = env.reset(1, {})
        assert len(r.images) == n and len(calls) == n   # not rendered at all, not rendered and dropped
        env.close()


@pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"), reason="Debian's chromium is not installed")
def test_miniwob_skips_the_capture():
    pytest.importorskip("miniwob")
    for shots in ("1", "0"):
        env = registry.make("miniwob/click-button", {"boxes": "0", "screenshots": shots})
        try:
            inst = env.gym.unwrapped.instance
            r = env.reset(5)
            assert inst.record_screenshots is (shots == "1")   # MiniWoB's own capture is off, not just dropped
            assert len(r.images) == int(shots) and (r.width, r.height) == (160, 210)
            assert "instruction:" in r.text and "button" in r.text
            ref = next(line.split()[0] for line in r.text.splitlines() if " button " in line)
            r = env.step(Action("click", target=ref))
            assert len(r.images) == int(shots) and r.outcome == Outcome.TERMINATED
        finally:
            env.close()


@pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"), reason="Debian's chromium is not installed")
def test_the_browser_skips_the_capture():
    pytest.importorskip("playwright")
    env = registry.make("browser", {"html": "<button>Go</button>", "screenshots": "0"})
    captured = []
    real = env._capture

    async def counted(params):
        captured.append(params)
        return await real(params)

    env._capture = counted
    try:
        r = env.reset(1, {})
        assert r.images == [] and "Go" in r.text and (r.width, r.height) == (env.opts.width, env.opts.height)
        r = env.step(Action("wait"))
        assert r.images == [] and captured == []
    finally:
        env.close()


@pytest.mark.skipif(not (shutil.which("Xvfb") and shutil.which("xdotool")), reason="no Xvfb / xdotool")
def test_the_desktop_skips_the_capture():
    env = registry.make("desktop", {"width": "320", "height": "240", "apps": "xclock", "settle_s": "0", "screenshots": "0"})
    try:
        env.screenshot = lambda: pytest.fail("captured a screenshot in a session without them")
        r = env.reset(1, {})
        assert r.images == [] and (r.width, r.height) == (320, 240) and "windows:" in r.text
    finally:
        env.close()


class _Tok:
    path = ""
    vision_start_id = -1


def test_the_actor_refuses_it_for_a_policy_shown_screenshots():
    off = {"screenshots": "0", "boxes": "0"}
    assert uitars.resolve(ActorConfig(env_options=off, image_history=0), _Tok()).image_history == 0
    assert uitars.resolve(ActorConfig(env_options=off), _Tok()).image_history == 0   # auto, a text checkpoint
    with pytest.raises(ValueError, match=r"screenshots is off.*image_history 2"):
        uitars.resolve(ActorConfig(env_options=off, image_history=2), _Tok())
    assert uitars.resolve(ActorConfig(env_options={"screenshots": "1"}, image_history=2), _Tok()).image_history == 2


def test_the_hybrid_hands_it_to_its_desktop():
    import types

    from envd.hybrid import HybridEnv

    env = HybridEnv.__new__(HybridEnv)   # the attribute alone: a real one needs Xvfb and bubblewrap
    env.desktop = types.SimpleNamespace(screenshots=True)
    env.screenshots = False
    assert env.desktop.screenshots is False and env.screenshots is False


def test_tars_up_and_eval_refuse_it_before_anything_starts(tmp_path):
    """A config error (exit 2, one line) before a checkpoint is built or a daemon starts, for an explicit
    image_history and for auto with a vision-language checkpoint."""
    import json

    from core.config import ConfigError
    from tars import checks
    from test_cli_errors import tars

    off = ActorConfig(env_options={"screenshots": "0"})
    checks.screenshots(off)                                   # auto, no checkpoint: a text policy
    vl = tmp_path / "vl"
    vl.mkdir()
    (vl / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    with pytest.raises(ConfigError, match=r"screenshots is off.*-1 \(auto\) for a vision-language checkpoint"):
        checks.screenshots(off, str(vl))
    checks.screenshots(ActorConfig(env_options={"screenshots": "0"}, image_history=0), str(vl))
    p = tars("up", "--preset", "miniwob", "--set", "actor.image_history=3", "--out", tmp_path / "run")
    assert p.returncode == 2 and "actor.image_history 3" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "run" / "model_init").exists()


def test_demonstrations_take_no_screenshots(monkeypatch):
    """A demonstration's turns are text (tars.demos.DemoTurn): every env it rolls is made without screenshots,
    under the run's other options, builtin ones included (builtin's own parser would refuse the name)."""
    from tars import demos

    assert demos.env_options_for_demos({"boxes": 0, "step_delay": "fixed:1", "screenshots": "1"}) == {
        "boxes": "0", "screenshots": "0"}
    made = []
    real = registry.make

    def make(env_id, options=None, **kw):
        env = real(env_id, options, **kw)
        made.append((env_id, env.screenshots))
        return env

    monkeypatch.setattr(registry, "make", make)
    tok = _demo_tokenizer()
    out = demos.demonstrations(tok, ["builtin/click", "builtin/mixed"], 4, "oracle", 0, 3,
                               env_options={"strict_targets": "1", "screenshots": "1"})
    assert len(out) == 4 and sorted(made) == [("builtin/click", False), ("builtin/mixed", False)]
    made.clear()
    demos.roll(["builtin/click"], 2, "noisy:0.5", 0, 3, {"screenshots": "1"})
    assert made == [("builtin/click", False)]


def _demo_tokenizer():
    from test_episode import TOK

    return TOK


def test_the_actor_turns_screenshots_off_where_nothing_of_the_episode_reads_them():
    """A text policy (shown no screenshot) with no judge creates its sessions with screenshots=0 unless the config
    says otherwise: its trajectories carried every screenshot to the learner before, for nothing."""
    import asyncio

    from actor.episode import run_episode
    from inference_server.scripted import ScriptedEngine
    from test_episode import TOK, answer, stack

    text = uitars.Vision(None, 0, "screen")
    assert uitars.session_options(ActorConfig(env_options={"boxes": "0"}), text) == {"boxes": "0", "screenshots": "0"}
    for kept in ({"env_options": {"screenshots": "1"}}, {"judge_mode": "replace"}):
        assert uitars.session_options(ActorConfig(**kept), text).get("screenshots") != "0"
    assert "screenshots" not in uitars.session_options(ActorConfig(), uitars.Vision(None, 2, "screen"))

    def episode(**kw):
        async def main():
            async with stack(ScriptedEngine(answer("type(content='1')"), TOK.vocab_size), max_turns=6, **kw) as (ctx, env):
                return await run_episode(ctx, env, "text-0001", "gym/TarsEpisodeStripes-v0", 1, 0)
        return asyncio.run(main())

    tr = episode(env_options={"render": "1"}, image_history=0)
    assert tr.outcome == "terminated" and len(tr.turns) == 4
    assert tr.images == {} and all(t.obs_ref.startswith("text:") for t in tr.turns)
    tr = episode(env_options={"render": "1", "screenshots": "1"}, image_history=0)
    assert len(tr.images) == 4 and all(t.obs_ref.startswith("sha256:") for t in tr.turns)
