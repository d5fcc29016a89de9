"""The gym/<id> backend: compliance on classic-control envs, actions (Discrete and Box), snapshots, frames."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import gymnasium
import numpy as np
import pytest

from envd import registry
from envd.base import Action, ActionError, Outcome
from envd.gym_backend import GymEnv, describe
from envd.gym_names import env_names
from envd.png import decode_png, encode_png
from envd_compliance import EnvCompliance, envd_client, run
from core.v1 import common_pb2, env_pb2


class StripesEnv(gymnasium.Env):
    """A tiny env with an rgb_array renderer that needs no pygame, and state that is not plain data."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 30}

    def __init__(self, render_mode=None):
        self.render_mode = render_mode
        self.observation_space = gymnasium.spaces.Box(0, 255, (8, 8, 3), np.uint8)
        self.action_space = gymnasium.spaces.Discrete(3)
        self.t = 0

    def _frame(self):
        f = np.zeros((6, 10, 3), np.uint8)
        f[:, self.t % 10] = (255, 128, 7)
        return f

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.full((8, 8, 3), self.t, np.uint8), {}

    def step(self, action):
        self.t += int(action)
        return np.full((8, 8, 3), self.t, np.uint8), float(action), self.t >= 6, False, {"t": self.t}

    def render(self):
        return self._frame()


gymnasium.register("TarsTestStripes-v0", entry_point=StripesEnv, max_episode_steps=20)


def test_listing_imports_no_entry_point_here(tmp_path, monkeypatch):
    """Which module entry points import is asked of a child process that sees no GPU: this process runs none of
    their packages' __init__ (gymnasium's phys2d imports JAX there, which takes 75 % of a GPU at its first array).
    A package that fails to import keeps its envs off the list; a callable entry point is listed as before."""
    from envd import gym_names

    log = tmp_path / "imported.txt"
    for pkg, body in (("tarsprobe_ok", f"import os\nopen({str(log)!r}, 'a').write("
                                       "f'{os.getpid()} {os.environ.get(\"CUDA_VISIBLE_DEVICES\")!r}\\n')\n"),
                      ("tarsprobe_broken", "raise ImportError('no such simulator here')\n")):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text(body)
        (tmp_path / pkg / "envs.py").write_text("class Env: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    gymnasium.register("TarsProbeOk-v0", entry_point="tarsprobe_ok.envs:Env")
    gymnasium.register("TarsProbeBroken-v0", entry_point="tarsprobe_broken.envs:Env")
    gym_names._importable.cache_clear()
    try:
        names = env_names()
    finally:
        del gymnasium.registry["TarsProbeOk-v0"], gymnasium.registry["TarsProbeBroken-v0"]
        gym_names._importable.cache_clear()
    assert "TarsProbeOk-v0" in names and "TarsProbeBroken-v0" not in names and "TarsTestStripes-v0" in names
    assert "tarsprobe_ok" not in sys.modules and "tarsprobe_broken" not in sys.modules
    pid, cuda = log.read_text().split()          # imported once, by another process that saw no GPU
    assert int(pid) != os.getpid() and cuda == "''"


def test_listing_fails_loudly_when_the_probe_cannot_run(monkeypatch):
    from envd import gym_names

    monkeypatch.setattr(gym_names, "_PROBE", "import sys; sys.exit('probe broke')")
    gym_names._importable.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="probe exit 1: probe broke"):
            env_names()
    finally:
        gym_names._importable.cache_clear()


def act(env: GymEnv, **a):
    return env.step(Action(**a))


def test_listing_and_unknown_ids():
    assert "CartPole-v1" in env_names() and "Pendulum-v1" in env_names()
    assert "gym/CartPole-v1" in registry.list_env_ids()
    with pytest.raises(KeyError):
        registry.make("gym/NoSuchEnv-v9", {})
    with pytest.raises(KeyError):
        registry.make("gym", {})
    for bad in ({"render": "1", "kwargs": "[1]"}, {"decimals": "x"}, {"obs_chars": "5"}, {"colour": "red"},
                {"kwargs": '{"render_mode": "human"}'}):
        with pytest.raises(ValueError):
            registry.make("gym/CartPole-v1", bad)


