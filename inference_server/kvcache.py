"""Batched KV caches and the per-trajectory prefix cache of the local engine.

Layout invariant of a batched cache: row i's valid keys are its LAST n_i columns (right-aligned, left padding).
Then key_valid follows from the lengths alone, a decode step appends one valid column to every row (which is
what `Attention` does with torch.cat), finished rows leave with index_select, and the common left padding is
trimmed by slicing. Only membership changes copy the cache; a decode step copies nothing beyond the model's cat.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v), each [B, Hkv, S, hd]
RowKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v), each [Hkv, n, hd] (one sequence, no padding)


def valid_from_lengths(lengths: torch.Tensor, S: int) -> torch.Tensor:
    """lengths [B] -> key_valid [B, S] bool, True on the last lengths[i] columns of row i."""
    return torch.arange(S, device=lengths.device)[None, :] >= (S - lengths)[:, None]


def left_pad(kv: KV, S: int) -> KV:
    """Pad every layer's caches on the left (the time axis) to S columns."""
    have = kv[0][0].shape[2]
    if have == S:
        return kv
    return [(F.pad(k, (0, 0, S - have, 0)), F.pad(v, (0, 0, S - have, 0))) for k, v in kv]


def compact_right(kv: KV, valid: torch.Tensor) -> tuple[KV, torch.Tensor]:
    """Move each row's valid columns (in order) to the right end, dropping holes; valid [B, S] -> lengths [B].

    Batch prefill leaves holes ([pad, prefix, pad, suffix]); this restores the layout invariant in one gather.
    """
    B, S = valid.shape
    lengths = valid.sum(1)
    n = int(lengths.max())
    if torch.equal(valid, valid_from_lengths(lengths, S)):
        return [(k[:, :, S - n:], v[:, :, S - n:]) for k, v in kv], lengths
    # A stable sort on the validity flag puts invalid columns first and keeps valid ones in their order.
    _, order = torch.sort(valid.to(torch.int8), dim=1, stable=True)
    idx = order[:, S - n:]  # [B, n]
    out = []
    for k, v in kv:
        g = idx[:, None, :, None].expand(B, k.shape[1], n, k.shape[3])
        out.append((k.gather(2, g), v.gather(2, g)))
    return out, lengths


def cat_rows(a: KV | None, a_len: torch.Tensor | None, b: KV, b_len: torch.Tensor) -> tuple[KV, torch.Tensor]:
    """Stack two right-aligned batches along the batch axis, left-padding the shorter one."""
    if a is None or a_len is None or a_len.numel() == 0:
        return b, b_len
    S = max(a[0][0].shape[2], b[0][0].shape[2])
    a, b = left_pad(a, S), left_pad(b, S)
    return [(torch.cat([ka, kb]), torch.cat([va, vb])) for (ka, va), (kb, vb) in zip(a, b)], torch.cat([a_len, b_len])


def take_rows(kv: KV, lengths: torch.Tensor, keep: list[int]) -> tuple[KV | None, torch.Tensor | None]:
    """Keep the given rows and trim the left padding no remaining row needs."""
    if not keep:
        return None, None
    idx = torch.tensor(keep, dtype=torch.long, device=lengths.device)
    lengths = lengths.index_select(0, idx)
    n = int(lengths.max())
    return [(k.index_select(0, idx)[:, :, -n:], v.index_select(0, idx)[:, :, -n:]) for k, v in kv], lengths


def row_kv(kv: KV, lengths: torch.Tensor, i: int, n: int | None = None) -> RowKV:
    """Row i's first n (default all) valid keys, copied so the batch storage can be freed."""
    have = int(lengths[i])
    n = have if n is None else n
    S = kv[0][0].shape[2]
    return [(k[i, :, S - have:S - have + n].clone(), v[i, :, S - have:S - have + n].clone()) for k, v in kv]


def pack(rows: list[RowKV | None], lengths: list[int]) -> KV:
    """Per-row caches (None or length 0 = empty) -> one left-padded batch [B, Hkv, max n, hd] per layer."""
    ref = next(r for r in rows if r is not None)
    S = max(lengths)
    out = []
    for layer in range(len(ref)):
        H, _, hd = ref[layer][0].shape
        k = ref[layer][0].new_zeros(len(rows), H, S, hd)
        v = torch.zeros_like(k)
        for i, (r, n) in enumerate(zip(rows, lengths)):
            if r is not None and n:
                k[i, :, S - n:] = r[layer][0][:, :n]
                v[i, :, S - n:] = r[layer][1][:, :n]
        out.append((k, v))
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual multi-turn case, checked at C speed
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] holds, a[:hi] == b[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class PrefixEntry:
    ids: list[int]   # tokens whose KV is held (the finished request's sequence minus its last, unfed token)
    kv: RowKV
    version: int     # oldest weight version that contributed to this KV
    nbytes: int
    images: dict | None = None  # placeholder-run start -> image hash the KV was computed with (core/vision.py)


class PrefixCache:
    """LRU of one KV prefix per trajectory, bounded by entries and bytes. Used by the scheduler thread only."""

    def __init__(self, capacity: int, max_bytes: int):
        self.capacity, self.max_bytes = capacity, max_bytes
        self._d: OrderedDict[str, PrefixEntry] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._d)

    def get(self, key: str) -> PrefixEntry | None:
        e = self._d.get(key)
        if e is not None:
            self._d.move_to_end(key)
        return e

    def pop(self, key: str) -> None:
        e = self._d.pop(key, None)
        if e is not None:
            self.nbytes -= e.nbytes

    def put(self, key: str, ids: list[int], kv: RowKV, version: int, images: dict | None = None) -> None:
        self.pop(key)
        nbytes = sum(k.numel() * k.element_size() * 2 for k, _ in kv)
        if self.capacity <= 0 or nbytes > self.max_bytes or not ids:
            return
        self._d[key] = PrefixEntry(ids, kv, version, nbytes, images or None)
        self.nbytes += nbytes
        while len(self._d) > self.capacity or self.nbytes > self.max_bytes:
            _, old = self._d.popitem(last=False)
            self.nbytes -= old.nbytes

    def clear(self) -> None:
        self._d.clear()
        self.nbytes = 0
