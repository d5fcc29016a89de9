"""The write-ahead log with its writes in a separate writer process: the receiver's io thread copies each record
into a shared-memory ring, the writer process (core/stream/walwriter.py) checksums, writes and fdatasyncs each batch.

Why: in WAL mode the learner process paid ~40 us of CPU per 33 KB trajectory for the syncer's block join, crc32,
pwritev and fdatasync, work the raw link never does. Here the learner process pays one memcpy into the ring (a few
us, GIL held) and one small message per batch; the checksum, the write (O_DIRECT: no page cache) and fdatasync's
own work run in the writer process (on another core when one is free), outside the learner's GIL.

  learner process                                          writer process (python -m core.stream.walwriter)
  io thread: stage(): reserve file offset, index id,       recv ("write", file offset, [(ring off, len)...])
             memcpy hdr+id+payload into the ring             copy into an aligned buffer, crc32, + TWC2 commit,
  io thread at a tick: sync_begin(): send the cut    ->      O_DIRECT pwrite of whole blocks, fdatasync
             batch's regions, go on receiving
  io thread at later ticks: sync_done(): the reply?  <-    ok | error text
             free the batch's ring space; ack it
  (sync(), compact() and close() on other threads wait for a reply in flight first, then make their own call.)

The file format is WriteAheadLog's (core/stream/wal.py), byte for byte: the same TWL2 records and TWC2 commit; only
a crashed writer leaves zeros after the last commit (its last block's padding), which the next open() cuts as a torn
tail. The learner process keeps the index, the reads (replay) and compaction (after which the writer reopens the file).

Failure: the writer's death (EOF on the control socket) or a reply past its deadline is sticky, like a failed
fdatasync: the batch in flight and everything after it is never acked, `fatal` is set and the receiver's get()
raises, so the learner stops loudly (the supervisor restarts it; the actors re-send what was not acked, the new
learner replays what was). The writer exits when the learner goes (EOF). A lock file beside the log (flock, shared
by the learner and its writer) keeps a new learner from opening the log while an old writer still holds it.

Memory: the ring has a fixed size; a record that does not fit waits (the receiver NACKs "busy", the actor retries).
"""
from __future__ import annotations

import array
import collections
import fcntl
import logging
import mmap
import os
import select
import socket
import subprocess
import sys
import threading
import time

from core.stream.wal import _COMMIT, _HDR, _MAGIC2, WalError, WalFull, WriteAheadLog
from core.stream.walwriter import REP, REQ, EXIT, HELLO, REOPEN, WRITE, WRITE_SYNC, recv_exact

log = logging.getLogger(__name__)

RING_BYTES = 64 << 20  # at least; WalDurability sizes it to hold two of the largest frames


class _Regions:
    """A staged batch: (ring offset, length) of its records, in file order, records that follow each other in the
    ring as one region (the writer then copies and checksums a run of them in one call, not one call per record);
    `extents`: the ring allocations to free once it is written."""

    __slots__ = ("bufs", "pos", "extents")

    def __init__(self):
        self.bufs: list[tuple[int, int]] = []
        self.pos = self.extents = 0


