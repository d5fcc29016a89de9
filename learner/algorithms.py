"""RL math for the learner, as pure torch functions.

Conventions
-----------
* Time is the LAST dimension. "1-D" functions (``gae``, ``vtrace``) take ``[T]`` and
  also accept leading batch dims ``[..., T]`` (each row is an independent trajectory).
* Masks are 0/1 (bool, int or float); an entry counts as "masked in" (valid) when > 0.
  Masked-out entries never influence a result, even if they hold inf/nan garbage.
* Advantage / return / v-trace targets are computed without gradient (detached).
* Reductions over an all-zero mask return 0 (never NaN) and keep the autograd graph.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "gae", "length_adaptive_lambda", "decoupled_ppo_loss", "vtrace", "grpo_advantages",
    "masked_gae", "decoupled_gae", "clipped_value_loss", "explained_variance",
    "masked_mean", "masked_whiten", "entropy_from_logits", "token_logprobs_from_logits",
    "kl_k3",
]


def _fdtype(x: Tensor) -> torch.dtype:
    return x.dtype if x.is_floating_point() else torch.get_default_dtype()


def _valid(mask: Tensor) -> Tensor:
    return mask > 0  # bool, same shape as mask


# --------------------------------------------------------------------------- masking
def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over entries with ``mask > 0`` (all of them, or along ``dim``).

    ``x``, ``mask``: same shape. Empty selection -> 0 (graph kept). Masked-out entries
    are replaced by 0 before summing, so inf/nan there does not leak (values or grads).
    """
    m = _valid(mask)
    xs = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        return xs.sum() / m.sum().clamp(min=1).to(xs.dtype)
    return xs.sum(dim) / m.sum(dim).clamp(min=1).to(xs.dtype)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over masked entries (population variance) -> mean 0,
    std 1 there; unmasked entries are 0. Shape preserved."""
    m = _valid(mask)
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    out = (x - mean) * torch.rsqrt(var + eps)
    return torch.where(m, out, torch.zeros((), dtype=out.dtype, device=out.device))


def masked_scale(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """x / sqrt(E[x^2] + eps) over masked entries: unit scale, the sign of every entry kept.

    Advantage normalisation for multi-turn episodes. Whitening (subtracting the token-weighted mean) is biased
    when episode length correlates with the outcome: long failing episodes dominate the mean, and subtracting it
    turns zero advantages (e.g. a GRPO group where every sample failed) into positive ones, rewarding whatever
    makes episodes long. Scaling alone keeps A = 0 at 0."""
    m = _valid(mask)
    out = x * torch.rsqrt(masked_mean(x * x, m) + eps)
    return torch.where(m, out, torch.zeros((), dtype=out.dtype, device=out.device))


def asymmetric_advantages(adv: Tensor, neg_weight: float) -> Tensor:
    """adv [B, T] -> adv with negative entries scaled by neg_weight (positive ones unchanged).

    neg_weight in [0, 1]: 1 is the usual symmetric policy gradient, 0 learns from better-than-expected samples only
    (self-imitation). In between, failed samples still push probability away from their choices, but less: with a
    weak baseline most tokens of a failed turn (the output format, shared with successful turns) carry a negative
    advantage, and at high learning rates those pushes spread probability mass off the format."""
    if not 0.0 <= neg_weight <= 1.0:
        raise ValueError(f"neg_weight must be in [0, 1], got {neg_weight}")
    return torch.where(adv < 0, adv * neg_weight, adv)


# --------------------------------------------------------------------------- GAE
@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, dones: Tensor, gamma: float, lam: float,
        bootstrap_value: float | Tensor = 0.0) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016).

        delta_t = r_t + gamma * V_{t+1} * (1 - done_t) - V_t,        V_T = bootstrap_value
        A_t     = delta_t + gamma * lam * (1 - done_t) * A_{t+1},    A_T = 0
        R_t     = A_t + V_t

    ``done_t = 1`` ends the episode after step t (no bootstrap, no carry of A).
    rewards, values, dones: [..., T]; bootstrap_value: scalar or [...].
    Returns (advantages [..., T], returns [..., T]), detached.
    """
    dt = _fdtype(values)
    r, v = rewards.to(dt), values.to(dt)                  # [..., T]
    notdone = 1.0 - dones.to(dt)                          # [..., T]
    T = v.shape[-1]
    next_v = torch.as_tensor(bootstrap_value, dtype=dt, device=v.device).expand(v.shape[:-1])
    next_a = torch.zeros(v.shape[:-1], dtype=dt, device=v.device)   # [...]
    adv = torch.empty_like(v)
    for t in range(T - 1, -1, -1):
        delta = r[..., t] + gamma * next_v * notdone[..., t] - v[..., t]
        next_a = delta + gamma * lam * notdone[..., t] * next_a
        adv[..., t] = next_a
        next_v = v[..., t]
    return adv, adv + v


