"""Rollout figures of `tars bench inference`, through real gRPC servers over LocalEngines (in process, loopback).

update_waste(): a closed loop of `workers` clients, each generating `max_new_tokens` at a time without pause, while
new weights are installed every `update_every_s` seconds through UpdateWeights. Two ways, in turn, same schedule:
- partial rollouts (tars): requests stay in flight across the update; the server resumes them under the new
  weights (default: the prefix KV is recomputed, max_stale_versions=0); a third run, partial_stale, asks for
  max_stale_versions=1 per request, so the KV computed under the previous weights is kept (nothing re-prefilled);
- restart-on-update (the baseline): at each update every in-flight call is cancelled (the server stops its engine
  request), the update is installed, and the cancelled requests are sent again from scratch.
Figure: tokens sampled by the engine that no caller received (discarded, then regenerated), as a share of the
tokens sampled: (engine tokens_generated - tokens delivered) / engine tokens_generated. Re-prefilled tokens
(prefix KV recomputed under the new weights) are reported beside it: work, but no token is thrown away.

multiturn_cache(): `episodes` concurrent multi-turn episodes over two replicas (sticky routing), each turn's prompt
= the previous prompt + the previous output + `obs_tokens` new tokens (an observation). Figure: the share of prompt
tokens of turns >= 2 served from the prefix cache, next to the most that could be (everything but the new tokens
and the one token that must be fed to get logits).
"""
from __future__ import annotations

import asyncio
import random
import tempfile
import time

from core.inference_client import InferenceClient
from inference_server.engine import LocalEngine
from inference_server.server import InferenceServer
from core.config import InferenceConfig
from core.model import CausalLM, DecoderConfig


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(2, vocab) for _ in range(n)]


async def _update_run(mode: str, dc: DecoderConfig, ckpts: list[str], workers: int, prompt_len: int, max_new_tokens: int,
                      duration_s: float, update_every_s: float, threads: int, seed: int) -> dict:
    cfg = InferenceConfig(threads=threads, max_context=1024)
    eng = LocalEngine(cfg, CausalLM(dc).init_weights(0, std=0.1))
    srv = InferenceServer(cfg, eng)
    await srv.start()
    client = InferenceClient([srv.address], timeout_s=300)
    rng = random.Random(seed)
    stale = 1 if mode == "partial_stale" else 0  # the per-request choice: keep KV one version old, or recompute it
    gate = asyncio.Event()
    gate.set()
    inflight: set[asyncio.Task] = set()
    delivered = completed = restarted = 0
    stop_at = time.monotonic() + duration_s

    async def worker(w: int):
        nonlocal delivered, completed, restarted
        while time.monotonic() < stop_at:
            p = _prompt(rng, prompt_len, dc.vocab_size)
            while True:  # the same request again after a restart
                await gate.wait()
                t = asyncio.create_task(client.generate(f"w{w}", p, max_new_tokens, temperature=1.0, max_stale_versions=stale))
                inflight.add(t)
                try:
                    r = await asyncio.shield(t)
                except asyncio.CancelledError:
                    if not t.cancelled():
                        raise
                    restarted += 1
                    continue
                finally:
                    inflight.discard(t)
                delivered += len(r.output_ids)
                completed += 1
                break

    async def updater():
        version, n = 0, 0
        while True:
            await asyncio.sleep(update_every_s)
            if time.monotonic() >= stop_at:
                return n
            version += 1
            if mode == "restart":
                gate.clear()
                for t in list(inflight):
                    t.cancel()
            await client.update_weights(version, path=ckpts[version % len(ckpts)])
            n += 1
            gate.set()

    m0 = eng.metrics()
    t0 = time.monotonic()
    try:
        up = asyncio.create_task(updater())
        await asyncio.gather(*(worker(w) for w in range(workers)))
        updates = await up
        # Cancelled engine requests stop at the next step: wait until nothing runs so every token is counted.
        while eng.metrics()["running"] or eng.metrics()["waiting"]:
            await asyncio.sleep(0.01)
        m = eng.metrics()
    finally:
        await client.close()
        await srv.stop(grace=1.0)
        await asyncio.to_thread(eng.close)
    sampled = m["tokens_generated"] - m0["tokens_generated"]
    return {
        "mode": mode, "seconds": time.monotonic() - t0, "weight_updates": updates, "requests_completed": completed,
        "requests_restarted": restarted, "tokens_sampled": sampled, "tokens_delivered": delivered,
        "tokens_discarded": sampled - delivered, "discarded_share": (sampled - delivered) / sampled if sampled else 0.0,
        "interrupted_requests": m["interrupted_requests"], "reprefilled_tokens": m["recomputed_tokens"],
        "reprefilled_share": m["recomputed_tokens"] / sampled if sampled else 0.0,
        "delivered_tokens_per_s": delivered / max(time.monotonic() - t0, 1e-9),
    }