class WriterProcessLog(WriteAheadLog):
    def __init__(self, path, fsync: bool = True, ring_bytes: int = RING_BYTES, reply_timeout_s: float = 60.0,
                 lock_timeout_s: float = 30.0):
        super().__init__(path, fsync=fsync)
        self.ring_bytes, self.reply_timeout_s, self.lock_timeout_s = ring_bytes, reply_timeout_s, lock_timeout_s
        self._staged = _Regions()
        self._ring: mmap.mmap | None = None
        self._ring_lock = threading.Lock()
        self._extents: collections.deque[tuple[int, int]] = collections.deque()  # allocated (start, end), in order
        self._conn: socket.socket | None = None
        self._proc: subprocess.Popen | None = None
        self._lock_fd = -1
        self.fatal: BaseException | None = None  # the writer process died or hung: the learner must stop
        self._inflight: tuple[int, float] | None = None  # (regions, sent at) of a sync_begin() not yet answered
        self._sent = self._done = 0  # sync_begin() tickets handed out / answered

    @property
    def writer_pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    # --- lifecycle --------------------------------------------------------------------------------------------------
    def open(self) -> "WriterProcessLog":
        d = os.path.dirname(self.path)
        if d:
            os.makedirs(d, exist_ok=True)
        self._lock_fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        t0 = time.monotonic()
        while True:  # an old writer (of a learner that just died) exits on EOF; wait for it, with a deadline
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if time.monotonic() - t0 > 0.5:
                    log.warning("wal %s: waited %.1fs for the previous writer to exit", self.path, time.monotonic() - t0)
                break
            except BlockingIOError:
                if time.monotonic() > t0 + self.lock_timeout_s:
                    os.close(self._lock_fd)
                    raise WalError(f"wal {self.path} is locked by another writer") from None
                time.sleep(0.05)
        super().open()  # scan, truncate a torn tail: before the writer exists
        ring_fd = os.memfd_create("tars-wal-ring")
        try:
            os.ftruncate(ring_fd, self.ring_bytes)
            self._ring = mmap.mmap(ring_fd, self.ring_bytes)
            _prefault(self._ring, self.ring_bytes >> 3)  # the part a stream cycles through (see _alloc)
            ours, theirs = socket.socketpair()
            with theirs:
                cmd = [sys.executable, "-m", "core.stream.walwriter", self.path, str(self.ring_bytes),
                       str(theirs.fileno()), str(ring_fd), str(self._lock_fd)]
                self._proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(), ring_fd, self._lock_fd),
                                              stdin=subprocess.DEVNULL)
            self._conn = ours
        finally:
            os.close(ring_fd)  # the mapping (and the writer's copy) keep the memory
        self._call(HELLO, 30.0)
        return self

    def close(self) -> None:
        try:
            super().close()  # writes the staged tail through the writer
        finally:
            if self._conn is not None and self.fatal is None:
                try:
                    with self._sync_lock:
                        self._call(EXIT, 10.0, self._end)  # the writer cuts its block padding there
                except WalError:
                    pass
            self._reap()

    def _reap(self) -> None:
        if self._proc is not None:
            try:
                self._proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5.0)
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # --- the ring ---------------------------------------------------------------------------------------------------
    def _place(self, n: int) -> int:
        """Where a record of n bytes goes in the ring after the last one, or -1 if there is no room now (call with
        _ring_lock). Freeing (from the oldest) never turns a place into no place, so room() then stage() holds."""
        R, ext = self.ring_bytes, self._extents
        if not ext:
            return 0 if n <= R else -1
        first, last = ext[0][0], ext[-1][1]
        if first < last or (first == 0 and last == R):  # not wrapped: free is [last, R) and [0, first)
            # Wrap early, once past R/8 with room at the start: a stream then cycles through about R/8 of the ring
            # (prefaulted at open), not all of it, and the head rarely runs into the tail.
            soft = R >> 3
            if last + n <= soft:
                return last
            if first >= max(n, soft >> 1):  # room before the tail for what is usually in flight
                return 0
            return last if last + n <= R else 0 if n <= first else -1
        return last if last + n <= first else -1        # wrapped: free is [last, first)

    def _alloc(self, n: int) -> int:
        with self._ring_lock:
            at = self._place(n)
            if at < 0:
                raise WalFull(f"wal {self.path}: no room in the ring for {n} bytes")
            self._extents.append((at, at + n))
            return at

    def room(self, nbytes: int) -> bool:
        with self._ring_lock:
            return self._place(nbytes) >= 0

    def _free(self, k: int) -> None:
        with self._ring_lock:
            for _ in range(k):
                self._extents.popleft()

    # --- io thread --------------------------------------------------------------------------------------------------
    def stage(self, tid: str, payload) -> None:
        idb = tid.encode("utf-8")
        hdr = _HDR.pack(_MAGIC2, len(idb), len(payload), 0)
        h, n = len(hdr) + len(idb), len(hdr) + len(idb) + len(payload)
        with self._lock:
            self._check_locked()
            at = self._alloc(n)
            r = self._ring
            r[at:at + len(hdr)] = hdr
            r[at + len(hdr):at + h] = idb
            r[at + h:at + n] = payload  # the one copy of the payload in this process
            b = self._staged
            if not self._staged_n:
                self._staged_start = self._end
            if b.bufs and sum(b.bufs[-1]) == at:  # right after the previous record: one region
                b.bufs[-1] = (b.bufs[-1][0], b.bufs[-1][1] + n)
            else:
                b.bufs.append((at, n))
            b.extents += 1
            b.pos += n
            self._staged_n += 1
            self.index[tid] = (self._end + h, len(payload))
            self._end += n

    def _cut_locked(self):
        if not self._staged_n:
            return None
        batch, start = self._staged, self._staged_start
        self._staged, self._staged_n = _Regions(), 0
        self._end += _COMMIT.size
        return batch, start

    def _check_locked(self) -> None:
        if self.fatal is not None and self._failed is None:
            self._failed = self.fatal
        super()._check_locked()

    # --- the writer ---------------------------------------------------------------------------------------------------
    def _request(self, op: int, timeout: float, start: int = 0, regions=(), extents: int = 0) -> None:
        """Send one request (call with _sync_lock, none in flight); _finish reads its reply and frees its `extents`
        ring allocations."""
        try:
            if self._conn is None:
                raise EOFError("no writer process")
            flat = array.array("Q", [x for r in regions for x in r])
            self._conn.settimeout(timeout)
            self._conn.sendall(REQ.pack(op, start, len(regions)) + flat.tobytes())
        except (OSError, EOFError) as e:  # socket.timeout is an OSError
            raise self._lost(e) from e
        self._inflight = (extents, time.monotonic())

    def _lost(self, e: BaseException) -> WalError:
        """The writer died or went silent: fatal and sticky."""
        code = self._proc.poll() if self._proc else None
        err = WalError(f"wal {self.path}: the writer process is gone (exit {code}): {e!r}")
        self.fatal = self._failed = err
        if self._proc is not None and code is None:
            self._proc.kill()
        log.error("%s; nothing after its last commit is acked", err)
        return err

    def _reply(self, timeout: float) -> None:
        self._conn.settimeout(timeout)
        status, n = REP.unpack(recv_exact(self._conn, REP.size))
        why = recv_exact(self._conn, n).decode("utf-8", "replace") if n else ""
        if status != 0:
            self._failed = WalError(f"wal {self.path}: {why}")
            raise self._failed

    def _call(self, op: int, timeout: float, start: int = 0, regions=(), extents: int = 0) -> None:
        """One request to the writer and its reply, within timeout (after the reply to a request sync_begin() left in
        flight, if any)."""
        self._finish(timeout)
        self._request(op, timeout, start, regions, extents)
        self._finish(timeout)

    def _write_locked(self, cut) -> None:
        """Hand a cut batch to the writer: checksum, write, commit record, fdatasync; returns once durable."""
        batch, start = cut
        if self._failed is not None:
            raise WalError(f"wal {self.path} failed earlier: {self._failed}")
        self._call(WRITE_SYNC if self.fsync else WRITE, self.reply_timeout_s, start, batch.bufs, batch.extents)

    def sync(self) -> None:
        with self._sync_lock:
            with self._lock:
                self._check_locked()
                cut = self._cut_locked()
                fd, dirty, self._dirty = self._fd, self._dirty, False
            if cut is not None:
                self._write_locked(cut)  # the writer fdatasyncs
            else:
                self._finish(self.reply_timeout_s)  # "everything staged before this call": a request in flight too
            self._datasync(fd, dirty)  # a self-checking append() went through this process's fd

    # --- syncs without a waiting thread (the receiver's io thread: core/stream/durability.py) -------------------------
    def sync_begin(self) -> int:
        """Send what is staged to the writer and return without waiting for it: a ticket for sync_done(). The io
        thread goes on receiving meanwhile, and no thread of this process waits on the writer (a syncer thread's
        wake-ups cost the io thread the GIL hand-overs that made WAL mode slower than the raw link)."""
        with self._sync_lock:
            self._finish(self.reply_timeout_s)  # at most one request in flight
            with self._lock:
                self._check_locked()
                cut = self._cut_locked()
                dirty, self._dirty = self._dirty, False
            self._datasync(self._fd, dirty)  # an append() through this process's fd (rare): durable the plain way
            if cut is None:
                return self._sent
            self._request(WRITE_SYNC if self.fsync else WRITE, self.reply_timeout_s, cut[1], cut[0].bufs,
                          cut[0].extents)
            self._sent += 1
            return self._sent

    def sync_done(self, ticket: int, timeout: float = 0.0) -> bool:
        """Is the batch of that ticket durable? Waits up to timeout for it (0: only looks). Raises WalError if it
        failed, or once the writer has been silent past reply_timeout_s."""
        if self._done >= ticket:
            return True
        if not self._sync_lock.acquire(timeout=timeout) if timeout else not self._sync_lock.acquire(False):
            return False  # another thread is talking to the writer (it finishes our request first)
        try:
            if self._inflight is None:  # its reply was an error (sticky), or the log was closed meanwhile
                raise WalError(f"wal {self.path}: sync {ticket} failed: {self._failed}")
            if not select.select([self._conn], [], [], timeout)[0]:  # a slow writer is not a lost one
                if time.monotonic() - self._inflight[1] > self.reply_timeout_s:
                    raise self._lost(TimeoutError(f"no reply in {self.reply_timeout_s:.0f}s"))
                return False
            self._finish(self.reply_timeout_s)
            return self._done >= ticket
        finally:
            self._sync_lock.release()

    def _settle(self) -> None:
        self._finish(self.reply_timeout_s)

    def _finish(self, timeout: float) -> None:
        """Read the reply to the request in flight, if any (call with _sync_lock), and free its ring space."""
        if self._inflight is None:
            return
        n = self._inflight[0]
        self._inflight = None
        try:
            self._reply(timeout)
        except WalError:  # the writer's own error answer (sticky, set by _reply)
            raise
        except (OSError, EOFError) as e:  # socket.timeout is an OSError
            raise self._lost(e) from e
        self._free(n)
        self._done = self._sent

    def _replaced(self) -> None:
        if self._conn is not None and self.fatal is None and self._fd >= 0:
            self._call(REOPEN, self.reply_timeout_s)


def _prefault(ring: mmap.mmap, n: int) -> None:
    """Allocate the first n bytes of the ring now rather than one page fault at a time on the io thread."""
    try:
        ring.madvise(23, 0, n)  # MADV_POPULATE_WRITE (Linux 5.14)
    except (OSError, ValueError):
        ring[:n] = bytes(n)
