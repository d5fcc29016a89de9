"""Write-ahead log of received trajectories: the learner acks a trajectory only once it is fsynced here.

File format: records appended one after another, each header "<4sIII" = (magic, id_len, payload_len, crc), then
id (utf-8), then payload (the Trajectory.encode() bytes exactly as the actor sent them). Two kinds:
  * b"TWL1": a self-checking record, crc = crc32(id + payload); written at once by append().
  * b"TWL2": a group-committed record (crc field 0), written by sync() for everything stage()d since the last sync,
    followed by one commit record "<4sQI" = (b"TWC2", offset of the batch's first record, crc32 of the batch's bytes
    from there up to the commit record). A TWL2 record counts only once the commit after it checks out.
A torn tail (the learner died mid-write: a short record, a bad crc, TWL2 records without a valid commit) is truncated
away on open; those trajectories were never acked (acks follow sync, in order), so their actors re-send them.

The receiver stages: its io thread only reserves the offset, indexes the id (so duplicates are caught at once) and
keeps a reference to the payload buffer (no copy); the syncer thread joins the batch into blocks of a few MB,
checksums each with one GIL-releasing crc32 call, writes them with one pwritev and fdatasyncs it before the acks go
out.

Only an index {id: (offset, length)} stays in memory; payloads are read back with pread when replayed, so a large
backlog costs disk, not RAM. One lock: the receiver's io thread appends, syncs and reads; the training thread may
compact after a checkpoint.
"""
from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading

# zlib-ng's crc32 is zlib's CRC-32 (the same values: the log's format is unchanged) computed with carry-less multiply
# instructions where the CPU has them: ~0.9 us for a 33 KB trajectory against ~9 us for zlib's (docs/benchmarks.md).
from zlib_ng.zlib_ng import crc32

log = logging.getLogger(__name__)

_HDR = struct.Struct("<4sIII")
_MAGIC = b"TWL1"
_MAGIC2 = b"TWL2"
_COMMIT = struct.Struct("<4sQI")
_COMMIT_MAGIC = b"TWC2"


def scan(read, size: int) -> tuple[list[tuple[str, int, int]], int]:
    """Valid records of a log: ([(id, payload offset, payload length)] in file order, end of the valid prefix).

    read(n, off) returns n bytes at off. Used on open and, read-only, by tools that inspect a live learner's log.
    """
    out: list[tuple[str, int, int]] = []
    batch: list[tuple[str, int, int]] = []  # TWL2 records waiting for their commit
    batch_start, crc = -1, 0
    off = good = 0
    while off + _HDR.size <= size:
        head = read(_HDR.size, off)
        magic = head[:4]
        if magic == _COMMIT_MAGIC:
            if off + _COMMIT.size > size:
                break
            _, start, want = _COMMIT.unpack(read(_COMMIT.size, off))
            if not batch or start != batch_start or crc != want:
                break
            out.extend(batch)
            batch, batch_start, crc = [], -1, 0
            off = good = off + _COMMIT.size
            continue
        _, id_len, plen, rcrc = _HDR.unpack(head)
        rec_end = off + _HDR.size + id_len + plen
        if magic not in (_MAGIC, _MAGIC2) or rec_end > size or (magic == _MAGIC and batch):
            break
        body = read(id_len + plen, off + _HDR.size)
        tid = body[:id_len].decode("utf-8", "replace")
        entry = (tid, off + _HDR.size + id_len, plen)
        if magic == _MAGIC:
            if crc32(body) != rcrc:
                break
            out.append(entry)
            good = rec_end
        else:
            if not batch:
                batch_start = off
            crc = crc32(body, crc32(head, crc))
            batch.append(entry)
        off = rec_end
    return out, good


_PAGE = 4096  # core/stream/walwriter.py writes whole blocks of this size with O_DIRECT: zeros after the logical end


def _padding(read, size: int, off: int) -> bool:
    """Zeros from off to the end of a file of whole blocks: the log writer's padding (cut when it exits, left by a
    crash), not damage."""
    return size % _PAGE == 0 and size - off < _PAGE and not any(read(size - off, off))


