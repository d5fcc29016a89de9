"""The WAL writer process (core/stream/walproc.py): same file format as the in-process log, a bounded ring, and a
killed writer loses nothing acked and duplicates nothing."""
from __future__ import annotations

import asyncio
import collections
import os
import signal
import threading
import time

import pytest

from core.proc import wait_for
from core.stream.receiver import TrajectoryReceiver
from core.stream.sender import TrajectorySender
from core.stream.wal import WalError, WalFull, WriteAheadLog, scan_ids
from core.stream.walproc import WriterProcessLog
from learner.staleness import StalenessManager
from tests.test_stream import FAST, traj


def payload(i: int, n: int = 40_000) -> bytes:
    return bytes([i % 251]) * n


def test_writer_process_log_wraps_its_ring_compacts_and_reads_back_as_a_plain_log(tmp_path):
    p = tmp_path / "w.wal"
    w = WriterProcessLog(p, ring_bytes=200_000).open()   # room for 4 records of 40 KB: the ring wraps many times
    assert w.writer_pid and w.writer_pid != os.getpid()
    for i in range(20):
        w.stage(f"t{i}", memoryview(payload(i)))
        if i % 3 == 2:
            w.sync()
    for i in range(20, 25):                              # a full ring refuses, and nothing of the refused one stays
        try:
            w.stage(f"t{i}", payload(i))
        except WalFull:
            assert f"t{i}" not in w
            break
    else:
        pytest.fail("the ring never filled")
    w.sync()
    stop = i
    assert w.compact({f"t{k}" for k in range(10)}) == (stop - 10, 10)   # the writer reopens the rewritten file
    w.stage("after", payload(99))
    w.sync()
    w.close()
    assert w.writer_pid is not None and w._proc.returncode == 0
    want = [f"t{k}" for k in range(10, stop)] + ["after"]
    assert scan_ids(p) == want
    r = WriteAheadLog(p).open()
    assert list(r.index) == want and r.truncated_bytes == 0
    assert [r.read(t) for t in want] == [payload(int(t[1:])) for t in want[:-1]] + [payload(99)]
    r.close()


def test_records_next_to_each_other_in_the_ring_go_to_the_writer_as_one_region(tmp_path):
    """The writer copies and checksums a region per call: a batch whose records follow each other in the ring is one
    region (not one per record), a wrap starts a second one, and every record's ring space is freed once written."""
    p = tmp_path / "w.wal"
    w = WriterProcessLog(p, ring_bytes=200_000).open()
    for i in range(3):
        w.stage(f"a{i}", payload(i, 10_000))
    assert len(w._staged.bufs) == 1 and w._staged.extents == 3
    assert w._staged.bufs[0][1] == sum(e - s for s, e in w._extents)   # the three records' bytes, as one region
    w.sync()
    assert not w._extents                                           # freed: three extents for one region
    for i in range(3, 12):                                          # 9 x 40 KB through 200 KB: the ring wraps
        w.stage(f"a{i}", payload(i))
        if i % 3 == 2:
            bufs = w._staged.bufs
            assert w._staged.extents == 3 and 1 <= len(bufs) <= 2
            assert sum(n for _, n in bufs) == sum(e - s for s, e in w._extents)
            w.sync()
    w.close()
    r = WriteAheadLog(p).open()
    assert [r.read(f"a{i}") for i in range(12)] == [payload(i, 10_000) for i in range(3)] + \
        [payload(i) for i in range(3, 12)]
    r.close()


def test_a_second_learner_waits_for_the_log_lock(tmp_path):
    p = tmp_path / "w.wal"
    w = WriterProcessLog(p).open()
    other = WriterProcessLog(p, lock_timeout_s=0.3)
    with pytest.raises(WalError, match="locked"):
        other.open()
    w.close()
    other.open().close()


class AckLog(TrajectorySender):
    """Records every id the learner acked for good (the actor forgets those)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.acked: list[str] = []

    def _on_ack(self, m):
        if not m.held:
            self.acked.extend(t for t in m.ids if t in self._outbox)
        super()._on_ack(m)


class Trainer(threading.Thread):
    """The training thread: like tests/test_stream.py's Consumer, but it records the error that get() raises."""

    def __init__(self, rx, want):
        super().__init__(daemon=True)
        self.rx, self.want, self.ids, self.error = rx, want, [], None

    def run(self):
        try:
            while len(self.ids) < self.want:
                tr = self.rx.get(timeout=0.05)
                if tr is not None:
                    self.rx.staleness.on_accepted(1)
                    self.ids.append(tr.id)
                    self.rx.mark_consumed([tr.id])
        except WalError as e:
            self.error = e


