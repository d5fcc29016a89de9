"""Supervised fine-tuning (UI-TARS-2 runs SFT before RL): stored trajectories and/or demonstrations -> HF layout.

Examples are whole multi-turn conversations in the token format the actor produces, with the loss on the
policy's turns only. Demonstrations come in through a DemonstrationSource (tokenizer -> examples), so this role
knows nothing of environments or prompt styles; the scripted demonstrators (oracle, noisy:P, confused:P[:N]) live
on the operations floor in tars.demos.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np
import torch

from learner.device import autocast, describe, resolve_device, resolve_precision
from core.chat import ChatTokenizer, has_tokenizer
from core.outcome import Outcome
from core.schema import SchemaError
from core.vlm import image_runs
from learner.batch import row_images
from learner.policy import TrainPolicy


# A demonstration source: the model directory's tokenizer (core.chat.ChatTokenizer) -> [(tokens, loss_mask)], loss on
# the answer tokens. The learner knows nothing of environments or prompt styles; the operations floor (tars.demos)
# builds scripted ones from envd's builtin tasks and the actor's prompt style and hands them in here.
# A vision-language example carries a third element: its images (learner.data.ExampleImages, from a trajectory), which
# bind_images turns into the learner.batch.RowImages the policy's forward takes, once, before training.
Example = tuple  # (tokens, loss_mask) or (tokens, loss_mask, ExampleImages | RowImages)
DemonstrationSource = Callable[[ChatTokenizer], list[Example]]


def pad(seqs: list[tuple[list[int], list[int]]], pad_id: int):
    T = max(len(e[0]) for e in seqs)
    tokens = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    valid = torch.zeros(len(seqs), T, dtype=torch.bool)
    mask = torch.zeros(len(seqs), T)
    for i, (t, m, *_) in enumerate(seqs):
        tokens[i, : len(t)] = torch.tensor(t)
        valid[i, : len(t)] = True
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return tokens, valid, mask


def _length_chunks(batch: list[Example], max_tokens: int) -> list[list[Example]]:
    """batch sorted longest first -> consecutive chunks whose padded size (rows x longest) stays <= max_tokens."""
    chunks, cur = [], []
    for e in batch:
        if cur and (len(cur) + 1) * len(cur[0][0]) > max_tokens:
            chunks.append(cur)
            cur = []
        cur.append(e)
    return chunks + ([cur] if cur else [])


def _inputs(chunk: list[Example], pad_id: int, device: torch.device):
    """tokens, key_valid, loss mask (on device) and the rows' images (None for a text batch) of a chunk."""
    tokens, valid, mask = (x.to(device) for x in pad(chunk, pad_id))
    rows = [e[2] if len(e) > 2 else None for e in chunk]
    return tokens, valid, mask, rows if any(r is not None for r in rows) else None


