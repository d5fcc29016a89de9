"""learner.correction: how the policy loss treats tokens that older weights generated (docs/learner.md, "Corrections").

pi_behav is the engine's logprob of each token (the weights that generated it, possibly several versions old),
pi_prox the learner's weights before this update (recomputed, or this update's own forward when it is a single pass),
pi_theta the weights being trained.

    decoupled  AReaL's decoupled PPO: clip pi_theta / pi_prox, weight min(pi_prox / pi_behav, learner.ppo.behav_cap)
    vtrace     IMPALA: the advantages are V-trace's, rho_t = min(rho_bar, pi_prox / pi_behav) already inside them
               (PPOTrainer.advantages); clip pi_theta / pi_prox, no second weight
    tis        truncated importance sampling: no pi_prox, no clip; gradient weight min(pi_theta / pi_behav, tis_cap)
    none       plain PPO: clip pi_theta / pi_behav (pi_old = pi_behav), no pi_prox

Only which function of learner/algorithms.py is called, and with which old policy, is decided here.

The learner logs, per update (learner.jsonl): is_ratio_mean, the mean of pi_learner / pi_behav over the generated
tokens (how far the behaviour policy is from the learner's weights before the update), and is_weight_mean, the mean
of the importance weight the correction puts on them (importance_weight below).
"""
from __future__ import annotations

import math

import torch

from learner import algorithms as A
from core.config_learner import LearnerConfig

# Whether the correction needs pi_prox, the learner's logprobs before the update (a no-grad policy pass unless the
# update is a single pass).
NEEDS_PROX = {"decoupled": True, "vtrace": True, "tis": False, "none": False}


def needs_prox(cfg: LearnerConfig) -> bool:
    return NEEDS_PROX[cfg.correction.kind]


def policy_loss(cfg: LearnerConfig, logp: torch.Tensor, prox: torch.Tensor | None, behav: torch.Tensor,
                adv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy loss over one chunk's generated tokens (all [N]: logp with gradient, prox None where the kind does
    not use it) and which tokens the clip or the cap cut ([N] bool, for the clipfrac metric)."""
    kind, p = cfg.correction.kind, cfg.ppo
    ones = torch.ones_like(logp)
    if kind == "tis":
        cap = cfg.correction.tis_cap
        with torch.no_grad():
            cut = (logp - behav) > math.log(cap)
        return A.tis_pg_loss(logp, behav, adv, ones, cap), cut
    if kind == "decoupled":
        old, weight_from, cap = prox, behav, p.behav_cap
    elif kind == "vtrace":
        old, weight_from, cap = prox, prox, None  # rho is inside V-trace's advantages: a weight of 1 here
    else:  # none: PPO as if the behaviour policy were the one before the update
        old, weight_from, cap = behav, behav, None
    loss = A.decoupled_ppo_loss(logp, old, weight_from, adv, ones, p.eps_low, p.eps_high, cap)
    with torch.no_grad():
        ratio = torch.exp(logp - old)
        cut = (ratio > 1 + p.eps_high) | (ratio < 1 - p.eps_low)
    return loss, cut


MAX_LOG_RATIO = 20.0  # a logged ratio is at most e^20, so a metric never overflows to inf


def importance_weight(cfg: LearnerConfig, learner: torch.Tensor,
                      behav: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pi_learner / pi_behav, the weight the correction puts on the token) for generated tokens [N], where
    pi_learner is the learner's logprob before the update (pi_prox; under tis and none, which have none, the first
    epoch's training forward's: the weights before the update in its first minibatch): decoupled
    min(ratio, behav_cap), vtrace rho = min(ratio, rho_bar), tis min(ratio, tis_cap), none 1 (no correction).
    For the logs; the losses apply their own weights (learner/algorithms.py)."""
    ratio = torch.exp((learner - behav).clamp(max=MAX_LOG_RATIO))
    kind, c = cfg.correction.kind, cfg.correction
    cap = {"decoupled": cfg.ppo.behav_cap, "vtrace": c.rho_bar, "tis": c.tis_cap}.get(kind)
    return ratio, (ratio.clamp(max=cap) if cap is not None else torch.ones_like(ratio))
