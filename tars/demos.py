"""Scripted demonstrations for the SFT warm start: a demonstrator rolled through envd's builtin tasks in-process,
each turn built by actor.tiny.turn_ids (the actor's own turn rule, in the checkpoint's chat template, with the
actor's system prompt) -> [(tokens, loss_mask)] for learner.sft.

This lives on the operations floor because it joins two roles (an environment and a prompt style); the learner
only sees the examples (learner.sft.DemonstrationSource).
"""
from __future__ import annotations

import random
from dataclasses import replace

from actor.tiny import answer_ids, turn_ids
from core.action import Action
from core.outcome import Outcome
from core.chat import ChatTokenizer
from envd import builtin


def parse_demonstrator(spec: str) -> tuple[str, float, int]:
    """oracle | noisy:P | confused:P | confused:P:N -> (kind, P, N distractors)."""
    if spec == "oracle":
        return "oracle", 1.0, 0
    kind, _, rest = spec.partition(":")
    p, _, n = rest.partition(":")
    if kind in ("noisy", "confused") and p and (not n or kind == "confused"):
        try:
            pf = float(p)
        except ValueError:
            pf = -1.0
        if not 0.0 <= pf <= 1.0:
            raise ValueError(f"demonstrator {spec!r}: P must be a number in [0, 1]")
        if not n:
            return kind, pf, 0
        if n.isdigit() and int(n) <= 16:
            return kind, pf, int(n)
        raise ValueError(f"demonstrator {spec!r}: N must be a whole number of distractors, 0 to 16")
    raise ValueError(f"unknown demonstrator {spec!r}: expected oracle, noisy:P, confused:P or confused:P:N")


GOAL_VERBS = {"open", "then", "click", "type", "into", "answer"}


def confused_action(env, rng: random.Random, distractors: int = 0) -> Action:
    """The oracle's action with its label or text swapped for a word drawn at random from the goal's words and
    `distractors` plausible wrong ones (a visible label to click, a name to type): the demonstrator knows what to do
    and that the words mostly come from the instruction, not which word goes where."""
    a = env.oracle_action()
    key = "content" if a.type == "type" else "target"
    words = [w for w in env.observe().instruction.split() if w not in GOAL_VERBS]
    for _ in range(distractors):
        words.append(rng.choice(builtin.VALUES) if key == "content" else rng.choice(env.clickable()))
    return replace(a, **{key: rng.choice(words)}) if words else a


def demonstrations(tok: ChatTokenizer, env_ids: list[str], episodes: int, demonstrator: str, seed: int,
                   max_turns: int = 6, system_prompt: str = "tiny", obs_budget: int = 0) -> list[tuple[list[int], list[int]]]:
    """Roll the demonstrator through builtin envs in-process -> [(tokens, loss_mask)]. `obs_budget`: the actor's
    actor.max_obs_tokens, so a demonstration's prompts are the ones the policy will see in RL."""
    kind, p, n = parse_demonstrator(demonstrator)
    rng = random.Random(seed)
    envs = {e: builtin.make(e.split("/", 1)[1], {"max_steps": str(max_turns)}) for e in env_ids}
    out = []
    for i in range(episodes):
        env = envs[env_ids[i % len(env_ids)]]
        r = env.reset(rng.randrange(1 << 30))
        toks, mask = [], []
        while True:
            prompt = turn_ids(tok, system_prompt, r.text, r.instruction, first=not toks, obs_budget=obs_budget)
            toks += prompt
            mask += [0] * len(prompt)
            if rng.random() < p:
                a = env.oracle_action()
            else:
                a = confused_action(env, rng, n) if kind == "confused" else env.random_action(rng)
            ans = answer_ids(tok, a)
            toks += ans
            mask += [1] * len(ans)
            r = env.step(a)
            if r.outcome != Outcome.RUNNING:
                break
        out.append((toks, mask))
    return out


def source(cfg, episodes: int):
    """A learner.sft.DemonstrationSource: `episodes` demonstrations of cfg.sft.demonstrator on cfg.actor.env_ids."""
    parse_demonstrator(cfg.sft.demonstrator)  # a bad spec is refused before any model is loaded
    return lambda tok: demonstrations(tok, list(cfg.actor.env_ids), episodes, cfg.sft.demonstrator, cfg.seed,
                                      cfg.actor.max_turns, cfg.actor.system_prompt, cfg.actor.max_obs_tokens)
