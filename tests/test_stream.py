"""Trajectory stream over real sockets on 127.0.0.1: delivery, flow control, bad frames, dedupe, restarts, admission."""
import asyncio
import collections
import io
import os
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from learner.staleness import StalenessManager
from core.stream import messages as P
from core.schema import Trajectory, Turn
from core.stream.receiver import TrajectoryReceiver
from core.stream.sender import TrajectorySender

FAST = dict(heartbeat_s=0.05, dead_after_s=1.0)


def traj(tid: str, n: int = 32) -> Trajectory:
    return Trajectory(id=tid, env_id="builtin/test", outcome="terminated", tokens=np.arange(n, dtype=np.int32),
                      logprobs=np.full(n, -0.5, np.float32), versions=np.zeros(n, np.int32),
                      mask=np.ones(n, np.uint8), turns=[Turn("text:1", "out", {}, 1.0, 0, n)], ret=1.0)


def receiver(tmp_path, bind="tcp://127.0.0.1:0", stal=None, **kw):
    stal = stal or StalenessManager(batch_size=8, eta=1000)
    return TrajectoryReceiver(bind, str(tmp_path / "wal.log"), stal, **kw)


class Consumer(threading.Thread):
    """The training thread: takes trajectories, resolves their staleness accounting, marks them consumed."""

    def __init__(self, rx, want=None, delay=0.0):
        super().__init__(daemon=True)
        self.rx, self.want, self.delay = rx, want, delay
        self.ids: list[str] = []
        self.halt = threading.Event()

    def run(self):
        while not self.halt.is_set() and (self.want is None or len(self.ids) < self.want):
            tr = self.rx.get(timeout=0.05)
            if tr is None:
                continue
            self.rx.staleness.on_accepted(1)
            self.ids.append(tr.id)
            self.rx.mark_consumed([tr.id])
            if self.delay:
                time.sleep(self.delay)