def test_killed_writer_process_loses_nothing_acked_and_duplicates_nothing(tmp_path):
    N = 400
    path = str(tmp_path / "wal.log")

    def receiver(bind, consumed=()):
        return TrajectoryReceiver(bind, path, StalenessManager(batch_size=8, eta=1000), credits=32, queue_size=64,
                                  consumed_ids=consumed)

    rx1 = receiver("tcp://127.0.0.1:0")
    addr = rx1.start()
    pid = rx1.durability.wal.writer_pid

    async def main():
        s = AckLog(addr, "act", window=64, **FAST)
        await s.start()

        async def produce():
            for i in range(N):
                await s.send(traj(f"k{i}", n=2048), timeout=30)

        prod = asyncio.create_task(produce())
        t1 = Trainer(rx1, N)
        t1.start()
        deadline = time.monotonic() + 15
        while len(s.acked) < 60 and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        assert len(s.acked) >= 60 and not prod.done()             # killed mid-stream, with acks already out
        os.kill(pid, signal.SIGKILL)
        await asyncio.to_thread(t1.join, 10)
        assert isinstance(t1.error, WalError) and "writer process is gone" in str(t1.error)  # the learner fails loudly
        acked_at_kill = list(s.acked)
        await asyncio.sleep(0.2)
        # Nothing is acked after the writer's death: whatever the actor had not been told stays in its outbox.
        assert s.acked == acked_at_kill
        await asyncio.to_thread(rx1.stop)
        on_disk = scan_ids(path)
        assert len(on_disk) == len(set(on_disk))                   # each id logged once
        assert set(acked_at_kill) <= set(on_disk)                  # everything acked was fsynced first
        # The supervisor restarts the learner: its checkpoint lists what it trained (t1.ids).
        rx2 = receiver(addr, consumed=t1.ids)
        assert rx2.start() == addr
        t2 = Trainer(rx2, N - len(t1.ids))
        t2.start()
        await prod
        await s.flush(timeout=30)
        await asyncio.to_thread(t2.join, 30)
        st = s.stats()
        await s.close()
        return rx2, t1.ids, t2.ids, st, on_disk

    rx2, first, second, st, on_disk = asyncio.run(main())
    s2 = rx2.stats()
    rx2.stop()
    trained = collections.Counter(first + second)
    assert set(trained) == {f"k{i}" for i in range(N)} and max(trained.values()) == 1   # exactly once
    assert st["pending"] == 0 and s2["replayed"] == len(set(on_disk) - set(first))
    final = scan_ids(path)
    assert len(final) == len(set(final)) and set(final) | set(first) == set(trained)


def test_a_hung_writer_process_is_fatal_after_its_deadline_and_acks_nothing(tmp_path):
    w = WriterProcessLog(tmp_path / "w.wal", reply_timeout_s=0.5).open()
    w.stage("a", payload(1))
    w.sync()
    os.kill(w.writer_pid, signal.SIGSTOP)             # alive but silent: a deadline, not a hang
    w.stage("b", payload(2))
    t0 = time.monotonic()
    with pytest.raises(WalError, match="writer process is gone"):
        w.sync()
    assert time.monotonic() - t0 < 5 and w.fatal is not None
    with pytest.raises(WalError):                      # sticky: nothing staged later may be acked either
        w.stage("c", payload(3))
    w.close()                                          # the stopped writer is killed, not waited on for ever
    assert w._proc.returncode is not None
    assert scan_ids(tmp_path / "w.wal") == ["a"]


def test_an_unknown_wal_writer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="wal writer"):
        TrajectoryReceiver("tcp://127.0.0.1:0", str(tmp_path / "w.log"), StalenessManager(batch_size=8, eta=10),
                           wal_writer="disk")


# --- the writer's block appends (core/stream/walwriter.py), against the in-process log as the reference -------------

def _record(tid: str, body: bytes) -> bytes:
    from core.stream.wal import _HDR, _MAGIC2
    idb = tid.encode()
    return _HDR.pack(_MAGIC2, len(idb), len(body), 0) + idb + body


def _batches(seed: int):
    """Batches of records of awkward sizes: tiny ones, ones across the small staging buffer, one far larger."""
    import random
    rng = random.Random(seed)
    sizes = [1, 4095, 4096, 4097, 70_000, 9, 200_000] + [rng.randrange(1, 30_000) for _ in range(40)]
    recs = [(f"r{i}", bytes([i % 251]) * n) for i, n in enumerate(sizes)]
    out, i = [], 0
    while i < len(recs):
        k = rng.randrange(1, 6)
        out.append(recs[i:i + k])
        i += k
    return out


