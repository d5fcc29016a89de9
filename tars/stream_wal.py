"""Write-ahead log of received trajectories: the learner acks a trajectory only once it is fsynced here.

File format, one record per trajectory, appended:
    header "<4sIII" = (b"TWL1", id_len, payload_len, crc32(id + payload)), then id (utf-8), then payload
    (the Trajectory.encode() bytes exactly as the actor sent them).
A torn tail (the learner died mid-write) fails the length or crc check on open and is truncated away; those
trajectories were never acked, so their actors still hold them and re-send them.

Only an index {id: (offset, length)} stays in memory; payloads are read back with pread when replayed, so a large
backlog costs disk, not RAM. One lock: the receiver's io thread appends, syncs and reads; the training thread may
compact after a checkpoint.
"""
from __future__ import annotations

import logging
import os
import struct
import threading
import zlib

log = logging.getLogger(__name__)

_HDR = struct.Struct("<4sIII")
_MAGIC = b"TWL1"


class WriteAheadLog:
    def __init__(self, path: str | os.PathLike, fsync: bool = True):
        self.path = os.fspath(path)
        self.fsync = fsync
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()  # taken before _lock, never after it
        self.index: dict[str, tuple[int, int]] = {}   # id -> (payload offset, payload length), file order
        self._fd = -1
        self._end = 0
        self._dirty = False
        self.truncated_bytes = 0

    def open(self) -> "WriteAheadLog":
        d = os.path.dirname(self.path)
        if d:
            os.makedirs(d, exist_ok=True)
        with self._lock:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            self._scan_locked()
        return self

    def _scan_locked(self) -> None:
        self.index = {}
        size = os.fstat(self._fd).st_size
        off = 0
        while off + _HDR.size <= size:
            magic, id_len, plen, crc = _HDR.unpack(os.pread(self._fd, _HDR.size, off))
            rec_end = off + _HDR.size + id_len + plen
            if magic != _MAGIC or rec_end > size:
                break
            body = os.pread(self._fd, id_len + plen, off + _HDR.size)
            if zlib.crc32(body) != crc:
                break
            tid = body[:id_len].decode("utf-8", "replace")
            self.index.setdefault(tid, (off + _HDR.size + id_len, plen))
            off = rec_end
        if off < size:
            # A torn or corrupt tail: nothing after it was acked (acks follow fsync, in order), so drop it.
            log.warning("wal %s: truncating %d bytes of torn tail at offset %d", self.path, size - off, off)
            self.truncated_bytes = size - off
            os.ftruncate(self._fd, off)
            os.fsync(self._fd)
        self._end = off

    def __contains__(self, tid: str) -> bool:
        return tid in self.index

    def __len__(self) -> int:
        return len(self.index)

    def append(self, tid: str, payload: bytes) -> None:
        """Write one record (not yet durable: call sync() before acking it)."""
        idb = tid.encode("utf-8")
        hdr = _HDR.pack(_MAGIC, len(idb), len(payload), zlib.crc32(payload, zlib.crc32(idb)))
        with self._lock:
            n = os.pwritev(self._fd, [hdr, idb, payload], self._end)
            if n != len(hdr) + len(idb) + len(payload):  # short write: disk full; leave the tail torn, raise
                raise OSError(f"short write to {self.path}: {n} bytes")
            self.index[tid] = (self._end + len(hdr) + len(idb), len(payload))
            self._end += n
            self._dirty = True

    def sync(self) -> None:
        """Make every record appended before this call durable (one fdatasync however many came since the last).

        The append lock is not held during fdatasync, so the io thread keeps appending while a syncer thread waits
        on the disk; _sync_lock keeps compact/close from swapping the fd underneath.
        """
        with self._sync_lock:
            with self._lock:
                fd, dirty, self._dirty = self._fd, self._dirty, False
            if dirty and self.fsync and fd >= 0:
                os.fdatasync(fd)

    def read(self, tid: str) -> bytes:
        with self._lock:
            off, n = self.index[tid]
            return os.pread(self._fd, n, off)

    def compact(self, drop: set[str] | frozenset[str]) -> tuple[int, int]:
        """Rewrite the log without the records in `drop` (atomic rename); returns (kept, dropped)."""
        with self._sync_lock, self._lock:
            keep = [(t, o, n) for t, (o, n) in self.index.items() if t not in drop]
            dropped = len(self.index) - len(keep)
            if not dropped:
                return len(keep), 0
            closed = self._fd < 0  # compacting a closed log (after stop) is allowed; it stays closed
            if closed:
                self._fd = os.open(self.path, os.O_RDWR)
            tmp = self.path + ".compact"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                end, index = 0, {}
                for t, o, n in keep:
                    payload = os.pread(self._fd, n, o)
                    idb = t.encode("utf-8")
                    hdr = _HDR.pack(_MAGIC, len(idb), n, zlib.crc32(payload, zlib.crc32(idb)))
                    os.pwritev(fd, [hdr, idb, payload], end)
                    index[t] = (end + len(hdr) + len(idb), n)
                    end += len(hdr) + len(idb) + n
                os.fsync(fd)
                os.replace(tmp, self.path)
                dfd = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY)
                try:
                    os.fsync(dfd)  # the rename itself must be durable
                finally:
                    os.close(dfd)
            except BaseException:
                os.close(fd)
                raise
            os.close(self._fd)
            self._fd, self._end, self.index, self._dirty = fd, end, index, False
            if closed:
                os.close(fd)
                self._fd = -1
            return len(keep), dropped

    def close(self) -> None:
        with self._sync_lock, self._lock:
            if self._fd >= 0:
                if self._dirty and self.fsync:
                    os.fdatasync(self._fd)
                os.close(self._fd)
                self._fd = -1
