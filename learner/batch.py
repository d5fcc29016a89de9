"""A batch of trajectories as padded tensors, and the indexing between [B, T] tensors and the generated tokens.

Token t of a row is an MDP step when mask[t] = 1 (the policy generated it); the critic's value "at t" is
V(tokens[:t]), the state before token t (learner.policy.TrainPolicy.values_at). A truncated episode also carries the
state it was cut in (core/schema.py, `boot_at`): `boot` marks the position t = boot_at whose V(tokens[:boot_at])
bootstraps its return. That position is one past the row's last token when the actor appended the final prompt there,
so a row may need one column more than it has tokens: `widths` says how many columns each row needs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from core.outcome import Outcome
from core.schema import Trajectory, turn_rewards


@dataclass
class Batch:
    tokens: torch.Tensor      # [B, T] long
    valid: torch.Tensor       # [B, T] bool (False = right padding)
    mask: torch.Tensor        # [B, T] float, 1 = generated token (trained on)
    behav_logp: torch.Tensor  # [B, T]
    versions: torch.Tensor    # [B, T] long, -1 where not generated
    rewards: torch.Tensor     # [B, T] turn rewards on the last generated token of each turn
    returns: torch.Tensor     # [B] episode return
    boot: torch.Tensor        # [B, T] float, 1 at the bootstrap position of a truncated row (at most one per row)
    widths: torch.Tensor      # [B] long, on the CPU: columns each row needs (tokens, and its bootstrap position)
    groups: list[str]
    ids: list[str]

    def to(self, device: torch.device) -> "Batch":
        """The tensors on `device` (the same Batch when it is already there: the CPU path copies nothing). `widths`
        stays on the CPU: chunking is decided on the host."""
        names = ("tokens", "valid", "mask", "behav_logp", "versions", "rewards", "returns", "boot")
        return Batch(**{k: getattr(self, k).to(device) for k in names}, widths=self.widths, groups=self.groups,
                     ids=self.ids)


def boot_position(tr: Trajectory) -> int:
    """The position whose value bootstraps `tr`'s return: boot_at for a truncated trajectory that carries its final
    state, else 0 (none: a terminated episode is worth nothing after its end)."""
    return tr.boot_at if tr.outcome == Outcome.TRUNCATED else 0


def collate(trajs: list[Trajectory], pad_id: int = 0) -> Batch:
    boots = [boot_position(t) for t in trajs]
    widths = [max(len(t.tokens), p + 1 if p else 0) for t, p in zip(trajs, boots)]
    B, T = len(trajs), max(widths)
    tokens = torch.full((B, T), pad_id, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    mask = torch.zeros(B, T)
    behav = torch.zeros(B, T)
    versions = torch.full((B, T), -1, dtype=torch.long)
    rewards = torch.zeros(B, T)
    boot = torch.zeros(B, T)
    for i, t in enumerate(trajs):
        n = len(t.tokens)
        tokens[i, :n] = torch.from_numpy(t.tokens.astype(np.int64))
        valid[i, :n] = True
        mask[i, :n] = torch.from_numpy(t.mask.astype(np.float32))
        behav[i, :n] = torch.from_numpy(t.logprobs.astype(np.float32))
        versions[i, :n] = torch.from_numpy(t.versions.astype(np.int64))
        rewards[i, :n] = torch.from_numpy(turn_rewards(t))
        if boots[i]:
            boot[i, boots[i]] = 1.0
    mask[:, 0] = 0.0  # the first token has no prefix to be predicted from
    rets = torch.tensor([t.ret for t in trajs], dtype=torch.float32)
    return Batch(tokens, valid, mask, behav, versions, rewards, rets, boot, torch.tensor(widths, dtype=torch.long),
                 [t.group or t.id for t in trajs], [t.id for t in trajs])


def at(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x [B, T] read at the positions t >= 1 of mask -> [N], in the order logprobs_at / values_at use."""
    return x[:, 1:][mask[:, 1:] > 0]


def put(values: torch.Tensor, mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Inverse of `at`: [N] -> [B, T], zeros elsewhere."""
    out = torch.zeros_like(like, dtype=values.dtype)
    out[:, 1:][mask[:, 1:] > 0] = values
    return out


def bootstrap_values(values: torch.Tensor, boot: torch.Tensor) -> torch.Tensor:
    """values [B, T] (the critic's, read at the generated and the bootstrap positions) -> [B]: V of each truncated
    row's final state, 0 for every other row (a terminated episode bootstraps nothing)."""
    return (values * boot).sum(1)


def length_chunks(lengths: torch.Tensor, idx: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
    """Split trajectory indices into chunks of similar length so a padded chunk holds <= max_tokens tokens."""
    order = idx[torch.argsort(lengths[idx], descending=True)]
    chunks, cur, cur_max = [], [], 0
    for i in order.tolist():
        L = int(lengths[i])
        if cur and max(cur_max, L) * (len(cur) + 1) > max_tokens:
            chunks.append(torch.tensor(cur))
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, L)
    if cur:
        chunks.append(torch.tensor(cur))
    return chunks
