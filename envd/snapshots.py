"""Snapshots a client may hold and hand back: authenticated with the daemon's key, so Restore never runs a backend's
restore on bytes the daemon did not make.

A backend's snapshot is its own state, trusted by its restore: a terminal's workspace and limits, an episode's
`done` / `success`, a page's URL. Handed out as is, a client could edit one (success true, a step limit of 10^9,
another sandbox's limits) and Restore it. Snapshot therefore returns MAGIC + HMAC-SHA256(key, env id + state) + state,
and Restore refuses anything whose tag does not match (INVALID_ARGUMENT) before the backend sees it: an edited state,
or one restored under another env id than the one it was taken from.

The key is envd.snapshot_key (or snapshot_key_file): daemons given the same key restore each other's snapshots, and
a restarted daemon its own. Empty (the default): a random key per daemon process, so a snapshot restores on the
daemon that made it, while it runs. Fork never leaves the daemon and skips the seal.
"""
from __future__ import annotations

import hashlib
import hmac
import os

MAGIC = b"TSN1"
_TAG = hashlib.sha256().digest_size


class SnapshotSeal:
    def __init__(self, key: str | bytes = b""):
        key = key.encode() if isinstance(key, str) else key
        self._key = key or os.urandom(32)

    def _tag(self, env_id: str, state: bytes) -> bytes:
        return hmac.new(self._key, env_id.encode() + b"\0" + state, hashlib.sha256).digest()

    def seal(self, env_id: str, state: bytes) -> bytes:
        return MAGIC + self._tag(env_id, state) + state

    def open(self, env_id: str, blob: bytes) -> bytes:
        """The backend state inside a snapshot sealed for env_id; ValueError if this daemon's key did not seal it."""
        if len(blob) < len(MAGIC) + _TAG or not blob.startswith(MAGIC):
            raise ValueError("not a snapshot from envd's Snapshot (no sealed header)")
        tag, state = blob[len(MAGIC):len(MAGIC) + _TAG], blob[len(MAGIC) + _TAG:]
        if not hmac.compare_digest(tag, self._tag(env_id, state)):
            raise ValueError(f"the snapshot's seal does not match this daemon's key for {env_id!r}: altered, taken "
                             "of another env, or made by a daemon with another envd.snapshot_key")
        return state