def length_adaptive_lambda(length: float, alpha: float = 0.05) -> float:
    """VAPO length-adaptive GAE lambda: lambda = 1 - 1 / (alpha * length).

    Clamped to [0, 1]: for ``length <= 1/alpha`` the raw formula is <= 0 and we return 0.0
    (one-step TD advantages); length <= 0 also gives 0.0. Long sequences -> lambda -> 1.
    """
    x = alpha * float(length)
    if x <= 1.0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - 1.0 / x))


@torch.no_grad()
def masked_gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float,
               lam: float) -> tuple[Tensor, Tensor]:
    """GAE over token sequences where only masked (generated) tokens are MDP steps.

    rewards, values, mask: [B, T]. For each row the masked positions t_0 < t_1 < ... < t_n
    form the trajectory; the recursion jumps from t_k to t_{k+1} (prompt / environment
    tokens in between are skipped), t_n is terminal with bootstrap 0. Rewards at unmasked
    positions are ignored. Unmasked positions get advantage 0 and return 0.
    Equivalent to ``gae`` on the compacted row with done at the last step.
    Returns (advantages [B, T], returns [B, T]), detached.
    """
    dt = _fdtype(values)
    m = _valid(mask)                                       # [B, T]
    r, v = rewards.to(dt), values.to(dt)                   # [B, T]
    r = torch.where(m, r, torch.zeros((), dtype=dt, device=v.device))
    v = torch.where(m, v, torch.zeros((), dtype=dt, device=v.device))
    B, T = v.shape
    next_v = torch.zeros(B, dtype=dt, device=v.device)     # V of next generated token
    next_a = torch.zeros(B, dtype=dt, device=v.device)     # A of next generated token
    adv = torch.zeros_like(v)
    for t in range(T - 1, -1, -1):
        mt = m[:, t]                                       # [B]
        a_t = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * next_a
        adv[:, t] = torch.where(mt, a_t, adv[:, t])
        next_a = torch.where(mt, a_t, next_a)
        next_v = torch.where(mt, v[:, t], next_v)
    return adv, torch.where(m, adv + v, adv)


def decoupled_gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float,
                  lam_policy: float, lam_critic: float = 1.0) -> tuple[Tensor, Tensor]:
    """Decoupled GAE (VAPO / UI-TARS-2): policy advantages use ``lam_policy``; the critic's
    value targets are the returns A + V computed with ``lam_critic`` (1.0 = Monte-Carlo,
    unbiased for the value). Shapes as ``masked_gae``. Returns (advantages, value_targets).
    """
    adv, _ = masked_gae(rewards, values, mask, gamma, lam_policy)
    _, targets = masked_gae(rewards, values, mask, gamma, lam_critic)
    return adv, targets


