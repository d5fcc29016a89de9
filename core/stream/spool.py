"""The actor's outbox on disk: a killed actor's unacked trajectories survive into its restart (same actor_id).

One file per trajectory, named by a hash of its id, written without fsync: it protects against the actor process
dying, not against the machine losing power. Layout: <u32 id length> id <u32 frame length> frame [msgpack map of
the images the frame refers to by hash]. A file is removed once the learner acks (or refuses) its trajectory.
"""
from __future__ import annotations

import hashlib
import os
import struct

import msgpack


class Spool:
    def __init__(self, directory: str):
        self.dir = directory

    def _path(self, tid: str) -> str:
        return os.path.join(self.dir, hashlib.sha1(tid.encode()).hexdigest() + ".traj")

    def save(self, tid: str, frame: bytes, images: dict | None = None) -> None:
        p = self._path(tid)
        idb = tid.encode()
        with open(p + ".tmp", "wb") as f:
            f.write(struct.pack("<I", len(idb)) + idb)
            f.write(struct.pack("<I", len(frame)) + frame)
            if images:
                f.write(msgpack.packb(images, use_bin_type=True))
        os.replace(p + ".tmp", p)

    def remove(self, tid: str) -> bool:
        """False if it was not there."""
        try:
            os.unlink(self._path(tid))
            return True
        except FileNotFoundError:
            return False

    def load(self) -> list[tuple[str, bytes, dict | None]]:
        """(id, frame, images) of every spooled trajectory, oldest first (roughly the original order)."""
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
        for _, p in sorted(files):
            with open(p, "rb") as f:
                data = f.read()
            (n,) = struct.unpack_from("<I", data)
            tid = data[4:4 + n].decode()
            (m,) = struct.unpack_from("<I", data, 4 + n)
            frame, rest = data[8 + n:8 + n + m], data[8 + n + m:]
            out.append((tid, frame, msgpack.unpackb(rest, raw=False) if rest else None))
        return out
