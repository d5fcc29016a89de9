"""A batch of trajectories as padded tensors, and the indexing between [B, T] tensors and the generated tokens.

Token t of a row is an MDP step when mask[t] = 1 (the policy generated it); the critic's value "at t" is
V(tokens[:t]), the state before token t (learner.policy.TrainPolicy.values_at). A truncated episode also carries the
state it was cut in (core/schema.py, `boot_at`): `boot` marks the position t = boot_at whose V(tokens[:boot_at])
bootstraps its return. That position is one past the row's last token when the actor appended the final prompt there,
so a row may need one column more than it has tokens: `widths` says how many columns each row needs.

A vision-language trajectory (core/schema.py `segments`, `image_refs`; a VL checkpoint, core/vlm.py) also gets a
RowImages: where each of its independent sequences starts and the pixel_values / image_grid_thw of the images bound
to that segment's framed runs, in token order (the contract's rule 3: TrainPolicy computes each segment as its own
sequence with its own images). A segment's first token, like a row's, has no prefix: it is never trained on.
A vision token the policy sampled (the last generated token of its episode, actor/episode.py) is no run: RowImages
lists it in `stray`, the model's input takes the padding id there, its target (the logprob taken) is the real id.
Text trajectories have none (`images` is None for an all-text batch) and take the text path unchanged.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np
import torch

from core.outcome import Outcome
from core.schema import Trajectory, group_key, trained_positions, turn_rewards
from core.vlm import image_runs


@dataclass
class RowImages:
    """One VL row: segment starts (0 first) and, per segment, (pixel_values [P, D] f32, image_grid_thw [n, 3] long)
    of its runs' images in token order, on the CPU (moved where the forward runs); None for a segment without
    images (every segment of a text row: text_segments)."""
    starts: list[int]
    pixels: list[tuple[torch.Tensor, torch.Tensor] | None]
    stray: list[int] = field(default_factory=list)  # positions of vision tokens the policy sampled (embedded as padding)


def stray_positions(tokens: np.ndarray, mask, spec) -> list[int]:
    """Positions of the vision special tokens (spec.special_ids) that the policy sampled (mask 1): never part of a
    framed run (the actor stops generation on them and ends the episode there, actor/episode.py)."""
    if mask is None:
        return []
    gen = np.asarray(mask) > 0
    return np.flatnonzero(gen & np.isin(np.asarray(tokens), spec.special_ids)).tolist()


def row_images(tokens: np.ndarray, segments, image_refs, images: dict, spec, cache: dict | None = None,
               what: str = "trajectory", pixels: bool = True, mask=None) -> RowImages:
    """A VL sequence's RowImages; ValueError (naming `what`) unless every framed run is bound to exactly one image
    whose processed grid gives that run's pad count (the contract's rule 1) and no run crosses a segment start.
    cache: sha -> (pixel_values, image_grid_thw), shared across the rows of a batch. pixels=False: the checks only
    (the pad counts from the images' sizes, no pixel processing); the RowImages then has no pixels.

    mask: the generated tokens. A vision token the policy sampled is no run: the model's input takes the padding id
    there (TrainPolicy._segment_hidden), its target stays the real id. That is exact only as the last generated token
    (nothing trained attends to it), which is where the actor ends such an episode; anywhere else is a ValueError.

    spec None (a text checkpoint): the segments alone (text_segments); a ValueError if there are images."""
    from core.vlm import png_size

    if spec is None:
        if image_refs:
            raise ValueError(f"{what} carries images but the model is not a vision-language checkpoint")
        return text_segments(segments)
    cache = {} if cache is None else cache
    stray = stray_positions(tokens, mask, spec)
    if stray:
        last = int(np.flatnonzero(np.asarray(mask) > 0)[-1])
        if stray != [last]:
            raise ValueError(f"{what}: the vision token the model wrote at {stray[0]} is not its last generated "
                             f"token ({last}): the conversation went on past it")
        tokens = np.array(tokens, copy=True)
        tokens[stray[0]] = -1
    starts = [0, *[int(s) for s in segments]]
    runs = image_runs(tokens, spec.image_token_id)
    if len(runs) != len(image_refs):
        raise ValueError(f"{what}: {len(runs)} framed image runs but {len(image_refs)} image_refs")
    per_seg: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in starts]
    for (a, b), ref in zip(runs, image_refs):
        k = bisect.bisect_right(starts, a) - 1
        if k + 1 < len(starts) and b > starts[k + 1]:
            raise ValueError(f"{what}: the image run at [{a}, {b}) crosses the segment start {starts[k + 1]}")
        if a == 0 or tokens[a - 1] != spec.vision_start_token_id or b >= len(tokens) or \
                tokens[b] != spec.vision_end_token_id:
            raise ValueError(f"{what}: the image run at [{a}, {b}) is not framed by <|vision_start|> ... "
                             "<|vision_end|>")
        png = images.get(ref)
        if png is None:
            raise ValueError(f"{what}: image {ref[:12]}... is referenced but its bytes are missing")
        if not pixels:
            want = spec.image_tokens(*png_size(png))
            if b - a != want:
                raise ValueError(f"{what}: the image run at [{a}, {b}) has {b - a} pads, its image takes {want}")
            continue
        if ref not in cache:
            cache[ref] = spec.pixels([png])
        pv, thw = cache[ref]
        want = int(thw.prod()) // spec.merge_size ** 2
        if b - a != want:
            raise ValueError(f"{what}: the image run at [{a}, {b}) has {b - a} pads, its image takes {want}")
        per_seg[k].append((pv, thw))
    pixels = []
    for ims in per_seg:
        if ims:
            pixels.append((torch.cat([pv for pv, _ in ims]), torch.cat([thw for _, thw in ims])))
        else:
            pixels.append(None)
    return RowImages(starts, pixels, stray)


def text_segments(segments) -> RowImages:
    """A text row's independent segments (a conversation windowed at the context, actor/episode.py): no images."""
    starts = [0, *[int(s) for s in segments]]
    return RowImages(starts, [None] * len(starts))


def _needs_rows(tr: Trajectory, spec) -> bool:
    """Whether a trajectory's row needs a RowImages: it has segments, images, or a vision token the policy sampled."""
    return bool(tr.segments or tr.image_refs or (spec is not None and stray_positions(tr.tokens, tr.mask, spec)))


def binding_error(tr: Trajectory, spec) -> str | None:
    """Why a trajectory's images cannot be bound for training (row_images' checks, without the pixels), or None
    (they can, or it has none). The learner keeps such a trajectory out of the loss instead of failing an update."""
    if not _needs_rows(tr, spec):
        return None
    try:
        row_images(tr.tokens, tr.segments, tr.image_refs, tr.images, spec, pixels=False, mask=tr.mask)
    except ValueError as e:
        return str(e)
    return None


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
    truncated: torch.Tensor   # [B] bool: a limit cut the episode (Outcome.TRUNCATED), with or without a boot position
    widths: torch.Tensor      # [B] long, on the CPU: columns each row needs (tokens, and its bootstrap position)
    groups: list              # [B] core.schema.group_key of each row: (actor, group), or the id of an ungrouped one
    ids: list[str]
    images: list[RowImages | None] | None = field(default=None)  # VL rows (module doc); None: an all-text batch

    def to(self, device: torch.device) -> "Batch":
        """The tensors on `device` (the same Batch when it is already there: the CPU path copies nothing). `widths`
        stays on the CPU: chunking is decided on the host; so do the images (moved by the forward that takes them)."""
        names = ("tokens", "valid", "mask", "behav_logp", "versions", "rewards", "returns", "boot", "truncated")
        return Batch(**{k: getattr(self, k).to(device) for k in names}, widths=self.widths, groups=self.groups,
                     ids=self.ids, images=self.images)

    def vl(self, rows: torch.Tensor) -> list[RowImages | None] | None:
        """The images of these rows (a chunk's indices), for TrainPolicy's `vl=`; None when the batch is all text."""
        if self.images is None:
            return None
        return [self.images[i] for i in rows.tolist()]


def right_padded(valid: torch.Tensor) -> bool:
    """Every row of a [B, T] bool mask is valid positions then padding (collate's layout). Then the padding mask can
    be left out of a causal forward: no valid position attends to the padding after it, so the valid positions'
    states are the same, and SDPA takes its causal kernel instead of an explicit [B, 1, T, T] mask (~2.5x faster
    forward + backward on CPU at T = 1024, measured)."""
    return bool((valid[:, 1:] <= valid[:, :-1]).all()) if valid.shape[1] > 1 else True


def trained_rows(mask: torch.Tensor) -> torch.Tensor:
    """[B] bool (on the CPU): the rows of a batch's mask with a trained token. A row without one adds nothing to any
    loss, and a forward over it alone would take means over nothing (NaN, and the update skipped)."""
    return (mask.sum(1) > 0).cpu()


def boot_position(tr: Trajectory) -> int:
    """The position whose value bootstraps `tr`'s return: boot_at for a truncated trajectory that carries its final
    state, else 0 (none: a terminated episode is worth nothing after its end)."""
    return tr.boot_at if tr.outcome == Outcome.TRUNCATED else 0


def collate(trajs: list[Trajectory], pad_id: int = 0, vl=None) -> Batch:
    """vl: the model's core.vlm.VLSpec (TrainPolicy.vl) when it is a VL checkpoint; ValueError if a trajectory carries
    images and there is none, or its images do not bind (row_images). A text trajectory's segments give its row a
    RowImages without pixels (text_segments): each segment is computed as its own sequence."""
    images, cache = None, {}
    need = [_needs_rows(t, vl) for t in trajs]
    if any(need):
        images = [row_images(t.tokens, t.segments, t.image_refs, t.images, vl, cache, f"trajectory {t.id}",
                             mask=t.mask) if n else None for t, n in zip(trajs, need)]
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
        mask[i, :n] = torch.from_numpy(trained_positions(t).astype(np.float32))
        behav[i, :n] = torch.from_numpy(t.logprobs.astype(np.float32))
        versions[i, :n] = torch.from_numpy(t.versions.astype(np.int64))
        rewards[i, :n] = torch.from_numpy(turn_rewards(t))
        if boots[i]:
            boot[i, boots[i]] = 1.0
    rets = torch.tensor([t.ret for t in trajs], dtype=torch.float32)
    cut = torch.tensor([t.outcome == Outcome.TRUNCATED for t in trajs], dtype=torch.bool)
    return Batch(tokens, valid, mask, behav, versions, rewards, rets, boot, cut, torch.tensor(widths, dtype=torch.long),
                 [group_key(t) for t in trajs], [t.id for t in trajs], images)


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


def live_rows(idx: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
    """idx restricted to the rows marked in live ([B] bool; None = all). One row stays when none is live, so the
    minibatch still steps on its (zero) gradient as it would have."""
    if live is None:
        return idx
    keep = idx[live[idx]]
    return keep if len(keep) else idx[:1]


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