def test_discrete_actions_and_outcomes():
    env = registry.make("gym/CartPole-v1", {})
    r = env.reset(1, {})
    assert r.text.startswith("observation: [") and "0..1" in r.instruction and r.outcome == Outcome.RUNNING
    for a in ({"type": "type", "content": "1"}, {"type": "hotkey", "key": "0"}, {"type": "click", "target": " 1 "}):
        r = env.step(Action(**a))
        assert r.reward == 1.0 and r.outcome == Outcome.RUNNING
    rs = [env.step(Action("type", content="1")) for _ in range(40) if env.outcome == Outcome.RUNNING]
    assert rs[-1].outcome == Outcome.TERMINATED and r.step >= 3
    env.close()


def test_truncation_maps_to_truncated():
    env = registry.make("gym/Pendulum-v1", {"max_episode_steps": "3"})
    env.reset(0, {})
    outs = [env.step(Action("type", content="[0.0]")).outcome for _ in range(3)]
    assert outs == [Outcome.RUNNING, Outcome.RUNNING, Outcome.TRUNCATED]
    with pytest.raises(ActionError):
        env.step(Action("type", content="[0.0]"))
    env.close()


def test_box_actions_parse_and_check_bounds():
    env = registry.make("gym/Pendulum-v1", {})
    env.reset(0, {})
    r = env.step(Action("type", content="[1.5]"))
    assert r.reward < 0 and "low [-2.0]" in r.instruction
    r = env.step(Action("type", content="-0.25"))          # a bare number for a one-element box
    assert r.step == 2
    env.close()


BAD_ACTIONS = {
    "gym/CartPole-v1": [{"type": "type", "content": "2"}, {"type": "type", "content": "-1"},
                        {"type": "type", "content": "left"}, {"type": "type"}, {"type": "scroll"},
                        {"type": "hotkey", "key": "1.5"}, {"type": "wait"},
                        # past int64 (np.int64 raised OverflowError: envd answered INFRA_ERROR and closed the session)
                        {"type": "type", "content": "99999999999999999999"},
                        {"type": "hotkey", "key": "-99999999999999999999"}],
    "gym/Pendulum-v1": [{"type": "type", "content": "[3.0]"}, {"type": "type", "content": "[0.1, 0.2]"},
                        {"type": "type", "content": "[NaN]"}, {"type": "type", "content": "not json"},
                        {"type": "type", "content": '["a"]'}, {"type": "click", "target": "1"},
                        {"type": "type", "content": "1e999"},
                        # an integer past float64 (OverflowError) and brackets nested 3000 deep (RecursionError)
                        {"type": "type", "content": "[" + "1" * 400 + "]"},
                        {"type": "type", "content": "[" * 3000 + "]" * 3000}],
}


@pytest.mark.parametrize("env_id", sorted(BAD_ACTIONS))
def test_bad_actions_are_errors_and_change_nothing(env_id):
    env, twin = registry.make(env_id, {}), registry.make(env_id, {})
    good = Action("type", content="1" if "CartPole" in env_id else "[0.5]")
    r0, t0 = env.reset(4, {}), twin.reset(4, {})
    assert r0.text == t0.text
    for bad in BAD_ACTIONS[env_id]:
        with pytest.raises(ActionError):
            env.step(Action(**bad))
        assert env.observe().text == r0.text
    a, b = env.step(good), twin.step(good)                    # same trajectory as an env that saw no bad action
    assert (a.text, a.reward, a.step) == (b.text, b.reward, b.step)
    env.close()
    twin.close()


