"""The receiver's hand-over queue to the training thread (core/stream/ioloop.HandOver): bounded, in order, one
wake-up per burst of puts, and a consumer blocked in get() is woken by what a burst or a WAL replay queued."""
import asyncio
import threading

import pytest

from core.stream.ioloop import HandOver
from core.stream.sender import TrajectorySender
from test_stream import FAST, receiver, traj  # tests/ is on sys.path (rootless test dir)


class CountingCondition(threading.Condition):
    def __init__(self):
        super().__init__(threading.Lock())
        self.notified: list[int] = []

    def notify(self, n=1):
        self.notified.append(n)
        super().notify(n)


def test_items_come_out_in_order_and_an_empty_get_times_out():
    q = HandOver(4)
    for i in range(3):
        q.put(i)
    assert q.qsize() == 3 and not q.full()
    assert [q.get(0.0), q.get(0.0), q.get(0.0)] == [0, 1, 2]  # queued items are taken without a wake()
    assert q.get(0.01) is None


def test_a_full_queue_refuses_the_put_and_keeps_what_it_has():
    q = HandOver(2)
    q.put("a")
    q.put("b")
    assert q.full()
    with pytest.raises(OverflowError, match="full"):
        q.put("c")
    assert [q.get(0.0), q.get(0.0), q.get(0.0)] == ["a", "b", None]


def test_a_burst_of_puts_wakes_once():
    q = HandOver(64)
    q._cond = CountingCondition()
    for i in range(32):
        q.put(i)
    assert q._cond.notified == []            # puts alone wake no one
    q.wake()
    q.wake()                                  # nothing new since: no second notify
    assert q._cond.notified == [32]           # enough for as many consumers as items
    q.put(32)
    q.wake()
    assert q._cond.notified == [32, 1]


def test_wake_ends_a_blocked_get():
    q = HandOver(8)
    got = []
    t = threading.Thread(target=lambda: got.append(q.get(60.0)), daemon=True)
    t.start()
    q.put("x")
    q.wake()
    t.join(20)  # far less than the get's own 60 s: the wake ended the wait
    assert not t.is_alive() and got == ["x"]


def test_a_consumer_waiting_before_start_gets_the_wal_replay(tmp_path):
    """Replayed entries are queued by the io thread's tick with no actor connected (no burst of messages): the
    consumer blocked in get() must still be woken for them."""
    rx = receiver(tmp_path, credits=16, queue_size=32)
    addr = rx.start()

    async def send():
        s = TrajectorySender(addr, "a0", window=16, **FAST)
        await s.start()
        for i in range(5):
            await s.send(traj(f"w{i}"), timeout=10)
        await s.flush(timeout=10)  # acked: in the WAL, and not consumed
        await s.close()

    asyncio.run(send())
    rx.stop()
    rx2 = receiver(tmp_path, credits=16, queue_size=32)
    got = []
    t = threading.Thread(target=lambda: got.append(rx2.get(timeout=60.0)), daemon=True)
    t.start()  # blocked on the empty queue before the receiver even starts
    rx2.start()
    try:
        t.join(20)
        assert not t.is_alive() and got and got[0] is not None and got[0].id == "w0"
        assert rx2.stats()["replayed"] == 5
    finally:
        rx2.stop()


def test_the_benchs_stricter_raw_baseline_delivers_everything_through_a_small_hand_over():
    """`python -m tars.bench.stream --raw-burst`: the raw link handing over through HandOver, with a queue far smaller
    than the transfer (its receiving thread waits for room, waking the consumer, instead of dropping or hanging)."""
    from tars.bench.stream import _run_raw, _trajs
    trajs = _trajs(300, 2000)
    seconds, learner_cpu, *_ = _run_raw(trajs, queue_size=4, subprocess=False, payload_bytes=2000, burst=True)
    assert seconds > 0 and learner_cpu > 0  # _drive raises TimeoutError unless the consumer got all 300
