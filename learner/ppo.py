"""One policy update from a batch of trajectories: PPO with a critic (or GRPO), read top to bottom.

    collate -> proximal logprobs (the weights before the update, when the correction uses them) -> critic values,
    and V of each truncated episode's final state -> advantages and value targets over generated tokens only
    (decoupled GAE, or V-trace; GRPO: group-centred returns) -> minibatch policy loss of learner.correction.kind with
    clip-higher -> clipped value loss

Behaviour logprobs come from the engine (per token, with the version that produced them); learner/correction.py
says how each correction uses them. Every estimator is a function of learner/algorithms.py (tested against slow
references); this module only decides which, on which tensors.
"""
from __future__ import annotations

import copy
import math
import time

import numpy as np
import torch

from learner import algorithms as A
from learner.batch import Batch, at, bootstrap_values, collate, length_chunks, live_rows, put, trained_rows
from learner.correction import importance_weight, needs_prox, policy_loss
from learner.device import autocast
from learner.distributed import Dist
from learner import fsdp as F
from learner.policy import TrainPolicy
from core.config import GREEDY_BELOW, LearnerConfig
from core.schema import Trajectory


def all_finite(*xs) -> bool:
    """Every figure (float, 0-d tensor, or None: skipped) finite."""
    return all(x is None or math.isfinite(float(x)) for x in xs)


def lr_lambda(warmup: int):
    return lambda step: min(1.0, (step + 1) / max(1, warmup))


