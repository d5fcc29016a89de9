"""Arrivals -> batches: every trajectory off the stream is logged, filtered (infra_error, too stale) and, when episodes
are sampled in GRPO groups, held until its whole group is in.

Trajectories kept out of the loss never reach a batch: an infra_error episode is never a reward of 0, one whose
oldest token is more than `learner.staleness.max_lag` versions behind is dropped (a GRPO member again when its group
is released, at the version it is trained at), so is one with a token of a
version the learner has not reached (counted future_versions: a bug or a hostile actor; its lag would be < 0 and
pass as fresh), and so is one with no generated
token (counted no_generated_tokens: a truncated episode whose first prompt did not fit the inference server's context;
in a GRPO group its return of 0 would only move the others' baseline), and so is one whose images cannot be bound to its
framed image runs (counted unbound_images: `check`, learner.batch.binding_error). All are listed in `masked`, so
trained.jsonl can account for every id, and marked consumed on the stream: at once (they are settled), or, for a
member of a GRPO group, with its group (take_masked, once the group is in a batch the caller consumes), so a
checkpoint never lists a group's masked member as consumed while its kept ones come again after a restart (the
group would then count one arrival short and wait out group.timeout_s).
"""
from __future__ import annotations

import collections
import json
import logging
import threading
import time
from typing import Callable, TextIO

from core.config_learner import GroupConfig
from core.outcome import Outcome
from core.schema import group_key, trained_positions

log = logging.getLogger("tars.learner")

POLL_S = 0.5  # longest wait for one arrival: the stop flag, group deadlines and idle work are checked this often


