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
    "kl_k1", "kl_k3", "masked_vtrace", "grouped_advantages", "tis_pg_loss", "masked_scale",
    "asymmetric_advantages",
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


def _compact(mask: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """Where each row's masked (generated) positions go in a compact [B, L] layout, right-aligned.

    Returns (m, rows, cols, L): m the bool mask; rows, cols [N] the compact coordinates of x[m] (row-major); L the
    most steps in a row. Right-aligned, every row's last step is the compact layout's last column, so a backward
    recursion starts all rows together from their bootstrap value, and the zero padding in front of shorter rows
    comes after their first step in that recursion (it never reaches a real step).
    """
    m = _valid(mask)
    n = m.sum(-1)                                                     # [B] steps per row
    L = int(n.max()) if m.numel() else 0
    cols = torch.cumsum(m.long(), -1) - 1 + (L - n)[:, None]          # [B, T]
    rows = torch.arange(m.shape[0], device=m.device)[:, None].expand_as(m)
    return m, rows[m], cols[m], L


def _pack(x: Tensor, m: Tensor, rows: Tensor, cols: Tensor, L: int, dt: torch.dtype) -> Tensor:
    """x [B, T] at the masked positions -> [B, L] (zeros in the padding); garbage elsewhere in x never enters."""
    out = torch.zeros(m.shape[0], L, dtype=dt, device=m.device)
    out[rows, cols] = x[m].to(dt)
    return out


def _unpack(y: Tensor, m: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """Inverse of _pack: [B, L] -> [B, T], zeros at the unmasked positions."""
    out = torch.zeros(m.shape, dtype=y.dtype, device=y.device)
    out[m] = y[rows, cols]
    return out


def _bootstrap(bootstrap: float | Tensor, B: int, dt: torch.dtype, device) -> Tensor:
    return torch.as_tensor(bootstrap, dtype=dt, device=device).expand(B)


@torch.no_grad()
def masked_gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float,
               lam: float, bootstrap: float | Tensor = 0.0) -> tuple[Tensor, Tensor]:
    """GAE over token sequences where only masked (generated) tokens are MDP steps: ``gae`` on each row's steps.

    rewards, values, mask: [B, T]. For each row the masked positions t_0 < t_1 < ... < t_n form the trajectory;
    the recursion jumps from t_k to t_{k+1} (prompt / environment tokens in between are skipped). After t_n the
    episode ends: ``bootstrap`` [B] (or a scalar) is V of the state after the last step, 0 for an episode that
    terminated, the critic's value of the final observation for one that a limit truncated. Rewards and values at
    unmasked positions are ignored; unmasked positions get advantage 0 and return 0.
    Returns (advantages [B, T], returns [B, T]), detached.
    """
    dt = _fdtype(values)
    m, rows, cols, L = _compact(mask)
    r, v = _pack(rewards, m, rows, cols, L, dt), _pack(values, m, rows, cols, L, dt)      # [B, L]
    boot = _bootstrap(bootstrap, m.shape[0], dt, v.device)
    adv, ret = gae(r, v, torch.zeros_like(v), gamma, lam, bootstrap_value=boot)
    return _unpack(adv, m, rows, cols), _unpack(ret, m, rows, cols)


def decoupled_gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float,
                  lam_policy: float, lam_critic: float = 1.0,
                  bootstrap: float | Tensor = 0.0) -> tuple[Tensor, Tensor]:
    """Decoupled GAE (VAPO / UI-TARS-2): policy advantages use ``lam_policy``; the critic's
    value targets are the returns A + V computed with ``lam_critic`` (1.0 = Monte-Carlo,
    unbiased for the value). Both bootstrap from ``bootstrap`` after each row's last step.
    Shapes as ``masked_gae``. Returns (advantages, value_targets).
    """
    adv, _ = masked_gae(rewards, values, mask, gamma, lam_policy, bootstrap)
    _, targets = masked_gae(rewards, values, mask, gamma, lam_critic, bootstrap)
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
    # exp would overflow past ~88 in fp32 (inf loss, NaN gradient: the step skipped), which correction.kind=none
    # reaches with a stale token (u = current / behaviour there). For A >= 0 the clip already bounds u * A; for A < 0
    # PPO's term is the unclipped u * A, so the clamp is a dual clip at u = e^20: such a token's loss stops growing
    # and its gradient is 0 (at u just below e^20 the gradient is ~1e8 * |A|, a step that would swamp the batch).
    u = torch.exp(log_u.clamp(max=20.0))                                       # [B, T]
    surr = torch.minimum(u * adv, u.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)
    return -masked_mean(w * surr, m)


def tis_pg_loss(logp: Tensor, behav_logp: Tensor, advantages: Tensor, mask: Tensor,
                cap: float = 2.0) -> Tensor:
    """Truncated importance sampling policy gradient (ACER's truncated term; Yao et al. 2025's TIS cap):
    no proximal policy and no clip, each token's policy gradient weighted by its truncated behaviour ratio.

        rho_t = exp(logp_t - behav_logp_t)                     # current / behaviour
        L     = - mean_{t: mask_t} sg[min(rho_t, cap)] * exp(logp_t - sg[logp_t]) * A_t

    The value of L is -mean(min(rho, cap) A) (the truncated IS estimate of the surrogate); its gradient is
    -mean(min(rho, cap) A grad logp). Shapes and masking as ``decoupled_ppo_loss``; only ``logp`` carries gradient.
    """
    m = _valid(mask)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    adv = torch.where(m, advantages.detach().to(logp.dtype), zero)
    log_rho = torch.where(m, (logp.detach() - behav_logp.detach()).to(logp.dtype), zero)
    if cap is not None and math.isfinite(cap):
        log_rho = log_rho.clamp(max=math.log(cap))      # == min(rho, cap), overflow-free
    grad_carrier = torch.exp(torch.where(m, logp - logp.detach(), zero))   # 1 in value, d/dlogp = 1
    return -masked_mean(torch.exp(log_rho) * grad_carrier * adv, m)


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


