"""Ack confirmation: the learner forgets a consumed trajectory id once its actor can never send it again.

The receiver keeps every id it trained on (or dropped) to answer an actor's re-send as a duplicate; without a way to
forget them, that set and every checkpoint's list grew with the run. An id may be forgotten only when both hold:
  (a) its actor will never send it again: the actor got the final ACK (one without "held"), dropped its outbox entry
      and spool file, fsynced the spool's directory (a removed file must not come back after a power loss), and then
      said so: PING's "forgot" list (Forgotten, below). An ACK lost on a disconnect never leads to that: the actor
      re-sends, and the id is a duplicate, as before;
  (b) nothing in the learner can bring it back: the durability no longer holds it (WAL: compacted away, after the
      checkpoint that lists it as consumed is durable, the rename fsynced; checkpoint durability: committed, i.e.
      in a durable checkpoint) and the id is consumed.
ConsumedIds records a confirmation for an id it still tracks (consumed, or held by the durability: the WAL acks
before the id is trained) and forgets it at once if (b) holds, else at the next compaction (settle()); confirmations
of ids it does not track are ignored, so what it records is bounded by what it tracks. The checkpoint stores the
confirmed ids beside the consumed ones: a confirmation is a fact about the actor, true in every later (or restored)
run, so a restarted learner forgets them as soon as (b) holds for it.

A confirmation counts only from the actor that owns the id: the stream identity (ZMQ routing id, the actor's name)
whose TRAJ was accepted first, as a GRPO group belongs to the actor that sends it. A duplicate from another identity
does not take it over. Owners go into the checkpoint (id_owners, by identity), so a restarted learner still knows
them; a replayed WAL entry of a group takes its trajectory's actor (checked against the sender when it arrived). An
id whose owner is unknown (an older checkpoint, a replayed entry without a group) is never forgotten: safe, and
bounded by one checkpoint interval a restart.

Not inferred from HELLO: an id missing from a HELLO's pending_ids may still be in a spool file whose removal failed,
or in the spool of an incarnation that restarted with another spool_dir (or none), or with an old incarnation cut off
by a partition and still alive; a missing id proves nothing the learner could forget on.

A duplicate after a confirmation cannot come from a correct actor (every copy of a TRAJ precedes, on its pipe, the
PING that confirms it; a handed-over pipe's leftovers arrive under another identity and are not decoded). If one
comes anyway, an id still tracked is a duplicate as before, and one of the last RECENT forgotten ids is answered as a
duplicate too (counted late_duplicates); an id forgotten longer ago can no longer be told from a new one and is
trained again.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping

from core.stream.messages import MAX_CONFIRM, Ping

log = logging.getLogger(__name__)

RECENT = 1 << 14      # forgotten ids the learner still recognises as duplicates
MAX_IN_FLIGHT = 64    # actor: confirmation PINGs awaiting their PONG (an older one's ids are simply sent again)


class ConsumedIds:
    """Learner side: the consumed ids, the confirmations not yet acted on, and the recently forgotten ids.

    settled: False while a compaction runs or after one failed (a rename that may not be durable yet): ids are then
    only recorded, and settle() forgets them after the next compaction that succeeds."""

    def __init__(self, consumed: Iterable[str] = (), confirmed: Iterable[str] = (),
                 owners: Mapping[str, Iterable[str]] | None = None, warn=None):
        """consumed, confirmed, owners: a checkpoint's (state()); owners maps an identity's hex to its ids.
        warn(reason, fmt, *args): the receiver's throttled warning (a misbehaving peer may repeat itself)."""
        self.lock, self.warn = threading.Lock(), warn
        self.consumed: set[str] = set(consumed)
        self.confirmed: set[str] = set(confirmed)  # pruned to what is tracked by the first settle() (at start)
        self.owner: dict[str, bytes] = {}          # tracked id -> the identity that sent it first
        if not isinstance(owners or {}, Mapping):
            raise ValueError(f"id_owners: a mapping of identities to ids, not {type(owners).__name__}")
        for hexid, ids in (owners or {}).items():
            try:
                ident = bytes.fromhex(hexid)
            except (TypeError, ValueError):
                raise ValueError(f"id_owners: {hexid!r} is not an identity in hex") from None
            self.owner.update(dict.fromkeys(map(str, ids), ident))
        self.settled = False
        self._recent: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.counts = dict.fromkeys(("confirmations", "forgotten", "confirms_ignored", "confirms_foreign",
                                     "late_duplicates"), 0)

    def own(self, tid: str, ident: bytes) -> None:
        """tid was accepted (or replayed) from ident: its confirmations count from ident only. The first owner stays."""
        with self.lock:
            self.owner.setdefault(tid, ident)

    def add(self, ids: Iterable[str]) -> None:
        with self.lock:
            self.consumed.update(ids)

    def known(self, tid: str) -> bool:
        """Consumed, or forgotten recently (a late duplicate: counted)."""
        with self.lock:
            if tid in self.consumed:
                return True
            if tid in self._recent:
                self.counts["late_duplicates"] += 1
                if self.warn is not None:
                    self.warn("late", "trajectory %s came again after its actor confirmed forgetting it", tid)
                return True
        return False

    def confirm(self, ident: bytes, ids: list[str], holds: Callable[[str], bool]) -> None:
        """The actor ident forgot these ids (at most MAX_CONFIRM are read). holds: the durability's."""
        with self.lock:
            self.counts["confirms_ignored"] += max(0, len(ids) - MAX_CONFIRM)
            foreign = 0
            for t in ids[:MAX_CONFIRM]:
                if (owner := self.owner.get(t)) != ident:
                    if owner is not None:
                        foreign += 1
                    self.counts["confirms_ignored"] += 1
                    continue
                if t in self.consumed and self.settled and not holds(t):
                    self._forget(t)
                elif t in self.consumed or holds(t):
                    self.confirmed.add(t)
                else:
                    self.counts["confirms_ignored"] += 1
                    continue
                self.counts["confirmations"] += 1
            if foreign:
                self.counts["confirms_foreign"] += foreign
        if foreign and self.warn is not None:
            self.warn("foreign", "%r confirmed %d trajectory ids another actor sent: ignored", ident, foreign)

    def unsettle(self) -> frozenset[str]:
        """Before a compaction: the consumed ids to drop; nothing is forgotten until settle()."""
        with self.lock:
            self.settled = False
            return frozenset(self.consumed)

    def settle(self, holds: Callable[[str], bool]) -> None:
        """The durability is in a durable state (opened, or compacted): forget what is confirmed and not held by it;
        drop confirmations of ids no longer tracked."""
        with self.lock:
            self.settled = True
            for t in [t for t in self.confirmed if not holds(t)]:
                self.confirmed.discard(t)
                if t in self.consumed:
                    self._forget(t)
            for t in [t for t in self.owner if t not in self.consumed and not holds(t)]:
                del self.owner[t]  # neither consumed nor held: never trained here (a checkpoint run's lost memory)

    def _forget(self, t: str) -> None:
        self.consumed.discard(t)
        self.confirmed.discard(t)
        self.owner.pop(t, None)
        self._recent[t] = None
        if len(self._recent) > RECENT:
            self._recent.popitem(last=False)
        self.counts["forgotten"] += 1

    def state(self) -> dict:
        with self.lock:
            owners: dict[str, list[str]] = {}
            for t, ident in self.owner.items():
                owners.setdefault(ident.hex(), []).append(t)
            return {"consumed_ids": sorted(self.consumed), "confirmed_ids": sorted(self.confirmed),
                    "id_owners": {k: sorted(v) for k, v in sorted(owners.items())}}

    def stats(self) -> dict:
        with self.lock:
            return {**self.counts, "consumed": len(self.consumed), "confirmed_pending": len(self.confirmed),
                    "owned": len(self.owner)}