class Admission:
    def __init__(self, receiver, staleness, max_lag: int, group: GroupConfig, episodes: TextIO, archive=None,
                 counters: collections.Counter | None = None, check: Callable[[object], str | None] | None = None,
                 max_pending: int = 4096):
        self.receiver, self.staleness, self.max_lag = receiver, staleness, max_lag
        # Kept members pending groups may hold; past it the oldest group is released as it is (collect).
        self.max_pending = max(1, max_pending)
        self.group_size, self.group_timeout_s = max(1, group.size), group.timeout_s
        self.episodes, self.archive = episodes, archive  # episodes.jsonl; the optional trajectory archive (.twl)
        self.counters = counters if counters is not None else collections.Counter()
        self.check = check  # trajectory -> why it cannot be trained on (None: it can)
        # group_key -> (first arrival, arrived, kept, ids kept out: consumed with the group)
        self.pending_groups: dict[tuple, tuple[float, int, list, list]] = {}
        # Ids kept out of the loss since the last update (trained.jsonl records them with the next version); those of
        # group members join it once their group is in the batch collect() returns (_masked_in_batch until then).
        self.masked: list[str] = []
        self._masked_in_batch: list[str] = []
        # Kept (on_accepted) but not yet handed out in a batch: in a pending group or a batch being collected. A
        # checkpoint counts them as not accepted (held()): they are not consumed, so a restart receives them again.
        self._held = 0
        # When collect last returned: a group's timeout counts only the time spent collecting (below).
        self._returned: float | None = None

    def held(self) -> int:
        return self._held

    def unsettled(self) -> int:
        """GRPO members kept out of the loss (on_rejected) but not consumed yet: they come again after a restart."""
        return len(self._masked_in_batch) + sum(len(out) for *_, out in self.pending_groups.values())

    def take_masked(self) -> list[str]:
        """The ids kept out of the loss since the last call; the caller marks them consumed with its batch (a
        masked GRPO member is consumed only then, with its group)."""
        masked, self.masked = self.masked, []
        return masked

    def collect(self, n: int, version: int, stop: threading.Event, on_idle: Callable[[], None] = lambda: None,
                on_tick: Callable[[], None] = lambda: None):
        """The next batch of at least n trajectories, in whole groups; None once `stop` is set.

        Group members finish at different times (successes are often shorter), so a batch cut by arrival would
        split groups and normalise partial ones (all-success or all-failure halves get advantage 0). A group is
        released once all `group.size` members have arrived (infra_error members count as arrived, never trained);
        a group incomplete after `group.timeout_s` is released as it is, so a lost actor cannot stall training.
        That time counts only while the learner collects: members that arrived during an update (or a checkpoint
        in `on_idle`) wait in the receiver's queue, so a group's clock stops meanwhile, or an update longer than
        the timeout would release every pending group without its queued members (each then trained as a group of
        its own).
        `on_idle` runs whenever POLL_S passes with no arrival (the learner checkpoints then if asked to); `on_tick`
        at least every POLL_S, arrivals or not (the learner's keep-alive to the other ranks).
        """
        k = self.group_size
        batch: list = []
        if self._returned is not None:  # the time away (an update) does not count against a pending group
            self._pause(time.monotonic() - self._returned)
        while len(batch) < n:
            if stop.is_set():
                return None
            tr = self.receiver.get(timeout=POLL_S)
            on_tick()
            now = time.monotonic()
            for g, (t0, arrived, members, out) in list(self.pending_groups.items()):
                if now - t0 > self.group_timeout_s:
                    del self.pending_groups[g]
                    self.counters["groups_timed_out"] += 1
                    batch += self._fresh(members, version)
                    self._masked_in_batch += out
            if tr is None:
                t_idle = time.monotonic()
                on_idle()  # a checkpoint taken there is time away too
                self._pause(time.monotonic() - t_idle)
                continue
            grouped = k > 1 and bool(tr.group)
            keep = self.admit(tr, version, settle=not grouped)
            self._held += keep
            if not grouped:
                batch += [tr] if keep else []
                continue
            g = group_key(tr)  # (actor, group): another actor's group of the same name is not this one
            t0, arrived, members, out = self.pending_groups.get(g, (now, 0, [], []))
            arrived += 1
            members, out = (members + [tr], out) if keep else (members, out + [tr.id])
            if arrived >= k:
                self.pending_groups.pop(g, None)
                batch += self._fresh(members, version)
                self._masked_in_batch += out
            else:
                self.pending_groups[g] = (t0, arrived, members, out)
                batch += self._fresh(self._evict(), version)
        self.masked += self._masked_in_batch
        self._masked_in_batch = []
        self._held -= len(batch)
        self._returned = time.monotonic()
        return batch

    def _fresh(self, members: list, version: int) -> list:
        """The members of a released group still within max_lag of `version`: a member kept on arrival ages while its
        group waits for the rest (over updates: its clock stops while the learner trains), and one past the bound is
        dropped now, as it would have been on arrival (too_stale; its id consumed with the batch)."""
        kept = []
        for tr in members:
            gen = tr.versions[tr.mask.astype(bool)]
            if len(gen) and version - int(gen.min()) > self.max_lag:
                self.counters["too_stale"] += 1
                self.staleness.on_dropped(1)
                self._held -= 1
                self._masked_in_batch.append(tr.id)
            else:
                kept.append(tr)
        return kept

    def _evict(self) -> list:
        """The oldest pending groups, released as they are, while their kept members number more than max_pending:
        arrivals no admission bounds (groups of fresh names that never complete) would else be held until their
        timeout, as many as a peer can send meanwhile. An honest run holds at most its admission bound."""
        out: list = []
        held = sum(len(members) for _, _, members, _ in self.pending_groups.values())
        while held > self.max_pending:
            _, _, members, masked = self.pending_groups.pop(next(iter(self.pending_groups)))  # in arrival order
            held -= len(members)
            out += members
            self._masked_in_batch += masked
            self.counters["groups_evicted"] += 1
        return out

    def _pause(self, seconds: float) -> None:
        """Stop the pending groups' clocks for `seconds` (time the learner spent elsewhere)."""
        self.pending_groups = {g: (t0 + seconds, *rest) for g, (t0, *rest) in self.pending_groups.items()}

    def admit(self, tr, version: int, settle: bool = True) -> bool:
        """Log one arrival; count and drop it (False) if it is an infra_error or too stale to train on. A dropped one
        is marked consumed and listed in `masked` now if `settle`, else by the caller (a GRPO member: collect)."""
        self.counters["received"] += 1
        if self.archive is not None and tr.id not in self.archive:  # the data flywheel's raw material
            self.archive.append(tr.id, tr.encode())
        gen = tr.versions[tr.mask.astype(bool)]
        lag = version - int(gen.min()) if len(gen) else 0
        self.episodes.write(json.dumps({
            "t": time.time(), "id": tr.id, "env_id": tr.env_id, "outcome": tr.outcome, "success": tr.success,
            "return": tr.ret, "turns": len(tr.turns), "start_version": tr.start_version,
            "vmin": int(gen.min()) if len(gen) else -1, "vmax": int(gen.max()) if len(gen) else -1,
            "train_version": version, "group": tr.group, "error": tr.error, "fault": str(tr.fault),
            "truncated_by": tr.truncated_by,
            "outputs": [t.output[:80] for t in tr.turns[:8]]}) + "\n")
        if tr.outcome == Outcome.INFRA_ERROR:  # never a reward of 0: kept out of the loss entirely
            self.counters[Outcome.INFRA_ERROR] += 1  # the same key as "infra_error" (a str enum)
        elif lag > self.max_lag:
            self.counters["too_stale"] += 1
        elif len(gen) and int(gen.max()) > version:  # not published yet: lag < 0 passed as perfectly fresh
            self.counters["future_versions"] += 1
            log.warning("trajectory %s kept out of the loss: tokens of version %d, the learner is at %d", tr.id,
                        int(gen.max()), version)
        elif not trained_positions(tr).any():  # nothing generated (its first prompt did not fit the context), or
            # only where no loss is taken (a first token, a segment's first token): no loss to take
            self.counters["no_generated_tokens"] += 1
        elif self.check is not None and (why := self.check(tr)) is not None:
            self.counters["unbound_images"] += 1
            log.warning("trajectory %s kept out of the loss: %s", tr.id, why)
        else:
            self.staleness.on_accepted(1)
            return True
        self.staleness.on_rejected(1)
        if settle:
            self.receiver.mark_consumed([tr.id])
            self.masked.append(tr.id)
        return False
