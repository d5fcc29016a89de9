"""Per-row sampling for a decode batch whose rows have different temperatures, top-p, top-k and seeds.

The behaviour logprob recorded for a token is log_softmax(logits / T) of the sampled token (T = 1 for greedy),
without the top-p / top-k truncation: that is what the learner recomputes (CausalLM.token_logprobs with the same
temperature), so on-policy ratios are 1 up to the engine's and the learner's precision (docs/learner.md, "The
precision contract"). Truncation only changes which tokens can be drawn.

Everything runs where the logits are (inference.device): the [B, V] logits never leave the device; only the
sampled ids and their logprobs ([B] each) are copied to the host by the caller. The generators (the engine's shared
one and each seeded request's own) live on the same device. On the CPU the draws are bit-identical to the sampler
before it moved (same uniforms, same inverse CDF), except where top-p's boundary falls on tied logprobs (bf16
logits), whose order is arbitrary in both; the steps a batch does not need are skipped (the division when
every temperature is 1, the greedy argmax when no row is greedy, top-p's full sort when top-k already bounds it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowParams:
    """The sampling parameters of a batch, as tensors on the sampling device, rebuilt only when the batch
    membership changes."""

    temperature: torch.Tensor        # [B] float, 0 = greedy
    top_p: torch.Tensor              # [B] float, 1 = off
    top_k: torch.Tensor              # [B] long, 0 = off
    generators: list                 # [B] torch.Generator or None (None = the engine's shared generator)
    all_greedy: bool
    any_top_p: bool
    any_top_k: bool
    any_greedy: bool = False
    unit_temperature: bool = False   # every sampled (non-greedy) row has temperature 1: no division needed
    all_top_k: bool = False          # every row has top_k > 0: top-p needs to sort only the top-k columns
    max_k: int = 0

    @classmethod
    def build(cls, temps: list[float], top_ps: list[float], top_ks: list[int], generators: list,
              device: torch.device | str = "cpu") -> "RowParams":
        t = torch.tensor(temps, dtype=torch.float32, device=device)
        p = torch.tensor([1.0 if x <= 0 else x for x in top_ps], dtype=torch.float32, device=device)
        k = torch.tensor(top_ks, dtype=torch.long, device=device)
        return cls(t, p, k, generators, all(x == 0 for x in temps), any(0 < x < 1 for x in top_ps),
                   any(x > 0 for x in top_ks), any(x == 0 for x in temps), all(x in (0, 1) for x in temps),
                   all(x > 0 for x in top_ks), max([int(x) for x in top_ks], default=0))


def sample(logits: torch.Tensor, rp: RowParams, shared: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any device) -> (tokens [B] long, behaviour logprobs [B] float), on the logits' device.

    rp's tensors and every generator must be on that device too (a torch.Generator draws on its own device)."""
    logits = logits.float()
    if rp.all_greedy:
        tok = logits.argmax(-1)
        lp = torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)
        return tok, lp
    greedy = rp.temperature == 0
    if rp.unit_temperature:  # x / 1 == x exactly: the division only costs a pass over [B, V]
        scaled = logits
    else:
        scaled = logits / torch.where(greedy, torch.ones_like(rp.temperature), rp.temperature)[:, None]
    base = torch.log_softmax(scaled, -1)  # [B, V]
    filt = base
    V = base.shape[-1]
    top = None  # (values, indices) of the kmax largest logprobs of each row, descending
    if rp.any_top_k:
        kk = torch.where(rp.top_k > 0, rp.top_k.clamp(max=V), torch.full_like(rp.top_k, V))
        kmax = min(V, rp.max_k) if rp.all_top_k else V
        top = torch.topk(base, kmax, dim=-1)
        kth = top.values.gather(-1, (kk - 1)[:, None])  # [B, 1]
        filt = filt.masked_fill(filt < kth, float("-inf"))
    if rp.any_top_p:
        if top is not None and rp.all_top_k and int((filt > float("-inf")).sum(-1).max()) <= top.values.shape[-1]:
            # Every token outside a row's top k is -inf already (no tie at the k-th value let more in): sorting
            # those kmax columns is the whole sort.
            sp, si = top.values.masked_fill(top.values < kth, float("-inf")), top.indices
        else:
            sp, si = torch.sort(filt, dim=-1, descending=True)
        probs = sp.exp()
        # Drop a token when the mass strictly before it already reaches top_p (the first token always stays).
        drop = (probs.cumsum(-1) - probs) >= rp.top_p[:, None]
        full = torch.zeros(base.shape, dtype=torch.bool, device=base.device)
        filt = filt.masked_fill(full.scatter(-1, si, drop), float("-inf"))
    probs = torch.softmax(filt, -1)
    # Inverse-CDF sampling draws one uniform per row: ~10x cheaper than torch.multinomial on a [B, V] batch.
    u = torch.empty(base.shape[0], 1, device=base.device)
    if all(g is None for g in rp.generators):
        torch.rand(u.shape, generator=shared, out=u)
    else:
        for i, g in enumerate(rp.generators):
            u[i] = torch.rand(1, generator=g if g is not None else shared, device=base.device)
    cdf = probs.cumsum(-1)
    tok = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    # Rounding can put u * total on the total itself: fall back to the likeliest token there (rare: looked for
    # only when it happened, which costs one [B] reduction instead of an argmax over [B, V]).
    over = tok >= V
    if bool(over.any()):
        tok = torch.where(over, probs.argmax(-1), tok)
    if rp.any_greedy:
        tok = torch.where(greedy, logits.argmax(-1), tok)
    return tok, base.gather(-1, tok[:, None]).squeeze(-1)
