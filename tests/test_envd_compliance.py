"""The envd compliance suite against tiny fake backends and, when it is importable, the builtin GUI env."""
from __future__ import annotations

import json
import re

import pytest

from envd import registry
from envd.base import Action, ActionError, Env, Outcome, Screenshot, StepResult
from envd_compliance import EnvCompliance


class CounterEnv(Env):
    """Count up to a goal with click(target=inc); also draws a (fake) screenshot to exercise images."""

    action_space = "click(target='inc'|'dec'), wait()"

    def __init__(self, name: str, options: dict[str, str]):
        try:
            self.goal = int(options.get("goal", 3))
            self.max_steps = int(options.get("max_steps", 10))
        except ValueError as e:
            raise ValueError(f"bad option: {e}") from None
        self.n = self.t = 0

    def _result(self, reward: float = 0.0) -> StepResult:
        outcome = (Outcome.TERMINATED if self.n >= self.goal else Outcome.TRUNCATED if self.t >= self.max_steps
                   else Outcome.RUNNING)
        return StepResult(text=f"count {self.n} [button inc] [button dec]", instruction=f"count to {self.goal}",
                          reward=reward, outcome=outcome, step=self.t, width=8, height=8,
                          images=[Screenshot(data=f"png:{self.n}".encode(), width=8, height=8)],
                          info={"n": self.n})

    def reset(self, seed: int, options: dict[str, str]) -> StepResult:
        self.n = self.t = 0
        return self._result()

    def step(self, action: Action) -> StepResult:
        if action.type not in ("click", "wait"):
            raise ActionError(f"unsupported action {action.type!r}")
        if action.type == "click":
            if action.target not in ("inc", "dec"):
                raise ActionError(f"no button {action.target!r}")
            self.n += 1 if action.target == "inc" else -1
        self.t += 1
        return self._result(1.0 if self.n >= self.goal else 0.0)

    def observe(self) -> StepResult:
        return self._result()

    def snapshot(self) -> bytes:
        return json.dumps([self.goal, self.max_steps, self.n, self.t]).encode()

    def restore(self, state: bytes) -> StepResult:
        try:
            self.goal, self.max_steps, self.n, self.t = json.loads(state)
        except (ValueError, TypeError) as e:
            raise ActionError(f"not a counter snapshot: {e}") from None
        return self._result()


class PlainCounterEnv(CounterEnv):
    """The same without observe/snapshot/restore: envd must fall back and answer UNIMPLEMENTED."""

    observe = Env.observe
    snapshot = Env.snapshot
    restore = Env.restore


registry.register("test-counter", CounterEnv, ["basic"])
registry.register("test-plain", PlainCounterEnv, ["basic"])


class TestCounterCompliance(EnvCompliance):
    env_id = "test-counter/basic"
    valid_action = {"type": "click", "target": "inc"}
    invalid_action = {"type": "teleport"}


class TestPlainCounterCompliance(EnvCompliance):
    env_id = "test-plain/basic"
    options = {"goal": "2"}
    valid_action = {"type": "click", "target": "inc"}
    invalid_action = {"type": "click", "target": "nowhere"}


def _builtin_available() -> bool:
    try:
        from envd import builtin  # noqa: F401  (written in parallel; the suite runs once it exists)
    except ImportError:
        return False
    return True


def _click_a_button(obs) -> dict:
    labels = re.findall(r"\[button ([^\]]+)\]", obs.text)
    assert labels, f"no button on the screen: {obs.text!r}"
    want = obs.instruction.removeprefix("click ").strip()
    return {"type": "click", "target": want if want in labels else labels[0]}


@pytest.mark.skipif(not _builtin_available(), reason="envd.builtin is not importable")
class TestBuiltinClickCompliance(EnvCompliance):
    env_id = "builtin/click"
    valid_action = staticmethod(_click_a_button)
    invalid_action = {"type": "teleport"}
    max_episode_steps = 6
