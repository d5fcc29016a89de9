"""The write-ahead log with its writes in a separate writer process: the receiver's io thread copies each record
into a shared-memory ring, the writer process checksums, writes and fdatasyncs each batch.

Why: in WAL mode the learner process paid ~40 us of CPU per 33 KB trajectory for the syncer's block join, crc32,
pwritev and fdatasync, work the raw link never does. Here the learner process pays one memcpy into the ring (a few
us, GIL held) and one small message per batch; the checksum, the copy into the page cache and fdatasync's own work
run in the writer process (on another core when one is free), outside the learner's GIL.

  learner process                                          writer process (python -m core.stream.walproc)
  io thread: stage(): reserve file offset, index id,       recv ("write", file offset, [(ring off, len)...])
             memcpy hdr+id+payload into the ring             crc32 over the regions, pwritev + TWC2 commit,
  syncer thread: sync(): send the cut batch's regions  ->    fdatasync
                 wait for the reply (deadline)         <-  ok | error text
                 free the batch's ring space; the io thread acks

The file format is WriteAheadLog's (core/stream/wal.py), byte for byte: the same TWL2 records and TWC2 commit. The
learner process keeps the index, the reads (replay) and compaction (after which the writer reopens the file).

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
import errno
import fcntl
import logging
import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib

from core.stream.wal import _COMMIT, _COMMIT_MAGIC, _HDR, _MAGIC2, WalError, WalFull, WriteAheadLog, _Batch

log = logging.getLogger(__name__)

# The control protocol on a socketpair: request (op, file offset, n regions) + n x (ring offset, length) as u64;
# reply (status 0 = ok, length of an error text) + the text.
_REQ, _REP = struct.Struct("<BQI"), struct.Struct("<BI")
_HELLO, _WRITE, _WRITE_SYNC, _REOPEN, _EXIT = range(5)

RING_BYTES = 64 << 20  # at least; WalDurability sizes it to hold two of the largest frames


class _Regions:
    """A staged batch: (ring offset, length) of each record, in file order."""

    __slots__ = ("bufs", "pos")

    def __init__(self):
        self.bufs: list[tuple[int, int]] = []
        self.pos = 0


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
                cmd = [sys.executable, "-m", "core.stream.walproc", self.path, str(self.ring_bytes),
                       str(theirs.fileno()), str(ring_fd), str(self._lock_fd)]
                self._proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(), ring_fd, self._lock_fd),
                                              stdin=subprocess.DEVNULL)
            self._conn = ours
        finally:
            os.close(ring_fd)  # the mapping (and the writer's copy) keep the memory
        self._call(_HELLO, 30.0)
        return self

    def close(self) -> None:
        try:
            super().close()  # writes the staged tail through the writer
        finally:
            if self._conn is not None and self.fatal is None:
                try:
                    self._call(_EXIT, 10.0)
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
            b.bufs.append((at, n))
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
    def _call(self, op: int, timeout: float, start: int = 0, regions=()) -> None:
        """One request to the writer and its reply, within timeout; its death or silence is fatal and sticky."""
        try:
            if self._conn is None:
                raise EOFError("no writer process")
            flat = array.array("Q", [x for r in regions for x in r])
            self._conn.settimeout(timeout)
            self._conn.sendall(_REQ.pack(op, start, len(regions)) + flat.tobytes())
            status, n = _REP.unpack(_recv_exact(self._conn, _REP.size))
            why = _recv_exact(self._conn, n).decode("utf-8", "replace") if n else ""
        except (OSError, EOFError) as e:  # socket.timeout is an OSError
            code = self._proc.poll() if self._proc else None
            err = WalError(f"wal {self.path}: the writer process is gone (exit {code}): {e!r}")
            self.fatal = self._failed = err
            if self._proc is not None and code is None:
                self._proc.kill()
            log.error("%s; nothing after its last commit is acked", err)
            raise err from e
        if status != 0:
            err = WalError(f"wal {self.path}: {why}")
            self._failed = err
            raise err

    def _write_locked(self, cut) -> None:
        """Hand a cut batch to the writer: checksum, write, commit record, fdatasync; returns once durable."""
        batch, start = cut
        if self._failed is not None:
            raise WalError(f"wal {self.path} failed earlier: {self._failed}")
        self._call(_WRITE_SYNC if self.fsync else _WRITE, self.reply_timeout_s, start, batch.bufs)
        self._free(len(batch.bufs))

    def sync(self) -> None:
        with self._sync_lock:
            with self._lock:
                self._check_locked()
                cut = self._cut_locked()
                fd, dirty, self._dirty = self._fd, self._dirty, False
            if cut is not None:
                self._write_locked(cut)  # the writer fdatasyncs
            if dirty and self.fsync and fd >= 0:  # a self-checking append() went through this process's fd
                try:
                    os.fdatasync(fd)
                except OSError as e:
                    self._failed = e
                    raise WalError(f"wal {self.path}: fdatasync failed: {e}") from e

    def _replaced(self) -> None:
        if self._conn is not None and self.fatal is None and self._fd >= 0:
            self._call(_REOPEN, self.reply_timeout_s)


def _prefault(ring: mmap.mmap, n: int) -> None:
    """Allocate the first n bytes of the ring now rather than one page fault at a time on the io thread."""
    try:
        ring.madvise(23, 0, n)  # MADV_POPULATE_WRITE (Linux 5.14)
    except (OSError, ValueError):
        ring[:n] = bytes(n)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError("the other end closed the WAL control socket")
        got += k
    return bytes(buf)


def _serve(path: str, ring_bytes: int, sock_fd: int, ring_fd: int, lock_fd: int) -> int:
    sock = socket.socket(fileno=sock_fd)
    ring = mmap.mmap(ring_fd, ring_bytes)
    os.close(ring_fd)
    mv = memoryview(ring)
    fd = os.open(path, os.O_WRONLY)
    try:
        while True:
            try:
                op, start, count = _REQ.unpack(_recv_exact(sock, _REQ.size))
                flat = array.array("Q", _recv_exact(sock, 16 * count)) if count else ()
            except (EOFError, OSError):
                return 0  # the learner is gone: nothing more may be written
            try:
                if op in (_WRITE, _WRITE_SYNC):
                    crc, bufs = 0, []
                    for k in range(0, len(flat), 2):
                        b = mv[flat[k]:flat[k] + flat[k + 1]]
                        crc = zlib.crc32(b, crc)
                        bufs.append(b)
                    bufs.append(_COMMIT.pack(_COMMIT_MAGIC, start, crc))
                    _Batch.write(fd, start, bufs)
                    bufs = b = None  # no views of the ring outlive the request
                    if op == _WRITE_SYNC:
                        os.fdatasync(fd)
                elif op == _REOPEN:
                    os.close(fd)
                    fd = os.open(path, os.O_WRONLY)
                elif op == _EXIT:
                    sock.sendall(_REP.pack(0, 0))
                    return 0
            except OSError as e:
                why = f"writer op {op} failed: {e!r}".encode()
                sock.sendall(_REP.pack(1, len(why)) + why)
                continue
            sock.sendall(_REP.pack(0, 0))
    finally:
        os.close(fd)
        os.close(lock_fd)


if __name__ == "__main__":
    # A Ctrl-C or SIGTERM to the process group: the learner decides when to stop (it flushes through this process
    # first, then says "exit"); EOF on the control socket ends it if the learner dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    a = sys.argv[1:]
    try:
        sys.exit(_serve(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4])))
    except OSError as e:
        if e.errno != errno.EPIPE:
            raise
        sys.exit(1)
