"""Content-addressed screenshots on the trajectory stream: each image crosses once per learner connection.

A GUI trajectory repeats screenshots (every sample of a GRPO group starts on the same page; a step that changes
nothing gives the same screen again), and a screenshot is most of a trajectory's bytes. So the actor sends an image's
bytes only the first time on a connection (as extra frames of a TRAJ message, see core/stream/messages.py) and later
trajectories refer to it by hash (Turn.obs_ref "sha256:<hex>"). The learner keeps what it received in an ImageStore
on disk beside its WAL, so that WAL replay after a restart still finds every image its trajectories refer to.

The store is write-once by content: put() checks that the bytes hash to the name they are sent under, so a peer
cannot make one hash resolve to other bytes.

It is also bounded by what is still needed: resolve() records which images each trajectory it resolved refers to,
release() forgets a trajectory once it is consumed, and collect() (after a durable checkpoint, when the consumed ids
are the checkpoint's) deletes every image no unconsumed trajectory refers to. A WAL replay then still finds all it
needs; an actor whose later trajectory refers to a collected image is NACKed "missing images" and sends it again.
One lock makes store-resolve-and-hold atomic against collect(), which takes it one batch of deletions at a time.
"""
from __future__ import annotations

import collections
import hashlib
import os
import re
import threading

_HEX = re.compile(r"^[0-9a-f]{64}$")


def image_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def referenced(turns, image_refs=()) -> list[str]:
    """Image hashes a trajectory refers to (its turns' observations, then the images bound in its prompts), in
    order, without repeats."""
    out: dict[str, None] = {}
    for t in turns:
        ref = t.obs_ref
        if ref.startswith("sha256:"):
            out[ref[7:]] = None
    for h in image_refs:
        out[h] = None
    return list(out)


class ImageError(ValueError):
    """Bytes that do not hash to the name they came with, or a name that is not a sha256 hex digest."""


class ImageStore:
    def __init__(self, directory: str):
        self.dir = directory
        self._have: set[str] = set()
        self.bytes_stored = 0
        self.lock = threading.RLock()
        self._held: dict[str, list[str]] = {}  # trajectory id -> the images it refers to, until released
        self.collected = 0                    # images deleted by collect(), over the store's life

    def open(self) -> "ImageStore":
        os.makedirs(self.dir, exist_ok=True)
        for name in os.listdir(self.dir):
            if _HEX.match(name):
                self._have.add(name)
            elif name.endswith(".tmp"):
                os.unlink(os.path.join(self.dir, name))  # died mid-write
        return self

    def __contains__(self, h: str) -> bool:
        return h in self._have

    def __len__(self) -> int:
        return len(self._have)

    def hold(self, tid: str, hashes: list[str]) -> None:
        with self.lock:
            self._held[tid] = list(hashes)

    def release(self, tids) -> None:
        """These trajectories are consumed: their images are no longer needed for them."""
        with self.lock:
            for t in tids:
                self._held.pop(t, None)

    def collect(self, batch: int = 256) -> int:
        """Delete every image no held trajectory refers to; returns how many. Call when the consumed trajectories
        are those of a durable checkpoint (after it), so a replay of the rest finds its images. The lock is taken per
        `batch` deletions (each batch checked against the holds of that moment), so the stream's io thread, which
        needs it to resolve a trajectory, waits for one batch, not for the whole collection."""
        with self.lock:
            todo = list(self._have)
        n = 0
        for i in range(0, len(todo), batch):
            with self.lock:
                keep = {h for hs in self._held.values() for h in hs}
                for h in todo[i:i + batch]:
                    if h in keep or h not in self._have:
                        continue
                    self._have.discard(h)  # with the file, under the lock: a put() of it now writes it again
                    try:
                        os.unlink(os.path.join(self.dir, h))
                    except FileNotFoundError:
                        pass
                    n += 1
        self.collected += n
        return n

    def put(self, h: str, data: bytes) -> bool:
        """Store data under h (no-op if present); True if it was new. Raises ImageError for a wrong hash."""
        with self.lock:
            return self._put(h, data)

    def _put(self, h: str, data: bytes) -> bool:
        if not isinstance(h, str) or not _HEX.match(h):
            raise ImageError(f"image name {h!r} is not a sha256 hex digest")
        if h in self._have:
            return False
        if image_hash(data) != h:
            raise ImageError(f"image bytes do not hash to {h[:16]}...")
        p = os.path.join(self.dir, h)
        with open(p + ".tmp", "wb") as f:
            f.write(data)
        # Not fsynced: the WAL entries that refer to it are, and an image lost with the machine's power is re-sent
        # by the actor (the learner NACKs "missing images" with retry, and the actor re-attaches it).
        os.replace(p + ".tmp", p)
        self._have.add(h)
        self.bytes_stored += len(data)
        return True

    def get(self, h: str) -> bytes:
        with open(os.path.join(self.dir, h), "rb") as f:
            return f.read()

    def missing(self, hashes) -> list[str]:
        return [h for h in hashes if h not in self._have]


def take_attached(store: ImageStore, names: list[str], frames: list[bytes], max_bytes: int,
                  wanted: set[str] | None = None) -> None:
    """Store the images attached to a TRAJ message (its header's images names the extra frames, in order); with
    `wanted`, only those (what the trajectory refers to: other frames would sit in the store, held by nothing)."""
    if len(names) != len(frames):
        raise ImageError(f"{len(frames)} image frames but names {names!r:.80}")
    total = sum(len(f) for f in frames)
    if total > max_bytes:
        raise ImageError(f"{total} bytes of images exceed the {max_bytes}-byte limit")
    for h, b in zip(names, frames):
        if wanted is None or h in wanted:
            store.put(h, b)


def resolve(store: ImageStore, tr) -> list[str]:
    """Fill tr.images with every image its turns refer to, and hold them for tr until it is released; returns the
    hashes the store lacks (then tr is unchanged and nothing is held).

    Images carried inline in the frame (an actor without dedupe) are checked and stored too."""
    with store.lock:
        refs = referenced(tr.turns, tr.image_refs)
        for h in refs:  # (inline images it does not refer to are not stored)
            if h in tr.images:
                store.put(h, tr.images[h])
        miss = store.missing(refs)
        if not miss:
            tr.images = {h: tr.images.get(h) or store.get(h) for h in refs}
            if refs:
                store.hold(tr.id, refs)
        return miss


class SentImages:
    """Actor side: the image hashes sent on the current learner connection, oldest first; bounded (forgetting one
    only costs a re-send)."""

    def __init__(self, cap: int):
        self.cap = cap
        self._sent: collections.OrderedDict[str, None] = collections.OrderedDict()

    def take(self, hashes) -> list[str]:
        """The hashes not sent yet (in order), now counted as sent."""
        new = [h for h in hashes if h not in self._sent]
        for h in new:
            self._sent[h] = None
        while len(self._sent) > self.cap:
            self._sent.popitem(last=False)
        return new

    def discard(self, h: str) -> None:
        self._sent.pop(h, None)

    def clear(self) -> None:
        self._sent.clear()
