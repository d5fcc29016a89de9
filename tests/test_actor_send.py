"""actor/main.py's hand-off of finished episodes to the stream: a send that can never happen gives its admission
back (the learner's staleness manager stops counting the episode as running), and a send that timed out waiting
for the learner (down, restarting, backlogged) is tried again instead of dropping finished work."""
from __future__ import annotations

import asyncio

from actor.main import Actor
from core import config as C
from core.schema import Trajectory, Turn
from tars.fresh import shared_tokenizer

import numpy as np


class FakeSender:
    """TrajectorySender's send/lost, scripted: each send pops the next outcome (an exception or None = delivered)."""

    def __init__(self, outcomes):
        self.outcomes, self.sent, self.lost_n = list(outcomes), [], 0
        self.settled = asyncio.Event()  # delivered, or its admission given back

    async def send(self, tr, timeout):
        out = self.outcomes.pop(0)
        if out is not None:
            raise out
        self.sent.append(tr.id)
        self.settled.set()

    async def lost(self, n):
        self.lost_n += n
        self.settled.set()


def _traj(tid: str) -> Trajectory:
    return Trajectory(id=tid, env_id="builtin/click", outcome="terminated", tokens=np.array([1, 2], np.int32),
                      logprobs=np.zeros(2, np.float32), versions=np.zeros(2, np.int32), mask=np.array([0, 1], np.uint8),
                      turns=[Turn("text:1", "x", {}, 1.0, 1, 2)], ret=1.0)


def _run(outcomes, stopping=False):
    async def main():
        a = Actor(C.RunConfig(), "a0", ["127.0.0.1:9"], ["127.0.0.1:9"], "tcp://127.0.0.1:9", shared_tokenizer())
        a.sender = FakeSender(outcomes)
        a._stopping = stopping
        a._send(_traj("t1"))
        await asyncio.wait_for(a.sender.settled.wait(), 10)
        return a.sender, a.stats

    return asyncio.run(main())


def test_a_timed_out_send_is_tried_again_until_it_goes_out():
    s, stats = _run([TimeoutError("no credit"), TimeoutError("no credit"), None])
    assert s.sent == ["t1"] and s.lost_n == 0 and stats["send_retries"] == 2 and stats["send_failures"] == 0


def test_a_send_that_can_never_happen_gives_its_admission_back():
    s, stats = _run([ValueError("over the frame limit")])
    assert s.sent == [] and s.lost_n == 1 and stats["send_failures"] == 1


def test_a_timeout_while_stopping_gives_the_admission_back_instead_of_waiting():
    s, stats = _run([TimeoutError("no credit")], stopping=True)
    assert s.sent == [] and s.lost_n == 1 and stats["send_retries"] == 0


def test_the_senders_size_check_is_the_learners_two_limits():
    """The frame and the images attached to one message are each limited to max_frame_bytes by the learner; the
    sender refused a trajectory whose frame and images only together passed the limit."""
    import hashlib
    import os

    from core.stream.sender import TrajectorySender

    async def main():
        s = TrajectorySender("tcp://127.0.0.1:9", "a0")
        s.max_frame_bytes = 1000
        imgs = {hashlib.sha256(b).hexdigest(): b for b in (os.urandom(600), os.urandom(300))}
        try:                                             # 900 + 900 bytes: each under 1000
            await s.send_frame("ok", b"x" * 900, 0.05, images=imgs)
        except ValueError as e:
            raise AssertionError(f"refused: {e}") from None
        except Exception:                                # not started: it gets past the check and fails later
            pass
        for frame, images in ((b"x" * 1001, {}), (b"x", {**imgs, "c": os.urandom(200)})):
            try:
                await s.send_frame("big", frame, 0.05, images=images)
            except ValueError as e:
                assert "at most 1000" in str(e)
            else:
                raise AssertionError("not refused")

    asyncio.run(main())


