"""The `gym/<id>` backend: any installed Gymnasium environment as an envd session (`gym/CartPole-v1`, ...).

Options (strings):
  render               "1": add the env's rgb_array frame to every observation as a PNG (zlib, no imaging library;
                       not with envd's screenshots=0); the env must have an rgb_array render mode that works here.
  max_episode_steps    override the registered time limit (envs registered without one get 1000)
  decimals             rounding of numbers in the observation text (default 3)
  obs_chars            longest observation text (default 2000)
  kwargs               JSON object of extra gymnasium.make arguments (scalars or lists of strings), e.g.
                       '{"is_slippery": false}'

Actions: discrete spaces take type(content='N'), hotkey(key='N') or click(target='N') (the integer action; the
same in all three, for policies that emit any of them). Box spaces take type(content='[a, b]'): JSON numbers in
the space's shape (a bare number for a one-element box), each within its bounds. MultiDiscrete/MultiBinary take a
JSON list of integers. Anything else, or a value out of range, is an ActionError and the env does not move.
finished() ends the episode as truncated (the agent stopped; the env was not done). terminated/truncated map to
envd's outcomes (terminated wins when both are set); the reward is the env's.

Snapshots: for envs whose whole state is a few plain attributes (classic control, the toy-text grids, blackjack)
the snapshot is JSON: those attributes, the RNG's bit-generator state, the time-limit counter and the last
observation. Nothing is ever unpickled. Other envs answer UNIMPLEMENTED.
"""
from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from envd.base import Action, ActionError, Env, Outcome, Screenshot, StepResult, refuse_unknown
from envd.browser_input import _bool
from envd.png import encode_png

SNAPSHOT_VERSION = 1
DEFAULT_MAX_STEPS = 1000
# The attributes that hold the whole state of an env, by class (module.qualname of env.unwrapped).
STATE_ATTRS = {
    "gymnasium.envs.classic_control.cartpole.CartPoleEnv": ("state", "steps_beyond_terminated"),
    "gymnasium.envs.classic_control.acrobot.AcrobotEnv": ("state",),
    "gymnasium.envs.classic_control.mountain_car.MountainCarEnv": ("state",),
    "gymnasium.envs.classic_control.continuous_mountain_car.Continuous_MountainCarEnv": ("state",),
    "gymnasium.envs.classic_control.pendulum.PendulumEnv": ("state", "last_u"),
    "gymnasium.envs.toy_text.frozen_lake.FrozenLakeEnv": ("s", "lastaction"),
    "gymnasium.envs.toy_text.cliffwalking.CliffWalkingEnv": ("s", "lastaction"),
    "gymnasium.envs.toy_text.taxi.TaxiEnv": ("s", "lastaction", "fickle_step", "taxi_orientation"),
    "gymnasium.envs.toy_text.blackjack.BlackjackEnv": ("dealer", "player"),
}


# ---- observation text ----------------------------------------------------------------------------------------

def _num(x: Any, decimals: int) -> str:
    if isinstance(x, (bool, np.bool_)):
        return str(bool(x)).lower()
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    x = float(x)
    if not math.isfinite(x):
        return str(x)
    r = round(x, decimals)
    return str(int(r)) if r == int(r) and abs(r) < 1e15 else repr(r)


