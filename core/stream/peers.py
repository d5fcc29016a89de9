"""The learner's view of one actor on the stream (core/stream/receiver.py keeps one per ZMQ identity): its credit,
the episodes admitted for it that have not finished (the ledger), and how much of that ledger rests on its word.

HELLO carries `inflight`: episodes a previous learner admitted that still run on the actor (after a learner
restart). The receiver cannot check that, so the claim is bounded three ways (one HELLO claiming 10**12 froze
admissions for as long as its sender kept pinging):
  * it is taken only in the receiver's first actor_timeout_s: actors re-introduce themselves to a restarted learner
    then, and at any other time a new (or restarted) actor has nothing in flight;
  * never beyond what the admission bound lets start now (learner/staleness.py adopt_claim);
  * what no trajectory from that actor bears out within actor_timeout_s (of the HELLO, or of its last arrival) is
    given back (on_lost). An episode that arrives after all is adopted then, like any arrival no admission covers.

Episodes granted by ADMIT are given back the same way once older than `grant_ttl_s` (learner.stream.grant_ttl_s):
a peer that admits episodes and never sends them, while it keeps pinging, held its share of the admission bound
for good, and a peer that asked for the whole capacity shut admissions for every other actor. The ttl is an
honest episode's longest life; one that arrives later is adopted like any other late arrival. Arrivals and losses
bear out claims first, then the oldest grants.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

# Credit an idle actor keeps when it is reclaimed, and how long without a trajectory makes it idle (see regrant).
KEEP_CREDIT, IDLE_S = 8, 1.0
MAX_PEERS = 4096  # actors one receiver tracks; a HELLO from another identity beyond it is refused (receiver.py)


@dataclass
class Peer:
    incarnation: str
    credit: int = 0         # credit granted and not yet spent: each unit is a reserved queue slot
    ledger: int = 0         # episodes this receiver admitted for the actor and has not seen finish
    last_seen: float = 0.0
    claimed: int = 0        # part of the ledger taken on the actor's word (HELLO inflight), not yet borne out
    claim_deadline: float = 0.0
    last_traj: float = 0.0  # when its last trajectory arrived (or its HELLO): idle since then
    grants: collections.deque = field(default_factory=collections.deque)  # [when, n] of its ADMIT grants, oldest 1st
    granted: int = 0        # the n of `grants`, summed

    def grant(self, now: float, n: int) -> None:
        """ADMIT granted n episodes now."""
        if n > 0:
            self.ledger += n
            self.grants.append([now, n])
            self.granted += n

    def _trim(self) -> None:
        """The grants left are what the ledger holds beyond its claims: the oldest go first."""
        extra = self.granted - (self.ledger - self.claimed)
        while extra > 0 and self.grants:
            take = min(extra, self.grants[0][1])
            self.grants[0][1] -= take
            self.granted -= take
            extra -= take
            if not self.grants[0][1]:
                self.grants.popleft()

    def finish(self, n: int) -> None:
        """n episodes of the ledger ended without arriving (lost, or NACKed for good)."""
        self.ledger -= n
        self.claimed = min(self.claimed, self.ledger)
        self._trim()

    def arrived(self, now: float, ttl: float) -> bool:
        """One of its episodes arrived; False when the ledger does not cover it (the caller adopts it). Claimed
        episodes are borne out first (they started before the HELLO); the remaining claims get ttl more."""
        if not self.ledger:
            return False
        self.ledger -= 1
        if self.claimed:
            self.claimed -= 1
            self.claim_deadline = now + ttl
        self._trim()
        return True

    def expire(self, now: float, grant_ttl: float) -> list[tuple[str, int]]:
        """Claims past their deadline and grants older than grant_ttl (0: never), taken off the ledger, as
        (counter, n): the caller gives them back (on_lost)."""
        out = []
        if self.claimed and now > self.claim_deadline:
            k, self.claimed = self.claimed, 0
            self.ledger -= k
            out.append(("claims_expired", k))
        k = 0
        while grant_ttl > 0 and self.grants and now - self.grants[0][0] > grant_ttl:
            k += self.grants.popleft()[1]
        if k:
            self.ledger -= k
            self.granted -= k
            out.append(("grants_expired", k))
        return out


def regrant(peers: dict[bytes, Peer], credits: int, free: int, now: float) -> list[tuple[bytes, int]]:
    """Credit to send, as (identity, n): n < 0 takes credit back. Credit is the receiver's view of the actor's: what
    it granted minus what arrived, so it may go below 0 while trajectories sent under reclaimed credit are in flight
    (both sides then agree again once they land).

    Fair re-grant: least credit first, up to `credits` each, small grants batched (one CREDIT per ~1/8 window) to
    save messages. Credit an actor holds but does not use is taken back when another wants it and no slot is free:
    an actor that sent nothing for IDLE_S keeps KEEP_CREDIT (idle, paused or wedged actors holding every slot left an
    actor that came later with no credit at all, for good)."""
    out: list[tuple[bytes, int]] = []
    batch = max(1, credits // 8)
    short = sum(min(batch, credits - max(p.credit, 0)) for p in peers.values() if p.credit < min(batch, credits))
    if short > free:
        keep = min(KEEP_CREDIT, credits)
        for ident, p in peers.items():
            if p.credit > keep and now - p.last_traj > IDLE_S:
                out.append((ident, keep - p.credit))
                free += p.credit - keep
                p.credit = keep
    for ident, p in sorted(peers.items(), key=lambda kv: kv[1].credit):
        want = credits - max(p.credit, 0)
        g = min(want, free)
        if g <= 0 or (g < batch and g < want and p.credit > 0):
            continue
        p.credit += g
        free -= g
        out.append((ident, g))
    return out
