"""Supervised warm start on scripted demonstrations (UI-TARS-2 runs SFT before RL).

Demonstrations are whole multi-turn conversations in the same token format the actor produces, with the loss
on the policy's turns only. `noisy:P` demonstrators take the oracle's action with probability P and a random
visible widget otherwise, like imperfect human data: the warm-started policy knows the format and the grammar
of the task but is far from solving it, which leaves the improvement to RL. `confused:P[:N]` demonstrators do the
oracle's kind of action but with a word of the goal drawn at random (or one of N plausible distractors): the policy
learns to copy words from the instruction, firmly for every word, and RL learns which word goes where.
"""
from __future__ import annotations

import random
import time

import numpy as np
import torch

from actor.tiny import answer_ids, turn_prompt_ids
from envd import builtin
from learner.device import autocast, describe, resolve_device, resolve_precision
from learner.ppo import sft_loss
from tars.model import CausalLM
from tars.tokenizer import Tokenizer


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


def confused_action(env, rng: random.Random, distractors: int = 0) -> dict:
    """The oracle's action with its label or text swapped for a word drawn at random from the goal's words and
    `distractors` plausible wrong ones (a visible label to click, a name to type): the demonstrator knows what to do
    and that the words mostly come from the instruction, not which word goes where."""
    a = dict(env.oracle_action())
    key = "content" if a["type"] == "type" else "target"
    words = [w for w in env.observe().instruction.split() if w not in GOAL_VERBS]
    for _ in range(distractors):
        words.append(rng.choice(builtin.VALUES) if key == "content" else rng.choice(env.clickable()))
    if words:
        a[key] = rng.choice(words)
    return a


def demonstrations(tok: Tokenizer, env_ids: list[str], episodes: int, demonstrator: str, seed: int,
                   max_turns: int = 6) -> list[tuple[list[int], list[int]]]:
    """Roll the demonstrator through builtin envs in-process -> [(tokens, loss_mask)]."""
    kind, p, n = parse_demonstrator(demonstrator)
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
            if rng.random() < p:
                a = env.oracle_action()
            else:
                a = confused_action(env, rng, n) if kind == "confused" else env.random_action(rng)
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
              log=None, device: torch.device | None = None, amp_dtype: torch.dtype | None = None) -> dict:
    """SFT on `device` (default: where the policy is), forward passes under bf16 autocast when amp_dtype is set;
    weights, optimizer and loss stay fp32. The policy is left on `device`; save_hf writes fp32 CPU tensors."""
    device = device if device is not None else next(policy.parameters()).device
    policy.to(device)
    g = np.random.default_rng(seed)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / max(1, steps)))
    policy.train()
    t0, losses = time.perf_counter(), []
    for s in range(steps):
        idx = g.integers(0, len(demos), batch_size)
        tokens, valid, mask = (x.to(device) for x in pad([demos[i] for i in idx], pad_id))
        with autocast(device, amp_dtype):
            loss = sft_loss(policy, tokens, valid, mask)  # fp32: logprobs_at upcasts the logits
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


def run(cfg, model_dir: str, out_dir: str, data: list[str], demos: int = 0, steps: int | None = None,
        log=print) -> dict:
    """`tars sft`: fine-tune model_dir on stored trajectories (data: trajectory files, e.g. a split's sft.twl)
    and/or `demos` scripted demonstrations (cfg.sft.demonstrator on cfg.actor.env_ids); write HF layout to out_dir."""
    import json
    import pathlib

    from learner.data import read_trajectories, sft_examples

    if not data and demos <= 0:
        raise ValueError("nothing to train on: give trajectory files (--data) and/or --demos N")
    device = resolve_device(cfg.learner.device)  # the learner's choice: ConfigError before any work
    amp_dtype = resolve_precision(cfg.learner.precision, device)
    torch.manual_seed(cfg.seed)
    src = pathlib.Path(model_dir)
    policy = CausalLM.load_hf(src)
    examples = sft_examples(read_trajectories(data)) if data else []
    n_traj = len(examples)
    tok_file = src / "tars_tokenizer.json"
    if demos > 0:
        if not tok_file.exists():
            raise ValueError(f"--demos needs the tars tokenizer in {tok_file}")
        examples += demonstrations(Tokenizer.load(src), list(cfg.actor.env_ids), demos, cfg.sft.demonstrator,
                                   cfg.seed, cfg.actor.max_turns)
    if not examples:
        raise ValueError("the trajectory files hold no trajectory with generated tokens")
    steps = cfg.sft.steps if steps is None else steps
    if steps <= 0:
        raise ValueError("--steps must be >= 1")
    log(f"sft on {describe(device, amp_dtype)}")
    m = train_sft(policy, examples, steps, cfg.sft.batch_size, cfg.sft.lr, cfg.seed, policy.config.pad_token_id, log=log,
                  device=device, amp_dtype=amp_dtype)
    extra = {"tars_tokenizer.json": tok_file.read_text()} if tok_file.exists() else {}
    policy.save_hf(out_dir, extra_files=extra)
    m.update(trajectories=n_traj, demonstrations=len(examples) - n_traj, out=str(out_dir), device=str(device),
             precision="bf16" if amp_dtype is not None else "fp32")
    pathlib.Path(out_dir, "sft.json").write_text(json.dumps(m, indent=2))
    return m
