"""Scripted-baseline hints: a session created with the option `hint_policy=oracle|random|noisy:P` gets, in the info of
every reset and step result that leaves the episode running, the next action of that scripted policy (noisy:P: the
oracle's with probability P, else the random one's, drawn turn by turn from a random stream that each Reset seeds
with the episode's seed, so an episode's hints do not depend on what its session played before).

Why in the daemon: an oracle reads the backend's own state (builtin's goal, MiniWoB's DOM and fields), which envd
never sends over the wire. With the hint, a scripted baseline still plays through the real EnvService, session for
session like a model policy (`tars eval --model oracle`), so its score proves the whole env path, not just the
backend. The option is consumed by the daemon: backends never see it.

    info["hint_action"]  the action to send back in the next Step, as Action.to_dict() writes it; one that names an
                         element (target) also carries its point (the element's centre in screen pixels) where the
                         backend can say it (`ground`), so a demonstrator for a screenshot policy can click there
    info["hint_error"]   why there is none (the backend has no oracle, or its oracle cannot do this task)
"""
from __future__ import annotations

import random
from dataclasses import replace
from typing import Callable

from envd.base import Action, ActionError, Env, Outcome, StepResult

OPTION = "hint_policy"
POLICIES = ("oracle", "random", "noisy:P")


def check(policy: str) -> None:
    """ValueError unless `policy` is one of POLICIES (P a number in [0, 1])."""
    if policy in ("oracle", "random"):
        return
    kind, _, p = policy.partition(":")
    try:
        ok = kind == "noisy" and 0.0 <= float(p) <= 1.0
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{OPTION}={policy!r}: expected one of {list(POLICIES)}")


def stream(policy: str, env_id: str, seed: int) -> random.Random:
    """The hint policy's random stream for an episode of `env_id` on `seed` (made at CreateSession, again at every
    Reset): an episode's hints follow from its seed alone."""
    return random.Random(f"{policy}:{env_id}:{seed}")


def split_options(options: dict[str, str]) -> tuple[dict[str, str], str]:
    """(the backend's options, the hint policy or "")."""
    if OPTION not in options:
        return options, ""
    rest = dict(options)
    return rest, str(rest.pop(OPTION)).strip()


def next_action(env: Env, policy: str, last: StepResult, rng: random.Random) -> Action:
    """The scripted policy's next action on `env` (NotImplementedError when it has none), grounded (`grounded`)."""
    if policy.startswith("noisy:"):
        policy = "oracle" if rng.random() < float(policy[6:]) else "random"
    if policy == "oracle":
        fn = getattr(env, "oracle_action", None)
        if fn is None:
            raise NotImplementedError(f"{env.env_id or type(env).__name__} has no oracle")
        return grounded(env, fn())
    fn = getattr(env, "random_action", None)
    if fn is not None:
        return grounded(env, fn(rng))
    w, h = last.width or 640, last.height or 400  # no action model of its own: a click anywhere on the screen
    return Action("click", point=(rng.uniform(0, w - 1), rng.uniform(0, h - 1)))


def grounded(env: Env, a: Action) -> Action:
    """`a` with the point of the element its target names (the backend's `ground(target)`: the element's centre in
    screen pixels, or None), where it names one and has no point; the target stays, so a Step of it acts as before."""
    ground = getattr(env, "ground", None)
    if not a.target or a.point is not None or ground is None:
        return a
    p = ground(a.target)
    return a if p is None else replace(a, point=p)


def with_hint(env: Env, policy: str, rng: random.Random, fn: Callable[..., StepResult], *args) -> StepResult:
    """fn(*args), with the hint added to the result's info while the episode runs."""
    r = fn(*args)
    if r.outcome != Outcome.RUNNING:
        return r
    try:
        r.info = {**r.info, "hint_action": next_action(env, policy, r, rng).to_dict()}
    except (NotImplementedError, ActionError) as e:
        r.info = {**r.info, "hint_error": f"{policy}: {e}"}
    return r