def test_a_restarted_actor_draws_new_seeds_and_group_ids(tmp_path):
    """A restart that shares the spool is a new life: its seeds (and so its GRPO group ids) differ from the first
    life's, which the learner may still hold pending groups of; the first life is the same as an actor without a
    spool (a run stays reproducible from its seed), and a torn counter still gives a life of its own."""
    from actor.main import episode_rng

    draw = lambda rng: [rng.randrange(1 << 30) for _ in range(8)]
    alone, _ = episode_rng(7, "a0", None)
    spool = str(tmp_path / "spool")
    lives = [episode_rng(7, "a0", spool) for _ in range(3)]
    assert [life for _, life in lives] == [0, 1, 2]
    first, second, third = (draw(rng) for rng, _ in lives)
    assert first == draw(alone)
    assert len({*first, *second, *third}) == 24
    assert episode_rng(7, "a1", str(tmp_path / "other"))[1] == 0    # each actor counts its own lives
    (tmp_path / "spool" / "lives").write_text("1x")
    rng, life = episode_rng(7, "a0", spool)
    assert life > 2 and draw(rng) != first


def test_a_stop_while_the_learner_has_not_answered_ends_the_actor_at_once(tmp_path):
    """With the learner down (nothing listens at the stream address), the actor waited out the whole 60 s for its
    WELCOME before it looked at its stop event, past a service manager's stop grace (systemd's and k8s's 60 s):
    a SIGTERM then ended in a SIGKILL. The stop now ends the wait; the spool is kept for the next start."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # a port nothing listens on
    port = s.getsockname()[1]
    s.close()

    async def main():
        a = Actor(C.RunConfig(), "a0", ["127.0.0.1:9"], ["127.0.0.1:9"], f"tcp://127.0.0.1:{port}", shared_tokenizer(),
                  str(tmp_path / "spool"))
        stop = asyncio.Event()
        run = asyncio.ensure_future(a.run(stop))
        deadline = asyncio.get_running_loop().time() + 10
        while a.sender._sock is None:  # until the actor has said HELLO and waits for the learner's WELCOME
            assert asyncio.get_running_loop().time() < deadline and not run.done()
            await asyncio.sleep(0.01)
        assert not run.done()
        stop.set()
        await asyncio.wait_for(run, 30)  # well under the 60 s HELLO deadline it waited out before

    asyncio.run(main())


def test_a_send_that_times_out_while_the_actor_stops_stays_in_the_spool(tmp_path):
    """The learner is down and the actor is stopped (SIGTERM): "t1" went out before (unacked, in the spool), "t2"
    waits for the send window and its wait times out during the stop's grace. Both must reach the learner from the
    spool when the actor starts again, as after a kill (on main the timed-out send removed t2's spool file: a stop
    lost every finished trajectory whose wait for the learner ran out in its grace period)."""
    import dataclasses

    from core.stream.receiver import TrajectoryReceiver
    from core.stream.sender import TrajectorySender
    from learner.staleness import StalenessManager

    spool = str(tmp_path / "spool")
    rx1 = TrajectoryReceiver("tcp://127.0.0.1:0", str(tmp_path / "wal.log"), StalenessManager(batch_size=8, eta=1000))
    addr = rx1.start()
    cfg = C.RunConfig()
    cfg = dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, send_window=1, admission_timeout_s=0.5))

    async def first_life():
        a = Actor(cfg, "a0", ["127.0.0.1:9"], ["127.0.0.1:9"], addr, shared_tokenizer(), spool)
        await a.sender.start(timeout=10)
        rx1.stop()                                    # the learner goes down
        a._send(_traj("t1"))                          # sent, never acked
        await asyncio.sleep(0.2)
        a._send(_traj("t2"))                          # waits for the window: the learner never frees it
        await asyncio.sleep(0.1)
        await a.shutdown(grace_s=3.0)                 # its 0.5 s wait runs out inside the grace
        return a.stats

    stats = asyncio.run(first_life())
    assert stats["send_retries"] == 0 and stats["send_failures"] == 1   # given up on while stopping, as before
    rx2 = TrajectoryReceiver(addr, str(tmp_path / "wal.log"), StalenessManager(batch_size=8, eta=1000))
    rx2.start()

    async def second_life():
        s = TrajectorySender(addr, "a0", spool_dir=spool)
        await s.start(timeout=10)
        await s.flush(timeout=10)
        await s.close()

    asyncio.run(second_life())
    ids = []
    while (t := rx2.get(timeout=0.3)) is not None:
        ids.append(t.id)
    rx2.stop()
    assert sorted(ids) == ["t1", "t2"]