class PPOTrainer:
    """The update on the device the policy's parameters are on (move the models there first: learner/main.py).

    amp_dtype=torch.bfloat16 runs the forward passes under autocast (learner/device.py); parameters, gradients,
    optimizer state and the loss math stay fp32. None (the default) is plain fp32.
    """

    def __init__(self, policy: TrainPolicy, critic: TrainPolicy | None, cfg: LearnerConfig, pad_id: int = 0, dist=None,
                 amp_dtype: torch.dtype | None = None, temperature: float = 1.0):
        if err := cfg.config_error():
            raise ValueError(err)
        self.policy, self.critic, self.cfg, self.pad_id = policy, critic, cfg, pad_id
        # The actors' sampling temperature (actor.temperature): the engine's behaviour logprobs are
        # log_softmax(logits / T), so pi_prox, pi_theta and pi_ref are the same tempered policy. Greedy (T under
        # GREEDY_BELOW, the engine's and SGLang's rule) reports T = 1 logprobs.
        self.temperature = float(temperature) if temperature >= GREEDY_BELOW else 1.0
        self.device = next(policy.parameters()).device
        self.amp_dtype = amp_dtype
        # Data parallel (learner/distributed.py): each rank backprops its share of the chunks, gradients summed.
        self.dist = dist if dist is not None else Dist()
        self.ref = None
        if cfg.ppo.kl_coef > 0:  # a frozen copy of the starting policy
            self.ref = copy.deepcopy(policy).eval().requires_grad_(False)
        # learner.parallel=fsdp on several ranks (learner/fsdp.py): the models are sharded in place before the
        # optimizers are built on their (sharded) parameters; FSDP reduces the gradients, not allreduce_grads.
        self.fsdp = cfg.parallel == "fsdp" and self.dist.world > 1
        if self.fsdp:
            for model in (policy, critic, self.ref):
                if model is not None:
                    F.shard(model, self.dist.world, self.device)
        # Frozen parameters (model.freeze_vision: the vision tower) are not in the optimisers.
        self.opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg.warmup_steps))
        self.critic_opt = None
        if critic is not None:
            self.critic_opt = torch.optim.AdamW([p for p in critic.parameters() if p.requires_grad], lr=cfg.critic_lr,
                                                weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
        self.updates = 0
        self.entropy_coef = cfg.ppo.entropy_coef  # adapted after each update when cfg.ppo.target_entropy > 0
        self.chunk_tokens = 4096  # padded tokens per forward chunk
        # One epoch of one minibatch on one process: the weights before the update are the weights of the training
        # forward, so pi_prox is that forward's logprobs (detached) and the critic's values its own forward's;
        # the two no-grad passes are skipped (a quarter of the update's compute). Same gradients, tested.
        self.fuse_single_pass = True

    def _my_chunks(self, chunks: list) -> list[tuple[torch.Tensor, bool]]:
        """This rank's chunks, each with whether it counts. Under FSDP every rank must run as many forward / backward
        calls as the others (each one all-gathers and reduce-scatters): a rank short of one runs a chunk again with
        weight 0 (its gradient adds nothing, its figures are not counted)."""
        mine = [(c, True) for c in self.dist.shard(chunks)]
        if self.fsdp and chunks:
            mine += [(chunks[0], False)] * (-(-len(chunks) // self.dist.world) - len(mine))
        return mine

    def _reduce_and_clip(self, model) -> float:
        """The gradients of `model` summed over the ranks (by hand, or FSDP's reduce-scatter already did), clipped to
        learner.grad_clip by their global norm -> that norm (the same on every rank)."""
        if not self.fsdp:
            self.dist.allreduce_grads(model.parameters())
        return float(F.full(torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.grad_clip)))

    # ---- advantages ----------------------------------------------------------------------------------------
    def advantages(self, b: Batch, values: torch.Tensor | None, prox: torch.Tensor | None):
        """(advantages, value targets) [B, T]. values: the critic's before the update, at the generated positions and
        each truncated row's bootstrap position; prox: pi_prox (V-trace's target policy)."""
        cfg = self.cfg
        if cfg.algo == "grpo" or values is None:
            # Centred within the group, not divided by its std (Dr. GRPO); the batch-level scaling sets the size.
            # No critic to value a cut-off episode's last state: learner.ppo.truncated_value stands in for it.
            rets = b.returns
            if cfg.ppo.truncated_value:
                rets = rets + cfg.ppo.truncated_value * b.truncated.to(rets.dtype)
            adv = A.grouped_advantages(rets, b.groups, std_norm=False)[:, None] * b.mask
            return adv, torch.zeros_like(adv)
        boot = bootstrap_values(values, b.boot)  # 0 for terminated rows
        if cfg.correction.kind == "vtrace":
            c = cfg.correction
            return A.masked_vtrace(b.behav_logp, prox, b.rewards, values, b.mask, cfg.ppo.gamma, boot, c.rho_bar,
                                   c.c_bar)
        lam = cfg.ppo.lam_policy
        if cfg.ppo.length_adaptive:
            mean_len = float(b.mask.sum(1).mean())
            lam = A.length_adaptive_lambda(mean_len, cfg.ppo.length_alpha)
        return A.decoupled_gae(b.rewards, values, b.mask, cfg.ppo.gamma, lam, cfg.ppo.lam_critic, boot)

    # ---- the update ----------------------------------------------------------------------------------------
    def _forward_old(self, b: Batch, chunks, with_prox: bool = True):
        """pi_prox (when asked for) at every generated token and V at every generated and bootstrap position, with
        the weights before this update -> [B, T] each (None for what is not computed)."""
        prox = torch.zeros_like(b.behav_logp) if with_prox else None
        values = torch.zeros_like(b.behav_logp) if self.critic is not None else None
        with torch.no_grad(), autocast(self.device, self.amp_dtype):
            for c in chunks:
                T = int(b.widths[c].max())
                c = c.to(self.device)  # a no-op on the CPU
                tok, val, msk = b.tokens[c, :T], b.valid[c, :T], b.mask[c, :T]
                if prox is not None:
                    lp = self.policy.logprobs_at(tok, val, msk, vl=b.vl(c), temperature=self.temperature)
                    prox[c, :T] = put(lp, msk, msk)  # fp32: logits are upcast
                if values is not None:
                    vm = msk + b.boot[c, :T]  # the generated positions and the bootstrap position
                    values[c, :T] = put(self.critic.values_at(tok, val, vm, vl=b.vl(c)).float(), vm, vm)
        return prox, values

    def _critic_pass(self, b: Batch, chunks) -> tuple[torch.Tensor, dict]:
        """Fused mode: the critic's forward with gradients, its value loss backpropagated chunk by chunk (each chunk's
        targets need only its own rows), and its values (before the update) for the advantages -> ([B, T], sums)."""
        cfg, dev, amp = self.cfg, self.device, self.amp_dtype
        values = torch.zeros_like(b.behav_logp)
        n_tok = float(b.mask.sum().clamp(min=1))
        self.critic.train()
        self.critic_opt.zero_grad(set_to_none=True)
        v_loss = 0.0
        for c in chunks:
            T = int(b.widths[c].max())
            c = c.to(dev)
            tok, val, msk, bt = b.tokens[c, :T], b.valid[c, :T], b.mask[c, :T], b.boot[c, :T]
            vm = msk + bt  # the generated positions and the bootstrap position
            with autocast(dev, amp):
                v_all = self.critic.values_at(tok, val, vm, vl=b.vl(c)).float()
            values[c, :T] = put(v_all.detach(), vm, vm)
            v = v_all[at(msk, vm) > 0]  # the generated positions': the value loss trains those only
            _, tg = A.masked_gae(b.rewards[c, :T], values[c, :T], msk, cfg.ppo.gamma, cfg.ppo.lam_critic,
                                 bootstrap_values(values[c, :T], bt))
            w = float(msk.sum()) / n_tok
            vl = A.clipped_value_loss(v, v.detach(), at(tg, msk), torch.ones_like(v), cfg.ppo.value_clip)
            (vl * w).backward()
            v_loss += w * float(vl.detach())
        return values, {"v_loss": v_loss}

    def step(self, trajs: list[Trajectory], version: int) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        b = collate(trajs, self.pad_id, getattr(self.policy, "vl", None)).to(self.device)
        lengths = b.widths  # on the CPU: chunking is decided on the host
        dev, amp = self.device, self.amp_dtype
        self.policy.eval()
        has_tok = trained_rows(b.mask)  # the rows with a trained token: the others add nothing to any loss
        chunks = length_chunks(lengths, torch.arange(len(trajs))[has_tok], self.chunk_tokens)
        # V-trace needs pi_prox for its advantages before the policy's training forward: no single pass for it.
        single = cfg.ppo.epochs == 1 and cfg.ppo.minibatches <= 1  # the training forward has the weights before the update
        fused = self.fuse_single_pass and single and self.dist.world == 1 and cfg.correction.kind != "vtrace"
        use_prox = needs_prox(cfg)  # tis and none use no pi_prox in their loss; their behav_prox_kl metric does
        critic_sums = {}
        if fused:
            prox = None  # taken from the training forward below, where a correction uses it
            values = None
            if self.critic is not None:
                values, critic_sums = self._critic_pass(b, chunks)
        else:
            # pi_prox for the loss, or for the metric alone where the training forward's weights will have moved
            prox, values = self._forward_old(b, chunks, with_prox=use_prox or not single)
        adv, targets = self.advantages(b, values, prox)
        if cfg.ppo.adv_norm:
            adv = A.masked_scale(adv, b.mask)
        if cfg.ppo.neg_adv_weight != 1.0:
            adv = A.asymmetric_advantages(adv, cfg.ppo.neg_adv_weight)
        # The entropy bonus and the KL anchor are loss terms too: their gradient is not 0 on a batch without advantage.
        has_signal = bool((adv * b.mask).abs().max() > 0) or self.entropy_coef > 0 or self.ref is not None
        live = self._rows_with_signal(adv, b.mask)
        run_mask = b.mask if live is None else b.mask * live.to(b.mask.device)[:, None]  # the rows trained
        stale = (version - b.versions).clamp(min=0).float()
        m = {"tokens": int(b.mask.sum()), "staleness_mean": float(A.masked_mean(stale, b.mask)),
             "bootstrapped": int(b.boot.sum()), "rows_skipped": int((~live).sum()) if live is not None else 0,
             "truncated": int(b.truncated.sum())}
        if prox is not None:  # KL(pi_behav || pi_prox), k1 on the behaviour's own tokens of the rows trained
            m["behav_prox_kl"] = float(A.masked_mean(A.kl_k1(b.behav_logp, prox), run_mask))
        kl_sum = 0.0
        iw_sums = [0.0, 0.0]  # importance ratio and weight summed over the first epoch's tokens (this rank's share)
        self.policy.train()
        B = len(trajs)
        stats: dict[str, list[float]] = {"pg_loss": [], "clipfrac": [], "entropy": [], "v_loss": [], "grad_norm": [], "kl_ref": []}
        nonfinite = 0  # minibatch steps skipped for a non-finite loss or gradient
        for epoch in range(cfg.ppo.epochs):
            perm = torch.randperm(B) if cfg.ppo.minibatches > 1 else torch.arange(B)
            for idx in perm.chunk(max(1, cfg.ppo.minibatches)):
                n_tok = float(b.mask[idx.to(dev)].sum().clamp(min=1))
                # Rows without signal add 0 to the gradient: not run, but their tokens stay in the normaliser n_tok.
                idx = live_rows(idx[has_tok[idx]], live)
                n_run = float(b.mask[idx.to(dev)].sum().clamp(min=1))
                self.opt.zero_grad(set_to_none=True)
                if self.critic is not None and not fused:  # fused: the critic's gradients are already in place
                    self.critic_opt.zero_grad(set_to_none=True)
                sums = {"pg_loss": 0.0, "clipfrac": 0.0, "entropy": 0.0, "v_loss": critic_sums.get("v_loss", 0.0)}
                if self.ref is not None:  # the same keys on every rank, whether or not it holds a chunk
                    sums["kl_ref"] = 0.0
                # Length-bucketed chunks with gradient accumulation: the same gradient as one padded batch
                # (each chunk's token-mean loss weighted by its share of the minibatch's tokens), less padding.
                for c, counts in self._my_chunks(length_chunks(lengths, idx, self.chunk_tokens)):
                    T = int(lengths[c].max())
                    c = c.to(dev)
                    tok, val, msk = b.tokens[c, :T], b.valid[c, :T], b.mask[c, :T]
                    w = float(msk.sum()) / n_tok if counts else 0.0
                    wm = float(msk.sum()) / n_run if counts else 0.0  # the figures: means over the rows run
                    # Forward passes under autocast (bf16 when asked); the loss below is fp32 math on fp32 logprobs.
                    with autocast(dev, amp):
                        logp, ent = self.policy.logprobs_at(tok, val, msk, with_entropy=True, vl=b.vl(c),
                                                            temperature=self.temperature)
                    ones = torch.ones_like(logp)
                    behav = at(b.behav_logp[c, :T], msk)
                    p_prox = None  # tis and none use no proximal policy
                    if prox is not None and use_prox:
                        p_prox = at(prox[c, :T], msk)
                    elif prox is None and counts:  # one pass: this forward's weights are the weights before the update
                        kl_sum += float(A.kl_k1(behav, logp.detach()).sum())
                        if fused:
                            p_prox = logp.detach()
                    if epoch == 0 and counts:  # vs pi_prox where there is one; tis and none: this first-epoch forward's
                        ratio, weight = importance_weight(cfg, logp.detach() if p_prox is None else p_prox, behav)
                        iw_sums[0] += float(ratio.sum())
                        iw_sums[1] += float(weight.sum())
                    loss, cut = policy_loss(cfg, logp, p_prox, behav, at(adv[c, :T], msk))
                    if self.entropy_coef:
                        loss = loss - self.entropy_coef * ent.mean()
                    if self.ref is not None:
                        with torch.no_grad(), autocast(dev, amp):
                            ref = self.ref.logprobs_at(tok, val, msk, vl=b.vl(c), temperature=self.temperature)
                        kl = A.kl_k3(logp, ref)
                        loss = loss + cfg.ppo.kl_coef * kl.mean()
                        if counts:
                            sums["kl_ref"] = sums.get("kl_ref", 0.0) + w * float(kl.detach().mean())
                    (loss * w).backward()
                    if counts:
                        sums["clipfrac"] += wm * float(cut.float().mean())
                        sums["pg_loss"] += w * float(loss.detach())
                        sums["entropy"] += wm * float(ent.detach().mean())
                    if self.critic is not None and not fused:
                        with autocast(dev, amp):
                            v = self.critic.values_at(tok, val, msk, vl=b.vl(c))
                        vl = A.clipped_value_loss(v.float(), at(values[c, :T], msk), at(targets[c, :T], msk), ones, cfg.ppo.value_clip)
                        (vl * w).backward()
                        if counts:
                            sums["v_loss"] += w * float(vl.detach())
                gn = self._reduce_and_clip(self.policy)
                cgn = self._reduce_and_clip(self.critic) if self.critic is not None else None
                # Metrics of the whole minibatch, and whether any rank saw a non-finite figure: one collective, so
                # every rank decides the same way whether to step.
                *totals, bad = self.dist.sum_floats(list(sums.values()) + [float(not all_finite(*sums.values(), gn, cgn))])
                if bad or not all_finite(*totals, gn, cgn):
                    # A NaN / inf loss or gradient (policy or critic): neither optimiser steps, or it would sit in the
                    # weights and Adam's moments for good and every later update would be NaN too.
                    nonfinite += 1
                    continue
                if has_signal:  # Adam's momentum would still move the weights on a batch with no advantage signal
                    self.opt.step()
                if self.critic is not None:
                    self.critic_opt.step()
                for k, v in zip(sums, totals):
                    stats.setdefault(k, []).append(v)
                stats["grad_norm"].append(float(gn))
        run_tok = int(run_mask.sum())  # the first epoch's tokens
        # No row trained (all skipped for zero advantage): an empty mean is 0, as masked_mean reports it, and as
        # the ranks report it (the fused pass may still have run rows; their sums are not a mean over run_mask).
        ratio_sum, weight_sum, kl_sum = self.dist.sum_floats([*iw_sums, kl_sum])
        if prox is None:  # from the training forward (this rank's chunks, summed over the ranks)
            m["behav_prox_kl"] = kl_sum / run_tok if run_tok else 0.0
        m["is_ratio_mean"] = ratio_sum / run_tok if run_tok else 0.0
        m["is_weight_mean"] = weight_sum / run_tok if run_tok else 0.0
        self.sched.step()
        self.updates += 1
        if cfg.ppo.target_entropy > 0 and stats["entropy"]:
            # Dual ascent on "entropy >= target" (as SAC's temperature): the bonus grows while the policy is below
            # the target and decays back to 0 once it is above, so it acts only against a collapse.
            ent = float(np.mean(stats["entropy"]))
            self.entropy_coef = float(min(cfg.ppo.entropy_coef_max,
                                          max(0.0, self.entropy_coef + cfg.ppo.entropy_coef_lr * (cfg.ppo.target_entropy - ent))))
        m["entropy_coef"] = self.entropy_coef
        self.policy.eval()
        m.update({k: float(np.mean(v)) for k, v in stats.items() if v})
        if values is not None:
            m["explained_variance"] = float(A.explained_variance(values, targets, b.mask))
        m["update_s"] = time.perf_counter() - t0
        m["policy_step_skipped"] = not has_signal or nonfinite > 0
        m["nonfinite_steps"] = nonfinite
        m["lr"] = self.sched.get_last_lr()[0]
        return m

    def _rows_with_signal(self, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """[B] bool: the rows whose gradient can be non-zero; None = every row (a critic, a reference KL, an entropy
        term or its adaptation reads every row, or learner.ppo.skip_zero_adv is off). Every policy loss here is
        linear in the advantage, so a row with advantage 0 at all its tokens contributes exactly 0."""
        p = self.cfg.ppo
        if not p.skip_zero_adv or self.critic is not None or self.ref is not None or self.entropy_coef > 0 \
                or p.target_entropy > 0:
            return None
        return ((adv * mask).abs().amax(1) > 0).cpu()

    def value_pretrain_step(self, trajs: list[Trajectory]) -> dict:
        """Critic only, Monte Carlo targets (lambda = 1), the policy untouched (value pretraining)."""
        b = collate(trajs, self.pad_id, getattr(self.policy, "vl", None)).to(self.device)
        lengths = b.widths
        chunks = length_chunks(lengths, torch.arange(len(trajs))[trained_rows(b.mask)], self.chunk_tokens)
        _, old = self._forward_old(b, chunks, with_prox=False)
        _, targets = A.decoupled_gae(b.rewards, old, b.mask, self.cfg.ppo.gamma, 1.0, 1.0,
                                     bootstrap_values(old, b.boot))
        n_tok = float(b.mask.sum().clamp(min=1))
        self.critic_opt.zero_grad(set_to_none=True)
        total = 0.0
        for c, counts in self._my_chunks(chunks):
            T = int(lengths[c].max())
            c = c.to(self.device)
            tok, val, msk = b.tokens[c, :T], b.valid[c, :T], b.mask[c, :T]
            with autocast(self.device, self.amp_dtype):
                v = self.critic.values_at(tok, val, msk, vl=b.vl(c)).float()
            vl = 0.5 * ((v - at(targets[c, :T], msk)) ** 2).mean()
            w = float(msk.sum()) / n_tok if counts else 0.0
            (vl * w).backward()
            if counts:
                total += w * float(vl.detach())
        gn = self._reduce_and_clip(self.critic)
        total, bad = self.dist.sum_floats([total, float(not all_finite(total, gn))])
        finite = not bad and all_finite(total, gn)
        if finite:  # a non-finite loss or gradient would stay in the critic for good
            self.critic_opt.step()
        return {"v_loss": total, "explained_variance": float(A.explained_variance(old, targets, b.mask)),
                "nonfinite_steps": int(not finite)}


def sft_loss(policy: TrainPolicy, tokens: torch.Tensor, valid: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-level cross-entropy over the masked (answer) tokens."""
    return -policy.logprobs_at(tokens, valid, mask).mean()