def test_kwargs_the_env_refuses_are_value_errors():
    """FrozenLake's KeyError for map_name='9x9' was answered NOT_FOUND at CreateSession and INFRA_ERROR at a Reset."""
    with pytest.raises(ValueError, match="9x9"):
        registry.make("gym/FrozenLake-v1", {"kwargs": '{"map_name": "9x9"}'})
    env = registry.make("gym/FrozenLake-v1", {})
    r0 = env.reset(1, {})
    with pytest.raises(ValueError, match="9x9"):
        env.reset(1, {"kwargs": '{"map_name": "9x9"}'})
    assert env.reset(1, {}).text == r0.text
    env.close()


def test_finished_ends_as_truncated():
    env = registry.make("gym/CartPole-v1", {})
    env.reset(0, {})
    r = env.step(Action("finished"))
    assert (r.outcome, r.reward) == (Outcome.TRUNCATED, 0.0)
    env.close()


@pytest.mark.parametrize("env_id,action", [
    ("gym/CartPole-v1", lambda i: str(i % 2)),
    ("gym/FrozenLake-v1", lambda i: str(i % 4)),              # slippery: the RNG decides every move
    ("gym/Blackjack-v1", lambda i: "1"),
    ("gym/MountainCarContinuous-v0", lambda i: f"[{(i % 5 - 2) / 2}]"),
])
def test_snapshot_restore_gives_identical_trajectories(env_id, action):
    env = registry.make(env_id, {})
    env.reset(9, {})
    for i in range(2):
        if env.outcome == Outcome.RUNNING:
            env.step(Action("type", content=action(i)))
    snap = env.snapshot()
    json.loads(snap)                                          # plain JSON, no pickle
    copy = registry.make(env_id, {})
    assert copy.restore(snap).text == env.observe().text

    def rollout(e):
        out = []
        for i in range(2, 14):
            if e.outcome != Outcome.RUNNING:
                break
            r = e.step(Action("type", content=action(i)))
            out.append((r.text, r.reward, r.outcome))
        return out

    assert rollout(env) == rollout(copy)
    env.close()
    copy.close()


def test_frozenlake_trajectories_depend_on_the_rng():
    """The control for the test above: without the restored RNG, slippery moves would differ."""
    paths = set()
    for seed in range(6):
        e = registry.make("gym/FrozenLake-v1", {"max_episode_steps": "8"})
        e.reset(seed, {})
        paths.add(tuple(e.step(Action("type", content="2")).text for _ in range(8) if e.outcome == Outcome.RUNNING))
        e.close()
    assert len(paths) > 1


def test_bad_snapshots_are_action_errors():
    env = registry.make("gym/CartPole-v1", {})
    env.reset(0, {})
    good = json.loads(env.snapshot())
    tampered = []
    for path, value in ((("attrs", "state"), {"ndarray": [0.0, 1.0], "dtype": "float64"}),
                        (("attrs", "state"), {"ndarray": [0.0, "x", 0.0, 0.0], "dtype": "float64"}),
                        (("attrs", "state"), {"ndarray": [1e400, 0, 0, 0], "dtype": "float64"}),
                        (("rng",), {"bit_generator": "MT19937", "state": {}}),
                        (("rng",), {"bit_generator": "PCG64", "state": {"state": "x", "inc": 1}}),
                        (("name",), "Pendulum-v1"), (("version",), 7), (("outcome",), "exploded"),
                        (("obs",), {"ndarray": [9e9, 9e9, 9e9, 9e9], "dtype": "float32"}),
                        (("options",), {"render": False, "decimals": 99})):
        d = json.loads(json.dumps(good))
        node = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        tampered.append(json.dumps(d).encode())
    for blob in [b"", b"\x80\x04pickle", b"[]", *tampered]:
        fresh = registry.make("gym/CartPole-v1", {})
        with pytest.raises(ActionError):
            fresh.restore(blob)
        fresh.close()
    env.close()