@pytest.mark.parametrize("direct", [True, False])
def test_block_appends_write_the_same_bytes_as_the_in_process_log(tmp_path, monkeypatch, direct):
    """Whole-block O_DIRECT writes (or buffered ones) with a carried partial block, a staging buffer that spills,
    a record appended by the learner process in between (its block read back), and a reopen: the file is the
    reference log's byte for byte once the padding is cut, and scans the same at every step."""
    from core.stream import walwriter
    from core.stream.wal import scan

    class Small(walwriter._Appender):
        STAGE = 64 << 10                                   # spills inside the 70 KB and 200 KB records

    ref = WriteAheadLog(tmp_path / "ref.wal").open()
    path = tmp_path / "blk.wal"
    path.touch()
    if not direct:
        monkeypatch.delattr(os, "O_DIRECT")
    app = Small(str(path))
    assert app.direct is direct
    side = os.open(path, os.O_WRONLY)                      # the learner process's own descriptor
    end = 0
    for n, batch in enumerate(_batches(0)):
        if n == 3:                                         # a self-checking record written by the learner itself
            ref.append("own", b"x" * 5000)
            ref.sync()
            own = open(tmp_path / "ref.wal", "rb").read()[end:]
            os.pwrite(side, own, end)
            end += len(own)
        if n == 6:
            app.open()                                     # as after a compaction: nothing kept, the block is read back
        for tid, body in batch:
            ref.stage(tid, body)
        ref.sync()
        app.append(end, [_record(t, b) for t, b in batch])
        end = os.path.getsize(tmp_path / "ref.wal")
        data = path.read_bytes()
        if direct:
            assert len(data) % 4096 == 0 and len(data) >= end and not data[end:].strip(b"\0")
        want, _ = scan(lambda k, o, d=open(tmp_path / "ref.wal", "rb").read(): d[o:o + k], end)
        assert scan(lambda k, o: data[o:o + k], len(data)) == (want, end)
    app.finish(end)
    app.close()
    os.close(side)
    ref.close()
    assert path.read_bytes() == (tmp_path / "ref.wal").read_bytes()


def test_block_appends_fall_back_to_the_page_cache_when_direct_writes_are_refused(tmp_path, monkeypatch):
    from core.stream import walwriter
    path = tmp_path / "blk.wal"
    path.touch()
    app = walwriter._Appender(str(path))
    real, refused = os.pwrite, []

    def pwrite(fd, data, off):
        if fd == app.fd and app.direct:
            refused.append(off)
            raise OSError(22, "Invalid argument")          # a file system that wants another alignment
        return real(fd, data, off)

    monkeypatch.setattr(os, "pwrite", pwrite)
    ref = WriteAheadLog(tmp_path / "ref.wal").open()
    end = 0
    for batch in _batches(1)[:4]:
        for tid, body in batch:
            ref.stage(tid, body)
        ref.sync()
        app.append(end, [_record(t, b) for t, b in batch])
        end = os.path.getsize(tmp_path / "ref.wal")
    ref.close()
    assert refused == [0] and not app.direct
    app.finish(end)
    app.close()
    assert path.read_bytes() == (tmp_path / "ref.wal").read_bytes()


def test_a_killed_writer_leaves_only_its_block_padding_which_the_next_open_cuts(tmp_path):
    p = tmp_path / "w.wal"
    w = WriterProcessLog(p).open()
    for i in range(5):
        w.stage(f"t{i}", payload(i, 10_001))               # an end that is not on a block boundary
    w.sync()
    end = w._end
    os.kill(w.writer_pid, signal.SIGKILL)
    w._proc.wait(10)
    size = os.path.getsize(p)
    assert size % 4096 == 0 and size > end                 # the last block went out whole, zeros after the commit
    w.close()
    r = WriteAheadLog(p).open()
    assert list(r.index) == [f"t{i}" for i in range(5)] and r.truncated_bytes == size - end
    assert [r.read(f"t{i}") for i in range(5)] == [payload(i, 10_001) for i in range(5)]
    r.close()
    assert os.path.getsize(p) == end


def _until(pred, what="the writer's reply"):
    return wait_for(pred, 10.0, what, every=0.002)


def test_sync_begin_returns_at_once_and_sync_done_reports_the_reply(tmp_path):
    w = WriterProcessLog(tmp_path / "w.wal").open()
    w.stage("a", payload(1))
    t = w.sync_begin()
    assert t == 1 and w._inflight is not None
    _until(lambda: w.sync_done(t))
    assert w._inflight is None and scan_ids(tmp_path / "w.wal") == ["a"]
    assert w.sync_begin() == t                             # nothing staged: nothing sent, the same ticket
    # Another thread's sync() (or compact, or close) takes the reply in flight first; the io thread then sees it done.
    w.stage("b", payload(2))
    t = w.sync_begin()
    w.stage("c", payload(3))
    th = threading.Thread(target=w.sync)
    th.start()
    th.join(10)
    assert w.sync_done(t) and scan_ids(tmp_path / "w.wal") == ["a", "b", "c"]
    w.stage("d", payload(4))
    t = w.sync_begin()
    assert w.compact({"a"}) == (3, 1) and w.sync_done(t)
    w.close()
    assert scan_ids(tmp_path / "w.wal") == ["b", "c", "d"]


