"""Content-addressed screenshots on the trajectory stream (core/stream/images.py), over real sockets on 127.0.0.1."""
import asyncio
import hashlib
import os

import numpy as np
import pytest
import zmq

from learner.staleness import StalenessManager
from core.stream import messages as P
from core.schema import Trajectory, Turn
from core.stream.images import ImageError, ImageStore
from core.stream.receiver import TrajectoryReceiver
from core.stream.sender import TrajectorySender

FAST = dict(heartbeat_s=0.05, dead_after_s=1.0)
IMG_A = os.urandom(20_000)  # incompressible stand-ins for PNG screenshots
IMG_B = os.urandom(20_000)
HA, HB = hashlib.sha256(IMG_A).hexdigest(), hashlib.sha256(IMG_B).hexdigest()


def traj(tid: str, imgs: list[bytes]) -> Trajectory:
    n = 8 * len(imgs)
    turns = [Turn(f"sha256:{hashlib.sha256(b).hexdigest()}", "out", {}, 0.0, 8 * i, 8 * i + 8) for i, b in enumerate(imgs)]
    return Trajectory(id=tid, env_id="miniwob/x", outcome="terminated", tokens=np.arange(n, dtype=np.int32),
                      logprobs=np.full(n, -0.5, np.float32), versions=np.zeros(n, np.int32), mask=np.ones(n, np.uint8),
                      turns=turns, ret=1.0, images={hashlib.sha256(b).hexdigest(): b for b in imgs})


def receiver(tmp_path, name="wal.log", bind="tcp://127.0.0.1:0"):
    return TrajectoryReceiver(bind, str(tmp_path / name), StalenessManager(batch_size=8, eta=1000))


async def send_all(addr, trajs, **kw):
    s = TrajectorySender(addr, "img-actor", **FAST, **kw)
    await s.start()
    for t in trajs:
        await s.send(t, timeout=5)
    await s.flush(timeout=5)
    st = s.stats()
    await s.close()
    return st


def drain(rx, n):
    out = []
    for _ in range(n):
        t = rx.get(timeout=5)
        assert t is not None, f"only {len(out)} of {n} trajectories arrived"
        out.append(t)
    return out


@pytest.mark.parametrize("dedupe", [True, False])
def test_each_image_crosses_once_and_the_learner_sees_every_image(tmp_path, dedupe):
    rx = receiver(tmp_path)
    addr = rx.start()
    trajs = [traj("t0", [IMG_A, IMG_B]), traj("t1", [IMG_A]), traj("t2", [IMG_B, IMG_A])]
    st = asyncio.run(send_all(addr, trajs, dedupe_images=dedupe))
    got = drain(rx, 3)
    rx.stop()
    for t in got:  # the learner gets every image its turns refer to, bytes intact
        assert t.images == {r.obs_ref[7:]: (IMG_A if r.obs_ref[7:] == HA else IMG_B) for r in t.turns}
    if dedupe:
        assert st["images_sent"] == 2 and st["images_deduped"] == 3
        assert st["image_bytes_sent"] == len(IMG_A) + len(IMG_B)
        assert st["bytes_sent"] < 2 * (len(IMG_A) + len(IMG_B)) + 10_000
    else:
        assert st["images_sent"] == 0 and st["bytes_sent"] > 5 * len(IMG_A)  # inline in every frame
    assert rx.stats()["images_stored"] == 2


