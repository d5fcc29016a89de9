"""Ack confirmation (core/stream/confirm.py): the learner forgets a consumed id once its actor confirmed forgetting it
and nothing of the learner's can bring it back, so the consumed set and every checkpoint stay bounded; exactly-once
holds through lost acks, misbehaving re-sends and restarts of the learner from its latest or an older checkpoint."""
import asyncio
import collections
import json
import threading
import time

import pytest
import zmq

from core.stream import confirm
from core.stream import messages as M
from core.stream.sender import TrajectorySender
from core.stream.spool import Spool
from tests.test_stream import FAST, raw_actor, receiver, traj, wait_until


class Trainer(threading.Thread):
    """The training thread of learner/main.py: trains, and every `every` ids checkpoints (state, compact, commit)."""

    def __init__(self, rx, want, every):
        super().__init__(daemon=True)
        self.rx, self.want, self.every = rx, want, every
        self.ids: list[str] = []
        self.ckpts: list[tuple[dict, list[str]]] = []  # (checkpoint_state, the ids trained up to it)

    def run(self):
        end = time.monotonic() + 30
        while len(self.ids) < self.want and time.monotonic() < end:
            tr = self.rx.get(timeout=0.05)
            if tr is None:
                continue
            self.rx.staleness.on_accepted(1)
            self.ids.append(tr.id)
            self.rx.mark_consumed([tr.id])
            if len(self.ids) % self.every == 0:
                self.ckpts.append((checkpoint(self.rx), list(self.ids)))


def checkpoint(rx) -> dict:
    state = rx.checkpoint_state()          # (the weights would be saved with it here)
    rx.compact_wal()
    rx.commit(frozenset(state["consumed_ids"]))
    return state


async def send_trained(s, prefix: str, n: int, trainer: Trainer) -> None:
    """Start s, send n trajectories (ids prefix0..), wait until the trainer has taken them all and s holds no unacked."""
    await s.start()
    for i in range(n):
        await s.send(traj(f"{prefix}{i}"), timeout=10)
    await asyncio.to_thread(trainer.join, 30)
    await s.flush(timeout=10)


def settle_all(rx, timeout=10.0) -> dict:
    """Checkpoints (what the training loop does) until every consumed id is forgotten; the last state."""
    last = {}
    wait_until(lambda: not last.update(checkpoint(rx)) and not last["consumed_ids"], timeout)
    return last