def tail_kind(read, size: int, good: int) -> str:
    """What follows a log's valid prefix (scan()'s end `good`): "" nothing; "incomplete" an append not finished
    (a record cut short by the end of the file, group-committed records up to the end with no commit yet, or the
    log writer's zero padding of its last block: what a reader sees during a write or after a crash inside one;
    none of it was acked); "corrupt" anything else (a crc or a commit that does not check out, bytes that are no
    record). Read-only, like scan()."""
    off, in_batch = good, False
    while off < size:
        if _padding(read, size, off):
            return "incomplete"
        if size - off < _HDR.size:
            head = read(size - off, off)
            return "incomplete" if any(m.startswith(head[:4]) for m in (_MAGIC, _MAGIC2, _COMMIT_MAGIC)) else "corrupt"
        head = read(_HDR.size, off)
        magic = head[:4]
        if magic == _COMMIT_MAGIC:  # scan() took every commit that checks out: this one does not, unless cut short
            return "incomplete" if in_batch and off + _COMMIT.size > size else "corrupt"
        if magic not in (_MAGIC, _MAGIC2):
            return "corrupt"
        _, id_len, plen, _ = _HDR.unpack(head)
        if off + _HDR.size + id_len + plen > size:
            return "incomplete"
        if magic == _MAGIC:  # whole, yet scan() stopped at or before it: a bad crc, or inside a batch
            return "corrupt"
        in_batch = True
        off += _HDR.size + id_len + plen
    return "incomplete" if in_batch else ""


def scan_ids(path) -> list[str]:
    """Ids in a WAL file, read-only (a live learner owns it: its uncommitted tail is simply not counted)."""
    with open(path, "rb") as f:
        data = f.read()
    records, _ = scan(lambda n, off: data[off:off + n], len(data))
    return [t for t, _, _ in records]


_BLOCK = 4 << 20  # staged buffers are joined into blocks of up to this size for the checksum and the write
_BIG = 1 << 20    # a buffer this large is its own block, checksummed and written where it is (no copy)


class _Batch:
    """Staged records by reference (no copy at stage time: the payloads stay in the buffers libzmq received them
    into); the syncer seals a cut batch: checksum, then one pwritev.

    The checksum must not hold the receiver's GIL for long: crc32 holds it for small buffers and releases it
    for large ones (zlib's above 5 KB), but every release costs the syncer up to the 5 ms switch interval to get the GIL back from a busy io
    thread, so one crc32 call per payload (or per 4 KB piece, GIL held: ~13 us per 33 KB trajectory on the io
    thread's GIL with zlib's crc32) is slow either way. seal() joins the small buffers into blocks of up to 4 MB (one memcpy per block,
    ~0.1 ms per MB with the GIL held) and checksums each block with one crc32 call that releases the GIL: a batch
    costs one or two GIL hand-overs and the checksum runs beside the io thread, on the other core."""

    __slots__ = ("bufs", "pos")

    def __init__(self):
        self.bufs: list = []
        self.pos = 0

    def put(self, b) -> None:
        self.bufs.append(b)
        self.pos += len(b)

    def seal(self) -> tuple[list, int]:
        """(blocks to write, crc32 of the whole batch)."""
        blocks, small, n, crc = [], [], 0, 0

        def close_small():
            nonlocal small, n, crc
            if small:
                blk = small[0] if len(small) == 1 else b"".join(small)
                crc = crc32(blk, crc)
                blocks.append(blk)
                small, n = [], 0

        for b in self.bufs:
            if len(b) >= _BIG:
                close_small()
                crc = crc32(b, crc)
                blocks.append(b)
                continue
            small.append(b)
            n += len(b)
            if n >= _BLOCK:
                close_small()
        close_small()
        return blocks, crc

    @staticmethod
    def write(fd: int, off: int, bufs: list) -> None:
        for i in range(0, len(bufs), 1000):  # Linux IOV_MAX is 1024
            chunk = bufs[i:i + 1000]
            want = sum(len(b) for b in chunk)
            n = os.pwritev(fd, chunk, off)
            if n != want:  # rare (huge writes): finish this chunk with plain pwrites
                if n <= 0:
                    raise OSError(f"short write at offset {off}")
                rest, o = memoryview(b"".join(chunk))[n:], off + n
                while rest:
                    k = os.pwrite(fd, rest, o)
                    if k <= 0:
                        raise OSError(f"short write at offset {o}")
                    rest, o = rest[k:], o + k
            off += want


