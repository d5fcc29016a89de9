"""The scheduler thread of LocalEngine: admission, batched prefill, batched decode, weight updates.

One iteration: apply pending weight updates -> drop cancelled requests -> admit waiting requests (prefix-cache
lookup) -> prefill one group of new / interrupted requests -> one decode step for every running request.
Running requests share one right-aligned batched KV cache (see inference_server.kvcache) that is re-packed only
when the batch membership changes.

The scheduler knows nothing of LocalEngine: it gets the model, the WorkQueue the engine fills, and the engine's
counters, and it owns the installed weight version (LocalEngine.version reads it).
"""
from __future__ import annotations

import collections
import logging
import os
import time
from concurrent.futures import InvalidStateError

import torch

from core.config import InferenceConfig
from core.model import CausalLM
from inference_server.engine_types import LENGTH, STOP, EngineClosed, GenerateOutput, Request, WeightUpdate
from inference_server.kvcache import KV, PrefixCache, auto_cache_bytes, cat_rows, common_prefix, compact_right, pack, row_kv, take_rows, valid_from_lengths
from inference_server.sampling import RowParams, sample
from inference_server.work_queue import WorkQueue

log = logging.getLogger("tars.inference.scheduler")


def _bucket(b: int) -> str:
    lo = 1 << (b.bit_length() - 1)
    return str(lo) if lo == 1 else f"{lo}-{2 * lo - 1}"


