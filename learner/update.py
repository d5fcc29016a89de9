"""The update step driver: value pretraining (critic only) first when configured, then policy updates; and the
per-batch figures the learner logs with each version."""
from __future__ import annotations

import collections
import math

import numpy as np

from core import telemetry
from core.config_learner import LearnerConfig

EV_WINDOW = 10


def value_pretrain_done(evs: list[float], threshold: float, window: int = EV_WINDOW) -> bool:
    """Value pretraining stops early on the mean explained variance of the last `window` batches, not on one batch:
    a 64-trajectory batch's figure is noisy (one passed 0.5 at update 50 of a quickstart run whose last 10 batches
    averaged 0.28)."""
    return len(evs) >= window and sum(evs[-window:]) / window >= threshold


class Updater:
    """One update per batch, the same branch on every rank (explained variance is a whole-batch figure)."""

    def __init__(self, trainer, cfg: LearnerConfig):
        self.trainer = trainer
        self.phase = "ppo" if trainer.critic is not None else "grpo"  # a critic exists with algo=ppo only
        # Restored from a checkpoint on resume. Without a critic (algo=grpo) there is nothing to pretrain: a preset's
        # value_pretrain.steps under --set learner.algo=grpo would otherwise fail the first update.
        self.value_pretrain_left = cfg.value_pretrain.steps if trainer.critic is not None else 0
        self.target_ev = cfg.value_pretrain.target_ev
        self.evs: collections.deque[float] = collections.deque(maxlen=EV_WINDOW)

    def update(self, batch, version: int) -> dict:
        if self.value_pretrain_left > 0:  # critic only; the policy (and so the behaviour) is unchanged
            m = self.trainer.value_pretrain_step(batch)
            self.value_pretrain_left -= 1
            if math.isfinite(m["explained_variance"]):  # a skipped, non-finite step says nothing of the critic
                self.evs.append(m["explained_variance"])
            if value_pretrain_done(list(self.evs), self.target_ev):
                self.value_pretrain_left = 0
            m["phase"] = "value_pretrain"
        else:
            m = self.trainer.step(batch, version)
            m["phase"] = self.phase
        return m


def generated_versions(tr) -> np.ndarray:
    """The policy version of each generated (trained) token of a trajectory."""
    return tr.versions[tr.mask.astype(bool)]


def record_staleness(batch, version: int, staleness, hist) -> None:
    """Per trained token, train version - the version that generated it: into the staleness manager's histogram
    and the OTel histogram `tars.token_staleness`."""
    for tr in batch:
        gen = generated_versions(tr)
        staleness.record_staleness(gen, version)
        if telemetry.S.metrics:
            for lag, n in zip(*np.unique(version - gen[gen >= 0], return_counts=True)):
                for _ in range(int(n)):  # OTel histograms take one value per call
                    hist.record(int(lag))


def batch_figures(batch, version: int) -> dict:
    """What the learner logs about the batch it trained version `version` on (learner.jsonl)."""
    return dict(success=float(np.mean([tr.success for tr in batch])), ret=float(np.mean([tr.ret for tr in batch])),
                max_staleness=int(max(version - 1 - int(generated_versions(tr).min(initial=version - 1))
                                      for tr in batch)))