def wait_until(pred, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def test_two_actors_1000_arrive_exactly_once(tmp_path):
    rx = receiver(tmp_path, credits=64, queue_size=256)
    addr = rx.start()
    con = Consumer(rx, want=1000)
    con.start()

    async def actor(name):
        s = TrajectorySender(addr, name, window=128, **FAST)
        await s.start()
        for i in range(500):
            await s.send(traj(f"{name}-{i}"), timeout=10)
        await s.flush(timeout=10)
        st = s.stats()
        await s.close()
        return st

    async def main():
        return await asyncio.gather(actor("a0"), actor("a1"))

    stats = asyncio.run(main())
    con.join(10)
    rx.stop()
    assert sorted(con.ids) == sorted(f"a{k}-{i}" for k in range(2) for i in range(500))
    s = rx.stats()
    assert s["accepted"] == 1000 and s["duplicates"] == 0 and s["acked"] == 1000 and s["queue_max"] <= 256
    assert all(st["sent"] == 500 and st["acked"] == 500 and st["pending"] == 0 for st in stats)
    assert rx.staleness.stats()["running"] == 0 and rx.staleness.stats()["accepted"] == 1000


def test_slow_consumer_blocks_the_sender_not_the_learner(tmp_path):
    rx = receiver(tmp_path, credits=8, queue_size=16)
    addr = rx.start()

    async def main():
        s = TrajectorySender(addr, "slow", window=64, **FAST)
        await s.start()
        # exactly the queue's slots: each of the 16 gets credit (a slow receiver may take a while to grant it),
        # then credit runs out and nothing more is sent or buffered
        for i in range(16):
            await s.send(traj(f"t{i}"), timeout=10)
        sent = 16
        with pytest.raises(TimeoutError):
            await s.send(traj("t16"), timeout=1.0)
        assert wait_until(lambda: rx.qsize() == 16, 10)
        con = Consumer(rx, delay=0.002)
        con.start()
        for i in range(sent, 200):                 # t16 (timed out, never sent) is sent again here
            await s.send(traj(f"t{i}"), timeout=10)
        await s.flush(timeout=10)
        await s.close()
        assert wait_until(lambda: len(con.ids) == 200, 10)
        con.halt.set()
        con.join(2)
        return con.ids

    ids = asyncio.run(main())
    rx.stop()
    assert sorted(ids) == sorted(f"t{i}" for i in range(200))
    assert rx.stats()["queue_max"] <= 16


def raw_actor(addr, name=b"raw"):
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    d.routing_id = name
    d.linger = 0
    d.connect(addr)
    return d


def recv_until(d, tag, timeout=10.0):
    """Messages from the learner up to and including the first with `tag`."""
    out = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if d.poll(50):
            t, b = d.recv_multipart()
            out.append((t, P.unpack(b)))
            if t == tag:
                return out
    raise TimeoutError(f"no {tag!r}; got {[t for t, _ in out]}")


def test_bad_frames_are_counted_and_the_receiver_keeps_working(tmp_path):
    stal = StalenessManager(batch_size=100, eta=0)
    rejected = []
    rx = receiver(tmp_path, stal=stal, max_frame_bytes=4096, on_reject=lambda a, t, r: rejected.append((a, t, r)))
    addr = rx.start()
    d = raw_actor(addr)
    d.send_multipart([P.PING, b"\x80"])                    # before HELLO: told to introduce itself
    assert recv_until(d, P.WHO)[-1][0] == P.WHO
    d.send_multipart([P.HELLO, P.pack({"actor": "raw", "incarnation": "x", "hello_id": 1, "pending_ids": []})])
    welcome = recv_until(d, P.WELCOME)[-1][1]
    assert welcome["max_frame_bytes"] == 4096 and welcome["hello_id"] == 1
    d.send_multipart([P.ADMIT, P.pack({"rid": 7, "n": 5})])
    assert recv_until(d, P.GRANT)[-1][1] == {"rid": 7, "granted": 5, "version": 0}

    good = traj("ok-1").encode()
    wrong_schema = msgpack.packb({**traj("v99").to_dict(), "schema": 99}, use_bin_type=True)
    cases = [("garbage", b"\xc1\xff\x00garbage", "malformed"), ("trunc", good[:-7], "malformed"),
             ("v99", wrong_schema, "unknown_schema"), ("big", traj("big", 2000).encode(), "oversize"),
             ("ok-1", traj("other-id").encode(), "malformed")]              # header id != payload id
    for tid, payload, _ in cases:
        d.send_multipart([P.TRAJ, P.pack({"seq": 1, "id": tid}), payload])
    nacks = [b for t, b in recv_until(d, P.NACK) + [recv_until(d, P.NACK)[-1] for _ in range(4)] if t == P.NACK]
    assert [n["id"] for n in nacks] == [c[0] for c in cases] and not any(n["retry"] for n in nacks)
    assert [n["reason"].split(":")[0] for n in nacks] == [c[2] for c in cases]
    d.send_multipart([P.TRAJ, b"\xc1", good])                              # unparseable header: protocol error
    d.send_multipart([b"only-one-frame"])
    d.send_multipart([P.TRAJ, P.pack({"seq": 2, "id": "ok-1"}), good])    # and a good one still goes through
    assert recv_until(d, P.ACK)[-1][1] == {"ids": ["ok-1"]}
    d.close()
    s = rx.stats()
    assert (s["malformed"], s["unknown_schema"], s["oversize"], s["protocol_errors"], s["accepted"]) == (3, 1, 1, 2, 1)
    assert len(rejected) == 5
    # 5 admitted: 5 NACKed frames are rejected episodes; the good one arrived uncovered and was adopted.
    assert stal.stats()["rejected"] == 5 and stal.stats()["running"] == 1
    assert rx.get(timeout=10).id == "ok-1"

    async def sender_still_works():
        s = TrajectorySender(addr, "a", **FAST)
        await s.start()
        with pytest.raises(ValueError):                                   # the actor knows the learner's limit
            await s.send(traj("huge", 2000), timeout=1)
        await s.send(traj("fine"), timeout=10)
        await s.flush(timeout=10)
        await s.close()

    asyncio.run(sender_still_works())
    assert rx.get(timeout=10).id == "fine"
    rx.stop()


def test_every_message_round_trips_and_a_malformed_body_raises_one_error():
    msgs = [P.Hello("a", "inc", 3, ["x"], 2), P.Traj(1, "t", ["h"]), P.Admit(7, 5), P.Lost(1), P.Ping(),
            P.Welcome("r", 3, 0, 8, 4096), P.Credit(4), P.Ack(["t"]), P.Ack(["t"], held="r"),
            P.Nack(None, "malformed: x", False), P.Nack("t", "missing images: 1", True, ["h"]), P.Grant(7, 5, 0),
            P.Version(2), P.Pong("r"), P.Who()]
    assert len({type(m) for m in msgs}) == 13
    for m in msgs:
        assert P.decode(P.TO_LEARNER if m.TAG in P.TO_LEARNER else P.TO_ACTOR, *m.encode()) == m
    # The bytes earlier builds wrote and read: optional fields are left out when empty, and may be absent.
    assert P.unpack(P.Ack(["t"]).encode()[1]) == {"ids": ["t"]}
    assert P.unpack(P.Nack("t", "r", False).encode()[1]) == {"id": "t", "reason": "r", "retry": False}
    assert P.Ping().encode() == [P.PING, b"\x80"]
    assert P.parse(P.TO_LEARNER, P.HELLO, {"actor": "a", "incarnation": "i", "hello_id": 1}) == P.Hello("a", "i", 1)
    assert P.parse(P.TO_LEARNER, P.TRAJ, {"seq": 1, "id": "t"}) == P.Traj(1, "t", [])
    bad = [(P.TO_LEARNER, P.HELLO, {"actor": "a", "incarnation": 5, "hello_id": 1}),
           (P.TO_LEARNER, P.HELLO, {"actor": "a", "incarnation": "i", "hello_id": 1, "pending_ids": 5}),
           (P.TO_LEARNER, P.ADMIT, {"rid": 1}), (P.TO_LEARNER, P.LOST, {"n": "1"}), (P.TO_ACTOR, P.ACK, {"ids": "t"}),
           (P.TO_ACTOR, P.CREDIT, {"n": True}), (P.TO_ACTOR, P.NACK, {"id": 3, "reason": "r", "retry": False}),
           (P.TO_ACTOR, P.WELCOME, {}), (P.TO_ACTOR, P.HELLO, {}), (P.TO_LEARNER, b"Z", {})]
    for kinds, tag, body in bad:
        with pytest.raises(P.ProtocolError):
            P.parse(kinds, tag, body)
    for raw in (b"\xc1", msgpack.packb([1, 2])):
        with pytest.raises(P.ProtocolError):
            P.decode(P.TO_LEARNER, P.PING, raw)
    with pytest.raises(P.ProtocolError) as e:
        P.parse(P.TO_LEARNER, P.TRAJ, {"id": "t", "images": "h"})
    assert e.value.msg_id == "t"                          # a refused TRAJ header still names its trajectory


def test_ill_typed_messages_count_as_protocol_errors_and_an_ill_typed_traj_is_nacked(tmp_path):
    rx = receiver(tmp_path)
    addr = rx.start()
    d = raw_actor(addr)
    d.send_multipart([P.HELLO, P.pack({"actor": "raw", "incarnation": 5, "hello_id": 1})])   # never answered
    d.send_multipart(P.Hello("raw", "x", 2).encode())
    assert recv_until(d, P.WELCOME)[-1][1]["hello_id"] == 2
    d.send_multipart([P.ADMIT, P.pack({"rid": "seven", "n": 5})])
    d.send_multipart([P.TRAJ, P.pack({"id": "no-seq"}), traj("no-seq").encode()])
    nack = recv_until(d, P.NACK)[-1][1]
    assert nack["id"] == "no-seq" and nack["reason"].startswith("malformed") and not nack["retry"]
    d.close()
    s = rx.stats()
    rx.stop()
    assert (s["protocol_errors"], s["malformed"], s["received"], s["accepted"], s["hellos"]) == (2, 1, 1, 0, 1)


def test_duplicate_ids_are_acked_but_delivered_once(tmp_path):
    rx = receiver(tmp_path)
    addr = rx.start()

    async def main():
        s = TrajectorySender(addr, "dup", **FAST)
        await s.start()
        for _ in range(3):
            await s.send(traj("same"), timeout=10)
        await s.send(traj("other"), timeout=10)
        await s.flush(timeout=10)
        rx.mark_consumed(["other"])
        await s.send(traj("other"), timeout=10)                             # consumed already: still a duplicate
        await s.flush(timeout=10)
        st = s.stats()
        await s.close()
        return st

    st = asyncio.run(main())
    got = [rx.get(timeout=0.5) for _ in range(3)]
    rx.stop()
    assert [t.id for t in got if t] == ["same", "other"]
    assert rx.stats()["duplicates"] == 3 and st["pending"] == 0


def test_learner_restart_delivers_every_trajectory_exactly_once(tmp_path):
    N = 300
    # queue_size: room for 128 past the consumer's 100, so the actor is still sending (and holds credit) when the
    # test sees accepted > 100 and kills rx1; with 64 a fast receiver filled it first and nothing went into the void.
    rx1 = receiver(tmp_path, credits=32, queue_size=128)
    addr = rx1.start()
    trained: list[str] = []

    async def main():
        s = TrajectorySender(addr, "act", window=64, **FAST)
        await s.start()

        async def produce():
            for i in range(N):
                await s.send(traj(f"r{i}"), timeout=15)

        prod = asyncio.create_task(produce())
        con1 = Consumer(rx1, want=100)
        con1.start()
        await asyncio.to_thread(con1.join, 10)
        trained.extend(con1.ids)
        # The point of the test is a restart with trajectories acked but not consumed: wait (with a deadline) until
        # the receiver holds some past the consumer's 100, instead of hoping the sender got ahead of it.
        deadline = asyncio.get_running_loop().time() + 10
        while rx1.stats()["accepted"] <= 100 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.002)
        ckpt = rx1.checkpoint_state()                 # taken with the weights that trained on con1.ids
        await asyncio.to_thread(rx1.stop)
        acked_unconsumed = rx1.stats()["accepted"] - 100
        assert acked_unconsumed > 0                   # the new receiver must replay these from the WAL
        await asyncio.sleep(0.3)                      # the actor keeps sending into the void meanwhile
        rx2 = receiver(tmp_path, bind=addr, consumed_ids=ckpt["consumed_ids"], credits=32, queue_size=64)
        assert rx2.start() == addr
        con2 = Consumer(rx2, want=N - 100)
        con2.start()
        await prod
        await s.flush(timeout=15)
        await asyncio.to_thread(con2.join, 15)
        trained.extend(con2.ids)
        st = s.stats()
        await s.close()
        return rx2, st, acked_unconsumed

    rx2, st, acked_unconsumed = asyncio.run(main())
    s2 = rx2.stats()
    assert rx2.compact_wal() == {"kept": 0, "dropped": s2["wal_entries"], "images_collected": 0}  # all consumed: the log empties
    rx2.stop()
    c = collections.Counter(trained)
    assert set(c) == {f"r{i}" for i in range(N)} and max(c.values()) == 1
    assert s2["replayed"] >= acked_unconsumed and st["restarts_seen"] == 1 and st["pending"] == 0
    assert rx2.staleness.stats()["running"] == 0      # replayed + adopted trajectories all resolved, none twice
    assert s2["wal_entries"] == N and st["resent"] > 0   # each written once; the void-sent ones were re-sent