def _resolve(fut, result=None, exc: BaseException | None = None) -> bool:
    """Set a Future unless its caller cancelled it meanwhile (a race the scheduler cannot prevent)."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
        return True
    except InvalidStateError:
        return False


# How long one idle wait for work lasts before the loop looks again (the queue wakes it at once on new work).
IDLE_WAIT_S = 0.5


class Scheduler:
    def __init__(self, cfg: InferenceConfig, model: CausalLM, queue: WorkQueue, stats: collections.Counter,
                 batch_hist: collections.Counter, version: int = 0):
        self.cfg = cfg
        self.model = model
        self.queue = queue
        self.stats = stats                         # shared with the engine, which reports them in metrics()
        self.batch_hist = batch_hist               # decode batch sizes, bucketed by _bucket
        self.version = int(version)                # the weight version installed now
        # The model's device (inference.device): step inputs are built there and sampling runs there; only the
        # sampled ids and their logprobs ([B] each) come back to the host.
        self.device = next(self.model.parameters()).device
        # cache_max_bytes 0 = derived from the memory available now (where the KV lives: RAM, or the GPU's).
        if self.cfg.cache_max_bytes < 0:
            raise ValueError(f"inference.cache_max_bytes must be >= 0 (0 = auto), got {self.cfg.cache_max_bytes}")
        self.cache = PrefixCache(self.cfg.cache_capacity, self.cfg.cache_max_bytes or auto_cache_bytes(self.device),
                                 self.cfg.cache_block_tokens)
        self.max_stale_seen = 0                    # largest staleness budget any admitted request asked for
        self.rows: list[Request] = []              # running requests, row i of self.kv
        self.kv: KV | None = None
        self.lengths: torch.Tensor | None = None   # [B] tokens held in each row's KV
        self.rp: RowParams | None = None           # sampling params of self.rows, None = rebuild
        self.prefill: collections.deque[Request] = collections.deque()  # admitted, KV not computed yet
        self.idle_s = 0.0
        # Unseeded requests share one generator seeded from the OS, so two engines never draw the same stream.
        self.gen = torch.Generator(device=self.device).manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)

    def active(self) -> int:
        return len(self.rows) + len(self.prefill)

    # ---- the loop ------------------------------------------------------------------------------------
    def run(self) -> None:
        with torch.inference_mode():
            while True:
                if not self.active():
                    t0 = time.monotonic()
                    while not self.queue.wait(IDLE_WAIT_S):
                        pass
                    self.idle_s += time.monotonic() - t0
                work = self.queue.take(self.cfg.max_batch - self.active())
                if work is None:  # closed
                    break
                try:
                    self._drop_cancelled()  # first, so an update does not recompute KV for requests already given up
                    for u in work.updates:
                        self._apply(u)
                    self._drop_cancelled()
                    for r in work.requests:
                        self._admit(r)
                    if self.prefill:
                        self._prefill_step()
                    if self.rows:
                        self._decode_step()
                except Exception as e:  # a bug or OOM in one step fails the requests in it, not the engine
                    log.exception("engine step failed")
                    self.stats["step_errors"] += 1
                    err = RuntimeError(f"engine step failed: {type(e).__name__}: {e}")
                    self._fail_active(err)
                    # What this step took and had not admitted or applied yet (resolved ones stay as they are).
                    for f in [*(r.future for r in work.requests), *(u.future for u in work.updates)]:
                        _resolve(f, exc=err)
        self.fail_all(EngineClosed("engine closed"))

    def apply_pending(self) -> None:
        """Apply queued weight updates from the calling thread (only while the loop thread is not running)."""
        updates = self.queue.take_updates()
        with torch.inference_mode():
            for u in updates:
                self._apply(u)

    def fail_all(self, exc: BaseException) -> None:
        self._fail_active(exc)
        work = self.queue.drain()
        for r in work.requests:
            _resolve(r.future, exc=exc)
        for u in work.updates:
            _resolve(u.future, exc=exc)

    def _fail_active(self, exc: BaseException) -> None:
        for r in [*self.rows, *self.prefill]:
            _resolve(r.future, exc=exc)
        self.rows, self.kv, self.lengths, self.rp = [], None, None, None
        self.prefill.clear()

    # ---- weights -------------------------------------------------------------------------------------
    def _apply(self, u: WeightUpdate) -> None:
        t0 = time.monotonic()
        # The update's own reference to its weights goes now: the loop keeps `work` (this update in it) until its next
        # take, which an idle engine may not do for hours, and the copy (or a mapped shm segment) would stay in memory.
        sd, u.state_dict = u.state_dict, {}
        try:
            self.model.load_weights(sd)
        except Exception as e:  # checked by the caller already; a failure here leaves the old weights' version
            _resolve(u.future, exc=e)
            return
        self.version = u.version
        interrupted, keep, redo = 0, [], []
        for i, r in enumerate(self.rows):
            r.interruptions += 1
            interrupted += 1
            # Stale KV is kept only within the request's own staleness budget; otherwise recompute it all.
            (keep if r.max_stale_versions >= u.version - r.kv_version else redo).append(i)
        for r in self.prefill:
            if r.out:  # an earlier interruption is still waiting for its re-prefill
                r.interruptions += 1
                interrupted += 1
            if r.prefix_kv is not None and r.max_stale_versions < u.version - r.kv_version:
                r.prefix_kv, r.prefix_len, r.cached_tokens = None, 0, 0
        if redo:
            redo_reqs = [self.rows[i] for i in redo]
            self.kv, self.lengths = take_rows(self.kv, self.lengths, keep)
            self.rows = [self.rows[i] for i in keep]
            self.rp = None
            for r in reversed(redo_reqs):  # first in line for the next prefill, in their old order
                n = len(r.input_ids) + len(r.out)
                r.recomputed_tokens += n
                self.stats["recomputed_tokens"] += n
                self.prefill.appendleft(r)
        # Cached prefixes staler than every budget seen so far, by more than one version (the grace lets a caller
        # that raises its budget right after an update still hit), are dead weight: give their memory back now.
        # A finished trajectory's entry is never asked for again; this is what keeps the cache from filling with them.
        self.cache.drop_older(self.version - max(self.cfg.max_stale_versions, self.max_stale_seen) - 1)
        self.stats["weight_updates"] += 1
        self.stats["interrupted"] += interrupted
        self.stats["stale_kept"] += len(keep)
        _resolve(u.future, {
            "version": u.version, "load_ms": (time.monotonic() - u.t0) * 1e3, "apply_ms": (time.monotonic() - t0) * 1e3,
            "interrupted_requests": interrupted, "recomputed_requests": len(redo), "stale_kv_kept": len(keep),
        })

    # ---- admission and prefill -----------------------------------------------------------------------
    def _drop_cancelled(self) -> None:
        dead = [i for i, r in enumerate(self.rows) if r.future.cancelled()]
        if dead:
            gone = set(dead)
            keep = [i for i in range(len(self.rows)) if i not in gone]
            self.kv, self.lengths = take_rows(self.kv, self.lengths, keep)
            self.rows = [self.rows[i] for i in keep]
            self.rp = None
        before = len(self.prefill)
        if any(r.future.cancelled() for r in self.prefill):
            self.prefill = collections.deque(r for r in self.prefill if not r.future.cancelled())
        self.stats["cancelled"] += len(dead) + before - len(self.prefill)

    def _admit(self, r: Request) -> None:
        if r.future.cancelled():
            self.stats["cancelled"] += 1
            return
        self.max_stale_seen = max(self.max_stale_seen, r.max_stale_versions)
        e = self.cache.get(r.trajectory_id) if r.trajectory_id else None
        if e is not None:
            if self.version - e.version > r.max_stale_versions:
                self.cache.pop(r.trajectory_id)  # computed by weights too old for this request: recompute
            else:
                # At least one prompt token must be fed to get next-token logits.
                n = min(common_prefix(e.ids, r.input_ids), len(r.input_ids) - 1)
                if e.images or r.img_key:
                    # KV is only reusable up to the first placeholder run whose image differs (or was dropped).
                    a, b = e.images or {}, r.img_key or {}
                    n = min([n, *(s for s in set(a) | set(b) if a.get(s) != b.get(s))])
                if n > 0:
                    r.prefix_kv, r.prefix_len, r.cached_tokens, r.kv_version = e.kv(n), n, n, e.version
        self.prefill.append(r)

    def _suffix_len(self, r: Request) -> int:
        return len(r.input_ids) + len(r.out) - r.prefix_len

    def _take_group(self) -> list[Request]:
        """The oldest pending prefill plus the ones closest to it in length, within the padded-token budget."""
        anchor = self.prefill[0]
        ta = self._suffix_len(anchor)
        group, maxt, total = [anchor], ta, ta
        for r in sorted(list(self.prefill)[1:], key=lambda r: abs(self._suffix_len(r) - ta)):
            t = self._suffix_len(r)
            m = max(maxt, t)
            # Stay within the budget, and let padding at most double the work.
            if (len(group) + 1) * m > self.cfg.prefill_batch_tokens or (len(group) + 1) * m > 2 * (total + t) + 64:
                continue
            group.append(r)
            maxt, total = m, total + t
        chosen = set(map(id, group))
        self.prefill = collections.deque(r for r in self.prefill if id(r) not in chosen)
        return group

    def _prefill_step(self) -> None:
        group = self._take_group()
        B = len(group)
        self.stats["prefill_steps"] += 1
        seqs = [r.sequence() for r in group]
        P_i = [r.prefix_len for r in group]
        T_i = [len(s) - p for s, p in zip(seqs, P_i)]
        P, T = max(P_i), max(T_i)
        # Suffixes left-padded so every row's last real token is in the last column.
        ids = torch.zeros(B, T, dtype=torch.long)
        mrope = self.model.mrope_section is not None
        pos = torch.zeros(3, B, T, dtype=torch.long) if mrope else torch.zeros(B, T, dtype=torch.long)
        for i, (r, s, p, t) in enumerate(zip(group, seqs, P_i, T_i)):
            ids[i, T - t:] = torch.tensor(s[p:], dtype=torch.long)
            if mrope:
                pos[:, i, T - t:] = _mrope_positions(r, p, t)
            else:
                pos[i, T - t:] = torch.arange(p, p + t)
        ids, pos = ids.to(self.device), pos.to(self.device)
        key_valid = torch.cat([valid_from_lengths(torch.tensor(P_i, device=self.device), P),
                               valid_from_lengths(torch.tensor(T_i, device=self.device), T)], 1)
        past = pack([r.prefix_kv for r in group], P_i) if P > 0 else None
        h, kv = self.model.hidden(ids, pos, key_valid, past, _image_inputs(group, P_i, T_i, T),
                                  _vl_image_embeds(self.model, group, P_i, T_i, T))
        logits = self.model.lm_head(h[:, -1])  # [B, V]: only the last position is sampled
        kv, lengths = compact_right(kv, key_valid)
        for r, p, t in zip(group, P_i, T_i):
            if not r.out:  # first prefill; re-prefills are counted as recomputed_tokens instead
                self.stats["prefill_tokens"] += t
                self.stats["cache_hit_tokens"] += p
            if not p:
                r.kv_version = self.version
            r.prefix_kv, r.prefix_len = None, 0
        rp = RowParams.build([r.params.temperature for r in group], [r.params.top_p for r in group],
                             [r.params.top_k for r in group], [r.generator for r in group], self.device)
        tok, lp = sample(logits, rp, self.gen)
        keep = self._emit_all(group, kv, lengths, tok.cpu().tolist(), lp.cpu().tolist())
        if keep:
            kv, lengths = take_rows(kv, lengths, keep)
            self.kv, self.lengths = cat_rows(self.kv, self.lengths, kv, lengths)
            self.rows.extend(group[i] for i in keep)
            self.rp = None

    # ---- decode --------------------------------------------------------------------------------------
    def _decode_step(self) -> None:
        rows = self.rows
        B = len(rows)
        if self.rp is None:
            self.rp = RowParams.build([r.params.temperature for r in rows], [r.params.top_p for r in rows],
                                      [r.params.top_k for r in rows], [r.generator for r in rows], self.device)
        toks = torch.tensor([r.out[-1] for r in rows], dtype=torch.long, device=self.device)[:, None]
        S = self.kv[0][0].shape[2]
        key_valid = valid_from_lengths(self.lengths + 1, S + 1)
        pos = self.lengths[:, None]
        if self.model.mrope_section is not None:  # a VL request's later tokens sit at j + its rope delta
            pos = pos + torch.tensor([r.vl.rope_delta if r.vl is not None else 0 for r in rows],
                                     device=pos.device)[:, None]
        logits, self.kv = self.model(toks, pos, key_valid, self.kv)
        self.lengths = self.lengths + 1
        tok, lp = sample(logits[:, -1], self.rp, self.gen)  # on the device; [B] ids and logprobs come back
        self.stats["decode_steps"] += 1
        self.stats["batch_rows"] += B
        self.batch_hist[_bucket(B)] += 1
        keep = self._emit_all(rows, self.kv, self.lengths, tok.cpu().tolist(), lp.cpu().tolist())
        if len(keep) < B:
            self.kv, self.lengths = take_rows(self.kv, self.lengths, keep)
            self.rows = [rows[i] for i in keep]
            self.rp = None

    def _emit_all(self, rows: list[Request], kv: KV, lengths: torch.Tensor, toks: list[int], lps: list[float]) -> list[int]:
        """Append one token to each row; finish the rows that are done; return the indices still running."""
        version, keep = self.version, []
        max_ctx = self.cfg.max_context
        self.stats["tokens"] += len(toks)  # before any Future resolves, so a caller never sees its tokens uncounted
        for i, (r, t, lp) in enumerate(zip(rows, toks, lps)):
            r.out.append(t)
            r.logprobs.append(lp)
            r.versions.append(version)
            if r.on_token is not None:
                try:
                    r.on_token(t, lp, version)
                except Exception:  # a broken stream consumer must not stop the batch
                    log.exception("on_token callback failed")
            if t in r.stop_ids:
                self._finish(r, STOP, kv, lengths, i)
            elif len(r.out) >= r.params.max_new_tokens or len(r.input_ids) + len(r.out) >= max_ctx:
                self._finish(r, LENGTH, kv, lengths, i)
            else:
                keep.append(i)
        return keep

    def _finish(self, r: Request, reason: str, kv: KV, lengths: torch.Tensor, i: int) -> None:
        if r.trajectory_id and self.cfg.cache_capacity > 0 and not r.future.cancelled():
            n = int(lengths[i])  # the KV holds the sequence minus its last (sampled, never fed) token
            self.cache.put(r.trajectory_id, r.sequence()[:n], row_kv(kv, lengths, i, clone=False), r.kv_version, r.img_key)
        out = GenerateOutput(r.out, r.logprobs, r.versions, reason, len(r.input_ids), r.cached_tokens,
                             r.interruptions, r.recomputed_tokens)
        self.stats["finished" if _resolve(r.future, out) else "cancelled"] += 1


def _image_inputs(group: list[Request], P_i: list[int], T_i: list[int], T: int):
    """(rows, columns, patch pixels) of the placeholder positions inside this prefill's suffixes, or None."""
    rows, cols, pix = [], [], []
    for i, (r, p, t) in enumerate(zip(group, P_i, T_i)):
        if r.img_pix is None:
            continue
        sel = [j for j, q in enumerate(r.img_pos) if p <= q < p + t]
        rows += [i] * len(sel)
        cols += [T - t + r.img_pos[j] - p for j in sel]  # suffixes are left-padded to T columns
        if sel:
            pix.append(r.img_pix[sel])
    if not rows:
        return None
    return torch.tensor(rows), torch.tensor(cols), torch.cat(pix)