def sft_backward(policy: TrainPolicy, batch: list[Example], pad_id: int, chunk_tokens: int,
                 device: torch.device, amp_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Backpropagate the SFT loss (mean -logprob over every answer token of the batch) and return it. The batch runs
    in chunks of similar length (<= chunk_tokens padded tokens each): the gradient of one padded batch, without the
    attention over the shorter rows' padding."""
    batch = sorted(batch, key=lambda e: len(e[0]), reverse=True)
    n_tokens = max(1, sum(sum(e[1]) for e in batch))
    total = 0.0
    for chunk in _length_chunks(batch, chunk_tokens):
        tokens, valid, mask, vl = _inputs(chunk, pad_id, device)
        with autocast(device, amp_dtype):
            lp = policy.logprobs_at(tokens, valid, mask, vl=vl)  # fp32: logprobs_at upcasts the logits
        loss = -lp.sum() / n_tokens
        loss.backward()
        total += float(loss.detach())
    return torch.tensor(total)


def bind_images(policy: TrainPolicy, examples: list[Example]) -> list[Example]:
    """Examples with ExampleImages -> with RowImages (the pixels computed once; a segment's first token is never a
    loss token: it has no prefix). ValueError when the model is not a VL checkpoint or an example's images do not
    bind (learner.batch.row_images). Text examples pass unchanged."""
    from learner.data import ExampleImages

    out, cache = [], {}
    for i, e in enumerate(examples):
        if len(e) > 2 and isinstance(e[2], ExampleImages):
            im = e[2]
            mask = list(e[1])
            for s in im.segments:
                mask[s] = 0
            # the generated tokens (the trajectory's mask: before the segment starts are zeroed, and with the turns
            # left out of the loss): a vision token the policy sampled as its last one is no image run, as in the
            # learner's own binding (learner.batch.collate)
            gen = im.generated if im.generated is not None else e[1]
            e = (e[0], mask, row_images(np.asarray(e[0]), im.segments, im.image_refs, im.images, policy.vl, cache,
                                        f"SFT example {i}", mask=np.asarray(gen)))
        out.append(e)
    return out


@torch.no_grad()
def answer_scores(policy: TrainPolicy, examples: list[Example], pad_id: int, device: torch.device,
                  amp_dtype: torch.dtype | None = None, rows: int = 16) -> dict:
    """How well the policy writes the examples' answers: "nll", the mean -logprob per answer token, and "p_answer",
    the mean over answers (each run of loss-mask 1s) of the probability of the whole answer, i.e. how often sampling
    at temperature 1 would write it exactly."""
    was_training = policy.training
    policy.eval()
    total, n_tok, probs = 0.0, 0, []
    for i in range(0, len(examples), rows):
        chunk = examples[i:i + rows]
        tokens, valid, mask, vl = _inputs(chunk, pad_id, device)
        with autocast(device, amp_dtype):
            lp = policy.logprobs_at(tokens, valid, mask, vl=vl).float().cpu().tolist()  # masked t >= 1, row-major
        total, n_tok, k = total - sum(lp), n_tok + len(lp), 0
        for m in mask[:, 1:].cpu().numpy():
            for a, b in image_runs(m, 1):  # each answer: a maximal run of 1s in the loss mask (the same helper)
                probs.append(math.exp(sum(lp[k:k + b - a])))
                k += b - a
    policy.train(was_training)
    return {"nll": total / max(1, n_tok), "p_answer": float(np.mean(probs)) if probs else 0.0}


def train_sft(policy: TrainPolicy, demos, steps: int, batch_size: int, lr: float, seed: int, pad_id: int,
              log=None, device: torch.device | None = None, amp_dtype: torch.dtype | None = None,
              chunk_tokens: int = 2048, val: list[Example] | None = None, val_every: int = 50) -> dict:
    """SFT on `device` (default: where the policy is), forward passes under bf16 autocast when amp_dtype is set;
    weights, optimizer and loss stay fp32. The policy is left on `device`; save_hf writes fp32 CPU tensors.
    val: examples measured (answer_scores) before the first step, every val_every steps and after the last."""
    device = device if device is not None else next(policy.parameters()).device
    policy.to(device)
    demos = bind_images(policy, demos)
    val = bind_images(policy, val) if val else []
    history: list[dict] = []

    def measure(s: int) -> None:
        history.append({"step": s, **answer_scores(policy, val, pad_id, device, amp_dtype)})
        if log:
            log(f"sft step {s}/{steps} validation: loss {history[-1]['nll']:.3f}, p(answer) {history[-1]['p_answer']:.3f}")
    g = np.random.default_rng(seed % 2**64)  # numpy takes no negative seed; the config's seed may be one (seed=-3)
    # frozen parameters (model.freeze_vision) are not in the optimiser
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / max(1, steps)))
    policy.train()
    t0, losses = time.perf_counter(), []
    for s in range(steps):
        if val and s % val_every == 0:
            measure(s)
        idx = g.integers(0, len(demos), batch_size)
        opt.zero_grad(set_to_none=True)
        loss = sft_backward(policy, [demos[i] for i in idx], pad_id, chunk_tokens, device, amp_dtype)
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if log and (s % 50 == 0 or s == steps - 1):
            log(f"sft step {s + 1}/{steps} loss {np.mean(losses[-50:]):.3f}")
    if val:
        measure(steps)
    policy.eval()
    out = {"sft_steps": steps, "sft_loss": float(np.mean(losses[-50:])) if losses else None, "sft_s": time.perf_counter() - t0}
    return {**out, "val": history} if val else out


def check_tokenizer(trajs, tok: ChatTokenizer, src) -> None:
    """ValueError naming the first trajectory whose generated tokens do not decode, with the model directory's
    tokenizer, to the text its episode recorded (Turn.output: the actor's decode of the same ids): it was generated
    with another tokenizer, and its ids mean other words here. Turns with no recorded text are not checked."""
    for tr in trajs:
        for i, t in enumerate(tr.turns):
            if not t.output:
                continue
            got = tok.decode(tr.tokens[t.start:t.end].tolist())
            if got != t.output:
                raise ValueError(f"trajectory {tr.id} was not generated with the tokenizer of {src}: turn {i}'s tokens "
                                 f"decode to {got[:60]!r} with it, but the policy wrote {t.output[:60]!r} (train on "
                                 "trajectories of this model's tokenizer)")