@pytest.mark.parametrize("durability", ["wal", "checkpoint"])
def test_long_stream_keeps_the_consumed_set_and_checkpoints_bounded(tmp_path, durability):
    N, EVERY = 1200, 100
    rx = receiver(tmp_path, durability=durability, credits=32, queue_size=128)
    addr = rx.start()
    tr = Trainer(rx, N, EVERY)
    tr.start()

    async def main():
        s = TrajectorySender(addr, "long", window=64, spool_dir=str(tmp_path / "spool"), **FAST)
        await s.start()
        for k in range(N // EVERY):          # in rounds, so what each checkpoint may hold does not depend on timing
            for i in range(k * EVERY, (k + 1) * EVERY):
                await s.send(traj(f"L{i}"), timeout=10)
            assert await asyncio.to_thread(wait_until, lambda: len(tr.ckpts) == k + 1, 10)
            # acked for good (checkpoint mode: by that checkpoint's commit), then confirmed and echoed
            assert await asyncio.to_thread(wait_until, lambda: s.stats()["pending"] == s.stats()["unconfirmed"] == 0,
                                           10)
        await asyncio.to_thread(tr.join, 10)
        st = s.stats()
        await s.close()
        return st

    st = asyncio.run(main())
    final = settle_all(rx)
    stats = rx.stats()
    rx.stop()
    assert len(tr.ids) == N and collections.Counter(tr.ids).most_common(1)[0][1] == 1
    sizes = [len(c["consumed_ids"]) for c, _ in tr.ckpts]
    # Before: the set and each checkpoint held every id of the run (100, 200, ..., 1200).
    assert sizes == [EVERY] * (N // EVERY), sizes    # only what was trained since the last checkpoint
    assert final == {"consumed_ids": [], "confirmed_ids": [], "id_owners": {}} and stats["consumed"] == 0
    assert stats["owned"] == 0 and stats["confirms_foreign"] == 0
    assert stats["forgotten"] == N and stats["confirmed_pending"] == 0 and stats["confirms_ignored"] == 0
    assert len(json.dumps(final)) < 100 and st["confirms_dropped"] == 0 and st["pending"] == 0
    assert stats["duplicates"] == 0 and stats["late_duplicates"] == 0


def _hello(d, inc, pending=()):
    d.send_multipart(M.Hello("raw", inc, 1, list(pending)).encode())
    return M.decode(M.TO_ACTOR, *_recv_until(d, M.Welcome)[-1])


def _recv_until(d, kind, timeout=10.0):
    end = time.monotonic() + timeout
    out = []
    while time.monotonic() < end:
        if d.poll(50):
            frames = d.recv_multipart()
            out.append(frames)
            if isinstance(M.decode(M.TO_ACTOR, *frames), kind):
                return out
    raise TimeoutError(f"no {kind.__name__}")


def _send(d, tid):
    d.send_multipart([M.TRAJ, M.pack({"seq": 1, "id": tid}), traj(tid).encode()])
    return M.decode(M.TO_ACTOR, *_recv_until(d, M.Ack)[-1])


def _ping(d, cseq, forgot):
    d.send_multipart(M.Ping(cseq, forgot).encode())
    return M.decode(M.TO_ACTOR, *_recv_until(d, M.Pong)[-1])


def _train(rx, tid):
    got = rx.get(timeout=5)
    assert got is not None and got.id == tid
    rx.staleness.on_accepted(1)
    rx.mark_consumed([tid])


def test_lost_ack_keeps_the_id_and_a_resend_is_still_a_duplicate(tmp_path):
    """An actor that never confirms (its ACK lost, or an older actor) keeps its ids in the consumed set; a HELLO that
    leaves them out confirms nothing; duplicates after a confirmation are not trained again."""
    rx = receiver(tmp_path, credits=16, queue_size=16)
    addr = rx.start()
    d = raw_actor(addr)
    try:
        assert _hello(d, "i1").confirms
        assert _send(d, "t1").ids == ["t1"]           # this ACK "is lost": the actor keeps t1 and confirms nothing
        _train(rx, "t1")
        checkpoint(rx)
        assert _ping(d, 7, ["nope", "t9"]).cseq == 7  # ids the learner does not track: ignored
        assert checkpoint(rx)["consumed_ids"] == ["t1"] and rx.stats()["confirmed_pending"] == 0
        assert _send(d, "t1").ids == ["t1"]           # the re-send: a duplicate, acked, not queued
        assert rx.get(timeout=0.2) is None and rx.stats()["duplicates"] == 1
        assert _hello(d, "i2", pending=[]).confirms   # a new incarnation without t1: proves nothing
        assert checkpoint(rx)["consumed_ids"] == ["t1"]
        assert _send(d, "t1").ids == ["t1"] and rx.get(timeout=0.2) is None

        assert _send(d, "t2").ids == ["t2"]           # confirmed while still in the WAL, not yet trained:
        _ping(d, 8, ["t2"])
        assert rx.stats()["confirmed_pending"] == 1   # recorded, not forgotten
        assert _send(d, "t2").ids == ["t2"]           # (a misbehaving re-send: still a duplicate)
        _train(rx, "t2")
        assert rx.get(timeout=0.2) is None
        state = checkpoint(rx)                        # the checkpoint lists t2 and its confirmation, then compacts
        raw = b"raw".hex()
        assert state == {"consumed_ids": ["t1", "t2"], "confirmed_ids": ["t2"], "id_owners": {raw: ["t1", "t2"]}}
        assert rx.checkpoint_state() == {"consumed_ids": ["t1"], "confirmed_ids": [], "id_owners": {raw: ["t1"]}}
        _ping(d, 9, ["t1"])                           # confirmed after its compaction: forgotten at once
        assert rx.checkpoint_state() == {"consumed_ids": [], "confirmed_ids": [], "id_owners": {}}
        assert _send(d, "t1").ids == ["t1"] and _send(d, "t2").ids == ["t2"]  # recently forgotten: still duplicates
        assert rx.get(timeout=0.2) is None
        s = rx.stats()
        assert s["late_duplicates"] == 2 and s["forgotten"] == 2 and s["accepted"] == 2 and s["confirms_ignored"] == 2
    finally:
        d.close()
        rx.stop()


@pytest.mark.parametrize("restore", ["latest", "older"])
def test_learner_restart_from_a_checkpoint_stays_exactly_once(tmp_path, restore):
    """A learner restored from its latest checkpoint forgets at once what that checkpoint's confirmations allow; one
    restored from an older checkpoint trains nothing twice either (what it lost went into the abandoned lineage)."""
    N = 200
    rx1 = receiver(tmp_path, credits=32, queue_size=64)
    addr = rx1.start()
    tr1 = Trainer(rx1, N, 60)                          # the last 20 are still in the WAL at the final checkpoint
    tr1.start()
    out = {}

    async def main():
        s = TrajectorySender(addr, "rs", window=64, **FAST)
        await send_trained(s, "a", N, tr1)
        assert await asyncio.to_thread(wait_until, lambda: s.stats()["unconfirmed"] == 0, 10)
        last = checkpoint(rx1)                        # the trainer stopped: the final checkpoint, all confirmed
        assert last["confirmed_ids"], "the latest checkpoint should carry confirmations of ids still in its WAL"
        state, prefix = (last, list(tr1.ids)) if restore == "latest" else tr1.ckpts[1]  # older: after 120
        await asyncio.to_thread(rx1.stop)
        rx2 = receiver(tmp_path, bind=addr, credits=32, queue_size=64, consumed_ids=state["consumed_ids"],
                       confirmed_ids=state["confirmed_ids"])
        assert rx2.start() == addr
        out["at_start"], out["older_consumed"] = rx2.stats(), state["consumed_ids"]
        tr2 = Trainer(rx2, N, 50)
        tr2.start()
        for i in range(N):
            await s.send(traj(f"b{i}"), timeout=15)
        await asyncio.to_thread(tr2.join, 30)
        await s.flush(timeout=10)
        assert await asyncio.to_thread(wait_until, lambda: s.stats()["unconfirmed"] == 0, 10)
        out["sender"] = s.stats()
        await s.close()
        return rx2, prefix, tr2.ids

    rx2, prefix, second = asyncio.run(main())
    final = settle_all(rx2)
    s2 = rx2.stats()
    rx2.stop()
    c = collections.Counter(prefix + second)
    assert max(c.values()) == 1                       # nothing trained twice in the lineage that goes on
    assert set(second) == {f"b{i}" for i in range(N)} and s2["replayed"] == 0
    if restore == "latest":                           # the checkpoint's confirmations: forgotten at start
        assert out["at_start"]["forgotten"] > 0 and out["at_start"]["consumed"] == 0
        assert set(prefix) == {f"a{i}" for i in range(N)}
        assert final["consumed_ids"] == [] and s2["consumed"] == 0
    else:  # ids that checkpoint lists unconfirmed were confirmed to the abandoned lineage: kept (safe, bounded by it)
        assert s2["consumed"] <= len(out["older_consumed"])
    assert s2["duplicates"] == 0
    assert out["sender"]["pending"] == 0 and out["sender"]["restarts_seen"] == 1


def test_wire_fields_are_optional_both_ways():
    """Old peers: an old actor's PING and an old learner's WELCOME / PONG decode; defaults encode as before."""
    assert M.Ping().encode() == [M.PING, M.pack({})]
    assert M.Ping.from_body({}) == M.Ping() and M.Ping.from_body({"cseq": 3, "forgot": ["a"]}) == M.Ping(3, ["a"])
    w = M.Welcome("r", 1, 0, 8, 1024)
    assert "confirms" not in w.body() and not M.Welcome.from_body(w.body()).confirms
    assert M.Welcome.from_body(M.Welcome("r", 1, 0, 8, 1024, True).body()).confirms
    assert M.Pong("r").body() == {"run_id": "r"} and M.Pong.from_body({"run_id": "r", "cseq": 4}).cseq == 4
    with pytest.raises(M.ProtocolError):
        M.Ping.from_body({"forgot": [1]})


def test_forgotten_is_bounded_resent_until_echoed_and_synced_first():
    syncs = []
    f = confirm.Forgotten(cap=5, resend_s=1.0, sync=lambda: syncs.append(1))
    for i in range(7):
        f.add(f"x{i}")
    assert len(f) == 5 and f.dropped == 2             # the oldest are never confirmed: the learner keeps them
    p = M.decode(M.TO_LEARNER, *f.ping(10.0))
    assert p.forgot == [f"x{i}" for i in range(2, 7)] and syncs == [1]
    assert f.ping(10.5) is None                       # sent, not yet due again
    assert M.decode(M.TO_LEARNER, *f.ping(11.1)).forgot == p.forgot and syncs == [1]  # nothing new: no sync
    f.echoed(p.cseq)
    assert len(f) == 0 and f.ping(20.0) is None
    f.add("y")
    f.sync = lambda: (_ for _ in ()).throw(OSError("EIO"))
    assert f.ping(30.0) is None and len(f) == 1       # the spool's directory not synced: not confirmed yet
    f.sync = None
    assert len(f.pings(30.0)) == 1
    f.resend()
    assert M.decode(M.TO_LEARNER, *f.ping(30.1)).forgot == ["y"]


def test_a_confirmation_counts_only_from_the_actor_that_sent_the_id(tmp_path):
    """Another peer that knows an actor's ids cannot make the learner forget them (a re-send after a lost ACK would
    then be trained twice), not even after sending one of them itself; the owner survives a learner restart."""
    rx = receiver(tmp_path, credits=16, queue_size=16)
    addr = rx.start()
    d, evil = raw_actor(addr), raw_actor(addr, b"evil")
    try:
        _hello(d, "i1")
        _hello(evil, "e1")
        assert _send(d, "t1").ids == ["t1"]
        _train(rx, "t1")
        checkpoint(rx)
        assert _ping(evil, 3, ["t1"]).cseq == 3       # answered, so the peer cannot tell, and ignored
        assert _send(evil, "t1").ids == ["t1"]        # its own copy: a duplicate, which does not make it the owner
        _ping(evil, 4, ["t1"])
        state = checkpoint(rx)
        assert state["consumed_ids"] == ["t1"] and state["id_owners"] == {b"raw".hex(): ["t1"]}
        s = rx.stats()
        assert s["confirms_foreign"] == 2 and s["forgotten"] == 0 and s["duplicates"] == 1
        assert _send(d, "t1").ids == ["t1"] and rx.get(timeout=0.2) is None  # the owner's re-send: a duplicate
        assert rx.stats()["late_duplicates"] == 0
    finally:
        d.close()
        evil.close()
        rx.stop()
    rx2 = receiver(tmp_path, bind=addr, credits=16, queue_size=16, consumed_ids=state["consumed_ids"],
                   confirmed_ids=state["confirmed_ids"], id_owners=state["id_owners"])
    rx2.start()
    d, evil = raw_actor(addr), raw_actor(addr, b"evil")
    try:
        _hello(d, "i1")
        _hello(evil, "e1")
        _ping(evil, 1, ["t1"])
        assert rx2.checkpoint_state()["consumed_ids"] == ["t1"] and rx2.stats()["confirms_foreign"] == 1
        _ping(d, 1, ["t1"])                           # the owner, known from the checkpoint
        assert rx2.checkpoint_state() == {"consumed_ids": [], "confirmed_ids": [], "id_owners": {}}
    finally:
        d.close()
        evil.close()
        rx2.stop()
    with pytest.raises(ValueError, match="not an identity in hex"):
        receiver(tmp_path, id_owners={"zz": ["t1"]})
    with pytest.raises(ValueError, match="a mapping of identities"):
        receiver(tmp_path, id_owners=["t1"])


def test_confirmations_lost_with_a_learner_are_sent_again_to_the_next(tmp_path):
    """PINGs a learner never answered (it died): the actor sends their ids again after the next learner's WELCOME,
    and that learner, restored from a checkpoint that knows their owner, forgets them."""
    N = 60
    rx1 = receiver(tmp_path, credits=32, queue_size=64)
    addr = rx1.start()
    send1 = rx1._send                                  # confirmations lost: neither read nor echoed
    rx1._send = lambda ident, m: None if isinstance(m, M.Pong) and m.cseq else send1(ident, m)
    rx1._ids.confirm = lambda *a: None
    tr1 = Trainer(rx1, N, N)
    tr1.start()
    out = {}

    async def main():
        s = TrajectorySender(addr, "lost", window=64, **FAST)
        await send_trained(s, "c", N, tr1)
        assert await asyncio.to_thread(wait_until, lambda: s.stats()["unconfirmed"] == N, 10)
        state = tr1.ckpts[-1][0]
        assert len(state["consumed_ids"]) == N and not state["confirmed_ids"]
        assert state["id_owners"] == {b"lost".hex(): sorted(f"c{i}" for i in range(N))}
        await asyncio.to_thread(rx1.stop)
        rx2 = receiver(tmp_path, bind=addr, credits=32, queue_size=64, consumed_ids=state["consumed_ids"],
                       confirmed_ids=state["confirmed_ids"], id_owners=state["id_owners"])
        assert rx2.start() == addr
        assert await asyncio.to_thread(wait_until, lambda: s.stats()["unconfirmed"] == 0, 15)
        out["sender"] = s.stats()
        await s.close()
        return rx2

    rx2 = asyncio.run(main())
    s2 = rx2.stats()
    state = rx2.checkpoint_state()
    rx2.stop()
    assert s2["forgotten"] == N and s2["consumed"] == 0 and s2["confirms_ignored"] == 0
    assert state == {"consumed_ids": [], "confirmed_ids": [], "id_owners": {}}
    assert out["sender"]["restarts_seen"] == 1 and out["sender"]["pending"] == 0


def test_a_spool_file_that_cannot_be_removed_is_not_confirmed(tmp_path):
    """An acked id whose spool file stays (unlink failed) may be loaded and sent again by a restarted actor: it is not
    confirmed, so the learner keeps recognising it; the rest of that ACK is handled as usual."""
    rx = receiver(tmp_path, credits=32, queue_size=64)
    addr = rx.start()
    tr = Trainer(rx, 3, 3)
    tr.start()

    async def main():
        s = TrajectorySender(addr, "sp", window=8, spool_dir=str(tmp_path / "spool"), **FAST)
        remove = s._spool.remove
        s._spool.remove = lambda tid: (_ for _ in ()).throw(OSError(5, "EIO")) if tid == "x1" else remove(tid)
        await s.start()
        for i in range(3):
            await s.send(traj(f"x{i}"), timeout=10)
        await s.flush(timeout=10)
        assert await asyncio.to_thread(wait_until, lambda: s.stats()["unconfirmed"] == 0, 10)
        st = s.stats()
        await s.close()
        return st

    st = asyncio.run(main())
    tr.join(10)
    final = settle_all(rx, timeout=2)
    rx.stop()
    assert st["spool_errors"] == 1 and st["unspooled"] == 2 and st["pending"] == 0
    assert final["consumed_ids"] == ["x1"]            # the others confirmed and forgotten
    assert [tid for tid, _, _ in Spool(str(tmp_path / "spool")).load()] == ["x1"]  # what a restart would re-send