def test_checkpoint_durability_holds_until_commit_and_frees_the_window(tmp_path):
    """durability="checkpoint": no WAL; a held trajectory leaves the send window but stays in the outbox, is never
    re-sent to the run that holds it, and is forgotten only once commit() covers it."""
    rx = receiver(tmp_path, durability="checkpoint", credits=16, queue_size=64)
    addr = rx.start()
    con = Consumer(rx, want=40)
    con.start()

    async def main():
        s = TrajectorySender(addr, "ck", window=8, resend_after_s=0.2, **FAST)
        await s.start()
        for i in range(40):                              # 5x the window, nothing committed yet
            await s.send(traj(f"c{i}"), timeout=5)
        await asyncio.to_thread(con.join, 5)
        assert await asyncio.to_thread(wait_until, lambda: s.stats()["held"] == 40)
        await asyncio.sleep(0.6)                         # three re-send periods: held entries are not re-sent
        held = s.stats()
        with pytest.raises(TimeoutError):
            await s.flush(timeout=0.2)                   # not durable yet
        rx.commit(con.ids[:25])                          # a checkpoint covering the first 25
        assert await asyncio.to_thread(wait_until, lambda: s.stats()["pending"] == 15)
        rx.commit(con.ids)
        await s.flush(timeout=5)
        st = s.stats()
        await s.close()
        return held, st

    held, st = asyncio.run(main())
    stats = rx.stats()
    rx.stop()
    assert held["pending"] == 40 and held["resent"] == 0 and stats["duplicates"] == 0
    assert st["pending"] == st["held"] == 0 and st["acked"] == 40 and stats["committed"] == 40
    assert sorted(con.ids) == sorted(f"c{i}" for i in range(40)) and not (tmp_path / "wal.log").exists()


