"""Scripted-baseline hints: a session created with the option `hint_policy=oracle|random` gets, in the info of every
reset and step result that leaves the episode running, the next action of that scripted policy.

Why in the daemon: an oracle reads the backend's own state (builtin's goal, MiniWoB's DOM and fields), which envd
never sends over the wire. With the hint, a scripted baseline still plays through the real EnvService, session for
session like a model policy (`tars eval --model oracle`), so its score proves the whole env path, not just the
backend. The option is consumed by the daemon: backends never see it.

    info["hint_action"]  the action to send back in the next Step, as Action.to_dict() writes it
    info["hint_error"]   why there is none (the backend has no oracle, or its oracle cannot do this task)
"""
from __future__ import annotations

import random
from typing import Callable

from envd.base import Action, ActionError, Env, Outcome, StepResult

OPTION = "hint_policy"
POLICIES = ("oracle", "random")


def split_options(options: dict[str, str]) -> tuple[dict[str, str], str]:
    """(the backend's options, the hint policy or "")."""
    if OPTION not in options:
        return options, ""
    rest = dict(options)
    return rest, str(rest.pop(OPTION)).strip()


def next_action(env: Env, policy: str, last: StepResult, rng: random.Random) -> Action:
    """The scripted policy's next action on `env` (NotImplementedError when it has none)."""
    if policy == "oracle":
        fn = getattr(env, "oracle_action", None)
        if fn is None:
            raise NotImplementedError(f"{env.env_id or type(env).__name__} has no oracle")
        return fn()
    fn = getattr(env, "random_action", None)
    if fn is not None:
        return fn(rng)
    w, h = last.width or 640, last.height or 400  # no action model of its own: a click anywhere on the screen
    return Action("click", point=(rng.uniform(0, w - 1), rng.uniform(0, h - 1)))


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
