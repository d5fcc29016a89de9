"""Tests for the estimators of learner/algorithms.py: advantages and value targets (GAE, masked and decoupled GAE
with the truncation bootstrap, V-trace, GRPO). The losses and diagnostics are in tests/test_losses.py.

Every fast function is checked against a slow reference written directly from the paper
notation (plain Python loops over floats / numpy), independently of the vectorised code.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learner.algorithms import (
    decoupled_gae, gae, grouped_advantages, grpo_advantages, length_adaptive_lambda, masked_gae, masked_vtrace,
    vtrace,
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


def ref_masked_gae(r, v, mask, gamma, lam, boot=None):
    """Each row's generated steps through ref_gae: done after the last one (boot None), or not done and bootstrapped
    from boot[b] (a truncated episode: the value of the state it was cut in)."""
    B, T = r.shape
    A = np.zeros((B, T)); R = np.zeros((B, T))
    for b in range(B):
        idx = [i for i in range(T) if mask[b, i] > 0]
        if not idx:
            continue
        d = [0.0] * (len(idx) - 1) + [1.0 if boot is None else 0.0]
        a, ret = ref_gae([r[b, i] for i in idx], [v[b, i] for i in idx], d, gamma, lam,
                         0.0 if boot is None else boot[b])
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


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0)])
def test_masked_gae_bootstraps_each_row_from_its_own_value(seed, gamma, lam):
    """bootstrap [B]: V after each row's last step (0 = terminated, as the default). Advantages and targets both
    bootstrap, and a row bootstrapped from 0 is exactly the terminated row."""
    r, v, mask = rand_masked(seed)
    boot = np.random.default_rng(100 + seed).normal(size=r.shape[0])
    boot[3] = 0.0
    A, R = masked_gae(t(r), t(v), t(mask), gamma, lam, bootstrap=t(boot))
    A_ref, R_ref = ref_masked_gae(r, v, mask, gamma, lam, boot=boot)
    close(A, A_ref); close(R, R_ref)
    A0, R0 = masked_gae(t(r), t(v), t(mask), gamma, lam)
    assert torch.equal(A[3], A0[3]) and torch.equal(R[3], R0[3])
    adv, targ = decoupled_gae(t(r), t(v), t(mask), gamma, lam, 1.0, bootstrap=t(boot))
    close(adv, A_ref); close(targ, ref_masked_gae(r, v, mask, gamma, 1.0, boot=boot)[1])


def test_masked_gae_truncated_against_terminated_by_hand():
    """Two generated tokens (prompt tokens around them), rewards 0 then 1, V = 0.5, 0.8, gamma 0.9; the truncated
    row bootstraps from V_final = 2.0. By hand:
        terminated: delta_1 = 1 - 0.8 = 0.2            delta_0 = 0.9 * 0.8 - 0.5 = 0.22
        truncated:  delta_1 = 1 + 0.9 * 2 - 0.8 = 2.0   delta_0 = 0.22
        A_0 = delta_0 + 0.9 * lam * delta_1;  lambda-return targets R = A + V."""
    mask = t([[0, 0, 1, 0, 0, 1, 0], [0, 0, 1, 0, 0, 1, 0]])
    r = t([[9, 9, 0.0, 9, 9, 1.0, 9], [9, 9, 0.0, 9, 9, 1.0, 9]])       # 9s at unmasked positions: ignored
    v = t([[7, 7, 0.5, 7, 7, 0.8, 7], [7, 7, 0.5, 7, 7, 0.8, 7]])
    boot = t([0.0, 2.0])
    for lam, a0 in ((1.0, (0.40, 2.02)), (0.5, (0.31, 1.12)), (0.0, (0.22, 0.22))):
        A, R = masked_gae(r, v, mask, 0.9, lam, bootstrap=boot)
        close(A[:, [2, 5]], [[a0[0], 0.2], [a0[1], 2.0]], 1e-12)
        close(R[:, [2, 5]], [[a0[0] + 0.5, 1.0], [a0[1] + 0.5, 2.8]], 1e-12)
    # lam = 1 value targets: discounted returns, the truncated one with gamma^k V_final added
    _, targ = decoupled_gae(r, v, mask, 0.9, 0.5, lam_critic=1.0, bootstrap=boot)
    close(targ[:, [2, 5]], [[0.9, 1.0], [0.9 * 1.0 + 0.81 * 2.0, 1.0 + 0.9 * 2.0]], 1e-12)


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


def ref_masked_vtrace(mu, pi, r, v, mask, gamma, boot, clip_rho, clip_c):
    B, T = r.shape
    PG = np.zeros((B, T)); VS = np.zeros((B, T))
    for b in range(B):
        idx = [i for i in range(T) if mask[b, i] > 0]
        if not idx:
            continue
        vs, pg = ref_vtrace([mu[b, i] for i in idx], [pi[b, i] for i in idx], [r[b, i] for i in idx],
                            [v[b, i] for i in idx], boot[b], [gamma] * len(idx), clip_rho, clip_c)
        for k, i in enumerate(idx):
            PG[b, i], VS[b, i] = pg[k], vs[k]
    return PG, VS


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip_rho,clip_c", [(1.0, 1.0), (2.0, 0.9)])
def test_masked_vtrace_matches_compacted_reference(seed, clip_rho, clip_c):
    r, v, mask = rand_masked(seed)
    g = np.random.default_rng(200 + seed)
    mu, pi = g.normal(-1, 0.7, size=r.shape), g.normal(-1, 0.7, size=r.shape)
    boot = g.normal(size=r.shape[0]); boot[2] = 0.0
    pg, vs = masked_vtrace(t(mu), t(pi), t(r), t(v), t(mask), 0.95, t(boot), clip_rho, clip_c)
    pg_ref, vs_ref = ref_masked_vtrace(mu, pi, r, v, mask, 0.95, boot, clip_rho, clip_c)
    close(pg, pg_ref); close(vs, vs_ref)
    assert torch.all(pg[t(mask) == 0] == 0) and torch.all(vs[t(mask) == 0] == 0)
    mu2, r2, v2 = mu.copy(), r.copy(), v.copy()                     # garbage where nothing was generated
    mu2[mask == 0] = np.nan; r2[mask == 0] = 1e30; v2[mask == 0] = -np.inf
    pg2, vs2 = masked_vtrace(t(mu2), t(pi), t(r2), t(v2), t(mask).bool(), 0.95, t(boot), clip_rho, clip_c)
    close(pg2, pg_ref); close(vs2, vs_ref)


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_masked_vtrace_on_policy_is_masked_gae_lambda_one(seed):
    """On-policy (rho = c = 1) V-trace targets are the lambda = 1 returns and its advantages GAE(1)'s, bootstrap
    included."""
    r, v, mask = rand_masked(seed)
    logp = np.random.default_rng(seed).normal(-1, 0.5, size=r.shape)
    boot = np.random.default_rng(300 + seed).normal(size=r.shape[0])
    pg, vs = masked_vtrace(t(logp), t(logp), t(r), t(v), t(mask), 0.97, t(boot))
    A, R = masked_gae(t(r), t(v), t(mask), 0.97, 1.0, bootstrap=t(boot))
    close(pg, A); close(vs, R)


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




@pytest.mark.parametrize("std_norm", [True, False])
def test_grpo_advantages_of_equal_returns_are_exactly_zero_whatever_the_rounding(std_norm):
    """Equal returns whose float mean is not the value itself (8 x -0.1, 7 x 0.3 in fp32) still give exactly 0."""
    for v in (-0.1, 0.1, 0.3, -0.3, 0.7, 1 / 3):
        for k in (2, 3, 6, 7, 8, 16, 64):
            assert torch.all(grpo_advantages(torch.full((k,), v), std_norm) == 0), (v, k)
    X = torch.full((3, 8), -0.1)
    X[1, 0] = 0.9
    out = grpo_advantages(X, std_norm)
    assert torch.all(out[0] == 0) and torch.all(out[2] == 0) and torch.all(out[1] != 0)


def test_groups_of_one_in_a_batch_of_equal_returns_are_exactly_zero():
    """learner.group.size = 1 (the default): each trajectory is centred on the batch mean, and a batch whose returns
    are all equal (64 x -0.1: a float mean off by 7e-9) gives exactly 0, not rounding noise."""
    for v in (-0.1, 0.3, 1 / 3):
        r = torch.full((64,), v)
        assert torch.all(grouped_advantages(r, [str(i) for i in range(64)]) == 0)
    r = torch.tensor([-0.1, -0.1, 0.9])
    close(grouped_advantages(r, ["a", "b", "c"]), (r - r.mean()).numpy())


def test_grpo_advantages_centred_only():
    """std_norm=False (Dr. GRPO): centred, not divided by the std."""
    g = np.random.default_rng(7)
    X = g.normal(size=(3, 5)) * 0.01
    close(grpo_advantages(t(X), std_norm=False), X - X.mean(1, keepdims=True))
    assert torch.all(grpo_advantages(t([0.4]), std_norm=False) == 0)


def ref_grouped(returns, groups, std_norm):
    out = [0.0] * len(returns)
    batch_mean = sum(returns) / len(returns)
    for g in dict.fromkeys(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        rs = [returns[i] for i in idx]
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((x - mean) ** 2 for x in rs) / (len(rs) - 1)) if len(rs) > 1 else 0.0
        for i in idx:
            if len(idx) == 1:
                out[i] = returns[i] - batch_mean
            else:
                out[i] = (returns[i] - mean) / (std + 1e-6) if std_norm else returns[i] - mean
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("std_norm", [False, True])
def test_grouped_advantages_matches_reference(seed, std_norm):
    """Ragged groups in any order (a group of one is centred on the batch mean), as the learner's batches come."""
    g = np.random.default_rng(seed)
    groups = [f"g{int(x)}" for x in g.integers(0, 5, size=17)]
    returns = g.normal(size=17)
    got = grouped_advantages(t(returns), groups, std_norm=std_norm)
    close(got, ref_grouped(list(returns), groups, std_norm))
    same = grouped_advantages(torch.ones(4), ["a", "a", "b", "b"])
    assert torch.all(same == 0)