@torch.no_grad()
def masked_vtrace(behav_logp: Tensor, target_logp: Tensor, rewards: Tensor, values: Tensor, mask: Tensor,
                  gamma: float, bootstrap: float | Tensor = 0.0, clip_rho: float = 1.0,
                  clip_c: float = 1.0) -> tuple[Tensor, Tensor]:
    """``vtrace`` over token sequences where only masked (generated) tokens are steps, as ``masked_gae`` does GAE.

    All [B, T]; each row's masked positions are its steps (discount ``gamma`` between them), and ``bootstrap`` [B]
    (or a scalar) is V after the last one: 0 for a terminated episode, V of the final observation for a truncated
    one. Returns (policy-gradient advantages [B, T], value targets vs [B, T]) -- the order of ``decoupled_gae`` --
    zeros at unmasked positions, detached.
    """
    dt = _fdtype(values)
    m, rows, cols, L = _compact(mask)
    mu, pi, r, v = (_pack(x, m, rows, cols, L, dt) for x in (behav_logp, target_logp, rewards, values))
    boot = _bootstrap(bootstrap, m.shape[0], dt, v.device)
    # The padding in front of shorter rows: ratio 1, reward 0, V 0; the recursion reaches it only after the row's
    # real steps are done, and its results are dropped.
    vs, pg = vtrace(mu, pi, r, v, boot, torch.full_like(v, gamma), clip_rho=clip_rho, clip_c=clip_c)
    return _unpack(pg, m, rows, cols), _unpack(vs, m, rows, cols)


# --------------------------------------------------------------------------- GRPO
@torch.no_grad()
def grpo_advantages(group_returns: Tensor, std_norm: bool = True) -> Tensor:
    """GRPO group-normalised advantages along the last dim:
        A_k = (r_k - mean(r)) / (std(r) + 1e-6)       std_norm=True (GRPO)
        A_k =  r_k - mean(r)                           std_norm=False (Dr. GRPO: centred only)
    ``std`` is the unbiased (Bessel-corrected) sample std, as ``torch.std`` / TRL / verl.
    [K] -> [K] or [G, K] -> [G, K]. All-equal returns give exactly 0 (as does K == 1).
    """
    r = group_returns.to(_fdtype(group_returns))
    if r.shape[-1] < 2:
        return torch.zeros_like(r)
    centred = r - r.mean(dim=-1, keepdim=True)
    # A group of equal returns is exactly 0: its float mean can differ from the value by a rounding (8 x -0.1 in fp32:
    # +-7e-9), which would count as signal, and the batch scaling and Adam would turn it into a full step.
    equal = r.amax(dim=-1, keepdim=True) == r.amin(dim=-1, keepdim=True)
    centred = torch.where(equal, torch.zeros_like(centred), centred)
    if not std_norm:
        return centred
    std = r.std(dim=-1, keepdim=True)
    return centred / (std + 1e-6)


@torch.no_grad()
def grouped_advantages(returns: Tensor, groups: list, std_norm: bool = False) -> Tensor:
    """Per-trajectory GRPO advantages for a batch of ragged groups: returns [B], groups [B] (any hashable label).

    Each group of two or more goes through ``grpo_advantages``; a group of one (GRPO with group.size = 1, or a
    group cut short by its timeout down to one member) is centred on the batch mean instead (REINFORCE with a
    batch baseline). The learner uses std_norm=False (Dr. GRPO): dividing by a tiny std turns -0.1 format
    penalties in an all-failed group into advantages as large as a success; the batch-level scaling sets the size.
    """
    out = torch.zeros_like(returns, dtype=_fdtype(returns))
    members: dict = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    # The batch baseline of a group of one; a batch of equal returns is its own mean exactly (a float mean of equal
    # values can be off by a rounding, which would pass for signal: see grpo_advantages).
    base = returns[0] if len(returns) and bool(returns.amax() == returns.amin()) else returns.mean()
    for idx in members.values():
        r = returns[idx]
        out[idx] = grpo_advantages(r, std_norm) if len(idx) > 1 else r - base
    return out


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


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k1 estimator (Schulman) of KL(pi || pi_ref) with tokens sampled from pi:
        k1 = logp - ref_logp
    Unbiased, high variance, can be negative per token. The learner logs it as behav_prox_kl: KL(pi_behav || pi_prox)
    on the behaviour policy's own tokens, how far the weights moved since those tokens were generated."""
    return logp - ref_logp


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimator (Schulman) of KL(pi || pi_ref) with tokens sampled from pi:
        k3 = exp(ref_logp - logp) - 1 - (ref_logp - logp)  >= 0
    Same shape as inputs; unbiased for KL, low variance. No clamping applied."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0