def run(cfg, model_dir: str, out_dir: str, data: list[str], demos: DemonstrationSource | None = None,
        steps: int | None = None, log=print, val_demos: DemonstrationSource | None = None) -> dict:
    """`tars sft`: fine-tune model_dir on stored trajectories (data: trajectory files, e.g. a split's sft.twl)
    and/or the examples a demonstration source gives for the model's tokenizer; write HF layout to out_dir.
    val_demos: examples of their own to measure the SFT by (train_sft's val), with the same tokenizer."""
    import json
    import pathlib

    from learner.data import read_trajectories, sft_examples

    if not data and demos is None:
        raise ValueError("nothing to train on: give trajectory files (--data) and/or --demos N")
    device = resolve_device(cfg.learner.device)  # the learner's choice: ConfigError before any work
    amp_dtype = resolve_precision(cfg.learner.precision, device)
    torch.manual_seed(cfg.seed)
    src = pathlib.Path(model_dir)
    policy = TrainPolicy.load(src)
    if cfg.model.freeze_vision:
        policy.freeze_vision()
    vocab = policy.config.vocab_size
    trajs = list(read_trajectories(data)) if data else []
    for tr in trajs:  # as the learner's stream does: a bad one is refused before any training, not an IndexError later
        try:
            tr.validate(vocab)
        except SchemaError as e:
            raise ValueError(f"trajectory {tr.id} cannot be trained on by {src}: {e}") from None
    # an infra_error episode says nothing about the policy (the learner never trains on one; `tars data split` drops
    # them): a run's trajectories.twl holds them, since the learner archives every arrival
    infra = sum(1 for tr in trajs if tr.outcome == Outcome.INFRA_ERROR)
    trajs = [tr for tr in trajs if tr.outcome != Outcome.INFRA_ERROR]
    if infra:
        log(f"sft: {infra} infra_error trajectories left out")
    if trajs and has_tokenizer(src):   # ids of another tokenizer inside this vocabulary would train silently
        check_tokenizer(trajs, ChatTokenizer.load(src, cfg.actor.chat_template_kwargs), src)
    examples = sft_examples(trajs)
    n_traj = len(examples)
    pad_id = policy.config.pad_token_id
    val: list[Example] = []
    if demos is not None or val_demos is not None:  # the model directory's tokenizer (an error when it has none)
        tok = ChatTokenizer.load(src, cfg.actor.chat_template_kwargs)  # the prompts the actor will build
        examples += demos(tok) if demos is not None else []
        val = val_demos(tok) if val_demos is not None else []
        pad_id = tok.pad_id
        bad = next((max(e[0]) for e in examples[n_traj:] + val if e[0] and not 0 <= min(e[0]) <= max(e[0]) < vocab), None)
        if bad is not None:
            raise ValueError(f"a demonstration has token id {bad}, outside the model's vocabulary of {vocab}: the "
                             f"tokenizer of {src} does not match its model")
    if not examples:
        raise ValueError("nothing to train on: " + " and ".join(
            ([f"the trajectory files ({len(trajs)} trajectories, {infra} infra_error ones left out) hold none with "
              "generated tokens outside a parse error"] if data else []) + (["the demonstration source gave no demonstrations"] if demos else [])))
    steps = cfg.sft.steps if steps is None else steps
    if steps <= 0:
        raise ValueError("--steps must be >= 1")
    shown = sum(1 for e in examples if len(e) > 2 and e[2].image_refs)   # examples with their screenshots
    log(f"sft on {describe(device, amp_dtype)}: {len(examples)} examples, {shown} with screenshots")
    m = train_sft(policy, examples, steps, cfg.sft.batch_size, cfg.sft.lr, cfg.seed, pad_id, log=log,
                  device=device, amp_dtype=amp_dtype, val=val)
    policy.save_hf(out_dir, tokenizer_from=src)  # with the model directory's tokenizer files
    m.update(trajectories=n_traj, infra_error_dropped=infra, demonstrations=len(examples) - n_traj,
             with_screenshots=shown, out=str(out_dir), device=str(device),
             precision="bf16" if amp_dtype is not None else "fp32")
    pathlib.Path(out_dir, "sft.json").write_text(json.dumps(m, indent=2))
    return m