def test_checkpoint_durability_restart_resends_only_what_no_checkpoint_covered(tmp_path):
    rx1 = receiver(tmp_path, durability="checkpoint", credits=32, queue_size=64)
    addr = rx1.start()

    async def main():
        s = TrajectorySender(addr, "act", window=64, **FAST)
        await s.start()
        for i in range(60):
            await s.send(traj(f"k{i}"), timeout=5)
        con1 = Consumer(rx1, want=45)                    # trains on 45, checkpoints after 30 of them
        con1.start()
        await asyncio.to_thread(con1.join, 5)
        ckpt = {"consumed_ids": con1.ids[:30]}
        rx1.commit(ckpt["consumed_ids"])
        assert await asyncio.to_thread(wait_until, lambda: s.stats()["pending"] == 30)
        await asyncio.to_thread(rx1.stop)               # dies: 15 trained past the checkpoint + 15 queued are lost
        rx2 = receiver(tmp_path, bind=addr, durability="checkpoint", consumed_ids=ckpt["consumed_ids"], credits=32,
                       queue_size=64)
        assert rx2.start() == addr
        con2 = Consumer(rx2, want=30)
        con2.start()
        await asyncio.to_thread(con2.join, 10)
        rx2.commit(con2.ids)
        await s.flush(timeout=5)
        st = s.stats()
        await s.close()
        return con1.ids[:30], con2.ids, rx2, st

    first, second, rx2, st = asyncio.run(main())
    s2 = rx2.stats()
    rx2.stop()
    assert sorted(first + second) == sorted(f"k{i}" for i in range(60))
    assert not set(first) & set(second) and st["resent"] == 30 and st["restarts_seen"] == 1
    assert s2["duplicates"] == 0 and s2["replayed"] == 0 and st["pending"] == 0
    assert rx2.staleness.stats()["running"] == 0