def update_waste(workers: int = 16, prompt_len: int = 32, max_new_tokens: int = 64, duration_s: float = 12.0,
                 update_every_s: float = 2.0, threads: int = 1, seed: int = 0, with_stale: bool = True) -> dict:
    dc = DecoderConfig(vocab_size=300)
    with tempfile.TemporaryDirectory(prefix="tars-bench-") as d:
        ckpts = []
        for i in range(2):
            CausalLM(dc).init_weights(100 + i, std=0.1).save_hf(f"{d}/v{i}")
            ckpts.append(f"{d}/v{i}")
        args = (dc, ckpts, workers, prompt_len, max_new_tokens, duration_s, update_every_s, threads, seed)
        partial = asyncio.run(_update_run("partial", *args))
        restart = asyncio.run(_update_run("restart", *args))
        stale = asyncio.run(_update_run("partial_stale", *args)) if with_stale else None
    return {"workers": workers, "prompt_len": prompt_len, "max_new_tokens": max_new_tokens, "duration_s": duration_s,
            "update_every_s": update_every_s, "partial": partial, "restart": restart, "partial_stale": stale}


async def _multiturn(episodes: int, turns: int, first_prompt: int, obs_tokens: int, max_new_tokens: int, threads: int,
                     seed: int, replicas: int) -> dict:
    dc = DecoderConfig(vocab_size=300)
    cfg = InferenceConfig(threads=threads, max_context=2048)
    made = []
    for _ in range(replicas):
        eng = LocalEngine(cfg, CausalLM(dc).init_weights(0, std=0.1))
        srv = InferenceServer(cfg, eng)
        await srv.start()
        made.append((srv, eng))
    client = InferenceClient([s.address for s, _ in made], timeout_s=300)
    rng = random.Random(seed)
    rows: list[tuple[int, int, int]] = []  # (turn, prompt_tokens, cached_tokens)
    reusable = 0
    homes: dict[str, set] = {}

    async def episode(e: int):
        nonlocal reusable
        ids = _prompt(rng, first_prompt, dc.vocab_size)
        for turn in range(turns):
            r = await client.generate(f"ep{e}", ids, max_new_tokens, temperature=1.0)
            rows.append((turn, r.prompt_tokens, r.cached_tokens))
            homes.setdefault(f"ep{e}", set()).add(r.replica)
            nxt = ids + r.output_ids + _prompt(rng, obs_tokens, dc.vocab_size)
            if turn + 1 < turns:
                reusable += len(ids) + len(r.output_ids) - 1  # the last output token was never fed: no KV for it
            ids = nxt

    try:
        await asyncio.gather(*(episode(e) for e in range(episodes)))
    finally:
        await client.close()
        for srv, eng in made:
            await srv.stop(grace=1.0)
            await asyncio.to_thread(eng.close)
    later = [(p, c) for t, p, c in rows if t > 0]
    prompt_later = sum(p for p, _ in later)
    cached_later = sum(c for _, c in later)
    prompt_all = sum(p for _, p, _ in rows)
    return {"episodes": episodes, "turns": turns, "first_prompt": first_prompt, "obs_tokens": obs_tokens,
            "max_new_tokens": max_new_tokens, "replicas": replicas,
            "hit_share_later_turns": cached_later / prompt_later if prompt_later else 0.0,
            "reusable_share_later_turns": reusable / prompt_later if prompt_later else 0.0,
            "hit_over_reusable": cached_later / reusable if reusable else 0.0,
            "hit_share_all_turns": cached_later / prompt_all if prompt_all else 0.0,
            "prompt_tokens": prompt_all, "cached_tokens": cached_later,
            "episodes_on_one_replica": sum(len(h) == 1 for h in homes.values())}


def multiturn_cache(episodes: int = 16, turns: int = 6, first_prompt: int = 64, obs_tokens: int = 24, max_new_tokens: int = 16,
                    threads: int = 1, seed: int = 0, replicas: int = 2) -> dict:
    return asyncio.run(_multiturn(episodes, turns, first_prompt, obs_tokens, max_new_tokens, threads, seed, replicas))