class Forgotten:
    """Actor side: ids acked for good and forgotten, told to the learner in PINGs until a PONG echoes that PING's cseq.

    Bounded by cap (the oldest beyond it are never confirmed: the learner keeps them, which is safe). An unechoed id is
    sent again after resend_s, and at once after a WELCOME (a learner restart, or PINGs lost on a reconnect: a learner
    that does not know the actor answers WHO without reading them). sync: the spool directory's fsync, run before a
    PING confirms an id whose file was removed since the last one."""

    def __init__(self, cap: int, resend_s: float, sync: Callable[[], None] | None = None):
        self.cap, self.resend_s, self.sync = cap, resend_s, sync
        self._ids: collections.OrderedDict[str, float] = collections.OrderedDict()  # id -> last sent (0: never)
        self._in_flight: collections.OrderedDict[int, list[str]] = collections.OrderedDict()  # cseq -> its ids
        self._cseq = 0
        self._synced = True
        self.dropped = self.sync_errors = 0

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, tid: str) -> None:
        self._ids[tid] = 0.0
        self._synced = False
        if len(self._ids) > self.cap:
            self._ids.popitem(last=False)
            self.dropped += 1

    def ping(self, now: float) -> list[bytes] | None:
        """The frames of a PING confirming up to MAX_CONFIRM due ids, or None (nothing due, or the sync failed)."""
        due = list(itertools.islice((t for t, at in self._ids.items() if not at or now - at > self.resend_s),
                                    MAX_CONFIRM))
        if not due:
            return None
        if not self._synced and self.sync is not None:
            try:
                self.sync()
            except OSError as e:  # their files might come back after a power loss: confirm nothing now
                self.sync_errors += 1
                if not self.sync_errors & (self.sync_errors - 1):  # the 1st, 2nd, 4th, ... failure
                    log.warning("cannot fsync the spool directory (%s, %d times): forgotten ids not confirmed", e,
                                self.sync_errors)
                return None
        self._synced = True
        self._cseq += 1
        for t in due:
            self._ids[t] = now
        self._in_flight[self._cseq] = due
        if len(self._in_flight) > MAX_IN_FLIGHT:
            self._in_flight.popitem(last=False)
        return Ping(self._cseq, due).encode()

    def pings(self, now: float, most: int = 8) -> list[list[bytes]]:
        """The PINGs of one heartbeat: up to `most` of them (most x MAX_CONFIRM ids)."""
        out: list[list[bytes]] = []
        while len(out) < most and (p := self.ping(now)):
            out.append(p)
        return out

    def echoed(self, cseq: int) -> None:
        for t in self._in_flight.pop(cseq, ()):
            self._ids.pop(t, None)

    def resend(self) -> None:
        for t in self._ids:
            self._ids[t] = 0.0
