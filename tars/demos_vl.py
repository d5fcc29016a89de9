"""Demonstrations with screenshots: a scripted demonstrator played through the actor's own episode loop.

A policy shown screenshots (actor.image_history > 0: a vision-language checkpoint, by default) learns its warm start
from what it will see in RL: each demonstration is an actor episode (actor.episode.run_episode, through a real envd
on loopback in this process, behind a token of its own) in which the demonstrator writes the answers instead of the
model, so the prompts, the image runs, the segments and the images of every example are the actor's own (one place
builds them), and SFT trains on them with their screenshots (learner.sft: ExampleImages, bound per segment like the
learner's RL batches). An episode that ends as an infrastructure error (a browser that crashed) is left out, as a
lost one is; when nothing is left, the error says why.

    oracle    envd's hint (envd/hints.py: sessions created with hint_policy=oracle) is the next action; an action
              that names an element carries its point, so it is written at that point in the checkpoint's
              coordinates and point form (actor.uitars.Vision.demo_answer). Only won episodes are kept.
    noisy:P   envd's noisy:P hint: the oracle's action with probability P, else the backend's random one (a click
              anywhere on the screen for a backend without an action model); every episode is kept.

Seeds are the caller's (tars.demos.episode_seeds: training seeds, below core.config.HELD_OUT_SEED_BASE), episode i on
env_ids[i % len] with that env id's next seed, drawn before any episode runs, so the demonstrations do not depend on
how many run at once: `workers` sessions (by default one per env id, and at least one per core of the host up to 8,
so one task's demonstrations are not rolled one after the other), worker k playing episodes k, k + workers, .... The
demonstrator is never a policy: nothing here runs during RL or evaluation.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets

from actor.envclient import RecordingEnv
from core.action import Action
from core.inference_client import GenerateResult
from envd import hints


MAX_PER_CORE_SESSIONS = 8


class _GaveUp(Exception):
    """The oracle has no action for this page (envd's hint_error): the episode is dropped, not a demonstration."""


class _Demonstrator(RecordingEnv):
    """One episode's stand-in for the model: the episode's env (a RecordingEnv: the last observation, with its hint),
    and an inference client whose generate answers with the demonstrator's action as the policy should write it."""

    def __init__(self, env, tok, vis, style: str):
        super().__init__(env)
        self.tok, self.vis, self.style, self.longest = tok, vis, style, (0, "")

    def action(self) -> Action:
        info = json.loads(self.obs.info_json or "{}")
        if not info.get("hint_action"):
            raise _GaveUp(str(info.get("hint_error", "no action")))
        return Action.from_dict(info["hint_action"])

    async def generate(self, tid, input_ids, max_new_tokens, **_kw) -> GenerateResult:
        o = self.obs
        shot = bytes(o.images[-1].data) if o.images else b""
        text = self.vis.demo_answer(self.style, self.action(), (o.width, o.height), shot)
        ids = self.tok.answer(text)
        if len(ids) > self.longest[0]:
            self.longest = (len(ids), text)
        ids = ids[:max_new_tokens] if max_new_tokens > 0 else ids
        return GenerateResult(ids, [0.0] * len(ids), [0] * len(ids), "stop", len(input_ids), 0, 0, "demonstrator")


async def _roll(cfg, tok, env_ids: list[str], episodes: int, demonstrator: str, keep_all: bool, seeds_of,
                workers: int):
    from actor import uitars
    from actor.envclient import EnvClient
    from actor.episode import EpisodeContext, run_episode
    from core.outcome import Outcome
    from envd.server import EnvServer

    a = cfg.actor
    acfg = dataclasses.replace(a, env_options={**a.env_options, hints.OPTION: demonstrator}, judge_mode="off",
                               max_new_tokens=a.max_new_tokens or 256)
    vis = uitars.resolve(acfg, tok)
    # this process's own daemon, on loopback, with a token of its own: no other process can call it
    token = secrets.token_hex(16)
    server = EnvServer(dataclasses.replace(cfg.envd, host="127.0.0.1", port=0, auth_token=token), control_token=token)
    await server.start()
    env = EnvClient(server.address, token, a.rpc_timeout_s, a.retries, workers, cfg.envd.lease_ttl_s / 2,
                    cfg.envd.lease_ttl_s)
    draws = {e: seeds_of(e) for e in dict.fromkeys(env_ids)}
    plan = [(env_ids[i % len(env_ids)], next(draws[env_ids[i % len(env_ids)]])) for i in range(episodes)]
    longest: list[tuple[int, str]] = []
    failed: list[str] = []   # the infrastructure errors of episodes left out
    unanswered: list[str] = []   # why episodes ended before their first answer (a first prompt over the context)

    async def work(k: int) -> list[tuple[int, object]]:
        out = []
        for i in range(k, episodes, workers):
            env_id, seed = plan[i]
            d = _Demonstrator(env, tok, vis, vis.style(a.system_prompt, env_id))
            ctx = EpisodeContext(acfg, tok, d, "demonstrator", max_context=cfg.inference.request_limit(), vision=vis)
            try:
                tr = await run_episode(ctx, d, f"demo-{env_id}-{i}", env_id, seed, 0)
            except _GaveUp:
                continue
            finally:
                longest.append(d.longest)
            if tr.outcome == Outcome.INFRA_ERROR:
                failed.append(f"{env_id}: {tr.error}")
            elif not tr.turns:
                unanswered.append(f"{env_id}: {tr.error or tr.truncated_by}")
            elif keep_all or (tr.outcome == Outcome.TERMINATED and tr.success):
                out.append((i, tr))
        return out

    tasks = [asyncio.create_task(work(k)) for k in range(workers)]
    try:
        parts = await asyncio.gather(*tasks)
    finally:   # one env id's error ends the others before their daemon stops
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await env.close()
        await server.stop(grace=1.0)
    n, text = max(longest, default=(0, ""))
    if a.max_new_tokens > 0 and n > a.max_new_tokens:
        raise ValueError(f"a demonstrated answer is longer than actor.max_new_tokens={a.max_new_tokens} tokens "
                         f"({text!r} is {n} with this checkpoint's tokenizer, its end-of-turn token included): RL "
                         f"would cut it short; set actor.max_new_tokens to at least {n}")
    kept = [tr for _, tr in sorted((x for part in parts for x in part), key=lambda x: x[0])]
    if episodes > 0 and not kept:
        lost = (f"; {len(failed)} ended as infrastructure errors (the first: {failed[0][:300]})" if failed else "")
        lost += (f"; {len(unanswered)} ended before their first answer (the first: {unanswered[0][:300]}; "
                 "inference.max_context is the actor's limit too)" if unanswered else "")
        raise ValueError(f"no demonstrations: of the {episodes} episodes the {demonstrator} demonstrator played on "
                         f"{', '.join(env_ids)} within actor.max_turns={a.max_turns}, none "
                         f"{'was won' if not keep_all else 'took a turn'}{lost}")
    return kept


def trajectories(cfg, tok, episodes: int, demonstrator: str, seeds_of, workers: int = 0) -> list:
    """`episodes` demonstrations of `demonstrator` (oracle | noisy:P: envd's hint policy) on cfg.actor.env_ids as the
    actor's Trajectory records (tokens, the answers' mask, segments, image_refs, images); seeds_of(env_id): that env
    id's episode seeds, in order. workers: episodes at once (0: one per env id, and at least one per core up to
    MAX_PER_CORE_SESSIONS; never more than the episodes). The oracle's episodes are kept when won, noisy's all; ValueError when none is kept."""
    hints.check(demonstrator)   # ValueError naming what envd takes (confused:P is for tars.demos' text turns)
    env_ids = list(cfg.actor.env_ids)
    # (at most MAX_PER_CORE_SESSIONS for the cores: each is a browser, and envd refuses sessions past its host budget)
    workers = max(1, min(episodes, workers or max(len(env_ids), min(os.cpu_count() or 1, MAX_PER_CORE_SESSIONS))))
    # from synchronous code (tars sft, tars up's warm start), as those are
    return asyncio.run(_roll(cfg, tok, env_ids, episodes, demonstrator, demonstrator != "oracle", seeds_of, workers))


def examples(cfg, tok, episodes: int, demonstrator: str, seeds_of) -> list[tuple]:
    """The demonstrations (trajectories) as learner.sft examples: (tokens, loss mask, ExampleImages), the loss on
    the answers."""
    from learner.data import sft_examples

    return sft_examples(trajectories(cfg, tok, episodes, demonstrator, seeds_of))