# --------------------------------------------------------------------------- policy loss
def decoupled_ppo_loss(logp: Tensor, prox_logp: Tensor, behav_logp: Tensor,
                       advantages: Tensor, mask: Tensor, eps_low: float = 0.2,
                       eps_high: float = 0.28, behav_cap: float = 5.0) -> Tensor:
    """Decoupled PPO objective (AReaL) with asymmetric clip (DAPO clip-higher).

        u_t = exp(logp_t - prox_logp_t)                        # current / proximal
        w_t = min(exp(prox_logp_t - behav_logp_t), behav_cap)  # proximal / behaviour, detached
        L   = - mean_{t: mask_t} w_t * min(u_t A_t, clip(u_t, 1 - eps_low, 1 + eps_high) A_t)

    All inputs share one shape, [T] or [B, T]; the mean is token-level over every masked
    token of the batch. Only ``logp`` carries gradient. Empty mask -> 0 (graph kept).
    ``behav_cap=None`` or inf disables the cap.
    """
    m = _valid(mask)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    adv = torch.where(m, advantages.detach().to(logp.dtype), zero)             # [B, T]
    log_u = torch.where(m, logp - prox_logp.detach(), zero)                    # [B, T]
    log_w = torch.where(m, (prox_logp - behav_logp).detach().to(logp.dtype), zero)
    if behav_cap is not None and math.isfinite(behav_cap):
        log_w = log_w.clamp(max=math.log(behav_cap))  # == min(exp(.), cap), overflow-free
    w = torch.exp(log_w)                                                       # [B, T]
    u = torch.exp(log_u)                                                       # [B, T]
    surr = torch.minimum(u * adv, u.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)
    return -masked_mean(w * surr, m)


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
                       clip: float = 0.2) -> Tensor:
    """PPO clipped value loss:
        v_clip = old + clip(v - old, -clip, clip)
        L = 0.5 * mean_{masked} max((v - R)^2, (v_clip - R)^2)
    All [B, T] (or any common shape); scalar out. Empty mask -> 0.
    """
    old, ret = old_values.detach(), returns.detach()
    v_clip = old + (values - old).clamp(-clip, clip)
    loss = torch.maximum((values - ret) ** 2, (v_clip - ret) ** 2)
    return 0.5 * masked_mean(loss, mask)


# --------------------------------------------------------------------------- v-trace
@torch.no_grad()
def vtrace(behav_logp: Tensor, target_logp: Tensor, rewards: Tensor, values: Tensor,
           bootstrap_value: float | Tensor, discounts: Tensor, clip_rho: float = 1.0,
           clip_c: float = 1.0) -> tuple[Tensor, Tensor]:
    """V-trace targets (IMPALA, Espeholt et al. 2018; as in trfl / seed_rl).

        rho_t   = min(clip_rho, pi_t / mu_t),   c_t = min(clip_c, pi_t / mu_t)
        delta_t = rho_t (r_t + gamma_t V(x_{t+1}) - V(x_t)),        V(x_T) = bootstrap_value
        v_s     = V(x_s) + sum_{t>=s} (prod_{i=s}^{t-1} gamma_i c_i) delta_t
                = V(x_s) + delta_s + gamma_s c_s (v_{s+1} - V(x_{s+1}))
        pg_adv_t = rho_t (r_t + gamma_t v_{t+1} - V(x_t)),         v_T = bootstrap_value

    ``discounts`` is the per-step gamma_t (0 where the episode ends at t).
    All [..., T] (time last); bootstrap_value scalar or [...]. ``clip_*=None``/inf: no clip.
    Returns (vs [..., T], pg_advantages [..., T]), detached.
    """
    dt = _fdtype(values)
    v, r, g = values.to(dt), rewards.to(dt), discounts.to(dt)          # [..., T]
    ratio = torch.exp(target_logp.to(dt) - behav_logp.to(dt))           # [..., T]
    rho = ratio if clip_rho is None else ratio.clamp(max=clip_rho)
    c = ratio if clip_c is None else ratio.clamp(max=clip_c)
    boot = torch.as_tensor(bootstrap_value, dtype=dt, device=v.device).expand(v.shape[:-1])
    v_next = torch.cat([v[..., 1:], boot.unsqueeze(-1)], dim=-1)         # [..., T]
    delta = rho * (r + g * v_next - v)                                   # [..., T]
    acc = torch.zeros(v.shape[:-1], dtype=dt, device=v.device)           # v_{s+1} - V_{s+1}
    vs_minus_v = torch.empty_like(v)
    for s in range(v.shape[-1] - 1, -1, -1):
        acc = delta[..., s] + g[..., s] * c[..., s] * acc
        vs_minus_v[..., s] = acc
    vs = v + vs_minus_v
    vs_next = torch.cat([vs[..., 1:], boot.unsqueeze(-1)], dim=-1)
    pg_adv = rho * (r + g * vs_next - v)
    return vs, pg_adv


