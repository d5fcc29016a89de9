"""Batched KV caches and the per-trajectory prefix cache of the local engine.

Layout invariant of a batched cache: row i's valid keys are its LAST n_i columns (right-aligned, left padding).
Then key_valid follows from the lengths alone, a decode step appends one valid column to every row (which is
what `Attention` does with torch.cat), finished rows leave with index_select, and the common left padding is
trimmed by slicing. Only membership changes copy the cache; a decode step copies nothing beyond the model's cat.

The prefix cache (PrefixCache) holds each trajectory's KV in fixed-size token blocks, evicted tail first under a
byte bound (docs/model.md, "The local engine's prefix cache").
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


def row_kv(kv: KV, lengths: torch.Tensor, i: int, n: int | None = None, clone: bool = True) -> RowKV:
    """Row i's first n (default all) valid keys, copied so the batch storage can be freed (clone=False: views)."""
    have = int(lengths[i])
    n = have if n is None else n
    S = kv[0][0].shape[2]
    if not clone:
        return [(k[i, :, S - have:S - have + n], v[i, :, S - have:S - have + n]) for k, v in kv]
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


def block_bytes(b: torch.Tensor) -> int:
    return b.numel() * b.element_size()


@dataclass(eq=False)
class PrefixEntry:
    """One trajectory's cached KV, in fixed-size token blocks so its tail can be evicted block by block."""

    ids: list[int]     # tokens whose KV is held (the finished request's sequence minus its last, unfed token)
    blocks: list[torch.Tensor]  # each [layers, 2 (k, v), Hkv, t, hd]; t == block_tokens for all but the last
    version: int       # oldest weight version that contributed to this KV
    nbytes: int
    images: dict | None = None  # placeholder-run start -> image hash the KV was computed with (core/vision.py)

    def kv(self, n: int) -> RowKV:
        """The first n cached tokens' KV per layer, [Hkv, n, hd] each (a copy: the entry may be evicted later)."""
        if not 0 < n <= len(self.ids):
            raise ValueError(f"{n} tokens asked of an entry holding {len(self.ids)}")
        bt = self.blocks[0].shape[3]
        x = torch.cat(self.blocks[:-(-n // bt)], dim=3)[:, :, :, :n]
        return [(x[layer, 0], x[layer, 1]) for layer in range(x.shape[0])]


def to_blocks(kv: RowKV, n: int, block_tokens: int) -> list[torch.Tensor]:
    """A sequence's KV (per layer [Hkv, >= n, hd], views are fine) -> blocks of block_tokens tokens (the last may
    be shorter), each one allocation [layers, 2, Hkv, t, hd] so evicting it gives its memory back."""
    L = len(kv)
    H, _, hd = kv[0][0].shape
    out = []
    for s in range(0, n, block_tokens):
        e = min(n, s + block_tokens)
        b = kv[0][0].new_empty(L, 2, H, e - s, hd)
        for layer, (k, v) in enumerate(kv):
            b[layer, 0].copy_(k[:, s:e])
            b[layer, 1].copy_(v[:, s:e])
        out.append(b)
    return out


class PrefixCache:
    """One KV prefix per trajectory, bounded by entries and bytes; used by the scheduler thread only.

    Memory is held in fixed-size token blocks. Over the bounds, the least recently used entry (put or hit) loses
    its tail block first, then the next one, and so on: an entry whose head survives still serves a hit of its
    longest remaining prefix (whole blocks), so a bound a little too small costs a few blocks' recompute, not
    whole trajectories'. Over `capacity` entries, the least recently used entry goes whole.
    """

    def __init__(self, capacity: int, max_bytes: int, block_tokens: int = 32):
        if block_tokens <= 0:
            raise ValueError(f"inference.cache_block_tokens must be > 0, got {block_tokens}")
        self.capacity, self.max_bytes, self.block_tokens = capacity, max_bytes, block_tokens
        self._d: OrderedDict[str, PrefixEntry] = OrderedDict()
        self.nbytes = 0
        self.evicted_blocks = 0   # tail blocks given up to the byte bound
        self.evicted_entries = 0  # entries gone whole (capacity, or every block evicted)
        self.dropped_stale = 0    # entries dropped by drop_older (too old for any request's staleness budget)

    def __len__(self) -> int:
        return len(self._d)

    @property
    def blocks(self) -> int:
        return sum(len(e.blocks) for e in self._d.values())

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
        """Cache the KV of `ids` (kv per layer [Hkv, >= len(ids), hd]; copied into blocks) for `key`."""
        self.pop(key)
        if self.capacity <= 0 or self.max_bytes <= 0 or not ids:
            return
        blocks = to_blocks(kv, len(ids), self.block_tokens)
        nbytes = sum(map(block_bytes, blocks))
        self._d[key] = PrefixEntry(list(ids), blocks, version, nbytes, images or None)
        self.nbytes += nbytes
        self._evict()

    def drop_older(self, version: int) -> int:
        """Drop every entry computed (in part) by weights older than `version`; returns how many went."""
        old = [k for k, e in self._d.items() if e.version < version]
        for k in old:
            self.pop(k)
        self.dropped_stale += len(old)
        return len(old)

    def _evict(self) -> None:
        while len(self._d) > self.capacity:
            self.pop(next(iter(self._d)))
            self.evicted_entries += 1
        while self.nbytes > self.max_bytes and self._d:
            key, e = next(iter(self._d.items()))  # least recently used
            b = e.blocks.pop()
            nb = block_bytes(b)
            e.nbytes -= nb
            self.nbytes -= nb
            self.evicted_blocks += 1
            del e.ids[len(e.blocks) * self.block_tokens:]
            if not e.blocks:
                del self._d[key]
                self.evicted_entries += 1

    def clear(self) -> None:
        self._d.clear()
        self.nbytes = 0


def auto_cache_bytes(device: torch.device | None = None, fraction: float = 0.1, cap: int = 4 << 30,
                     floor: int = 64 << 20) -> int:
    """The prefix cache's default byte bound (inference.cache_max_bytes = 0): `fraction` of the memory available
    at start (MemAvailable, or the free memory of the CUDA device the model is on), at most `cap`, at least `floor`."""
    avail = None
    if device is not None and device.type == "cuda":
        try:
            avail = torch.cuda.mem_get_info(device)[0]
        except Exception:
            avail = None
    if avail is None:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        avail = int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
    if avail is None:  # no /proc (not Linux): the physical memory
        try:
            import os

            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            avail = 10 * (1 << 30)
    return int(max(floor, min(cap, avail * fraction)))