def describe(value: Any, decimals: int = 3, max_items: int = 64) -> str:
    """A compact text rendering of an observation: numbers rounded, big arrays summarised."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {describe(v, decimals, max_items)}" for k, v in value.items()) + "}"
    if isinstance(value, tuple):
        return "(" + ", ".join(describe(v, decimals, max_items) for v in value) + ")"
    if isinstance(value, str):
        return json.dumps(value)
    a = np.asarray(value)
    if a.ndim == 0:
        return _num(a.item(), decimals)
    if a.size <= max_items:
        return json.dumps(np.round(a.astype(np.float64), decimals).tolist() if a.dtype.kind == "f" else a.tolist())
    flat = a.reshape(-1)
    head = ", ".join(_num(v, decimals) for v in flat[:8])
    stats = (f"min {_num(a.min(), decimals)} max {_num(a.max(), decimals)} mean {_num(a.mean(), decimals)}"
             if a.dtype.kind in "biuf" else "")
    return f"array shape {list(a.shape)} {a.dtype}: {stats}; first values [{head}, ...]"


def _jsonable(x: Any, depth: int = 0) -> Any:
    """Env info as JSON-safe data (bounded); anything odd becomes a short string."""
    if depth > 4:
        return str(x)[:200]
    if isinstance(x, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in list(x.items())[:64]}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v, depth + 1) for v in x[:64]]
    if isinstance(x, np.ndarray):
        return x.tolist() if x.size <= 64 else describe(x)
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if x is None or isinstance(x, (bool, int, float, str)):
        return x if not isinstance(x, str) else x[:1000]
    return str(x)[:200]


# ---- plain-data state codec (snapshots) ----------------------------------------------------------------------

def _encode(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return {"ndarray": v.tolist(), "dtype": str(v.dtype)}
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, (list, tuple)):
        return [_encode(x) for x in v]
    if v is None or isinstance(v, (bool, int, float)):
        return v
    raise NotImplementedError(f"cannot snapshot a state value of type {type(v).__name__}")


def _decode_scalar(raw: Any, what: str) -> Any:
    if raw is not None and not isinstance(raw, (bool, int, float)):
        raise ActionError(f"{what}: expected a number, got {raw!r:.80}")
    if isinstance(raw, float) and not math.isfinite(raw):
        raise ActionError(f"{what}: not a finite number")
    return raw


def _decode_like(raw: Any, like: Any, what: str) -> Any:
    """Decode `raw` into a value of the same kind as `like` (the fresh env's own value): an array of the same
    dtype and shape, a list of numbers, or a number (None allowed: some envs use it as 'not yet')."""
    if isinstance(like, np.ndarray):
        # The dtype may differ from a fresh env's (MountainCarContinuous: float64 after reset, float32 after a
        # step), but not its kind.
        if not isinstance(raw, dict) or np.dtype(str(raw.get("dtype"))).kind != like.dtype.kind:
            raise ActionError(f"{what}: expected an array of {like.dtype.kind} numbers")
        a = np.asarray(raw["ndarray"], dtype=np.dtype(str(raw["dtype"])))
        if a.shape != like.shape or (a.dtype.kind == "f" and not np.isfinite(a).all()):
            raise ActionError(f"{what}: expected a finite array of shape {list(like.shape)}")
        return a
    if isinstance(like, (list, tuple)):
        if not isinstance(raw, list) or len(raw) > 64:
            raise ActionError(f"{what}: expected a short list of numbers")
        return [_decode_scalar(r, what) for r in raw]
    return _decode_scalar(raw, what)


def parse_options(options: dict[str, str]) -> dict:
    """The session options (module docstring): the one parser of the factory, Reset, restore and
    registry.check_options. ValueError names a bad or unknown one; nothing is made."""
    refuse_unknown("gym", options, ("render", "max_episode_steps", "decimals", "obs_chars", "kwargs"))
    out: dict[str, Any] = {}
    for k, parse, default in (("render", _bool, "0"), ("max_episode_steps", int, 0), ("decimals", int, 3),
                              ("obs_chars", int, 2000), ("kwargs", lambda v: json.loads(v or "{}"), "{}")):
        try:
            out[k] = parse(options.get(k, default))
        except ValueError as e:
            raise ValueError(f"bad gym option {k}={options.get(k)!r}: {e}") from None
    kw = out["kwargs"]
    if not isinstance(kw, dict) or len(json.dumps(kw)) > 4096 or any(
            not isinstance(v, (bool, int, float, str, type(None)))
            and not (isinstance(v, list) and all(isinstance(s, str) for s in v)) for v in kw.values()):
        raise ValueError("kwargs must be a small JSON object of scalars or lists of strings")
    if "render_mode" in kw or "max_episode_steps" in kw:
        raise ValueError("set render and max_episode_steps as options, not in kwargs")
    if not 0 <= out["max_episode_steps"] <= 1_000_000 or not 0 <= out["decimals"] <= 12 \
            or not 100 <= out["obs_chars"] <= 100_000:
        raise ValueError("max_episode_steps in [0, 1e6], decimals in [0, 12], obs_chars in [100, 100000]")
    return out


class GymEnv(Env):
    """One Gymnasium env behind the envd contract."""

    def __init__(self, name: str, options: dict[str, str]):
        import gymnasium

        self.gym = gymnasium
        self.name = name
        self.env_id = f"gym/{name}"
        self.options = parse_options(options)
        self.env = self._make(self.options)
        self.space = self.env.action_space
        self.action_help = self._action_help()
        self.action_space = self.action_help
        self.obs: Any = None
        self.steps, self.total, self.last_reward = 0, 0.0, 0.0
        self.outcome, self.info = Outcome.RUNNING, {}

    # ---- construction ----------------------------------------------------------------------------------------
    def _make(self, opts: dict):
        gym = self.gym
        try:
            spec = gym.spec(self.name)
        except gym.error.Error as e:
            raise KeyError(f"unknown env id 'gym/{self.name}': {e}") from None
        steps = opts["max_episode_steps"] or (None if spec.max_episode_steps else DEFAULT_MAX_STEPS)
        kw = dict(opts["kwargs"])
        if opts["render"]:
            kw["render_mode"] = "rgb_array"
        try:
            env = gym.make(self.name, max_episode_steps=steps, **kw)
        except gym.error.DependencyNotInstalled as e:
            raise KeyError(f"gym/{self.name} is not available here: {e}") from None
        except TypeError as e:
            raise ValueError(f"gym/{self.name} does not take these kwargs: {e}") from None
        except (KeyError, IndexError) as e:   # a value the env looks up (map_name='9x9'): a KeyError read as an unknown
            if not opts["kwargs"]:            # env id (NOT_FOUND), and at a Reset as a broken backend (INFRA_ERROR)
                raise
            raise ValueError(f"gym/{self.name} refused kwargs {opts['kwargs']}: {type(e).__name__}: {e}") from None
        if opts["render"] and "rgb_array" not in env.metadata.get("render_modes", []):
            env.close()
            raise ValueError(f"gym/{self.name} has no rgb_array render mode")
        if opts["render"]:
            try:  # probe now: a missing drawing library (pygame) is the caller's problem, not a crash mid-episode
                env.reset(seed=0)
                env.render()
            except gym.error.DependencyNotInstalled as e:
                env.close()
                raise ValueError(f"render=1: gym/{self.name} cannot draw frames here: {e}") from None
        space = env.action_space
        if not isinstance(space, (gym.spaces.Discrete, gym.spaces.Box, gym.spaces.MultiDiscrete,
                                  gym.spaces.MultiBinary)):
            env.close()
            raise ValueError(f"gym/{self.name}: action space {space} is not supported (Discrete, Box, "
                             "MultiDiscrete, MultiBinary are)")
        return env

    def _action_help(self) -> str:
        s, sp = self.space, self.gym.spaces
        if isinstance(s, sp.Discrete):
            lo, hi = int(s.start), int(s.start) + int(s.n) - 1
            return f"type(content='N') (or hotkey(key='N'), click(target='N')) with N an integer in {lo}..{hi}"
        if isinstance(s, sp.Box):
            return (f"type(content='[...]'): JSON numbers of shape {list(s.shape)}, low {describe(s.low)}, "
                    f"high {describe(s.high)}")
        return f"type(content='[...]'): a JSON list of integers in {s}"

    # ---- episode ---------------------------------------------------------------------------------------------
    def reset(self, seed: int, options: dict[str, str] | None = None) -> StepResult:
        if options:
            opts = parse_options(options)
            if opts != self.options:
                env = self._make(opts)   # before touching the current env: a bad option leaves it as it was
                self.env.close()
                self.env, self.options, self.space = env, opts, env.action_space
                self.action_help = self.action_space = self._action_help()
        self.obs, info = self.env.reset(seed=int(seed))
        self.steps, self.total, self.last_reward, self.outcome = 0, 0.0, 0.0, Outcome.RUNNING
        self.info = _jsonable(info)
        return self._result(0.0)

    def _parse_action(self, action: Action) -> Any:
        kind, sp, s = action.type, self.gym.spaces, self.space
        if isinstance(s, sp.Discrete):
            raw = {"type": action.content, "hotkey": action.key, "click": action.target}.get(kind)
            if not raw:   # an empty string is no value: proto3 cannot tell it from an unset field
                raise ActionError(f"{self.env_id} takes {self.action_help}; got {kind!r} without a value")
            try:
                a = int(str(raw).strip())
            except ValueError:
                raise ActionError(f"{raw!r} is not an integer action") from None
            lo, n = int(s.start), int(s.n)
            if not lo <= a < lo + n:   # checked as Python ints: np.int64 of a 20-digit number raises OverflowError
                raise ActionError(f"action {a} is outside {lo}..{lo + n - 1}")
            return np.int64(a)
        if kind != "type" or not action.content:
            raise ActionError(f"{self.env_id} takes {self.action_help}")
        try:
            raw = json.loads(action.content)
        except (ValueError, RecursionError):   # RecursionError: brackets nested a thousand deep
            raise ActionError(f"{action.content[:80]!r} is not JSON") from None
        if isinstance(s, sp.Box):
            try:
                a = np.asarray(raw, dtype=np.float64)
            except (TypeError, ValueError, OverflowError):   # OverflowError: an integer past float64's range
                raise ActionError(f"{raw!r:.80} is not a list of numbers") from None
            if a.shape != s.shape and a.size == int(np.prod(s.shape)) and a.ndim <= 1:
                a = a.reshape(s.shape)   # a bare number for a one-element box, or a flat list
            if a.shape != s.shape:
                raise ActionError(f"action shape {list(a.shape)}, expected {list(s.shape)}")
            if not np.isfinite(a).all():
                raise ActionError("actions must be finite numbers")
            if (a < s.low).any() or (a > s.high).any():
                raise ActionError(f"action {describe(a)} is outside [{describe(s.low)}, {describe(s.high)}]")
            return a.astype(s.dtype)
        try:
            a = np.asarray(raw, dtype=s.dtype)
        except (TypeError, ValueError, OverflowError):
            raise ActionError(f"{raw!r:.80} is not a list of integers") from None
        if not isinstance(raw, list) or not s.contains(a):
            raise ActionError(f"{raw!r:.80} is not in {s}")
        return a

    def step(self, action: Action) -> StepResult:
        if self.obs is None:
            raise ActionError("reset the env first")
        if self.outcome != Outcome.RUNNING:
            raise ActionError("the episode is over; reset first")
        if action.type == "finished":
            self.steps += 1
            self.outcome = Outcome.TRUNCATED
            return self._result(0.0)
        a = self._parse_action(action)   # before any state changes: a bad action leaves the env as it was
        obs, reward, terminated, truncated, info = self.env.step(a)
        self.obs, self.steps = obs, self.steps + 1
        self.last_reward = float(reward)
        self.total += self.last_reward
        self.outcome = Outcome.TERMINATED if terminated else Outcome.TRUNCATED if truncated else Outcome.RUNNING
        self.info = _jsonable(info)
        return self._result(self.last_reward)

    def _result(self, reward: float) -> StepResult:
        o = self.options
        text = (f"observation: {describe(self.obs, o['decimals'])}\n"
                f"step {self.steps}, last reward {_num(self.last_reward, o['decimals'])}, "
                f"return {_num(self.total, o['decimals'])}")
        if len(text) > o["obs_chars"]:
            text = text[:o["obs_chars"] - 1] + "…"
        images, w, h = [], 0, 0
        if o["render"] and self.screenshots:
            frame = np.asarray(self.env.render())
            h, w = int(frame.shape[0]), int(frame.shape[1])
            images.append(Screenshot(data=encode_png(frame), width=w, height=h))
        info = {**self.info, "episode_return": self.total}
        return StepResult(text=text, instruction=f"{self.name}: maximise the return. Actions: {self.action_help}",
                          reward=reward, outcome=self.outcome, images=images, info=info, width=w, height=h,
                          step=self.steps)

    def observe(self) -> StepResult:
        if self.obs is None:
            raise ActionError("reset the env first")
        return self._result(0.0)

    def close(self) -> None:
        self.env.close()

    # ---- snapshots ------------------------------------------------------------------------------------------
    def _state_attrs(self) -> tuple[str, ...]:
        u = self.env.unwrapped
        attrs = STATE_ATTRS.get(f"{type(u).__module__}.{type(u).__qualname__}")
        if attrs is None:
            raise NotImplementedError(f"{self.env_id} cannot be snapshotted: its state is not known to be plain "
                                      f"data (snapshots cover {sorted(k.rsplit('.', 1)[1] for k in STATE_ATTRS)})")
        return tuple(a for a in attrs if hasattr(u, a))

    def _time_limit(self):
        e = self.env
        while isinstance(e, self.gym.Wrapper):
            if isinstance(e, self.gym.wrappers.TimeLimit):
                return e
            e = e.env
        return None

    def snapshot(self) -> bytes:
        attrs = self._state_attrs()
        if self.obs is None:
            raise ActionError("reset the env first")
        u, tl = self.env.unwrapped, self._time_limit()
        meta = {
            "version": SNAPSHOT_VERSION, "name": self.name,
            "options": {**self.options, "kwargs": json.dumps(self.options["kwargs"])},
            "attrs": {a: _encode(getattr(u, a)) for a in attrs},
            "rng": u.np_random.bit_generator.state,
            "elapsed": tl._elapsed_steps if tl is not None else None,
            "obs": _encode(self.obs), "steps": self.steps, "total": self.total, "last_reward": self.last_reward,
            "outcome": self.outcome, "info": self.info,
        }
        return json.dumps(meta).encode()

    def restore(self, state: bytes) -> StepResult:
        self._state_attrs()   # NotImplementedError before anything else for envs without snapshots
        try:
            meta = json.loads(bytes(state))
            if not isinstance(meta, dict) or meta.get("version") != SNAPSHOT_VERSION:
                raise ValueError("not a gym snapshot of this version")
            if meta["name"] != self.name:
                raise ValueError(f"snapshot of gym/{meta['name']}, not {self.env_id}")
            o = meta["options"]
            opts = parse_options({k: str(int(v) if isinstance(v, bool) else v) for k, v in o.items()})
            outcome = meta["outcome"]
            if outcome not in (Outcome.RUNNING, Outcome.TERMINATED, Outcome.TRUNCATED):
                raise ValueError(f"bad outcome {outcome!r}")
            outcome = Outcome(outcome)
            steps, total, last = int(meta["steps"]), float(meta["total"]), float(meta["last_reward"])
            if not (math.isfinite(total) and math.isfinite(last) and steps >= 0):
                raise ValueError("non-finite counters")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ActionError(f"not a {self.env_id} snapshot: {type(e).__name__}: {e}") from None
        if opts != self.options:
            env = self._make(opts)
            self.env.close()
            self.env, self.options, self.space = env, opts, env.action_space
            self.action_help = self.action_space = self._action_help()
        obs0, _ = self.env.reset(seed=0)   # initialises the wrappers (order enforcing, env checker)
        u, tl = self.env.unwrapped, self._time_limit()
        attrs = self._state_attrs()
        try:
            values = {a: _decode_like(meta["attrs"][a], getattr(u, a), a) for a in attrs}
            rng = meta["rng"]
            if not isinstance(rng, dict) or rng.get("bit_generator") != u.np_random.bit_generator.state["bit_generator"]:
                raise ActionError("rng: a different bit generator")
            obs = self._decode_obs(meta["obs"], obs0)
            for a, v in values.items():
                setattr(u, a, v)
            u.np_random.bit_generator.state = rng
            if tl is not None and meta["elapsed"] is not None:
                tl._elapsed_steps = int(meta["elapsed"])
        except (ValueError, KeyError, TypeError) as e:
            raise ActionError(f"not a {self.env_id} snapshot: {type(e).__name__}: {e}") from None
        self.obs, self.steps, self.total, self.last_reward, self.outcome = obs, steps, total, last, outcome
        self.info = _jsonable(meta.get("info") or {})
        return self._result(0.0)

    def _decode_obs(self, raw: Any, like: Any) -> Any:
        """The stored last observation, shaped like a fresh one and inside the observation space."""
        if isinstance(like, np.ndarray):
            obs = _decode_like(raw, like, "obs")
        elif isinstance(like, tuple) and isinstance(raw, list) and len(raw) == len(like):
            obs = tuple(_decode_scalar(r, "obs") for r in raw)
        else:
            obs = _decode_scalar(raw, "obs")
        if not self.env.observation_space.contains(obs):
            raise ActionError("obs: not in the observation space")
        return obs


def make(name: str, options: dict[str, str]) -> GymEnv:
    if not name:
        raise KeyError("a gym env id needs a name: gym/<gymnasium id>, e.g. gym/CartPole-v1")
    return GymEnv(name, options)
