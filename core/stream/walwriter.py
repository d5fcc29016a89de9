"""The WAL writer process (`python -m core.stream.walwriter`, started by core/stream/walproc.py's WriterProcessLog):
it reads a learner's staged records from their shared-memory ring, checksums them and appends them to the log with
their commit record, and fdatasyncs, one request at a time, answering each on the control socket.

The control protocol on a socketpair: request (op, file offset, n regions) + n x (ring offset, length) as u64;
reply (status 0 = ok, length of an error text) + the text. EXIT's offset is the log's logical end. The learner's
side, the ring and the failure rules are in core/stream/walproc.py; the file format in core/stream/wal.py.
"""
from __future__ import annotations

import array
import errno
import logging
import mmap
import os
import signal
import socket
import struct
import sys

from core.stream.wal import _COMMIT, _COMMIT_MAGIC, crc32

log = logging.getLogger(__name__)

REQ, REP = struct.Struct("<BQI"), struct.Struct("<BI")
HELLO, WRITE, WRITE_SYNC, REOPEN, EXIT = range(5)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError("the other end closed the WAL control socket")
        got += k
    return bytes(buf)


class _Appender:
    """The writer's side of the file: each batch (its records, copied out of the ring, and its commit record) goes
    into a page-aligned staging buffer and out with pwrite on an O_DIRECT descriptor, in whole 4 KB blocks.

    Why O_DIRECT: a buffered write of a 33 KB record cost ~17 us of CPU (page-cache allocation, dirty accounting,
    then writeback when fdatasync pushes it out) against ~3 us for the same bytes written direct, and on a 2-core
    learner host that CPU is taken from the learner and the actors. The log's bytes are the same either way.

    Whole blocks: a batch rarely ends on a 4 KB boundary, so the last block goes out padded with zeros (past the
    logical end: a scan stops there, as at any torn tail) and is kept here; the next batch starts by rewriting it
    with the same bytes before its own. A crash in that rewrite leaves the committed bytes as they were: sectors are
    written whole, and theirs are unchanged. Where the file came from elsewhere (opened, reopened after compaction,
    or a record the learner process appended itself), the partial block is read back first. On exit the padding is
    cut off (the learner names the logical end). A file system without O_DIRECT (tmpfs, or an alignment it refuses
    with EINVAL) gets the same writes buffered, unpadded."""

    ALIGN = 4096
    STAGE = 8 << 20

    def __init__(self, path: str):
        self.path = path
        self.buf = mmap.mmap(-1, self.STAGE)  # page-aligned, as O_DIRECT needs
        self.view = memoryview(self.buf)
        self.direct = hasattr(os, "O_DIRECT")
        self.fd = self.rfd = -1
        self.end = -1  # where this process's last write ended (its partial block is in buf), or -1: read it back
        self.open()

    def open(self) -> None:
        self.close()
        self.rfd = os.open(self.path, os.O_RDONLY)
        if self.direct:
            try:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False
        if not self.direct:
            self.fd = os.open(self.path, os.O_WRONLY)
        self.end = -1

    def close(self) -> None:
        for fd in (self.fd, self.rfd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.rfd = -1

    def _out(self, n: int, base: int) -> None:
        """Write buf[:n] at file offset base (n is a multiple of ALIGN unless it is the batch's last write)."""
        m = -(-n // self.ALIGN) * self.ALIGN if self.direct else n
        if m > n:
            self.buf[n:m] = bytes(m - n)
        try:
            _pwrite_all(self.fd, self.view[:m], base)
        except OSError as e:
            if not self.direct or e.errno != errno.EINVAL:
                raise
            log.warning("wal %s: O_DIRECT writes refused (%s); writing through the page cache", self.path, e)
            self.direct = False
            self.open()
            _pwrite_all(self.fd, self.view[:n], base)

    def _spill(self, fill: int, base: int) -> tuple[int, int]:
        """The buffer is full: write its whole blocks, keep the partial one at the start."""
        cut = fill - fill % self.ALIGN
        self._out(cut, base)
        self.buf.move(0, cut, fill - cut)
        return fill - cut, base + cut

    def append(self, start: int, pieces) -> None:
        """One batch at file offset start: its records (views of the ring, in file order) and its commit."""
        base = start - start % self.ALIGN
        fill = start - base
        known, self.end = self.end, -1  # until this batch is through (a failed write leaves buf undefined)
        if fill and known != start:
            old = os.pread(self.rfd, fill, base)
            if len(old) != fill:
                raise OSError(f"short read of the log's last block at {base}: {len(old)} of {fill} bytes")
            self.buf[:fill] = old
        crc, cap = 0, self.STAGE
        for piece in pieces:
            p, size = 0, len(piece)
            while p < size:
                k = min(size - p, cap - fill)
                self.buf[fill:fill + k] = piece[p:p + k]
                crc = crc32(self.view[fill:fill + k], crc)
                fill, p = fill + k, p + k
                if fill == cap:
                    fill, base = self._spill(fill, base)
        if cap - fill < _COMMIT.size:
            fill, base = self._spill(fill, base)
        self.buf[fill:fill + _COMMIT.size] = _COMMIT.pack(_COMMIT_MAGIC, start, crc)
        fill += _COMMIT.size
        self._out(fill, base)
        keep = fill - fill % self.ALIGN
        self.buf.move(0, keep, fill - keep)
        self.end = base + fill

    def finish(self, end: int) -> None:
        """Cut the padding after the logical end (the learner's: it may have appended records itself)."""
        if os.fstat(self.fd).st_size > end:  # padding (also from before a fall-back to buffered writes)
            os.ftruncate(self.fd, end)
            os.fdatasync(self.fd)


def _pwrite_all(fd: int, view: memoryview, off: int) -> None:
    while view:
        k = os.pwrite(fd, view, off)
        if k <= 0:
            raise OSError(errno.ENOSPC, f"short write at offset {off}")
        view, off = view[k:], off + k


def _serve(path: str, ring_bytes: int, sock_fd: int, ring_fd: int, lock_fd: int) -> int:
    sock = socket.socket(fileno=sock_fd)
    ring = mmap.mmap(ring_fd, ring_bytes)
    os.close(ring_fd)
    mv = memoryview(ring)
    out = _Appender(path)
    try:
        while True:
            try:
                op, start, count = REQ.unpack(recv_exact(sock, REQ.size))
                flat = array.array("Q", recv_exact(sock, 16 * count)) if count else ()
            except (EOFError, OSError):
                return 0  # the learner is gone: nothing more may be written
            try:
                if op in (WRITE, WRITE_SYNC):
                    out.append(start, [mv[flat[k]:flat[k] + flat[k + 1]] for k in range(0, len(flat), 2)])
                    if op == WRITE_SYNC:
                        os.fdatasync(out.fd)
                elif op == REOPEN:
                    out.open()
                elif op == EXIT:
                    out.finish(start)
                    sock.sendall(REP.pack(0, 0))
                    return 0
            except OSError as e:
                why = f"writer op {op} failed: {e!r}".encode()
                sock.sendall(REP.pack(1, len(why)) + why)
                continue
            sock.sendall(REP.pack(0, 0))
    finally:
        out.close()
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
