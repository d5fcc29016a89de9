"""The stream's receiver against idle, faulty and hostile peers over real sockets: credit it takes back, images it
does not store, syncs a HELLO does not force, a bound on the actors it tracks."""
import asyncio
import hashlib
import os
import shutil

import zmq

from core.stream import messages as M
from core.stream import peers
from core.stream.sender import TrajectorySender
from tests.test_stream import FAST, Consumer, receiver, traj, wait_until


def test_credit_idle_actors_hold_is_taken_back_for_an_actor_that_came_later(tmp_path):
    """Two actors that took every slot and only ping left a third with credit 0 for good (it won the admission
    and could never send): an idle actor's credit beyond KEEP_CREDIT now goes back when another wants it."""
    rx = receiver(tmp_path, credits=16, queue_size=32, wal_writer="thread")
    addr = rx.start()
    con = Consumer(rx)
    con.start()

    async def main():
        idle = [TrajectorySender(addr, f"idle{i}", window=16, **FAST) for i in range(2)]
        for s in idle:
            await s.start()
        late = TrajectorySender(addr, "late", window=16, **FAST)
        await late.start()
        for i in range(40):                                 # more than the queue: credit must keep coming
            await late.send(traj(f"late-{i}"), timeout=10)
        await late.flush(timeout=10)
        # The idle ones, reclaimed to KEEP_CREDIT (credit < 0 is never left behind), can still send.
        got = [s.stats()["credit"] for s in idle]
        for s in idle:
            await s.send(traj(f"{s.actor_id}-0"), timeout=10)
            await s.flush(timeout=10)
        for s in [*idle, late]:
            await s.close()
        return got

    try:
        held = asyncio.run(main())
        # Taken back to KEEP_CREDIT, never below (the idle ones sent nothing); the queue's slots freed since may
        # have been granted back to them (fair regrant), so their credit now reads KEEP_CREDIT..16.
        assert all(peers.KEEP_CREDIT <= c <= 16 for c in held), held
        assert wait_until(lambda: len(con.ids) == 42)
        assert rx.stats()["credits_reclaimed"] >= 16 - peers.KEEP_CREDIT
    finally:
        con.halt.set()
        rx.stop()


def test_regrant_never_reclaims_from_an_actor_that_is_sending():
    now = 100.0
    ps = {b"busy": peers.Peer("i", credit=16, last_traj=now - 0.1), b"idle": peers.Peer("j", credit=16, last_traj=0.0),
          b"new": peers.Peer("k", credit=0, last_traj=now)}
    out = dict(peers.regrant(ps, 16, 0, now))
    assert out[b"idle"] == peers.KEEP_CREDIT - 16 and b"busy" not in out and out[b"new"] == 16 - peers.KEEP_CREDIT
    assert ps[b"busy"].credit == 16 and ps[b"idle"].credit == peers.KEEP_CREDIT
    # With a slot free for whoever is short, nothing is taken back.
    ps = {b"idle": peers.Peer("j", credit=16), b"new": peers.Peer("k", credit=0, last_traj=now)}
    assert dict(peers.regrant(ps, 16, 16, now)) == {b"new": 16}


def _dealer(addr, name=b"p"):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.routing_id = name
    s.connect(addr)
    s.send_multipart(M.Hello(name.decode(), "i1", 1).encode())
    while s.poll(5000):
        if isinstance(welcome := M.decode(M.TO_ACTOR, *s.recv_multipart()), M.Welcome):
            return ctx, s, welcome
    raise AssertionError("no WELCOME")


def _replies(s, n, timeout_ms=10000):
    """The next n answers to TRAJs, one per id: the NACK, or the ACK that covers it (an ACK covers a batch)."""
    out = []
    while len(out) < n and s.poll(timeout_ms):
        m = M.decode(M.TO_ACTOR, *s.recv_multipart())
        if isinstance(m, M.Nack):
            out.append(m)
        elif isinstance(m, M.Ack):
            out += [m] * len(m.ids)
    return out