def test_a_restarted_learner_gets_the_images_again_and_wal_replay_finds_them(tmp_path):
    rx1 = receiver(tmp_path)
    addr = rx1.start()

    async def main():
        s = TrajectorySender(addr, "img-actor", **FAST)
        await s.start()
        await s.send(traj("t0", [IMG_A]), timeout=5)
        await s.flush(timeout=5)
        rx1.stop()
        # A new learner with a fresh image store (another WAL) on the same address: a new run_id.
        rx2 = receiver(tmp_path, "wal2.log", bind=addr)
        rx2.start()
        await s.send(traj("t1", [IMG_A]), timeout=10)
        await s.flush(timeout=10)
        st = s.stats()
        await s.close()
        return rx2, st

    rx2, st = asyncio.run(main())
    assert st["images_sent"] == 2 and st["restarts_seen"] == 1
    assert drain(rx2, 1)[0].images == {HA: IMG_A}
    rx2.stop()
    # Same WAL again: t1 was never consumed, so it is replayed, its image read back from the store.
    rx3 = receiver(tmp_path, "wal2.log")
    rx3.start()
    t = drain(rx3, 1)[0]
    rx3.stop()
    assert t.id == "t1" and t.images == {HA: IMG_A}


def _raw(addr):
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.routing_id = b"raw"
    d.linger = 0
    d.connect(addr)
    d.send_multipart([P.HELLO, P.pack({"actor": "raw", "incarnation": "i", "hello_id": 1, "pending_ids": [], "inflight": 0})])
    assert d.poll(5000)
    assert d.recv_multipart()[0] == P.WELCOME
    return ctx, d


def _answer(d, tag):
    while d.poll(5000):
        m = d.recv_multipart()
        if m[0] == tag:
            return P.unpack(m[1])
    raise AssertionError(f"no {tag!r} answer")


def test_unknown_hash_is_nacked_for_retry_and_forged_bytes_are_refused(tmp_path):
    rx = receiver(tmp_path)
    addr = rx.start()
    ctx, d = _raw(addr)
    try:
        t = traj("needs-a", [IMG_A])
        frame = Trajectory.encode(type(t)(**{**t.__dict__, "images": {}}))
        d.send_multipart([P.TRAJ, P.pack({"seq": 1, "id": "needs-a", "images": []}), frame])
        nack = _answer(d, P.NACK)
        assert nack["retry"] is True and nack["missing"] == [HA]
        # Bytes sent under another image's hash: refused, and nothing is stored under that name.
        d.send_multipart([P.TRAJ, P.pack({"seq": 2, "id": "needs-a", "images": [HA]}), frame, IMG_B])
        nack = _answer(d, P.NACK)
        assert nack["retry"] is False and "hash" in nack["reason"]
        assert HA not in rx.images
        # The right bytes: accepted, resolved.
        d.send_multipart([P.TRAJ, P.pack({"seq": 3, "id": "needs-a", "images": [HA]}), frame, IMG_A])
        got = rx.get(timeout=5)
        assert got.id == "needs-a" and got.images == {HA: IMG_A}
    finally:
        d.close(0)
        ctx.term()
        rx.stop()


def test_images_attached_to_a_frame_that_is_no_trajectory_are_not_stored(tmp_path):
    """Garbage payloads with 4 MiB image frames were NACKed but their images kept, for the life of the run: a
    peer could fill the disk. Attachments are stored only with a trajectory that decodes."""
    rx = receiver(tmp_path)
    addr = rx.start()
    ctx, d = _raw(addr)
    try:
        for i in range(5):
            img = os.urandom(1 << 20)
            name = hashlib.sha256(img).hexdigest()
            d.send_multipart([P.TRAJ, P.pack({"seq": i, "id": f"junk-{i}", "images": [name]}), b"\xc1junk", img])
            assert _answer(d, P.NACK)["reason"].startswith("malformed")
        assert len(rx.images) == 0
    finally:
        d.close(0)
        ctx.term()
        rx.stop()


