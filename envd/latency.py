"""Simulated slow environments: a per-step delay drawn from a long-tailed distribution, for any backend.

Real GUI environments are slow and unevenly so: a page load, an app launch or a dialog animation takes ~100 ms
most of the time and seconds now and then. The builtin tasks answer in microseconds, so on their own they cannot
show what synchronous RL loses to that tail (every batch waits for its slowest episode). A session created with

    step_delay=lognormal:MEDIAN_S,SIGMA[,CAP_S]     delay = min(CAP, MEDIAN * exp(SIGMA * N(0, 1)))
    step_delay=pareto:XM_S,ALPHA[,CAP_S]            delay = min(CAP, XM * U ** (-1 / ALPHA)),  U ~ U(0, 1]
    step_delay=fixed:SECONDS

sleeps that long (a real `time.sleep` in the daemon's worker thread, so the session is busy exactly as a slow
backend would be) before every reset and step. Delays are drawn from a generator seeded by the episode's reset
seed, so a run is reproducible. The cap defaults to 10 s, well inside envd.step_timeout_s, and may be at most
MAX_CAP_S (so may a fixed delay): the option comes from clients, and a sleep Python cannot interrupt holds its
worker past the call's deadline (`fixed:3600` on each of envd.workers sessions left every later call of every
session ABORTED for an hour). A delayed session
is served on the worker pool (never on the event loop), so envd.workers bounds how many sleep at once: give
the daemon at least as many workers as sessions stepping concurrently, or the queue adds its own delay.
"""
from __future__ import annotations

import math
import random
import time
from envd.base import Action, Env, StepResult

OPTION = "step_delay"
DEFAULT_CAP_S = 10.0
MAX_CAP_S = 30.0          # the longest delay a spec may ask for: half the default envd.step_timeout_s


class DelaySpec:
    """A parsed `step_delay` option; `draw(rng)` gives one delay in seconds."""

    def __init__(self, spec: str):
        self.spec = spec.strip()
        kind, _, args = self.spec.partition(":")
        try:
            nums = [float(x) for x in args.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"step_delay={spec!r}: parameters must be numbers") from None
        self.kind = kind.strip().lower()
        want = {"lognormal": (2, 3), "pareto": (2, 3), "fixed": (1, 1)}
        if self.kind not in want:
            raise ValueError(f"step_delay={spec!r}: the distribution must be one of {sorted(want)}")
        lo, hi = want[self.kind]
        if not lo <= len(nums) <= hi:
            raise ValueError(f"step_delay={spec!r}: {self.kind} takes {lo}-{hi} numbers, got {len(nums)}")
        if any(not math.isfinite(x) or x < 0 for x in nums):
            raise ValueError(f"step_delay={spec!r}: parameters must be finite and >= 0")
        self.params = nums[:2] if self.kind != "fixed" else nums
        self.cap = nums[2] if len(nums) == 3 else (nums[0] if self.kind == "fixed" else DEFAULT_CAP_S)
        if self.cap > MAX_CAP_S:
            raise ValueError(f"step_delay={spec!r}: a delay is capped at most at {MAX_CAP_S:g} s")
        if self.kind == "pareto" and self.params[1] <= 0:
            raise ValueError(f"step_delay={spec!r}: the pareto shape alpha must be > 0")

    def draw(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            return self.params[0]
        a, b = self.params
        try:
            if self.kind == "lognormal":
                d = a * math.exp(b * rng.gauss(0.0, 1.0))
            else:
                d = a * (1.0 - rng.random()) ** (-1.0 / b)   # 1 - random() is in (0, 1]: never a division by zero
        except OverflowError:   # a huge sigma, a tiny alpha: past any float, so past the cap
            return self.cap
        return min(d, self.cap)

    def describe(self) -> dict:
        return {"spec": self.spec, "kind": self.kind, "params": self.params, "cap_s": self.cap}


class DelayedEnv(Env):
    """Wraps a backend: sleeps a drawn delay before each reset and step; everything else is the backend's."""

    nonblocking = False  # it sleeps: never on the daemon's event loop

    def __init__(self, inner: Env, spec: DelaySpec):
        self.inner, self.spec = inner, spec
        self.env_id, self.action_space = inner.env_id, inner.action_space
        self.rng = random.Random(0)
        self.slept_s = 0.0

    def _sleep(self) -> None:
        d = self.spec.draw(self.rng)
        self.slept_s += d
        time.sleep(d)

    def reset(self, seed: int, options: dict[str, str] | None = None) -> StepResult:
        self.rng = random.Random(f"step-delay-{seed}")
        self._sleep()
        return self.inner.reset(seed, options)

    def step(self, action: Action) -> StepResult:
        # The action is checked first so an invalid one (ActionError) is answered at once and changes nothing.
        r = self.inner.step(action)
        self._sleep()
        return r

    def observe(self) -> StepResult:
        return self.inner.observe()

    @property
    def screenshots(self) -> bool:   # the session option is the backend's to honour
        return self.inner.screenshots

    @screenshots.setter
    def screenshots(self, on: bool) -> None:
        self.inner.screenshots = on

    def close(self) -> None:
        self.inner.close()

    def snapshot(self) -> bytes:
        return self.inner.snapshot()

    def restore(self, state: bytes) -> StepResult:
        return self.inner.restore(state)

    def __getattr__(self, name: str):  # oracle_action, random_action, ... (the hint policies use them)
        if name == "inner":  # not set yet (during __init__): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def wrap(env: Env, options: dict[str, str]) -> Env:
    """`env` delayed as `options["step_delay"]` asks, or `env` itself when the option is absent or empty."""
    spec = str(options.get(OPTION, "")).strip()
    return DelayedEnv(env, DelaySpec(spec)) if spec else env
