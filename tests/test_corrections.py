"""learner.correction: each of decoupled | vtrace | tis | none changes the update on the same stale batch, all four
agree on an on-policy one, and the staleness bound admits the same trajectories whatever the correction."""
from __future__ import annotations

import collections
import copy
import dataclasses
import io
import itertools
import re
import types

import numpy as np
import pytest
import torch

from learner.admission import Admission
from learner.batch import collate
from learner.dist_check import batch
from learner.ppo import PPOTrainer
from learner.staleness import StalenessManager
from core import config as C
from core.config import CorrectionConfig, LearnerConfig, PPOConfig
from core.model import DecoderConfig
from learner.policy import TrainPolicy

KINDS = CorrectionConfig.KINDS


def models():
    torch.manual_seed(0)
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2),
                                  seed=0, std=0.3)
    return pol, TrainPolicy.from_config(pol.config, value_head=True, seed=1, std=0.3)


def behaviour(pol, trajs, shift=None):
    """trajs with behaviour logprobs: the policy's own (on-policy), or shifted per token by up to +-1.5 nats as if
    older weights had generated them (stale: ratios past every clip and cap)."""
    b = collate(trajs)
    with torch.no_grad():
        lp = pol.logprobs_at(b.tokens, b.valid, b.mask)
    out, k = [], 0
    rng = np.random.default_rng(5)
    for i, t in enumerate(trajs):
        t = copy.deepcopy(t)
        pos = np.nonzero(b.mask[i].numpy())[0]
        own = lp[k:k + len(pos)].numpy()
        k += len(pos)
        if shift is not None:
            own = own + rng.uniform(-shift, shift, size=len(pos))
        t.logprobs = t.logprobs.copy()
        t.logprobs[pos] = np.minimum(own, 0.0)
        out.append(t)
    return out


def one_update(kind, pol, critic, trajs, **ppo):
    """One update from the given weights with plain SGD (Adam's per-parameter scaling would hide reweightings);
    -> (policy, critic, metrics)."""
    p, c = copy.deepcopy(pol), copy.deepcopy(critic)
    cfg = LearnerConfig(lr=0.1, critic_lr=0.1, warmup_steps=1, grad_clip=1e9, ppo=PPOConfig(**ppo),
                        correction=CorrectionConfig(kind=kind))
    tr = PPOTrainer(p, c, cfg, 0)
    tr.opt = torch.optim.SGD(p.parameters(), lr=0.1)
    tr.critic_opt = torch.optim.SGD(c.parameters(), lr=0.1)
    tr.sched = torch.optim.lr_scheduler.LambdaLR(tr.opt, lambda s: 1.0)
    m = tr.step(trajs, 3)
    return p, c, m


def delta(a, b) -> float:
    return max(float((x - y).detach().abs().max()) for x, y in zip(a.parameters(), b.parameters()))


def test_each_correction_changes_the_update_on_a_stale_batch():
    """Same weights, same batch whose behaviour logprobs are off the learner's: the four corrections give four
    different policy updates (and pg losses); vtrace also trains the critic towards other targets."""
    pol, critic = models()
    trajs = behaviour(pol, batch(0, n=12, max_len=30), shift=1.5)
    runs = {k: one_update(k, pol, critic, trajs) for k in KINDS}
    for k in KINDS:
        assert delta(runs[k][0], pol) > 1e-3, k  # each one did move the weights
    for a, b in itertools.combinations(KINDS, 2):
        assert delta(runs[a][0], runs[b][0]) > 1e-5, (a, b)
        assert runs[a][2]["pg_loss"] != pytest.approx(runs[b][2]["pg_loss"], rel=1e-4, abs=1e-6), (a, b)
    assert delta(runs["vtrace"][1], runs["decoupled"][1]) > 1e-5
    assert "behav_prox_kl" in runs["decoupled"][2] and runs["decoupled"][2]["behav_prox_kl"] != 0


def test_on_policy_every_correction_is_the_same_update():
    """Behaviour = the learner's own logprobs and lambda = 1: every ratio is 1, V-trace is GAE(1), nothing is
    clipped or capped, so all four give the same parameters. What differs above is the correction alone."""
    pol, critic = models()
    trajs = behaviour(pol, batch(1, n=12, max_len=30))
    runs = {k: one_update(k, pol, critic, trajs, lam_policy=1.0) for k in KINDS}
    for k in KINDS[1:]:
        assert delta(runs[k][0], runs["decoupled"][0]) < 1e-5, k
        assert delta(runs[k][1], runs["decoupled"][1]) < 1e-5, k
        assert runs[k][2]["clipfrac"] == 0.0
    assert delta(runs["decoupled"][0], pol) > 1e-3


def test_the_learner_logs_the_importance_weight_each_correction_applies():
    """is_ratio_mean (pi_learner / pi_behav before the update) is the same stale batch's whatever the correction;
    is_weight_mean is the weight each puts on the tokens: capped at behav_cap, rho_bar, tis_cap, or 1 for none."""
    pol, critic = models()
    trajs = behaviour(pol, batch(0, n=12, max_len=30), shift=1.5)
    ms = {k: one_update(k, pol, critic, trajs)[2] for k in KINDS}
    ratio = ms["decoupled"]["is_ratio_mean"]
    assert ratio > 1.2  # shifted by up to +-1.5 nats: E[e^U] for U uniform on [-1.5, 1.5] is ~1.42
    for k in KINDS:
        assert ms[k]["is_ratio_mean"] == pytest.approx(ratio, rel=1e-5), k
    w = {k: ms[k]["is_weight_mean"] for k in KINDS}
    assert w["none"] == 1.0
    assert w["vtrace"] < w["tis"] < w["decoupled"]  # caps 1 (rho_bar), 2 (tis_cap), 5 (behav_cap)
    assert w["vtrace"] <= 1.0 and w["tis"] <= 2.0
    assert w["decoupled"] == pytest.approx(ratio, rel=1e-5)  # no ratio here reaches the cap of 5 (e^1.5 < 4.5)