def test_images_no_unconsumed_trajectory_needs_are_collected_at_compaction(tmp_path):
    """The store kept every screenshot of a run. After a checkpoint's compaction it keeps only the images of
    trajectories not yet consumed: a replay still finds them, and an actor that refers to a collected image later is
    asked for it again (NACK "missing images") and the trajectory arrives whole."""
    rx = receiver(tmp_path)
    addr = rx.start()

    async def main():
        s = TrajectorySender(addr, "img-actor", **FAST)
        await s.start()
        for t in (traj("t0", [IMG_A]), traj("t1", [IMG_B])):
            await s.send(t, timeout=5)
        await s.flush(timeout=5)
        got = drain(rx, 2)
        rx.mark_consumed(["t0"])
        out = rx.compact_wal()
        assert out["images_collected"] == 1 and HA not in rx.images and HB in rx.images
        await s.send(traj("t2", [IMG_A, IMG_B]), timeout=10)  # the sender thinks the learner has A
        await s.flush(timeout=10)
        st = s.stats()
        await s.close()
        return got, st

    got, st = asyncio.run(main())
    t2 = drain(rx, 1)[0]
    assert t2.id == "t2" and t2.images == {HA: IMG_A, HB: IMG_B} and st["images_sent"] == 3  # A crossed twice
    rx.stop()
    rx2 = receiver(tmp_path)  # the same WAL: t1 and t2 were never consumed, and their images are still there
    rx2.start()
    assert sorted(t.id for t in drain(rx2, 2)) == ["t1", "t2"]
    rx2.stop()


def test_store_rejects_bad_names_and_survives_reopen(tmp_path):
    s = ImageStore(str(tmp_path / "imgs")).open()
    with pytest.raises(ImageError):
        s.put("../etc/passwd", b"x")
    assert s.put(HA, IMG_A) and not s.put(HA, IMG_A)
    s2 = ImageStore(str(tmp_path / "imgs")).open()
    assert HA in s2 and s2.get(HA) == IMG_A and s2.missing([HA, HB]) == [HB]


def test_a_frame_referring_to_images_nobody_holds_is_dropped_not_retried_forever(tmp_path):
    rx = receiver(tmp_path)
    addr = rx.start()

    async def main():
        s = TrajectorySender(addr, "img-actor", **FAST)
        await s.start()
        t = traj("orphan", [IMG_A])
        frame = Trajectory.encode(type(t)(**{**t.__dict__, "images": {}}))
        await s.send_frame("orphan", frame, timeout=5)          # refers to IMG_A, carries nothing
        await s.send(traj("fine", [IMG_B]), timeout=5)
        await s.flush(timeout=5)
        st = s.stats()
        await s.close()
        return st

    st = asyncio.run(main())
    got = drain(rx, 1)
    rx.stop()
    assert got[0].id == "fine" and st["nacked"] == 1 and st["retried"] == 0 and rx.stats()["missing_images"] == 1


def test_a_compaction_during_the_last_replay_keeps_its_images(tmp_path):
    """The io thread popped the last replay id, then read and resolved it; a checkpoint's compaction in between saw
    no replay pending and collected the image: the trajectory was dropped ("cannot replay"), unconsumed in the WAL
    for good. Pop and hold are now one step under the store's lock."""
    import threading

    rx1 = receiver(tmp_path)
    addr = rx1.start()
    asyncio.run(send_all(addr, [traj("t0", [IMG_A])]))
    drain(rx1, 1)  # delivered, never consumed
    rx1.stop()
    rx2 = receiver(tmp_path)
    popped, compacting = threading.Event(), threading.Event()
    read, compact = rx2.durability.read, rx2.durability.compact

    def held_read(tid):  # the window between the pop and the resolve, held open until the compaction has begun
        popped.set()
        assert compacting.wait(10)
        return read(tid)

    def compact_then_open(drop):
        out = compact(drop)
        compacting.set()
        return out

    rx2.durability.read, rx2.durability.compact = held_read, compact_then_open
    rx2.start()
    assert popped.wait(5)
    assert rx2.compact_wal()["images_collected"] == 0  # it waits for the replay's hold (the store's lock)
    got = rx2.get(timeout=5)
    rx2.stop()
    assert got is not None and got.id == "t0" and got.images == {HA: IMG_A}
