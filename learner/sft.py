"""Supervised warm start on scripted demonstrations (UI-TARS-2 runs SFT before RL).

Demonstrations are whole multi-turn conversations in the same token format the actor produces, with the loss
on the policy's turns only. `noisy:P` demonstrators take the oracle's action with probability P and a random
visible widget otherwise, like imperfect human data: the warm-started policy knows the format and the grammar
of the task but is far from solving it, which leaves the improvement to RL.
"""
from __future__ import annotations

import random
import time

import numpy as np
import torch

from actor.tiny import answer_ids, turn_prompt_ids
from envd import builtin
from learner.ppo import sft_loss
from tars.model import CausalLM
from tars.tokenizer import Tokenizer


def parse_demonstrator(spec: str) -> float:
    if spec == "oracle":
        return 1.0
    if spec.startswith("noisy:"):
        p = float(spec.split(":", 1)[1])
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"demonstrator {spec!r}: P must be in [0, 1]")
        return p
    raise ValueError(f"unknown demonstrator {spec!r}: expected oracle or noisy:P")


def demonstrations(tok: Tokenizer, env_ids: list[str], episodes: int, demonstrator: str, seed: int,
                   max_turns: int = 6) -> list[tuple[list[int], list[int]]]:
    """Roll the demonstrator through builtin envs in-process -> [(tokens, loss_mask)]."""
    p = parse_demonstrator(demonstrator)
    rng = random.Random(seed)
    envs = {e: builtin.make(e.split("/", 1)[1], {"max_steps": str(max_turns)}) for e in env_ids}
    out = []
    for i in range(episodes):
        env = envs[env_ids[i % len(env_ids)]]
        r = env.reset(rng.randrange(1 << 30))
        toks, mask = [], []
        while True:
            prompt = turn_prompt_ids(tok, r.text, r.instruction)
            toks += prompt
            mask += [0] * len(prompt)
            a = env.oracle_action() if rng.random() < p else env.random_action(rng)
            ans = answer_ids(tok, a)
            toks += ans
            mask += [1] * len(ans)
            r = env.step(a)
            if r.outcome != "running":
                break
        out.append((toks, mask))
    return out


def pad(seqs: list[tuple[list[int], list[int]]], pad_id: int):
    T = max(len(t) for t, _ in seqs)
    tokens = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    valid = torch.zeros(len(seqs), T, dtype=torch.bool)
    mask = torch.zeros(len(seqs), T)
    for i, (t, m) in enumerate(seqs):
        tokens[i, : len(t)] = torch.tensor(t)
        valid[i, : len(t)] = True
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return tokens, valid, mask


def train_sft(policy: CausalLM, demos, steps: int, batch_size: int, lr: float, seed: int, pad_id: int,
              log=None) -> dict:
    g = np.random.default_rng(seed)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / max(1, steps)))
    policy.train()
    t0, losses = time.perf_counter(), []
    for s in range(steps):
        idx = g.integers(0, len(demos), batch_size)
        tokens, valid, mask = pad([demos[i] for i in idx], pad_id)
        loss = sft_loss(policy, tokens, valid, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if log and (s % 50 == 0 or s == steps - 1):
            log(f"sft step {s + 1}/{steps} loss {np.mean(losses[-50:]):.3f}")
    policy.eval()
    return {"sft_steps": steps, "sft_loss": float(np.mean(losses[-50:])) if losses else None, "sft_s": time.perf_counter() - t0}