class WalError(OSError):
    """A write or fdatasync of the log failed: nothing staged from then on can be made durable (or acked)."""


class WalFull(WalError):
    """No room to stage this record now (core/stream/walproc.py's ring): refuse it for a retry; the log is fine."""


class WriteAheadLog:
    def __init__(self, path: str | os.PathLike, fsync: bool = True):
        self.path = os.fspath(path)
        self.fsync = fsync
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()  # taken before _lock, never after it
        self.index: dict[str, tuple[int, int]] = {}   # id -> (payload offset, payload length), file order
        self._fd = -1
        self._end = 0                  # end of the file once everything staged is written
        self._dirty = False
        # Staged records (by reference), reserved at _staged_start.._end; the syncer writes them.
        self._staged = _Batch()
        self._staged_n = 0
        self._staged_start = 0
        self._failed: BaseException | None = None
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
        fd = self._fd
        size = os.fstat(fd).st_size
        records, off = scan(lambda n, o: os.pread(fd, n, o), size)
        self.index = {}
        for tid, o, n in records:
            self.index.setdefault(tid, (o, n))
        if off < size:
            # A torn or corrupt tail: nothing after it was acked (acks follow fsync, in order), so drop it.
            log.warning("wal %s: truncating %d bytes of torn tail at offset %d", self.path, size - off, off)
            self.truncated_bytes = size - off
            os.ftruncate(fd, off)
            os.fsync(fd)
        self._end = off

    def __contains__(self, tid: str) -> bool:
        return tid in self.index

    def __len__(self) -> int:
        return len(self.index)

    def staged(self) -> int:
        """Records staged and not yet written by sync() (their payloads are held in memory until then)."""
        return self._staged_n

    def staged_bytes(self) -> int:
        return self._staged.pos

    def room(self, nbytes: int) -> bool:
        """Can a record of nbytes be staged now? Always here (staged payloads stay in libzmq's buffers, bounded by
        the caller); a log that stages into a fixed buffer (core/stream/walproc.py) says when it is full."""
        return True

    def append(self, tid: str, payload: bytes) -> None:
        """Write one self-checking record now (not yet durable: call sync() before acking it)."""
        idb = tid.encode("utf-8")
        hdr = _HDR.pack(_MAGIC, len(idb), len(payload), crc32(payload, crc32(idb)))
        with self._sync_lock, self._lock:  # _sync_lock: a cut must not overlap a syncer's write (shared buffers)
            self._check_locked()
            self._settle()
            if self._staged_n:  # keep file order: the staged batch (and its commit) goes first
                self._write_locked(self._cut_locked())
            n = os.pwritev(self._fd, [hdr, idb, payload], self._end)
            if n != len(hdr) + len(idb) + len(payload):  # short write: disk full; leave the tail torn, raise
                raise OSError(f"short write to {self.path}: {n} bytes")
            self.index[tid] = (self._end + len(hdr) + len(idb), len(payload))
            self._end += n
            self._dirty = True

    def stage(self, tid: str, payload: bytes) -> None:
        """Reserve a record for the next sync(), which writes, checksums and fdatasyncs it. Cheap: no syscall.

        The id is indexed at once (duplicates are recognised before the write); the caller bounds staged() and acks
        only after the sync() that follows."""
        idb = tid.encode("utf-8")
        hdr = _HDR.pack(_MAGIC2, len(idb), len(payload), 0)
        with self._lock:
            self._check_locked()
            b = self._staged
            if not self._staged_n:
                self._staged_start = self._end
            b.put(hdr + idb)
            b.put(payload)
            self._staged_n += 1
            self.index[tid] = (self._end + len(hdr) + len(idb), len(payload))
            self._end += len(hdr) + len(idb) + len(payload)

    def _check_locked(self) -> None:
        if self._failed is not None:
            raise WalError(f"wal {self.path} failed earlier: {self._failed}")
        if self._fd < 0:
            raise WalError(f"wal {self.path} is not open")

    def _cut_locked(self) -> tuple[_Batch, int] | None:
        """Take the staged batch and reserve room for its commit record: (batch, start offset)."""
        if not self._staged_n:
            return None
        batch, start = self._staged, self._staged_start
        self._staged, self._staged_n = _Batch(), 0
        self._end += _COMMIT.size
        return batch, start

    def _write_locked(self, cut) -> None:
        """Checksum and write a cut batch with its commit (called under _sync_lock or _lock; offsets are reserved)."""
        batch, start = cut
        try:
            blocks, crc = batch.seal()
            batch.write(self._fd, start, blocks + [_COMMIT.pack(_COMMIT_MAGIC, start, crc)])
        except BaseException as e:
            # Later records were reserved after this batch: the log can no longer be written in order.
            self._failed = e
            raise WalError(f"wal {self.path}: write failed: {e}") from e
        self._dirty = True

    def sync(self) -> None:
        """Write everything staged and make every record appended or staged before this call durable (one
        pwrite and one fdatasync however many came since the last).

        The append lock is not held while writing or in fdatasync, so the io thread keeps staging while a syncer
        thread waits on the disk; _sync_lock keeps compact/close from swapping the fd underneath.
        """
        with self._sync_lock:
            with self._lock:
                self._check_locked()
                cut = self._cut_locked()
            if cut is not None:
                self._write_locked(cut)  # its offsets are reserved, so appends may go on meanwhile
            with self._lock:
                fd, dirty, self._dirty = self._fd, self._dirty, False
            self._datasync(fd, dirty)

    def _datasync(self, fd: int, dirty: bool) -> None:
        """fdatasync `fd` when something was written through it since the last sync (and the log syncs at all)."""
        if dirty and self.fsync and fd >= 0:
            try:
                os.fdatasync(fd)
            except OSError as e:
                self._failed = e  # after a failed fdatasync the page cache state is unknown: stop acking
                raise WalError(f"wal {self.path}: fdatasync failed: {e}") from e

    def read(self, tid: str) -> bytes:
        with self._lock:
            off, n = self.index[tid]
            return os.pread(self._fd, n, off)

    def compact(self, drop: set[str] | frozenset[str]) -> tuple[int, int]:
        """Rewrite the log without the records in `drop` (atomic rename); returns (kept, dropped)."""
        with self._sync_lock, self._lock:
            if self._failed is not None:  # the index may name records that never reached the file
                raise WalError(f"wal {self.path} failed earlier: {self._failed}")
            self._settle()  # a batch still being written must be in the file before the file is copied
            if self._fd >= 0:
                cut = self._cut_locked()
                if cut is not None:
                    self._write_locked(cut)  # staged records must be in the file before it is copied
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
                    hdr = _HDR.pack(_MAGIC, len(idb), n, crc32(payload, crc32(idb)))
                    os.pwritev(fd, [hdr, idb, payload], end)
                    index[t] = (end + len(hdr) + len(idb), n)
                    end += len(hdr) + len(idb) + n
                os.fsync(fd)
                os.replace(tmp, self.path)
            except BaseException:  # the log is as it was (a full disk: the learner goes on, compacts at the next one)
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)  # what was written of the copy would keep the disk full
                raise
            os.close(self._fd)  # the file is the new one from here: so is this log's state, whatever follows
            self._fd, self._end, self.index, self._dirty = fd, end, index, False
            self._replaced()
            if closed:
                os.close(fd)
                self._fd = -1
            dfd = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY)
            try:
                os.fsync(dfd)  # the rename itself must be durable
            finally:
                os.close(dfd)
            return len(keep), dropped

    def _settle(self) -> None:
        """Called with both locks held before this process touches the file itself (append, compact): a subclass whose
        writes may still be in flight waits for them here."""

    def _replaced(self) -> None:
        """compact() swapped in the rewritten file (both locks held): a subclass with another writer re-points it."""

    def close(self) -> None:
        with self._sync_lock, self._lock:
            if self._fd >= 0:
                if self._failed is None:
                    cut = self._cut_locked()
                    if cut is not None:
                        try:
                            self._write_locked(cut)
                        except WalError:
                            log.exception("wal %s: could not write the staged tail on close", self.path)
                if self._dirty and self.fsync and self._failed is None:
                    os.fdatasync(self._fd)
                os.close(self._fd)
                self._fd = -1
