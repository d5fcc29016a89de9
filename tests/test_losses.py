"""Tests for the losses and diagnostics of learner/algorithms.py: the decoupled PPO loss, the truncated-IS policy
gradient, the clipped value loss, the KL estimators (k1, k3), masking helpers, entropy and explained variance.
The estimators of advantages and value targets are in tests/test_algorithms.py.

Every fast function is checked against a slow reference written directly from the paper
notation (plain Python loops over floats / numpy), independently of the vectorised code.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learner.algorithms import (
    clipped_value_loss, decoupled_ppo_loss, entropy_from_logits, explained_variance, kl_k1, kl_k3, masked_mean,
    masked_whiten, tis_pg_loss, token_logprobs_from_logits,
)

SEEDS = [0, 1, 2, 3, 4]
D = torch.float64


def close(a, b, tol=1e-9):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64),
                               rtol=tol, atol=tol)


# ============================================================================ references
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



def t(x):
    return torch.as_tensor(np.asarray(x, dtype=np.float64))


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


# ============================================================================ truncated IS policy gradient
def ref_tis(logp, behav, adv, mask, cap):
    """Per token in floats: value -mean(min(rho, cap) A), d/dlogp_i = -min(rho_i, cap) A_i / N."""
    L, Bh, A, M = (np.asarray(x, dtype=np.float64).reshape(-1) for x in (logp, behav, adv, mask))
    idx = [i for i in range(L.size) if M[i] > 0]
    n = max(len(idx), 1)
    w = {i: min(math.exp(L[i] - Bh[i]), cap) for i in idx}
    value = -sum(w[i] * A[i] for i in idx) / n
    grad = np.zeros(L.size)
    for i in idx:
        grad[i] = -w[i] * A[i] / n
    return value, grad.reshape(np.shape(logp))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape,cap", [((50,), 2.0), ((4, 13), 1.2), ((4, 13), math.inf)])
def test_tis_loss_value_and_grad_match_reference(seed, shape, cap):
    logp, _, behav, adv, mask = rand_ppo(seed, shape)
    x = t(logp).requires_grad_()
    b = t(behav).requires_grad_()
    loss = tis_pg_loss(x, b, t(adv), t(mask), cap)
    loss.backward()
    value, grad = ref_tis(logp, behav, adv, mask, cap)
    close(loss.item(), value); close(x.grad, grad)
    assert b.grad is None or torch.all(b.grad == 0)           # the weight is a constant
    if math.isfinite(cap):                                     # some tokens are over the cap here
        assert (np.exp(logp - behav)[mask > 0] > cap).any()


def test_tis_loss_masks_junk_and_empty():
    logp, _, behav, adv, mask = rand_ppo(1, (3, 8))
    base = tis_pg_loss(t(logp), t(behav), t(adv), t(mask))
    lj, bj, aj = logp.copy(), behav.copy(), adv.copy()
    lj[mask == 0] = 1e9; bj[mask == 0] = -math.inf; aj[mask == 0] = math.nan
    x = t(lj).requires_grad_()
    loss = tis_pg_loss(x, t(bj), t(aj), t(mask))
    loss.backward()
    close(loss.item(), base.item(), 1e-12)
    assert torch.all(x.grad[t(mask) == 0] == 0)
    z = tis_pg_loss(t(logp).requires_grad_(), t(behav), t(adv), torch.zeros(3, 8))
    assert z.item() == 0.0 and z.requires_grad


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


# ============================================================================ KL
def test_kl_k1():
    g = np.random.default_rng(6)
    a, b = g.normal(size=50), g.normal(size=50)
    close(kl_k1(t(a), t(b)), [a[i] - b[i] for i in range(50)])
    assert torch.all(kl_k1(t(a), t(a)) == 0)
    # unbiased estimator of KL(pi || ref) for samples from pi (per token it can be negative)
    torch.manual_seed(1)
    pi = torch.softmax(torch.randn(6, dtype=D), 0); ref = torch.softmax(torch.randn(6, dtype=D), 0)
    s = torch.multinomial(pi, 200000, replacement=True)
    k = kl_k1(pi.log()[s], ref.log()[s])
    assert (k < 0).any()
    assert k.mean().item() == pytest.approx((pi * (pi.log() - ref.log())).sum().item(), rel=0.03)


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


def test_masked_scale_keeps_zero_advantages_at_zero():
    from learner.algorithms import masked_scale

    x = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, -1.0, 0.0, 5.0]])
    m = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    y = masked_scale(x, m)
    assert torch.all(y[0] == 0) and y[1, 2] == 0 and y[1, 3] == 0
    assert torch.sign(y[1, :2]).tolist() == [1.0, -1.0]
    sel = y[m.bool()]
    assert torch.isclose((sel ** 2).mean(), torch.tensor(1.0), atol=1e-5)


def test_a_ratio_past_fp32_range_gives_a_finite_loss_and_gradient():
    """correction.kind=none feeds u = current / behaviour: a stale token whose behaviour logprob is -100 puts
    logp - behav near 99, past exp's fp32 range. The loss and gradient stay finite (the step is not skipped); with
    A > 0 the clip holds that token's gradient at 0, as PPO's clip says."""
    for adv, want_grad in ((1.0, 0.0), (-1.0, 0.0)):
        logp = torch.tensor([-1.0, -1.0], requires_grad=True)
        behav = torch.tensor([-1.2, -100.0])
        loss = decoupled_ppo_loss(logp, behav, behav, torch.tensor([adv, adv]), torch.ones(2), 0.2, 0.28, None)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and float(logp.grad[1]) == want_grad