def test_frames_as_png_and_unsupported_snapshots():
    env = registry.make("gym/TarsTestStripes-v0", {"render": "1"})
    r = env.reset(0, {})
    assert len(r.images) == 1 and (r.width, r.height) == (10, 6)
    np.testing.assert_array_equal(decode_png(r.images[0].data), env.env.render())
    assert "array shape [8, 8, 3] uint8" in r.text and len(r.text) < 400
    r = env.step(Action("type", content="2"))
    assert decode_png(r.images[0].data)[0, 2].tolist() == [255, 128, 7]
    with pytest.raises(NotImplementedError, match="cannot be snapshotted"):
        env.snapshot()
    with pytest.raises(NotImplementedError):
        env.restore(b"{}")
    env.close()


@pytest.mark.skipif(importlib.util.find_spec("pygame") is not None, reason="pygame is installed: CartPole can draw")
def test_render_without_a_drawing_library_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot draw frames"):
        registry.make("gym/CartPole-v1", {"render": "1"})


def test_png_encoder_round_trips():
    rng = np.random.default_rng(0)
    for shape in ((5, 7, 3), (4, 4), (3, 2, 4), (1, 1, 1)):
        img = rng.integers(0, 256, shape, dtype=np.uint8)
        out = decode_png(encode_png(img))
        np.testing.assert_array_equal(out.reshape(img.shape), img)
    with pytest.raises(ValueError):
        encode_png(np.zeros((2, 2, 5)))


def test_describe_is_compact_and_bounded():
    assert describe(np.array([0.123456, -2.0], np.float32)) == "[0.123, -2.0]"
    big = describe(np.arange(100000, dtype=np.float64))
    assert big.startswith("array shape [100000] float64: min 0 max 99999") and len(big) < 200
    assert describe({"a": (1, np.int64(2)), "b": "x"}) == '{a: (1, 2), b: "x"}'
    env = registry.make("gym/CartPole-v1", {"obs_chars": "100", "decimals": "1"})
    assert len(env.reset(0, {}).text) <= 100
    env.close()


def test_fork_over_envd_gives_identical_trajectories():
    async def body():
        async with envd_client() as c:
            sid = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id="gym/FrozenLake-v1"))).session_id
            await c.Reset(env_pb2.ResetRequest(session_id=sid, seed=3))
            await c.Step(env_pb2.StepRequest(session_id=sid, action=env_pb2.Action(type="type", content="1")))
            fork = (await c.Fork(env_pb2.ForkRequest(session_id=sid))).session_id
            trajectories = []
            for s in (sid, fork):
                out = []
                for i in range(12):
                    r = await c.Step(env_pb2.StepRequest(session_id=s, action=env_pb2.Action(
                        type="hotkey", key=str(i % 4))))
                    out.append((r.observation.text, r.reward, r.outcome))
                    if r.outcome != common_pb2.RUNNING:
                        break
                trajectories.append(out)
            assert trajectories[0] == trajectories[1] and len(trajectories[0]) >= 2
            unsupported = (await c.CreateSession(env_pb2.CreateSessionRequest(
                env_id="gym/TarsTestStripes-v0"))).session_id
            await c.Reset(env_pb2.ResetRequest(session_id=unsupported, seed=1))
            with pytest.raises(Exception) as ei:
                await c.Snapshot(env_pb2.SessionRef(session_id=unsupported))
            assert "UNIMPLEMENTED" in str(ei.value.code())
    run(body())


class TestCartPoleCompliance(EnvCompliance):
    env_id = "gym/CartPole-v1"
    valid_action = {"type": "type", "content": "1"}
    invalid_action = {"type": "type", "content": "7"}


class TestPendulumCompliance(EnvCompliance):
    env_id = "gym/Pendulum-v1"
    options = {"max_episode_steps": "10"}
    valid_action = {"type": "type", "content": "[0.5]"}
    invalid_action = {"type": "type", "content": "[5.0]"}
    max_episode_steps = 12


class TestFrameEnvCompliance(EnvCompliance):
    """Screenshots over the wire, and UNIMPLEMENTED snapshots."""
    env_id = "gym/TarsTestStripes-v0"
    options = {"render": "1"}
    valid_action = {"type": "click", "target": "1"}
    invalid_action = {"type": "click", "target": "9"}
    max_episode_steps = 10
