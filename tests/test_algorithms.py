"""Tests for learner/algorithms.py.

Every fast function is checked against a slow reference written directly from the paper
notation (plain Python loops over floats / numpy), independently of the vectorised code.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learner.algorithms import (
    clipped_value_loss, decoupled_gae, decoupled_ppo_loss, entropy_from_logits,
    explained_variance, gae, grpo_advantages, kl_k3, length_adaptive_lambda, masked_gae,
    masked_mean, masked_whiten, token_logprobs_from_logits, vtrace,
)

SEEDS = [0, 1, 2, 3, 4]
D = torch.float64


def close(a, b, tol=1e-9):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64),
                               rtol=tol, atol=tol)


# ============================================================================ references
def ref_gae(r, v, d, gamma, lam, boot):
    """A_t = sum_{l>=0} (gamma*lam)^l delta_{t+l}, truncated after the first done (forward sum)."""
    T = len(r)
    V = [float(x) for x in v] + [float(boot)]
    delta = [r[t] + gamma * V[t + 1] * (1 - d[t]) - V[t] for t in range(T)]
    A = []
    for t in range(T):
        a, coef = 0.0, 1.0
        for k in range(t, T):
            a += coef * delta[k]
            if d[k]:
                break
            coef *= gamma * lam
        A.append(a)
    return A, [A[t] + V[t] for t in range(T)]


def ref_vtrace(mu_logp, pi_logp, r, v, boot, g, clip_rho, clip_c):
    """IMPALA eq. (1), O(T^2) sum form, and the policy-gradient advantage of Sec. 4.2."""
    T = len(r)
    ratio = [math.exp(pi_logp[t] - mu_logp[t]) for t in range(T)]
    rho = [min(clip_rho, x) for x in ratio]
    c = [min(clip_c, x) for x in ratio]
    V = [float(x) for x in v] + [float(boot)]
    delta = [rho[t] * (r[t] + g[t] * V[t + 1] - V[t]) for t in range(T)]
    vs = []
    for s in range(T):
        total = V[s]
        for t in range(s, T):
            prod = 1.0
            for i in range(s, t):
                prod *= g[i] * c[i]
            total += prod * delta[t]
        vs.append(total)
    vs_ext = vs + [float(boot)]
    pg = [rho[t] * (r[t] + g[t] * vs_ext[t + 1] - V[t]) for t in range(T)]
    return vs, pg


def ref_ppo_loss(logp, prox, behav, adv, mask, eps_low, eps_high, cap):
    """Per-token autograd loop. ``logp`` is a leaf tensor; everything else python floats."""
    flat = logp.reshape(-1)
    P, Bh, A, M = (np.asarray(x, dtype=np.float64).reshape(-1) for x in (prox, behav, adv, mask))
    total, n = flat.sum() * 0.0, 0
    for i in range(flat.numel()):
        if M[i] <= 0:
            continue
        u = torch.exp(flat[i] - P[i])
        w = min(math.exp(P[i] - Bh[i]), cap)       # a float: carries no gradient
        clipped = torch.clamp(u, 1 - eps_low, 1 + eps_high)
        total = total + w * min(u * A[i], clipped * A[i])
        n += 1
    return -total / max(n, 1)


def rand_traj(seed, T, p_done=0.2):
    g = np.random.default_rng(seed)
    r = g.normal(size=T)
    v = g.normal(size=T)
    d = (g.random(T) < p_done).astype(np.float64)
    return r, v, d, float(g.normal())


def t(x):
    return torch.as_tensor(np.asarray(x, dtype=np.float64))


# ============================================================================ GAE
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (1.0, 1.0), (0.9, 0.0), (0.97, 0.5)])
def test_gae_matches_reference(seed, gamma, lam):
    r, v, d, boot = rand_traj(seed, 37)
    A, R = gae(t(r), t(v), t(d), gamma, lam, bootstrap_value=boot)
    A_ref, R_ref = ref_gae(r, v, d, gamma, lam, boot)
    close(A, A_ref)
    close(R, R_ref)
    close(R, A + t(v))


def test_gae_bool_dones_batched_and_tensor_bootstrap():
    rows = [rand_traj(s, 20) for s in range(4)]
    r = t([x[0] for x in rows]); v = t([x[1] for x in rows])
    d = t([x[2] for x in rows]).bool(); boot = t([x[3] for x in rows])
    A, R = gae(r, v, d, 0.95, 0.9, bootstrap_value=boot)       # [4, 20]
    for i, (ri, vi, di, bi) in enumerate(rows):
        A_ref, R_ref = ref_gae(ri, vi, di, 0.95, 0.9, bi)
        close(A[i], A_ref)
        close(R[i], R_ref)


def test_gae_edge_cases():
    # single step, not done: A = r + gamma*boot - V
    A, R = gae(t([1.0]), t([0.5]), t([0.0]), 0.9, 0.95, bootstrap_value=2.0)
    close(A, [1.0 + 0.9 * 2.0 - 0.5]); close(R, [1.0 + 0.9 * 2.0])
    # all dones: A_t = r_t - V_t, bootstrap ignored
    r, v, _, _ = rand_traj(7, 10)
    A, R = gae(t(r), t(v), torch.ones(10), 0.99, 0.95, bootstrap_value=100.0)
    close(A, r - v); close(R, r)
    # lam = 1, no dones: returns are discounted Monte-Carlo returns + gamma^(T-t) boot
    A, R = gae(t(r), t(v), torch.zeros(10), 0.9, 1.0, bootstrap_value=3.0)
    mc = [sum(0.9 ** (k - s) * r[k] for k in range(s, 10)) + 0.9 ** (10 - s) * 3.0 for s in range(10)]
    close(R, mc)
    # no gradient flows out of gae
    vv = t(v).requires_grad_()
    A, R = gae(t(r), vv, torch.zeros(10), 0.9, 0.9)
    assert not A.requires_grad and not R.requires_grad


def test_length_adaptive_lambda():
    assert length_adaptive_lambda(100) == pytest.approx(0.8)
    assert length_adaptive_lambda(1000) == pytest.approx(0.98)
    assert length_adaptive_lambda(200, alpha=0.1) == pytest.approx(0.95)
    for L in (0, 1, 5, 10, 20):          # alpha*L <= 1: raw formula <= 0 -> clamped to 0
        assert length_adaptive_lambda(L) == 0.0
    assert length_adaptive_lambda(21) == pytest.approx(1 - 1 / 1.05)
    vals = [length_adaptive_lambda(L) for L in range(0, 5000, 7)]
    assert all(0.0 <= x <= 1.0 for x in vals)
    assert all(a <= b for a, b in zip(vals, vals[1:]))
    assert isinstance(length_adaptive_lambda(300), float)


# ============================================================================ masked / decoupled GAE
def rand_masked(seed, B=5, T=40):
    g = np.random.default_rng(seed)
    r = g.normal(size=(B, T)); v = g.normal(size=(B, T))
    mask = (g.random((B, T)) < 0.6).astype(np.float64)
    mask[0] = 0.0                   # a row with no generated tokens
    mask[1, :] = 0.0; mask[1, 17] = 1.0   # a single generated token
    return r, v, mask


def ref_masked_gae(r, v, mask, gamma, lam):
    B, T = r.shape
    A = np.zeros((B, T)); R = np.zeros((B, T))
    for b in range(B):
        idx = [i for i in range(T) if mask[b, i] > 0]
        if not idx:
            continue
        d = [0.0] * (len(idx) - 1) + [1.0]
        a, ret = ref_gae([r[b, i] for i in idx], [v[b, i] for i in idx], d, gamma, lam, 0.0)
        for k, i in enumerate(idx):
            A[b, i], R[b, i] = a[k], ret[k]
    return A, R


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0)])
def test_masked_gae_matches_compacted_reference(seed, gamma, lam):
    r, v, mask = rand_masked(seed)
    A, R = masked_gae(t(r), t(v), t(mask), gamma, lam)
    A_ref, R_ref = ref_masked_gae(r, v, mask, gamma, lam)
    close(A, A_ref); close(R, R_ref)
    assert torch.all(A[t(mask) == 0] == 0) and torch.all(R[t(mask) == 0] == 0)
    # bool mask, and garbage at unmasked positions must not matter
    r2, v2 = r.copy(), v.copy()
    r2[mask == 0] = 1e30; v2[mask == 0] = np.nan
    A2, R2 = masked_gae(t(r2), t(v2), t(mask).bool(), gamma, lam)
    close(A2, A_ref); close(R2, R_ref)


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_decoupled_gae(seed):
    r, v, mask = rand_masked(seed)
    adv, targ = decoupled_gae(t(r), t(v), t(mask), 1.0, 0.9, lam_critic=1.0)
    close(adv, ref_masked_gae(r, v, mask, 1.0, 0.9)[0])
    close(targ, ref_masked_gae(r, v, mask, 1.0, 1.0)[1])
    # lam_critic = 1, gamma = 1: targets are the undiscounted sum of future generated rewards
    for b in range(r.shape[0]):
        idx = [i for i in range(r.shape[1]) if mask[b, i] > 0]
        for k, i in enumerate(idx):
            assert targ[b, i].item() == pytest.approx(sum(r[b, j] for j in idx[k:]))
    adv2, targ2 = decoupled_gae(t(r), t(v), t(mask), 0.99, 0.7, lam_critic=0.7)
    A_ref, R_ref = ref_masked_gae(r, v, mask, 0.99, 0.7)
    close(adv2, A_ref); close(targ2, R_ref)


# ============================================================================ decoupled PPO loss
def rand_ppo(seed, shape, spread=0.5):
    g = np.random.default_rng(seed)
    prox = g.normal(-1.0, 0.5, size=shape)
    logp = prox + g.normal(0, spread, size=shape)
    behav = prox + g.normal(0, 1.0, size=shape)     # some w above the cap of 5
    adv = g.normal(size=shape)
    mask = (g.random(shape) < 0.7).astype(np.float64)
    return logp, prox, behav, adv, mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", [(50,), (4, 13)])
def test_ppo_loss_value_and_grad_match_reference(seed, shape):
    logp, prox, behav, adv, mask = rand_ppo(seed, shape)
    kw = dict(eps_low=0.2, eps_high=0.28)
    x = t(logp).requires_grad_()
    loss = decoupled_ppo_loss(x, t(prox), t(behav), t(adv), t(mask), behav_cap=5.0, **kw)
    loss.backward()
    y = t(logp).requires_grad_()
    ref = ref_ppo_loss(y, prox, behav, adv, mask, cap=5.0, **kw)
    ref.backward()
    assert loss.dim() == 0
    close(loss.item(), ref.item())
    close(x.grad, y.grad)
    assert torch.all(x.grad[t(mask) == 0] == 0)


def test_ppo_2d_is_token_level_mean():
    logp, prox, behav, adv, mask = rand_ppo(11, (3, 9))
    mask[0, :] = 0.0; mask[1, :8] = 0.0            # rows with very different token counts
    args = [t(a) for a in (logp, prox, behav, adv, mask)]
    flat = [a.reshape(-1) for a in args]
    close(decoupled_ppo_loss(*args).item(), decoupled_ppo_loss(*flat).item())
    close(decoupled_ppo_loss(*args).item(),
          ref_ppo_loss(t(logp), prox, behav, adv, mask, 0.2, 0.28, 5.0).item())


def test_ppo_weight_gets_no_gradient_and_matches_plain_ppo_on_policy():
    logp, prox, behav, adv, mask = rand_ppo(3, (30,))
    x, p, b = t(logp).requires_grad_(), t(prox).requires_grad_(), t(behav).requires_grad_()
    decoupled_ppo_loss(x, p, b, t(adv), t(mask)).backward()
    assert p.grad is None or torch.all(p.grad == 0)
    assert b.grad is None or torch.all(b.grad == 0)
    # behav == prox -> w = 1 -> standard PPO-clip; logp == prox -> loss = -mean(A)
    l = decoupled_ppo_loss(t(prox), t(prox), t(prox), t(adv), t(mask))
    close(l.item(), -(adv * mask).sum() / mask.sum())


def test_ppo_clipping_zeroes_gradient_where_it_should():
    lo, hi = 0.2, 0.28
    # u values and advantage signs
    u = torch.tensor([1.5, 0.5, 1.5, 0.5, 1.1, 0.9], dtype=D)
    A = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0], dtype=D)
    prox = torch.full((6,), -1.0, dtype=D)
    x = (prox + torch.log(u)).requires_grad_()
    decoupled_ppo_loss(x, prox, prox, A, torch.ones(6), eps_low=lo, eps_high=hi).backward()
    g = x.grad
    assert g[0] == 0 and g[1] == 0            # A>0,u>1+hi  and  A<0,u<1-lo : clipped
    # A<0,u>1+hi and A>0,u<1-lo keep the unclipped (pessimistic) term: dL/dlogp = -u*A/N
    close(g[2].item(), -(1.5 * -1.0) / 6); close(g[3].item(), -(0.5 * 1.0) / 6)
    close(g[4].item(), -(1.1 * 1.0) / 6); close(g[5].item(), -(0.9 * -1.0) / 6)
    # asymmetric: u = 1.25 is inside [0.8, 1.28] -> gradient flows; u = 1.3 is clipped
    for uu, nonzero in ((1.25, True), (1.3, False), (0.81, True), (0.79, True)):
        x = torch.tensor([math.log(uu)], dtype=D, requires_grad=True)
        decoupled_ppo_loss(x, torch.zeros(1, dtype=D), torch.zeros(1, dtype=D),
                           torch.ones(1, dtype=D), torch.ones(1)).backward()
        assert (x.grad.abs().item() > 0) == nonzero
    x = torch.tensor([math.log(0.79)], dtype=D, requires_grad=True)   # A<0 below 1-lo: clipped
    decoupled_ppo_loss(x, torch.zeros(1, dtype=D), torch.zeros(1, dtype=D),
                       -torch.ones(1, dtype=D), torch.ones(1)).backward()
    assert x.grad.item() == 0


def test_ppo_behaviour_cap():
    z = torch.zeros(1, dtype=D)
    behav = torch.tensor([-math.log(100.0)], dtype=D)     # prox/behav = 100
    A = torch.tensor([2.0], dtype=D)
    assert decoupled_ppo_loss(z, z, behav, A, torch.ones(1)).item() == pytest.approx(-10.0)
    assert decoupled_ppo_loss(z, z, behav, A, torch.ones(1), behav_cap=50.0).item() == pytest.approx(-100.0)
    assert decoupled_ppo_loss(z, z, behav, A, torch.ones(1), behav_cap=math.inf).item() == pytest.approx(-200.0)
    behav = torch.tensor([math.log(2.0)], dtype=D)       # prox/behav = 0.5 < cap: untouched
    assert decoupled_ppo_loss(z, z, behav, A, torch.ones(1)).item() == pytest.approx(-1.0)


def test_ppo_zero_mask_and_single_token():
    for shape in ((7,), (2, 5)):
        x = torch.randn(shape, dtype=D, requires_grad=True)
        loss = decoupled_ppo_loss(x, torch.randn(shape, dtype=D), torch.randn(shape, dtype=D),
                                  torch.randn(shape, dtype=D), torch.zeros(shape))
        assert loss.item() == 0.0 and loss.requires_grad
        loss.backward()
        assert torch.all(x.grad == 0)
    x = torch.tensor([0.1], dtype=D, requires_grad=True)
    loss = decoupled_ppo_loss(x, torch.zeros(1, dtype=D), torch.zeros(1, dtype=D),
                              torch.tensor([3.0], dtype=D), torch.ones(1, dtype=torch.bool))
    close(loss.item(), -min(math.exp(0.1), 1.28) * 3.0)


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_ppo_junk_invalid_samples_do_not_change_loss(seed):
    """sample-factory style: padding with invalid garbage must leave loss and grads alone."""
    logp, prox, behav, adv, mask = rand_ppo(seed, (4, 12))
    x = t(logp).requires_grad_()
    base = decoupled_ppo_loss(x, t(prox), t(behav), t(adv), t(mask))
    base.backward()
    J = 6
    jl = torch.tensor([[1e4, -1e9, 80.0, -80.0, 3e38, -3e38]] * 4, dtype=D)
    jp = torch.tensor([[-1e9, 1e4, -math.inf, math.inf, math.nan, 0.0]] * 4, dtype=D)
    jb = torch.tensor([[math.inf, -1e9, math.nan, 1e9, -math.inf, 500.0]] * 4, dtype=D)
    ja = torch.tensor([[1e30, -1e30, math.nan, math.inf, -math.inf, 1e6]] * 4, dtype=D)
    x2 = torch.cat([t(logp), jl], 1).requires_grad_()
    loss = decoupled_ppo_loss(x2, torch.cat([t(prox), jp], 1), torch.cat([t(behav), jb], 1),
                              torch.cat([t(adv), ja], 1), torch.cat([t(mask), torch.zeros(4, J)], 1))
    loss.backward()
    close(loss.item(), base.item(), 1e-12)
    close(x2.grad[:, :12], x.grad, 1e-12)
    assert torch.all(x2.grad[:, 12:] == 0)
    # interleaved junk (not only appended) and a fully invalid row
    xs = torch.cat([jl[:, :3], t(logp), jl[:, 3:]], 1).requires_grad_()
    pad = lambda a, j: torch.cat([j[:, :3], a, j[:, 3:]], 1)
    m3 = torch.cat([torch.zeros(4, 3), t(mask), torch.zeros(4, 3)], 1)
    extra_row = lambda a, val: torch.cat([a, torch.full((1, a.shape[1]), val, dtype=a.dtype)], 0)
    loss3 = decoupled_ppo_loss(extra_row(xs, 1e9), extra_row(pad(t(prox), jp), -1e9),
                               extra_row(pad(t(behav), jb), math.nan),
                               extra_row(pad(t(adv), ja), math.inf), extra_row(m3, 0.0))
    close(loss3.item(), base.item(), 1e-12)


# ============================================================================ value loss
def test_clipped_value_loss_matches_reference_and_grad():
    g = np.random.default_rng(5)
    v, old, ret = g.normal(size=(3, 20)), g.normal(size=(3, 20)), g.normal(size=(3, 20))
    mask = (g.random((3, 20)) < 0.6).astype(np.float64)
    x = t(v).requires_grad_()
    loss = clipped_value_loss(x, t(old), t(ret), t(mask), clip=0.2)
    loss.backward()
    y = t(v).requires_grad_()
    total, n = y.sum() * 0, 0
    for i in range(3):
        for j in range(20):
            if mask[i, j]:
                vc = old[i, j] + min(max(y[i, j] - old[i, j], -0.2), 0.2)
                total = total + max((y[i, j] - ret[i, j]) ** 2, (vc - ret[i, j]) ** 2)
                n += 1
    ref = 0.5 * total / n
    ref.backward()
    close(loss.item(), ref.item()); close(x.grad, y.grad)
    z = clipped_value_loss(x, t(old), t(ret), torch.zeros(3, 20))
    assert z.item() == 0.0 and z.requires_grad


# ============================================================================ v-trace
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip_rho,clip_c", [(1.0, 1.0), (2.0, 0.9), (math.inf, math.inf)])
def test_vtrace_matches_reference(seed, clip_rho, clip_c):
    g = np.random.default_rng(seed)
    T = 25
    mu, pi = g.normal(-1, 0.7, size=T), g.normal(-1, 0.7, size=T)
    r, v = g.normal(size=T), g.normal(size=T)
    disc = 0.95 * (g.random(T) > 0.15)
    boot = float(g.normal())
    vs, pg = vtrace(t(mu), t(pi), t(r), t(v), boot, t(disc), clip_rho=clip_rho, clip_c=clip_c)
    vs_ref, pg_ref = ref_vtrace(mu, pi, r, v, boot, disc, clip_rho, clip_c)
    close(vs, vs_ref); close(pg, pg_ref)


def test_vtrace_batched_detached_and_hand_example():
    g = np.random.default_rng(9)
    mu, pi, r, v = (g.normal(size=(3, 8)) for _ in range(4))
    disc = np.full((3, 8), 0.9); boot = g.normal(size=3)
    pit = t(pi).requires_grad_()
    vs, pg = vtrace(t(mu), pit, t(r), t(v), t(boot), t(disc))
    assert not vs.requires_grad and not pg.requires_grad
    for b in range(3):
        vs_ref, pg_ref = ref_vtrace(mu[b], pi[b], r[b], v[b], boot[b], disc[b], 1.0, 1.0)
        close(vs[b], vs_ref); close(pg[b], pg_ref)
    # T = 2 by hand: ratios 2 and 0.5, clipped rho = c = (1, 0.5)
    vs, pg = vtrace(t([0.0, 0.0]), t([math.log(2), math.log(0.5)]), t([1.0, 2.0]), t([0.5, 1.0]),
                    3.0, t([0.9, 0.9]))
    d1 = 0.5 * (2.0 + 0.9 * 3.0 - 1.0)
    d0 = 1.0 * (1.0 + 0.9 * 1.0 - 0.5)
    vs1, vs0 = 1.0 + d1, 0.5 + d0 + 0.9 * 1.0 * d1
    close(vs, [vs0, vs1])
    close(pg, [1.0 * (1.0 + 0.9 * vs1 - 0.5), 0.5 * (2.0 + 0.9 * 3.0 - 1.0)])


@pytest.mark.parametrize("seed", SEEDS)
def test_vtrace_on_policy_reduces_to_gae_lambda_one(seed):
    r, v, d, boot = rand_traj(seed, 30)
    logp = torch.randn(30, dtype=D)
    gamma = 0.97
    disc = t(gamma * (1 - d))
    A, R = gae(t(r), t(v), t(d), gamma, 1.0, bootstrap_value=boot)
    for clip in (math.inf, 1.0):   # rho = 1 so clip >= 1 is irrelevant
        vs, pg = vtrace(logp, logp.clone(), t(r), t(v), boot, disc, clip_rho=clip, clip_c=clip)
        close(vs, R); close(pg, A)
    # no episode ends: vs_0 is the n-step return sum_k gamma^k r_k + gamma^T boot
    vs, _ = vtrace(logp, logp, t(r), t(v), boot, torch.full((30,), gamma, dtype=D),
                   clip_rho=math.inf, clip_c=math.inf)
    close(vs[0].item(), sum(gamma ** k * r[k] for k in range(30)) + gamma ** 30 * boot)


# ============================================================================ GRPO
@pytest.mark.parametrize("seed", SEEDS)
def test_grpo_advantages(seed):
    g = np.random.default_rng(seed)
    x = g.normal(size=8)
    close(grpo_advantages(t(x)), (x - x.mean()) / (x.std(ddof=1) + 1e-6))
    X = g.normal(size=(4, 6)); X[2] = 1.5
    out = grpo_advantages(t(X))
    assert out.shape == (4, 6)
    for i in range(4):
        row = X[i]
        exp = np.zeros(6) if np.all(row == row[0]) else (row - row.mean()) / (row.std(ddof=1) + 1e-6)
        close(out[i], exp)
    assert torch.all(out[2] == 0)
    assert torch.all(grpo_advantages(torch.tensor([1.0, 1.0, 1.0])) == 0)
    assert torch.all(grpo_advantages(torch.tensor([0.7])) == 0)
    assert grpo_advantages(torch.tensor([0, 1, 1, 0])).is_floating_point()


# ============================================================================ diagnostics
def test_explained_variance():
    g = np.random.default_rng(1)
    y, p = g.normal(size=100), g.normal(size=100)
    assert explained_variance(t(p), t(y)) == pytest.approx(1 - np.var(y - p) / np.var(y))
    assert explained_variance(t(y), t(y)) == pytest.approx(1.0)
    assert explained_variance(torch.full((100,), float(y.mean()), dtype=D), t(y)) == pytest.approx(0.0, abs=1e-12)
    m = (g.random(100) < 0.5)
    p2 = p.copy(); p2[~m] = np.nan
    assert explained_variance(t(p2), t(y), t(m)) == pytest.approx(1 - np.var((y - p)[m]) / np.var(y[m]))
    assert explained_variance(t(p), torch.ones(100, dtype=D)) == 0.0         # Var[target] = 0
    assert explained_variance(t(p), t(y), torch.zeros(100)) == 0.0           # empty mask
    assert isinstance(explained_variance(t(p), t(y)), float)


def test_masked_mean_and_whiten():
    g = np.random.default_rng(2)
    x = g.normal(3.0, 2.0, size=(4, 10)); m = (g.random((4, 10)) < 0.5).astype(np.float64)
    xj = x.copy(); xj[m == 0] = np.inf
    assert masked_mean(t(xj), t(m)).item() == pytest.approx(x[m > 0].mean())
    close(masked_mean(t(xj), t(m), dim=1), [x[i][m[i] > 0].mean() if m[i].any() else 0.0 for i in range(4)])
    assert masked_mean(t(x), torch.zeros(4, 10)).item() == 0.0
    w = masked_whiten(t(xj), t(m))
    sel = w[t(m) > 0].numpy()
    assert abs(sel.mean()) < 1e-9 and sel.std() == pytest.approx(1.0, abs=1e-6)
    close(sel, (x[m > 0] - x[m > 0].mean()) / np.sqrt(x[m > 0].var() + 1e-8))
    assert torch.all(w[t(m) == 0] == 0)
    assert torch.all(masked_whiten(t(x), torch.zeros(4, 10)) == 0)


def test_entropy_and_token_logprobs():
    g = np.random.default_rng(3)
    L = g.normal(size=(2, 5, 11)) * 3
    tok = g.integers(0, 11, size=(2, 5))
    H = entropy_from_logits(t(L))
    lp = token_logprobs_from_logits(t(L), torch.as_tensor(tok))
    assert H.shape == (2, 5) and lp.shape == (2, 5)
    for b in range(2):
        for s in range(5):
            z = L[b, s] - L[b, s].max()
            p = np.exp(z) / np.exp(z).sum()
            assert H[b, s].item() == pytest.approx(-(p * np.log(p)).sum())
            assert lp[b, s].item() == pytest.approx(math.log(p[tok[b, s]]))
    # uniform -> log V; banned (-inf) logits are fine for values and gradients
    assert entropy_from_logits(torch.zeros(7)).item() == pytest.approx(math.log(7))
    Lb = torch.tensor([[0.0, 0.0, -math.inf, -math.inf]], requires_grad=True)
    h = entropy_from_logits(Lb)
    assert h.item() == pytest.approx(math.log(2))
    h.sum().backward()
    assert torch.all(torch.isfinite(Lb.grad))
    # bf16 input computed in fp32
    assert entropy_from_logits(t(L).bfloat16()).dtype == torch.float32
    close(token_logprobs_from_logits(t(L).float(), torch.as_tensor(tok)), lp, 1e-5)


def test_kl_k3():
    g = np.random.default_rng(4)
    a, b = g.normal(size=50), g.normal(size=50)
    k = kl_k3(t(a), t(b))
    close(k, [math.exp(b[i] - a[i]) - 1 - (b[i] - a[i]) for i in range(50)])
    assert torch.all(k >= 0) and torch.all(kl_k3(t(a), t(a)) == 0)
    # unbiased estimator of KL(pi || ref) for samples from pi
    torch.manual_seed(0)
    pi = torch.softmax(torch.randn(6, dtype=D), 0); ref = torch.softmax(torch.randn(6, dtype=D), 0)
    s = torch.multinomial(pi, 200000, replacement=True)
    est = kl_k3(pi.log()[s], ref.log()[s]).mean().item()
    assert est == pytest.approx((pi * (pi.log() - ref.log())).sum().item(), rel=0.03)


def test_masked_scale_keeps_zero_advantages_at_zero():
    from learner.algorithms import masked_scale

    x = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, -1.0, 0.0, 5.0]])
    m = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    y = masked_scale(x, m)
    assert torch.all(y[0] == 0) and y[1, 2] == 0 and y[1, 3] == 0
    assert torch.sign(y[1, :2]).tolist() == [1.0, -1.0]
    sel = y[m.bool()]
    assert torch.isclose((sel ** 2).mean(), torch.tensor(1.0), atol=1e-5)
