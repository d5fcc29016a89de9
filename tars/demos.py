"""Scripted demonstrations for the SFT warm start: a demonstrator rolled through envd's tasks in-process, each turn
built by actor.tiny.turn_ids (the actor's own turn rule, in the checkpoint's chat template, with the actor's system
prompt) -> [(tokens, loss_mask)] for learner.sft.

    builtin tasks   oracle | noisy:P | confused:P[:N] (envd.builtin's oracle and random actions)
    other backends  oracle | noisy:P, where the backend has an oracle (MiniWoB++: the DOM oracle of
                    envd.miniwob_oracle.ORACLE_TASKS); noisy's other actions are the `random` hint policy's
                    (envd.hints). Each env id is rolled in a thread of its own, with its own env (a browser each),
                    under actor.env_options; the oracle's demonstrations keep only the episodes it won.

The oracle is a demonstrator only: nothing here runs during RL or evaluation. Seeds are drawn below
core.config.HELD_OUT_SEED_BASE, so a held-out evaluation never sees a demonstrated episode.

This lives on the operations floor because it joins two roles (an environment and a prompt style); the learner
only sees the examples (learner.sft.DemonstrationSource).
"""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from actor.tiny import answer_ids, turn_ids
from core.action import Action
from core.config import HELD_OUT_SEED_BASE
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
                   max_turns: int = 6, system_prompt: str = "tiny", obs_budget: int = 0,
                   env_options: dict | None = None) -> list[tuple[list[int], list[int]]]:
    """Roll the demonstrator through envd's envs in-process -> [(tokens, loss_mask)]. `obs_budget`: the actor's
    actor.max_obs_tokens, so a demonstration's prompts are the ones the policy will see in RL."""
    if not all(is_builtin(e) for e in env_ids):
        return [tokenize(tok, ep, system_prompt, obs_budget)
                for ep in roll(env_ids, episodes, demonstrator, seed, max_turns, env_options)]
    kind, p, n = parse_demonstrator(demonstrator)
    rng = random.Random(seed)
    envs = {e: builtin.make(e.split("/", 1)[1], {"max_steps": str(max_turns)}) for e in env_ids}
    out = []
    for i in range(episodes):
        env = envs[env_ids[i % len(env_ids)]]
        r = env.reset(rng.randrange(HELD_OUT_SEED_BASE))
        turns = []
        while True:
            if rng.random() < p:
                a = env.oracle_action()
            else:
                a = confused_action(env, rng, n) if kind == "confused" else env.random_action(rng)
            turns.append((r.text, r.instruction, a))
            r = env.step(a)
            if r.outcome != Outcome.RUNNING:
                break
        out.append(tokenize(tok, turns, system_prompt, obs_budget))
    return out


def is_builtin(env_id: str) -> bool:
    return str(env_id).startswith("builtin/") and str(env_id).split("/", 1)[1] in builtin.TASKS


def tokenize(tok: ChatTokenizer, episode: list[tuple[str, str, Action]], system_prompt: str = "tiny",
             obs_budget: int = 0) -> tuple[list[int], list[int]]:
    """One rolled episode [(observation text, instruction, action)] -> (tokens, loss_mask), the actor's turns."""
    toks: list[int] = []
    mask: list[int] = []
    for text, instruction, a in episode:
        prompt = turn_ids(tok, system_prompt, text, instruction, first=not toks, obs_budget=obs_budget)
        ans = answer_ids(tok, a)
        toks += prompt + ans
        mask += [0] * len(prompt) + [1] * len(ans)
    return toks, mask


def episode_seeds(seed: int, env_id: str):
    """The env seeds `roll` gives env_id's episodes, in order: training seeds (below HELD_OUT_SEED_BASE)."""
    rng = random.Random(f"{seed}:{env_id}:seeds")
    while True:
        yield rng.randrange(HELD_OUT_SEED_BASE)


def roll(env_ids: list[str], episodes: int, demonstrator: str, seed: int, max_turns: int = 6,
         env_options: dict | None = None, keep: str = "won") -> list[list[tuple[str, str, Action]]]:
    """Roll `demonstrator` (oracle | noisy:P) through any env with an oracle, in-process, episode i on
    env_ids[i % len]: one thread and one env per env id -> episodes as [(observation text, instruction, action)].
    keep: "won" drops the oracle's episodes that did not succeed (a demonstration must show the task done; every
    noisy episode is kept), "all" keeps every episode."""
    from envd import hints, registry

    kind, p, _ = parse_demonstrator(demonstrator)
    if kind == "confused":
        raise ValueError("the confused demonstrator exists for the builtin tasks only; use oracle or noisy:P")
    opts = {**{k: str(v) for k, v in (env_options or {}).items()}, "max_steps": str(max_turns)}

    def work(k: int) -> list[tuple[int, list]]:
        env_id = env_ids[k]
        rng = random.Random(f"{seed}:{env_id}")
        seeds = episode_seeds(seed, env_id)
        env = registry.make(env_id, dict(opts))
        out = []
        try:
            for i in range(k, episodes, len(env_ids)):
                r = env.reset(next(seeds))
                turns = []
                while r.outcome == Outcome.RUNNING and len(turns) < max_turns:
                    try:
                        a = env.oracle_action() if rng.random() < p else hints.next_action(env, "random", r, rng)
                    except NotImplementedError as e:
                        raise ValueError(f"{env_id}: no scripted demonstrator: {e}") from None
                    turns.append((r.text, r.instruction, a))
                    r = env.step(a)
                won = r.outcome == Outcome.TERMINATED and bool(r.info.get("success", r.reward > 0))
                if turns and (won or keep == "all" or kind != "oracle"):
                    out.append((i, turns))
        finally:
            env.close()
        return out

    with ThreadPoolExecutor(max(1, len(env_ids)), thread_name_prefix="demos") as pool:
        rolled = [x for part in pool.map(work, range(len(env_ids))) for x in part]
    return [turns for _, turns in sorted(rolled, key=lambda x: x[0])]


def source(cfg, episodes: int):
    """A learner.sft.DemonstrationSource: `episodes` demonstrations of cfg.sft.demonstrator on cfg.actor.env_ids."""
    parse_demonstrator(cfg.sft.demonstrator)  # a bad spec is refused before any model is loaded
    return lambda tok: demonstrations(tok, list(cfg.actor.env_ids), episodes, cfg.sft.demonstrator, cfg.seed,
                                      cfg.actor.max_turns, cfg.actor.system_prompt, cfg.actor.max_obs_tokens,
                                      cfg.actor.env_options)
