"""Scripted demonstrations for the SFT warm start: a demonstrator rolled through envd's tasks in-process, each turn
built by actor.tiny.turn_ids (the actor's own turn rule, in the checkpoint's chat template, with the actor's system
prompt) -> [(tokens, loss_mask)] for learner.sft.

    builtin tasks   oracle | noisy:P | confused:P[:N] (envd.builtin's oracle and random actions)
    other backends  oracle | noisy:P, where the backend has an oracle (MiniWoB++: the DOM oracle of
                    envd.miniwob_oracle.ORACLE_TASKS); noisy's other actions are the `random` hint policy's
                    (envd.hints). Each env id is rolled in a thread of its own, with its own env (a browser each);
                    the oracle's demonstrations keep only the episodes it won.

Every demonstration is played as the actor plays an episode: on its env ids under actor.env_options (strict_targets,
max_steps, ...; step_delay, which only slows a step, left out), at most actor.max_turns turns, and an action the env
rejects (envd.base.ActionError, e.g. a click on a label that is not on screen under strict_targets) changes nothing
and puts actor.tiny.INVALID_NOTE before the next observation, as the actor's next prompt does.

A policy the actor shows screenshots gets its demonstrations from tars.demos_vl instead (`source` picks): the same
demonstrators played through the actor's own episodes, with their screenshots.

The oracle is a demonstrator only: nothing here runs during RL or evaluation. Seeds are drawn below
core.config.HELD_OUT_SEED_BASE, so a held-out evaluation never sees a demonstrated episode.

This lives on the operations floor because it joins two roles (an environment and a prompt style); the learner
only sees the examples (learner.sft.DemonstrationSource).
"""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from actor.tiny import INVALID_NOTE, answer_ids, format_action, turn_ids
from core.action import Action
from core.config import HELD_OUT_SEED_BASE
from core.outcome import Outcome
from core.chat import ChatTokenizer
from core.session_options import SCREENSHOTS
from envd import builtin, latency, registry
from envd.base import ActionError


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
                   env_options: dict | None = None, max_new_tokens: int = 0,
                   stream: str = "") -> list[tuple[list[int], list[int]]]:
    """Roll the demonstrator through envd's envs in-process -> [(tokens, loss_mask)]. stream: a name for another
    series of training seeds (pages of their own: "val" for sft.val_episodes); "" = the SFT set's. `obs_budget`: the actor's
    actor.max_obs_tokens, so a demonstration's prompts are the ones the policy will see in RL. `max_new_tokens`:
    the actor's actor.max_new_tokens (0 = no limit): a demonstrated answer longer than that, which RL would cut
    short, is a ValueError naming the limit it needs."""
    if not all(is_builtin(e) for e in env_ids):
        eps = roll(env_ids, episodes, demonstrator, seed, max_turns, env_options, stream=stream)
        if episodes > 0 and not eps:
            raise ValueError(f"no demonstrations: the {demonstrator} demonstrator won none of the {episodes} episodes it "
                             f"played on {', '.join(env_ids)} within actor.max_turns={max_turns} (only won episodes "
                             "are demonstrations): raise actor.max_turns, or use noisy:P, which keeps every episode")
    else:
        kind, p, n = parse_demonstrator(demonstrator)
        rng = random.Random(_streamed(seed, stream))
        opts = env_options_for_demos(env_options)
        envs = {e: registry.make(e, dict(opts)) for e in env_ids}
        eps = []
        for i in range(episodes):
            env = envs[env_ids[i % len(env_ids)]]

            def choose(_r, env=env):
                if rng.random() < p:
                    return env.oracle_action()
                return confused_action(env, rng, n) if kind == "confused" else env.random_action(rng)

            eps.append(play(env, env.reset(rng.randrange(HELD_OUT_SEED_BASE)), choose, max_turns)[0])
    out = [tokenize(tok, ep, system_prompt, obs_budget) for ep in eps]
    if max_new_tokens > 0:
        sizes = [(len(answer_ids(tok, a)), format_action(a)) for ep in eps for _, _, a, _ in ep]
        over = [x for x in sizes if x[0] > max_new_tokens]
        if over:
            n, text = max(over, key=lambda x: x[0])
            raise ValueError(f"{len(over)} of {len(sizes)} demonstrated answers are longer than actor.max_new_tokens="
                             f"{max_new_tokens} tokens (the longest, {text!r}, is {n} with this checkpoint's "
                             f"tokenizer, its end-of-turn token included): RL would cut them short; set "
                             f"actor.max_new_tokens to at least {n}")
    return out


# A rolled turn: (observation text, instruction, the demonstrator's action, the note before the observation:
# INVALID_NOTE after a rejected action, else "").
DemoTurn = tuple[str, str, Action, str]


def env_options_for_demos(env_options: dict | None) -> dict[str, str]:
    """actor.env_options as the sessions of RL get them, without step_delay (a simulated slow GUI: it only waits)
    and without screenshots (a demonstration's turns are text: DemoTurn), for every env made by envd.registry."""
    opts = {k: str(v) for k, v in (env_options or {}).items() if k != latency.OPTION}
    return {**opts, SCREENSHOTS: "0"}


