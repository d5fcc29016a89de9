"""Per-row sampling for a decode batch whose rows have different temperatures, top-p, top-k and seeds.

The behaviour logprob recorded for a token is log_softmax(logits / T) of the sampled token (T = 1 for greedy),
without the top-p / top-k truncation: that is what the learner recomputes (CausalLM.token_logprobs with the same
temperature), so on-policy ratios are exactly 1. Truncation only changes which tokens can be drawn.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowParams:
    """The sampling parameters of a batch, as tensors, rebuilt only when the batch membership changes."""

    temperature: torch.Tensor        # [B] float, 0 = greedy
    top_p: torch.Tensor              # [B] float, 1 = off
    top_k: torch.Tensor              # [B] long, 0 = off
    generators: list                 # [B] torch.Generator or None (None = the engine's shared generator)
    all_greedy: bool
    any_top_p: bool
    any_top_k: bool

    @classmethod
    def build(cls, temps: list[float], top_ps: list[float], top_ks: list[int], generators: list) -> "RowParams":
        t = torch.tensor(temps, dtype=torch.float32)
        p = torch.tensor([1.0 if x <= 0 else x for x in top_ps], dtype=torch.float32)
        k = torch.tensor(top_ks, dtype=torch.long)
        return cls(t, p, k, generators, bool((t == 0).all()), bool((p < 1).any()), bool((k > 0).any()))


def sample(logits: torch.Tensor, rp: RowParams, shared: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B] long, behaviour logprobs [B] float)."""
    logits = logits.float()
    if rp.all_greedy:
        tok = logits.argmax(-1)
        lp = torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)
        return tok, lp
    greedy = rp.temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(rp.temperature), rp.temperature)[:, None]
    base = torch.log_softmax(scaled, -1)  # [B, V]
    filt = base
    if rp.any_top_k:
        V = base.shape[-1]
        kk = torch.where(rp.top_k > 0, rp.top_k.clamp(max=V), torch.full_like(rp.top_k, V))
        kth = torch.topk(base, int(kk.max()), dim=-1).values.gather(-1, (kk - 1)[:, None])  # [B, 1]
        filt = filt.masked_fill(filt < kth, float("-inf"))
    if rp.any_top_p:
        sp, si = torch.sort(filt, dim=-1, descending=True)
        probs = sp.exp()
        # Drop a token when the mass strictly before it already reaches top_p (the first token always stays).
        drop = (probs.cumsum(-1) - probs) >= rp.top_p[:, None]
        filt = filt.masked_fill(drop.scatter(-1, si, drop), float("-inf"))
    probs = torch.softmax(filt, -1)
    # Inverse-CDF sampling draws one uniform per row: ~10x cheaper than torch.multinomial on a [B, V] batch.
    u = torch.empty(base.shape[0], 1)
    shared_rows = [i for i, g in enumerate(rp.generators) if g is None]
    if len(shared_rows) == len(rp.generators):
        torch.rand(u.shape, generator=shared, out=u)
    else:
        for i, g in enumerate(rp.generators):
            u[i] = torch.rand(1, generator=g if g is not None else shared)
    cdf = probs.cumsum(-1)
    tok = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    # Rounding can put u * total on the total itself: fall back to the likeliest token there.
    tok = torch.where(tok >= probs.shape[-1], probs.argmax(-1), tok)
    tok = torch.where(greedy, logits.argmax(-1), tok)
    return tok, base.gather(-1, tok[:, None]).squeeze(-1)