def _mrope_positions(r: Request, p: int, t: int) -> torch.Tensor:
    """M-RoPE positions [3, t] of r's sequence positions p..p+t: the prompt's from its images (core.vlm.rope_positions),
    later (generated) tokens at j + rope delta; a request without images has plain positions."""
    j = torch.arange(p, p + t)
    if r.vl is None:
        return j[None].expand(3, t)
    out = (j + r.vl.rope_delta)[None].repeat(3, 1)
    n = len(r.input_ids)
    if p < n:
        out[:, :min(t, n - p)] = r.vl.positions[:, p:min(p + t, n)]
    return out


def _vl_image_embeds(model: CausalLM, group: list[Request], P_i: list[int], T_i: list[int], T: int):
    """(rows, columns, embeddings) of the <|image_pad|> positions inside this prefill's suffixes, or None: the vision
    tower runs once over every image with a pad in some suffix (a prefix-cache hit may end inside a run: only the
    run's remaining pads are placed)."""
    if model.visual is None:
        return None
    need = []  # (row, request, image, run start, first, end) of the pads to place
    for i, (r, p, t) in enumerate(zip(group, P_i, T_i)):
        if r.vl is None:
            continue
        for k, (s, e) in enumerate(r.vl.runs):
            lo, hi = max(s, p), min(e, p + t)
            if lo < hi:
                need.append((i, r, k, s, lo, hi))
    if not need:
        return None
    feats = model.image_features(torch.cat([r.vl.pixel_values[k] for _, r, k, *_ in need]),
                                 torch.stack([r.vl.grid_thw[k] for _, r, k, *_ in need]))
    rows, cols, embs, at = [], [], [], 0
    for i, r, k, s, lo, hi in need:
        n = r.vl.runs[k][1] - s
        rows += [i] * (hi - lo)
        cols += [T - T_i[i] + j - P_i[i] for j in range(lo, hi)]  # suffixes are left-padded to T columns
        embs.append(feats[at + lo - s:at + hi - s])
        at += n
    return torch.tensor(rows), torch.tensor(cols), torch.cat(embs)