# --------------------------------------------------------------------------- GRPO
@torch.no_grad()
def grpo_advantages(group_returns: Tensor) -> Tensor:
    """GRPO group-normalised advantages along the last dim:
        A_k = (r_k - mean(r)) / (std(r) + 1e-6)
    ``std`` is the unbiased (Bessel-corrected) sample std, as ``torch.std`` / TRL / verl.
    [K] -> [K] or [G, K] -> [G, K]. All-equal returns give exactly 0 (as does K == 1).
    """
    r = group_returns.to(_fdtype(group_returns))
    centred = r - r.mean(dim=-1, keepdim=True)
    if r.shape[-1] < 2:
        return torch.zeros_like(r)
    std = r.std(dim=-1, keepdim=True)
    return centred / (std + 1e-6)


# --------------------------------------------------------------------------- diagnostics
@torch.no_grad()
def explained_variance(pred: Tensor, target: Tensor, mask: Tensor | None = None) -> float:
    """1 - Var[target - pred] / Var[target] over (masked) entries, population variances.

    Returns 0.0 when Var[target] == 0 (constant target, incl. a single or no valid entry),
    where the ratio is undefined; never NaN. 1 = perfect, 0 = no better than a constant,
    negative = worse than predicting the mean.
    """
    pred, target = pred.to(torch.float64), target.to(torch.float64)
    m = torch.ones_like(target, dtype=torch.bool) if mask is None else _valid(mask)
    if int(m.sum()) == 0:
        return 0.0
    var_t = masked_mean((target - masked_mean(target, m)) ** 2, m)
    res = target - pred
    var_r = masked_mean((res - masked_mean(res, m)) ** 2, m)
    if not torch.isfinite(var_t) or float(var_t) <= 0.0:
        return 0.0
    return float(1.0 - var_r / var_t)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy H = -sum_v p_v log p_v of softmax(logits) per position.
    logits [..., V] -> [...] (float32 or wider). -inf logits (banned tokens) are fine."""
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    logp = torch.log_softmax(x, dim=-1)
    p = torch.exp(logp)
    return -(p * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)


def token_logprobs_from_logits(logits: Tensor, tokens: Tensor) -> Tensor:
    """log softmax(logits[b, t])[tokens[b, t]]: logits [B, T, V], tokens [B, T] -> [B, T].
    No shift is applied: align logits (which predict the NEXT token) with tokens beforehand."""
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    picked = torch.gather(x, -1, tokens.long().unsqueeze(-1)).squeeze(-1)   # [B, T]
    return picked - torch.logsumexp(x, dim=-1)                              # [B, T]


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimator (Schulman) of KL(pi || pi_ref) with tokens sampled from pi:
        k3 = exp(ref_logp - logp) - 1 - (ref_logp - logp)  >= 0
    Same shape as inputs; unbiased for KL, low variance. No clamping applied."""
    d = ref_logp - logp
    return torch.exp(d) - 1.0 - d