def test_images_of_a_refused_or_unreferencing_trajectory_are_not_stored(tmp_path):
    """A peer that ignores credit, the queue full: each busy-NACKed trajectory's frames were written to the image
    store first (200 MiB held by nothing in the audit's run), and frames it does not refer to were stored too."""
    rx = receiver(tmp_path, credits=2, queue_size=2, wal_writer="thread")
    addr = rx.start()
    ctx, s, w = _dealer(addr)
    try:
        assert w.credit == 2
        for i in range(2):                                  # the queue is full now (nobody trains)
            s.send_multipart([M.TRAJ, M.pack({"seq": i, "id": f"e{i}"}), traj(f"e{i}").encode()])
        assert len(_replies(s, 2)) == 2
        for i in range(2, 12):                              # no credit left: refused busy, images and all
            img = os.urandom(4096)
            s.send_multipart([M.TRAJ, M.pack({"seq": i, "id": f"e{i}", "images": [hashlib.sha256(img).hexdigest()]}),
                              traj(f"e{i}").encode(), img])
        got = _replies(s, 10)
        assert len(got) == 10 and all(isinstance(m, M.Nack) and m.retry and m.reason.startswith("busy") for m in got)
        assert rx.stats()["images_stored"] == 0 and len(rx.images) == 0
    finally:
        s.close(0)
        ctx.term()
        rx.stop()
    rx = receiver(tmp_path / "b", wal_writer="thread")      # room now, but the frame is not referred to
    addr = rx.start()
    ctx, s, _ = _dealer(addr)
    try:
        img = os.urandom(4096)
        s.send_multipart([M.TRAJ, M.pack({"seq": 1, "id": "u1", "images": [hashlib.sha256(img).hexdigest()]}),
                          traj("u1").encode(), img])
        assert isinstance(_replies(s, 1)[0], M.Ack) and len(rx.images) == 0
    finally:
        s.close(0)
        ctx.term()
        rx.stop()


def test_an_image_store_that_fails_is_a_retry_not_a_dead_io_thread(tmp_path):
    """An OSError from the image store (a full disk; here its directory gone) killed the io thread, so the learner
    stopped, and on a full disk crashed again after every restart. Now: NACKed busy, the actor keeps it."""
    rx = receiver(tmp_path, wal_writer="thread")
    addr = rx.start()
    shutil.rmtree(tmp_path / "wal.log.images")
    ctx, s, _ = _dealer(addr)
    try:
        img = os.urandom(1000)
        t = traj("t1")
        t.image_refs = [hashlib.sha256(img).hexdigest()]
        s.send_multipart([M.TRAJ, M.pack({"seq": 1, "id": "t1", "images": t.image_refs}), t.encode(), img])
        (m,) = _replies(s, 1)
        assert isinstance(m, M.Nack) and m.retry and "image store" in m.reason
        assert rx._thread.is_alive() and rx.get(0.05) is None       # get() does not raise: the learner goes on
        s.send_multipart([M.TRAJ, M.pack({"seq": 2, "id": "t2"}), traj("t2").encode()])
        assert isinstance(_replies(s, 1)[0], M.Ack)
    finally:
        s.close(0)
        ctx.term()
        rx.stop()


def test_a_hello_forces_a_wal_sync_only_for_pending_ids_it_must_answer(tmp_path):
    """Each HELLO flushed the WAL (a sync and fdatasync on the io thread): one identity looping HELLOs cut an honest
    actor's rate 6x. A HELLO whose pending ids the learner does not have answers without one."""
    rx = receiver(tmp_path, wal_writer="thread")
    addr = rx.start()
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.connect(addr)
    flushes, real = [], rx.durability.flush
    rx.durability.flush = lambda: flushes.append(1) or real()  # a sync of whatever is staged, fdatasync and all
    try:
        for i in range(50):
            s.send_multipart(M.Hello("flood", f"i{i}", i, pending_ids=["nobody-sent-this"]).encode())
            while s.poll(5000) and not isinstance(M.decode(M.TO_ACTOR, *s.recv_multipart()), M.Welcome):
                pass                                        # (VERSION, CREDIT on the way)
        assert flushes == []
        s.send_multipart([M.TRAJ, M.pack({"seq": 1, "id": "mine"}), traj("mine").encode()])
        s.send_multipart(M.Hello("flood", "again", 99, pending_ids=["mine"]).encode())  # one it must answer: durable
        while s.poll(5000) and not isinstance(m := M.decode(M.TO_ACTOR, *s.recv_multipart()), M.Welcome):
            pass
        assert len(flushes) == 1
    finally:
        s.close(0)
        ctx.term()
        rx.stop()


def test_the_actors_a_receiver_tracks_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr("core.stream.receiver.MAX_PEERS", 5)
    rx = receiver(tmp_path, wal_writer="thread")
    addr = rx.start()
    ctx = zmq.Context()
    socks = []
    try:
        for i in range(8):
            d = ctx.socket(zmq.DEALER)
            d.linger = 0
            d.routing_id = f"p{i}".encode()
            d.connect(addr)
            d.send_multipart(M.Hello(f"p{i}", "i", 1).encode())
            socks.append(d)
        answered = [d.poll(1500) for d in socks]
        assert sum(answered) == 5 and rx.stats()["peers_refused"] == 3 and rx.stats()["actors"] == 5
    finally:
        for d in socks:
            d.close(0)
        ctx.term()
        rx.stop()