def test_unknown_durability_is_refused(tmp_path):
    with pytest.raises(ValueError, match="durability"):
        receiver(tmp_path, durability="memory")


def test_admission_round_trip_and_lost(tmp_path):
    stal = StalenessManager(batch_size=4, eta=0)
    rx = receiver(tmp_path, stal=stal)
    addr = rx.start()

    async def main():
        s = TrajectorySender(addr, "adm", **FAST)
        await s.start()
        assert await s.admit(10, timeout=10) == (4, 0)      # eta=0: one batch per version
        assert await s.admit(1, timeout=10) == (0, 0)
        for i in range(3):
            await s.send(traj(f"e{i}"), timeout=10)
        await s.lost(1)                                    # the 4th episode was abandoned
        await s.flush(timeout=10)
        for _ in range(3):
            assert rx.get(timeout=10) is not None
            stal.on_accepted(1)
        assert wait_until(lambda: stal.stats()["running"] == 0, 10)
        stal.set_version(1)
        assert await asyncio.to_thread(wait_until, lambda: s.version == 1, 10)  # VERSION broadcast
        assert await s.admit(10, timeout=10) == ((0 + 1 + 1) * 4 - 3, 1)         # (eta+v+1)*B - accepted
        st = s.stats()
        await s.close()
        return st

    st = asyncio.run(main())
    rx.stop()
    assert st["inflight"] == 5 and stal.stats()["lost"] == 1


