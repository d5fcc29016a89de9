"""The actor's outbox on disk: a killed actor's unacked trajectories survive into its restart (same actor_id).

One file per trajectory, named by a hash of its id, written without fsync: it protects against the actor process
dying, not against the machine losing power. Layout: <u32 id length> id <u32 frame length> frame [msgpack map of
the images the frame refers to by hash]. A file is removed once the learner acks (or refuses) its trajectory.

A file that does not parse (truncated, or not a spool record) is skipped with a warning and renamed to
NAME.traj.corrupt, kept for inspection and never loaded again; every other file loads, and the actor starts.
"""
from __future__ import annotations

import hashlib
import logging
import os
import struct

import msgpack

log = logging.getLogger(__name__)


class SpoolRecordError(ValueError):
    """A spool file that is not one whole record."""


def parse(data: bytes) -> tuple[str, bytes, dict | None]:
    """(id, frame, images) of one spool file's bytes; SpoolRecordError if they are not exactly one whole record."""
    try:
        (n,) = struct.unpack_from("<I", data)
        if 4 + n + 4 > len(data):
            raise SpoolRecordError(f"truncated: id of {n} bytes in a file of {len(data)}")
        tid = data[4:4 + n].decode()
        (m,) = struct.unpack_from("<I", data, 4 + n)
        if 8 + n + m > len(data):
            raise SpoolRecordError(f"truncated: frame of {m} bytes, {len(data) - 8 - n} there")
        frame, rest = data[8 + n:8 + n + m], data[8 + n + m:]
        images = msgpack.unpackb(rest, raw=False) if rest else None
    except SpoolRecordError:
        raise
    except (struct.error, UnicodeDecodeError, ValueError, TypeError, msgpack.UnpackException) as e:
        raise SpoolRecordError(f"{type(e).__name__}: {e}") from e
    if images is not None and not (isinstance(images, dict) and all(
            isinstance(k, str) and isinstance(v, bytes) for k, v in images.items())):
        raise SpoolRecordError("its images are not a map of hash -> bytes")
    return tid, frame, images


class Spool:
    def __init__(self, directory: str):
        self.dir = directory
        self.skipped: list[str] = []  # files the last load() could not parse (renamed to *.corrupt)

    def _path(self, tid: str) -> str:
        return os.path.join(self.dir, hashlib.sha1(tid.encode()).hexdigest() + ".traj")

    def save(self, tid: str, frame: bytes, images: dict | None = None) -> None:
        """OSError when the file cannot be written (a full disk): nothing of it is left behind."""
        p = self._path(tid)
        idb = tid.encode()
        try:
            with open(p + ".tmp", "wb") as f:
                f.write(struct.pack("<I", len(idb)) + idb)
                f.write(struct.pack("<I", len(frame)) + frame)
                if images:
                    f.write(msgpack.packb(images, use_bin_type=True))
            os.replace(p + ".tmp", p)
        except OSError:
            try:
                os.unlink(p + ".tmp")   # a partial file would hold its disk space until the next start
            except OSError:
                pass
            raise

    def remove(self, tid: str) -> bool:
        """False if it was not there."""
        try:
            os.unlink(self._path(tid))
            return True
        except FileNotFoundError:
            return False

    def sync(self) -> None:
        """fsync the directory, so the files removed so far stay removed after a power loss: an actor confirms a
        forgotten id to the learner only after this (core/stream/confirm.py). OSError if it cannot."""
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def load(self) -> list[tuple[str, bytes, dict | None]]:
        """(id, frame, images) of every spooled trajectory, oldest first (roughly the original order); files that do
        not parse are skipped (logged, renamed to *.corrupt, listed in self.skipped)."""
        os.makedirs(self.dir, exist_ok=True)
        files = []
        for name in os.listdir(self.dir):
            p = os.path.join(self.dir, name)
            if not name.endswith(".traj"):
                if name.endswith(".tmp"):
                    os.unlink(p)  # died mid-write: that trajectory was never sent
                continue
            files.append((os.stat(p).st_mtime_ns, p))
        out = []
        self.skipped = []
        for _, p in sorted(files):
            try:
                with open(p, "rb") as f:
                    out.append(parse(f.read()))
            except (OSError, SpoolRecordError) as e:
                # One bad file (a truncated write, a full disk, a stray file) costs that trajectory, not the actor.
                log.warning("spool file %s skipped (%s); kept as %s.corrupt", p, e, os.path.basename(p))
                self.skipped.append(p)
                try:
                    os.replace(p, p + ".corrupt")
                except OSError as e2:
                    log.warning("could not set %s aside: %s", p, e2)
        return out
