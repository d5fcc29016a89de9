"""The write-ahead log's group commit: staged records count only once their commit record checks out."""
from __future__ import annotations

import os

import pytest

from core.stream.wal import WalError, WriteAheadLog, scan_ids


def payload(i: int, n: int = 40_000) -> bytes:
    return bytes([i % 251]) * n  # > 5 KB, so crc32 and the writes take the GIL-releasing paths


def test_staged_records_are_durable_after_sync_and_survive_reopen(tmp_path):
    p = tmp_path / "w.wal"
    w = WriteAheadLog(p).open()
    w.stage("a", payload(1))
    w.stage("b", memoryview(payload(2)))   # the receiver stages zero-copy frames
    assert "a" in w and "b" in w and w.staged() == 2 and os.path.getsize(p) == 0  # indexed at once, written later
    w.sync()
    assert w.staged() == 0
    w.append("c", payload(3))              # a self-checking record after a committed batch
    w.stage("d", payload(4))
    w.sync()
    w.close()
    r = WriteAheadLog(p).open()
    assert list(r.index) == ["a", "b", "c", "d"] and r.truncated_bytes == 0
    assert [r.read(t) for t in "abcd"] == [payload(i) for i in (1, 2, 3, 4)]
    assert scan_ids(p) == ["a", "b", "c", "d"]
    r.close()


def test_a_batch_without_a_valid_commit_is_a_torn_tail(tmp_path):
    p = tmp_path / "w.wal"
    w = WriteAheadLog(p).open()
    w.stage("a", payload(1))
    w.sync()
    good = os.path.getsize(p)
    w.stage("b", payload(2))
    w.stage("c", payload(3))
    w.sync()
    w.close()
    data = p.read_bytes()
    # 1. the learner died before the commit record reached the file
    p.write_bytes(data[:-16])
    assert scan_ids(p) == ["a"]
    r = WriteAheadLog(p).open()
    assert list(r.index) == ["a"] and os.path.getsize(p) == good and r.truncated_bytes == len(data) - 16 - good
    r.close()
    # 2. the commit is there but a byte of the batch is not what was checksummed
    bad = bytearray(data)
    bad[good + 100] ^= 0xFF
    p.write_bytes(bytes(bad))
    r = WriteAheadLog(p).open()
    assert list(r.index) == ["a"] and os.path.getsize(p) == good
    # 3. appending after the truncation works and is kept
    r.stage("b", payload(2))
    r.sync()
    r.close()
    assert scan_ids(p) == ["a", "b"]


def test_compact_and_close_write_what_is_staged(tmp_path):
    p = tmp_path / "w.wal"
    w = WriteAheadLog(p).open()
    for i in range(5):
        w.stage(f"t{i}", payload(i))
    assert w.compact({"t0", "t1"}) == (3, 2)       # staged records are written before the copy
    w.stage("t5", payload(5))
    w.close()                                        # and on close
    r = WriteAheadLog(p).open()
    assert list(r.index) == ["t2", "t3", "t4", "t5"] and r.read("t4") == payload(4)
    r.close()


def test_a_failed_write_stops_all_later_syncs(tmp_path):
    w = WriteAheadLog(tmp_path / "w.wal").open()
    w.stage("a", payload(1))
    os.close(w._fd)                                  # the next write fails (EBADF), as on a dead disk
    fd = os.open(os.devnull, os.O_RDONLY)            # keep the number taken so nothing else lands on it
    try:
        with pytest.raises(WalError):
            w.sync()
        with pytest.raises(WalError):                 # sticky: nothing staged later may be acked either
            w.stage("b", payload(2))
        with pytest.raises(WalError):
            w.sync()
        with pytest.raises(WalError):                 # its index names a record that never reached the file
            w.compact({"a"})
    finally:
        os.close(fd)
        w._fd = -1


def _records_checked_with_stdlib_zlib(data: bytes) -> list[str]:
    """Parse a log independently of core/stream/wal.py and check every checksum with the standard library's zlib."""
    import struct
    import zlib
    hdr, commit = struct.Struct("<4sIII"), struct.Struct("<4sQI")
    ids, pending, batch_start, pos = [], [], -1, 0
    while pos < len(data) and data[pos:pos + 4] != b"\0\0\0\0":
        magic = data[pos:pos + 4]
        if magic == b"TWC2":
            _, start, crc = commit.unpack_from(data, pos)
            assert start == batch_start and crc == zlib.crc32(data[start:pos])
            ids, pending, batch_start = ids + pending, [], -1
            pos += commit.size
            continue
        _, id_len, plen, crc = hdr.unpack_from(data, pos)
        body = data[pos + hdr.size:pos + hdr.size + id_len + plen]
        tid = body[:id_len].decode()
        if magic == b"TWL1":
            assert crc == zlib.crc32(body), tid
            ids.append(tid)
        else:
            assert magic == b"TWL2" and crc == 0
            batch_start = pos if batch_start < 0 else batch_start
            pending.append(tid)
        pos += hdr.size + id_len + plen
    assert not pending
    return ids


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_the_logs_checksums_are_zlibs_crc32(tmp_path, writer):
    """The log's crc32 is zlib-ng's (fast); its values must be the standard CRC-32 the format names, so logs written
    before and after read back alike: a log from each writer checks out against the standard library's zlib.crc32,
    and a log built here with zlib's checksums opens with every record."""
    import struct
    import zlib
    from core.stream.walproc import WriterProcessLog
    p = tmp_path / "w.wal"
    w = (WriterProcessLog(p, ring_bytes=8 << 20) if writer == "process" else WriteAheadLog(p)).open()
    for i in range(7):
        w.stage(f"s{i}", payload(i, 3_000 + 9_000 * i))  # small and large pieces
        if i % 3 == 2:
            w.sync()
    w.append("a", payload(99, 12_345))
    w.stage("z", payload(98, 70_001))
    w.close()
    assert _records_checked_with_stdlib_zlib(p.read_bytes()) == [f"s{i}" for i in range(7)] + ["a", "z"]

    q = tmp_path / "old.wal"
    hdr, out = struct.Struct("<4sIII"), bytearray()
    for i in range(3):
        body = f"o{i}".encode() + payload(i, 6_000)
        out += hdr.pack(b"TWL1", 2, 6_000, zlib.crc32(body)) + body
    start = len(out)
    for i in range(3, 5):
        out += hdr.pack(b"TWL2", 2, 6_000, 0) + f"o{i}".encode() + payload(i, 6_000)
    out += struct.pack("<4sQI", b"TWC2", start, zlib.crc32(bytes(out[start:])))
    q.write_bytes(bytes(out))
    r = WriteAheadLog(q).open()
    assert list(r.index) == [f"o{i}" for i in range(5)] and r.truncated_bytes == 0
    assert r.read("o4") == payload(4, 6_000)
    r.close()