def test_spool_resends_a_killed_actors_unacked_trajectories(tmp_path):
    rx1 = receiver(tmp_path)
    addr = rx1.start()
    spool = str(tmp_path / "spool")

    async def first_life():
        s = TrajectorySender(addr, "sp", spool_dir=spool, **FAST)
        await s.start()
        await s.send(traj("acked"), timeout=10)
        await s.flush(timeout=10)
        rx1.stop()                                         # learner goes away; the actor still has credit
        for i in range(5):
            await s.send(traj(f"s{i}"), timeout=10)
        await s.close()                                    # killed with 5 unacked

    asyncio.run(first_life())
    rx2 = receiver(tmp_path, bind=addr)
    rx2.start()

    async def second_life():
        s = TrajectorySender(addr, "sp", spool_dir=spool, **FAST)
        await s.start()
        await s.flush(timeout=5)
        st = s.stats()
        await s.close()
        return st

    st = asyncio.run(second_life())
    ids = []
    while (t := rx2.get(timeout=0.3)) is not None:
        ids.append(t.id)
    rx2.stop()
    assert sorted(ids) == ["acked"] + [f"s{i}" for i in range(5)]  # "acked" replayed from the WAL (never consumed)
    assert st["resent"] == 5 and st["pending"] == 0
    assert os.listdir(spool) == []



def test_a_spool_write_that_meets_a_full_disk_still_sends_the_trajectory(tmp_path, monkeypatch):
    """A full disk under the spool: the spool file of "full" is cut short by ENOSPC in the middle of its write. The
    spool is the actor's safety net, not the way trajectories travel: "full" still reaches the learner, once, and no
    partial spool file is left taking space (on main send() raised OSError, the actor counted a send failure and gave
    the admission back: a healthy learner never got the trajectory, and its partial .tmp stayed until a restart)."""
    import builtins
    import errno

    from core.stream import spool as spool_mod

    class FullDisk(io.FileIO):
        def write(self, b):
            super().write(bytes(b)[:3])   # a few bytes reach the disk, then it is full
            raise OSError(errno.ENOSPC, "No space left on device")

    def open_(path, mode="r", *a, **kw):
        if "w" in mode and path == spool_mod.Spool(spool)._path("full") + ".tmp":
            return FullDisk(path, "w")
        return builtins.open(path, mode, *a, **kw)

    rx = receiver(tmp_path)
    addr = rx.start()
    spool = str(tmp_path / "spool")
    monkeypatch.setattr(spool_mod, "open", open_, raising=False)

    async def main():
        s = TrajectorySender(addr, "full-disk", spool_dir=spool, **FAST)
        await s.start()
        await s.send(traj("full"), timeout=10)
        await s.send(traj("after"), timeout=10)
        await s.flush(timeout=10)
        st = s.stats()
        await s.close()
        return st

    st = asyncio.run(main())
    ids = []
    while (t := rx.get(timeout=0.3)) is not None:
        ids.append(t.id)
    rx.stop()
    assert ids == ["full", "after"]
    assert st["spool_errors"] == 1 and st["spooled"] == 1 and st["acked"] == 2 and st["pending"] == 0
    assert os.listdir(spool) == []   # "after" unspooled on its ack; nothing of "full" left behind
