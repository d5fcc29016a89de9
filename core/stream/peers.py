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
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Peer:
    incarnation: str
    credit: int = 0         # credit granted and not yet spent: each unit is a reserved queue slot
    ledger: int = 0         # episodes this receiver admitted for the actor and has not seen finish
    last_seen: float = 0.0
    claimed: int = 0        # part of the ledger taken on the actor's word (HELLO inflight), not yet borne out
    claim_deadline: float = 0.0

    def finish(self, n: int) -> None:
        """n episodes of the ledger ended without arriving (lost, or NACKed for good)."""
        self.ledger -= n
        self.claimed = min(self.claimed, self.ledger)

    def arrived(self, now: float, ttl: float) -> bool:
        """One of its episodes arrived; False when the ledger does not cover it (the caller adopts it). Claimed
        episodes are borne out first (they started before the HELLO); the remaining claims get ttl more."""
        if not self.ledger:
            return False
        self.ledger -= 1
        if self.claimed:
            self.claimed -= 1
            self.claim_deadline = now + ttl
        return True

    def expire_claims(self, now: float) -> int:
        """Claims past their deadline, taken off the ledger: the caller gives them back (on_lost)."""
        if not self.claimed or now <= self.claim_deadline:
            return 0
        k, self.claimed = self.claimed, 0
        self.ledger -= k
        return k