def play(env, r, choose, max_turns: int):
    """Play one episode from its reset result `r` as the actor does -> ([DemoTurn], the last result): at most
    max_turns turns; an action the env rejects changes nothing, and the next observation carries INVALID_NOTE."""
    turns: list[DemoTurn] = []
    note = ""
    while r.outcome == Outcome.RUNNING and len(turns) < max_turns:
        a = choose(r)
        turns.append((r.text, r.instruction, a, note))
        try:
            r = env.step(a)
            note = ""
        except ActionError:   # the actor's EnvActionError: the format penalty, and the note in the next prompt
            note = INVALID_NOTE
    return turns, r


def is_builtin(env_id: str) -> bool:
    return str(env_id).startswith("builtin/") and str(env_id).split("/", 1)[1] in builtin.TASKS


def tokenize(tok: ChatTokenizer, episode: list[DemoTurn], system_prompt: str = "tiny",
             obs_budget: int = 0) -> tuple[list[int], list[int]]:
    """One rolled episode [DemoTurn] -> (tokens, loss_mask), the actor's turns."""
    toks: list[int] = []
    mask: list[int] = []
    for text, instruction, a, note in episode:
        prompt = turn_ids(tok, system_prompt, text, instruction, note, first=not toks, obs_budget=obs_budget)
        ans = answer_ids(tok, a)
        toks += prompt + ans
        mask += [0] * len(prompt) + [1] * len(ans)
    return toks, mask


def _streamed(key, stream: str):
    """An RNG seed key for a named stream of seeds (see demonstrations); "" leaves the key as it was."""
    return f"{key}:{stream}" if stream else key


def episode_seeds(seed: int, env_id: str, stream: str = ""):
    """The env seeds `roll` gives env_id's episodes, in order: training seeds (below HELD_OUT_SEED_BASE)."""
    rng = random.Random(_streamed(f"{seed}:{env_id}:seeds", stream))
    while True:
        yield rng.randrange(HELD_OUT_SEED_BASE)


def roll(env_ids: list[str], episodes: int, demonstrator: str, seed: int, max_turns: int = 6,
         env_options: dict | None = None, keep: str = "won", stream: str = "") -> list[list[DemoTurn]]:
    """Roll `demonstrator` (oracle | noisy:P) through any env with an oracle, in-process, episode i on
    env_ids[i % len]: one thread and one env per env id -> episodes as [DemoTurn] (play).
    keep: "won" drops the oracle's episodes that did not succeed (a demonstration must show the task done; every
    noisy episode is kept), "all" keeps every episode."""
    from envd import hints

    kind, p, _ = parse_demonstrator(demonstrator)
    if kind == "confused":
        raise ValueError("the confused demonstrator exists for the builtin tasks only; use oracle or noisy:P")
    opts = env_options_for_demos(env_options)

    def work(k: int) -> list[tuple[int, list]]:
        env_id = env_ids[k]
        rng = random.Random(_streamed(f"{seed}:{env_id}", stream))
        seeds = episode_seeds(seed, env_id, stream)
        env = registry.make(env_id, dict(opts))
        out = []

        def choose(r):
            try:
                return env.oracle_action() if rng.random() < p else hints.next_action(env, "random", r, rng)
            except NotImplementedError as e:
                raise ValueError(f"{env_id}: no scripted demonstrator: {e}") from None

        try:
            for i in range(k, episodes, len(env_ids)):
                turns, r = play(env, env.reset(next(seeds)), choose, max_turns)
                won = r.outcome == Outcome.TERMINATED and bool(r.info.get("success", r.reward > 0))
                if turns and (won or keep == "all" or kind != "oracle"):
                    out.append((i, turns))
        finally:
            env.close()
        return out

    with ThreadPoolExecutor(max(1, len(env_ids)), thread_name_prefix="demos") as pool:
        rolled = [x for part in pool.map(work, range(len(env_ids))) for x in part]
    return [turns for _, turns in sorted(rolled, key=lambda x: x[0])]


def source(cfg, episodes: int, stream: str = ""):
    """A learner.sft.DemonstrationSource: `episodes` demonstrations of cfg.sft.demonstrator on cfg.actor.env_ids
    (stream: see demonstrations). A policy the actor shows screenshots (actor.image_history, resolved for the
    checkpoint: a vision-language one shows them by default) gets them played through the actor's own episodes, with
    their screenshots (tars.demos_vl); a text policy the text turns above."""
    kind = parse_demonstrator(cfg.sft.demonstrator)[0]  # a bad spec is refused before any model is loaded

    def build(tok: ChatTokenizer):
        from actor.uitars import resolve

        if resolve(cfg.actor, tok).image_history > 0:   # ValueError for settings the actor would refuse too
            from tars.demos_vl import examples

            if kind == "confused":
                raise ValueError(f"sft.demonstrator={cfg.sft.demonstrator}: a policy shown screenshots learns from "
                                 "oracle or noisy:P demonstrations (confused:P writes the builtin tasks' text turns)")
            return examples(cfg, tok, episodes, cfg.sft.demonstrator, lambda e: episode_seeds(cfg.seed, e, stream))
        return demonstrations(tok, list(cfg.actor.env_ids), episodes, cfg.sft.demonstrator, cfg.seed,
                              cfg.actor.max_turns, cfg.actor.system_prompt, cfg.actor.max_obs_tokens,
                              cfg.actor.env_options, cfg.actor.max_new_tokens, stream)
    return build


def val_source(cfg):
    """sft.val_episodes demonstrations on pages of their own (stream "val"), or None."""
    return source(cfg, cfg.sft.val_episodes, "val") if cfg.sft.val_episodes > 0 else None