@pytest.mark.parametrize("kind", KINDS)
def test_the_staleness_bound_admits_the_same_whatever_the_correction(kind):
    """Admission is the staleness manager's and the learner's max_lag filter, built from learner.staleness only:
    B * (version + 1 + eta) episodes may start, and a trajectory more than max_lag versions old is dropped."""
    cfg = C.load(None, None, [f"learner.correction.kind={kind}", "learner.batch_size=4", "learner.staleness.eta=1",
                              "learner.staleness.max_lag=2"])
    lc = cfg.learner
    assert lc.correction.kind == kind
    stal = StalenessManager(lc.batch_size, lc.staleness.eta, max_lag=lc.staleness.max_lag)  # as learner/main.py
    assert stal.try_admit(100) == 4 * (0 + 1 + 1)
    stal.set_version(1)
    assert stal.try_admit(100) == 4
    adm = Admission(types.SimpleNamespace(mark_consumed=lambda ids: None), stal, lc.staleness.max_lag, lc.group,
                    io.StringIO(), None, collections.Counter())
    old, fresh = batch(2, n=2)
    old.versions = np.where(old.mask > 0, 0, -1).astype(np.int32)
    fresh.versions = np.where(fresh.mask > 0, 2, -1).astype(np.int32)
    assert not adm.admit(old, version=3) and adm.admit(fresh, version=3)
    assert adm.counters["too_stale"] == 1
    # Tokens of a version the learner has not reached had lag < 0 and trained as perfectly fresh.
    future, _ = batch(2, n=2)
    future.versions = np.where(future.mask > 0, 2**31 - 1, -1).astype(np.int32)
    assert stal.try_admit(1) == 1
    assert not adm.admit(future, version=3) and adm.counters["future_versions"] == 1


def test_correction_config_is_checked():
    assert C.load(None, None, []).learner.correction.kind == "decoupled"  # the default: today's decoupled PPO
    with pytest.raises(C.ConfigError, match=re.escape("'retrace' is not one of decoupled | vtrace | tis | none")):
        C.load(None, None, ["learner.correction.kind=retrace"])
    with pytest.raises(C.ConfigError, match="needs a critic"):
        C.load(None, None, ["learner.correction.kind=vtrace", "learner.algo=grpo"])
    with pytest.raises(C.ConfigError, match=re.escape("learner.correction.tis_cap = 0.0: must be > 0")):
        C.load(None, None, ["learner.correction.tis_cap=0"])  # the field's bound (f(..., gt=0)) at load
    # A config built in code skips the loader: config_error (PPOTrainer's check) still says it.
    assert LearnerConfig(correction=CorrectionConfig(tis_cap=0)).config_error() == \
        "learner.correction.tis_cap must be > 0, got 0"
    pol, _ = models()
    with pytest.raises(ValueError, match="needs a critic"):
        PPOTrainer(pol, None, LearnerConfig(algo="grpo", correction=CorrectionConfig(kind="vtrace")), 0)
    text = C.help_text()
    assert "[learner.correction]" in text
    for f in dataclasses.fields(CorrectionConfig):
        assert f"learner.correction.{f.name} = " in text and f.metadata.get("help"), f.name


def _slow_behav_prox_kl(pol, trajs) -> float:
    """KL(pi_behav || pi_prox), k1 on the behaviour's tokens: each trajectory on its own through the weights before
    the update, summed token by token in float64."""
    total, n = 0.0, 0
    for t in trajs:
        b = collate([t])
        with torch.no_grad():
            prox = pol.logprobs_at(b.tokens, b.valid, b.mask).double()
        behav = b.behav_logp[0][b.mask[0] > 0].double()
        total += float((behav - prox).sum())
        n += len(prox)
    return total / n


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["fused", "single-unfused", "minibatches", "epochs"])
def test_behav_prox_kl_is_reported_and_right_in_every_mode(kind, mode):
    """Every correction and every update shape reports behav_prox_kl, and it is the slow reference's: tis and none
    use no pi_prox for their loss, yet the metric is the same KL of the same weights."""
    pol, critic = models()
    trajs = behaviour(pol, batch(2, n=8, max_len=24), shift=1.0)
    want = _slow_behav_prox_kl(pol, trajs)
    ppo = {"minibatches": {"minibatches": 2}, "epochs": {"epochs": 2}}.get(mode, {})
    p, c = copy.deepcopy(pol), copy.deepcopy(critic)
    tr = PPOTrainer(p, c, LearnerConfig(ppo=PPOConfig(**ppo), correction=CorrectionConfig(kind=kind)), 0)
    tr.fuse_single_pass = mode == "fused"
    m = tr.step(trajs, 3)
    assert m["rows_skipped"] == 0
    assert "behav_prox_kl" in m, (kind, mode)
    assert m["behav_prox_kl"] == pytest.approx(want, rel=1e-4, abs=1e-6), (kind, mode)