def test_sync_done_turns_a_silent_writer_into_an_error_after_its_deadline(tmp_path):
    w = WriterProcessLog(tmp_path / "w.wal", reply_timeout_s=0.5).open()
    os.kill(w.writer_pid, signal.SIGSTOP)
    w.stage("a", payload(1))
    t = w.sync_begin()
    assert not w.sync_done(t)                              # only looks: no reply yet, no error yet
    t0 = time.monotonic()
    with pytest.raises(WalError, match="writer process is gone"):
        _until(lambda: w.sync_done(t))
    assert 0.3 < time.monotonic() - t0 < 5 and w.fatal is not None
    w.close()
    assert scan_ids(tmp_path / "w.wal") == []


def test_sync_done_reports_a_writer_killed_with_a_request_in_flight(tmp_path):
    w = WriterProcessLog(tmp_path / "w.wal").open()
    os.kill(w.writer_pid, signal.SIGSTOP)
    w.stage("a", payload(1))
    t = w.sync_begin()
    os.kill(w.writer_pid, signal.SIGKILL)
    with pytest.raises(WalError, match="writer process is gone"):
        _until(lambda: w.sync_done(t))
    with pytest.raises(WalError):
        w.stage("b", payload(2))
    w.close()


def test_compaction_and_append_wait_for_a_batch_still_with_the_writer(tmp_path):
    """The io thread's batch is with the writer (no reply yet) when the training thread compacts, or the learner
    appends a record itself: both wait for it, so nothing acked is copied half-written or overwritten by padding."""
    for trial in range(5):
        p = tmp_path / f"c{trial}.wal"
        w = WriterProcessLog(p).open()
        w.stage("old", payload(0, 1000))
        w.sync()
        new = {f"n{i}": payload(i, 33_000) for i in range(30)}
        for t, b in new.items():
            w.stage(t, b)
        t = w.sync_begin()
        assert w.compact({"old"}) == (30, 1) and w.sync_done(t, 5.0)
        assert all(w.read(k) == b for k, b in new.items())
        w.stage("s", payload(1, 5000))
        t = w.sync_begin()
        w.append("own", payload(2, 700))               # through the learner's fd, into the batch's last block
        w.sync()
        assert w.sync_done(t) and w.read("own") == payload(2, 700) and w.read("s") == payload(1, 5000)
        w.close()
        r = WriteAheadLog(p).open()
        assert list(r.index) == [*new, "s", "own"] and r.truncated_bytes == 0
        r.close()


def test_a_slow_writer_is_waited_for_until_its_deadline_not_declared_lost(tmp_path):
    w = WriterProcessLog(tmp_path / "w.wal", reply_timeout_s=60).open()
    w.stage("a", payload(1))
    os.kill(w.writer_pid, signal.SIGSTOP)
    t = w.sync_begin()
    t0 = time.monotonic()
    assert w.sync_done(t, 0.3) is False                # waited 0.3 s, and said "not yet"
    assert time.monotonic() - t0 >= 0.25 and w.fatal is None
    os.kill(w.writer_pid, signal.SIGCONT)
    assert w.sync_done(t, 10.0)
    w.close()
    assert scan_ids(tmp_path / "w.wal") == ["a"]


def test_flush_says_when_it_could_not_make_the_accepted_ids_durable(tmp_path):
    """A HELLO answers the actor's pending ids as known only after a flush that made them durable: once the writer
    died with a batch in flight, flush() says False and nothing is acked (the ids are in the index, not on disk)."""
    from core.stream.durability import IoHooks, WalDurability
    sent = []
    io = IoHooks(send=lambda ident, m: sent.append((ident, m)), count=lambda *a, **k: None,
                 warn=lambda *a, **k: None)
    dur = WalDurability(io, str(tmp_path / "w.wal"), fsync=True, ack_interval_s=0.0, max_staged=100)
    dur.open(frozenset())
    dur.accept(b"actor1", "t0", payload(0))
    assert dur.flush() is True and [m.ids for _, m in sent] == [["t0"]]
    os.kill(dur.wal.writer_pid, signal.SIGSTOP)
    dur.accept(b"actor1", "t1", payload(1))
    dur.tick(time.monotonic())                          # the batch goes to the stopped writer
    os.kill(dur.wal.writer_pid, signal.SIGKILL)
    _until(lambda: dur.wal._proc.poll() is not None, "the killed writer's exit")
    assert dur.flush() is False and dur.fatal is not None and dur.holds("t1")
    assert [m.ids for _, m in sent] == [["t0"]]         # t1 never acked
    dur.close(1.0)
    assert scan_ids(tmp_path / "w.wal") == ["t0"]
