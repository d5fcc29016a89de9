"""When the learner may tell an actor to forget a trajectory: the receiver's durability, one strategy chosen at start.

An actor keeps every trajectory it sent until the learner acks it, and re-sends what a restarted learner lost, so an
ack is a promise that the trajectory survives a learner crash. The receiver (core/stream/receiver.py) validates and
queues a trajectory, then hands it to its Durability, which decides how that promise is kept:

  "wal"         WalDurability: the trajectory is written to the write-ahead log (core/stream/wal.py) and fsynced, in
                batches (the io thread stages, then at a tick hands each batch to the WAL writer process,
                core/stream/walproc.py, which checksums, writes and fdatasyncs it, and picks up the reply at a
                later tick; with wal_writer="thread" a syncer thread does that work here; then the io thread
                acks; group commit: one fdatasync in flight, the next one covers everything that arrived
                meanwhile, see WalDurability). A restarted learner replays the entries its checkpoint does
                not list as consumed; compact() drops consumed entries after a checkpoint.
  "checkpoint"  CheckpointDurability: no log. An accepted trajectory is answered at once with a "held" notice (the
                actor keeps it but stops its re-send timer) and acked for good when the training loop calls commit()
                after a checkpoint that lists it as consumed is on disk. A killed learner loses what it held, and the
                actors re-send exactly that (the new run does not know those ids). This takes the WAL's write,
                checksum and fdatasync of every byte off the hot path; the price is actor memory (everything since the
                last checkpoint, bounded by its max_outbox), so it suits frequent checkpoints and small trajectories.

Methods run on the receiver's io thread (which owns the socket: acks go out through the send hook it passes in),
except commit(), compact() and stats(), which the training thread calls.
"""
from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from core.stream.messages import Ack, Message
from core.stream.wal import WriteAheadLog
from core.stream.walproc import RING_BYTES, WriterProcessLog

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IoHooks:
    """The receiver's io-thread services a durability uses: send(ident, message), count(key, n), warn(reason, ...)."""
    send: Callable[[bytes, Message], None]
    count: Callable[..., None]
    warn: Callable[..., None]


class Durability(ABC):
    name: str = ""
    acks_ready = False  # set by a background sync that just finished: the io thread stops draining and ticks at once

    @property
    def fatal(self) -> BaseException | None:
        """Set once durability is lost for good in a way the learner must not run on (the WAL writer process died):
        the receiver's get() raises it."""
        return None

    def __init__(self, io: IoHooks):
        self.io = io

    def _ack(self, ident: bytes, ids: list[str]) -> None:
        """These ids are durable: the actor may forget them."""
        self.io.send(ident, Ack(ids))
        self.io.count("acked", len(ids))

    # --- lifecycle ------------------------------------------------------------------------------------------------
    @abstractmethod
    def open(self, consumed: frozenset[str]) -> list[str]:
        """Before the io thread starts: the ids to replay into the queue (arrival order), none of them consumed."""

    @abstractmethod
    def read(self, tid: str) -> bytes:
        """The payload of an id that open() returned for replay."""

    @abstractmethod
    def close(self, timeout: float) -> None:
        """After the io thread stopped (and flushed)."""

    # --- io thread ------------------------------------------------------------------------------------------------
    @abstractmethod
    def holds(self, tid: str) -> bool:
        """Received by this durability already (logged, or held in memory): a re-send of it is a duplicate."""

    @abstractmethod
    def backlogged(self, nbytes: int) -> bool:
        """Too much accepted and not yet durable (or no room for nbytes more): refuse new trajectories for now (the
        actor retries)."""

    @abstractmethod
    def accept(self, ident: bytes, tid: str, payload) -> None:
        """A validated trajectory from actor ident goes into the queue; answer it once durable. Raises WalError when
        it cannot be made durable (the receiver NACKs it for a retry)."""

    @abstractmethod
    def duplicate(self, ident: bytes, tid: str) -> None:
        """A trajectory received again that this learner already has (holds() or consumed): answer it again."""

    def answer_known(self, ident: bytes, ids: list[str]) -> None:
        """HELLO: of the actor's pending ids, these are already here (after flush()); tell it which to keep."""
        if ids:
            self._ack(ident, ids)

    @abstractmethod
    def flush(self) -> bool:
        """Synchronous: everything accepted so far is durable and answered when this returns True (HELLO, stop);
        False when it could not be (a failed or slow log): then nothing more may be acked as known."""

    @abstractmethod
    def tick(self, now: float) -> None:
        """Periodic, from the io loop: start and finish background work, send what is due."""

    def poll_timeout(self, now: float) -> float:
        """How long the io loop may wait for a message before tick() has something to do."""
        return 0.005

    # --- training thread ------------------------------------------------------------------------------------------
    @abstractmethod
    def commit(self, ids: Iterable[str]) -> None:
        """A checkpoint that lists these ids as consumed is durable."""

    @abstractmethod
    def compact(self, consumed: frozenset[str]) -> dict:
        """After a durable checkpoint: forget what it covers; {"kept": n, "dropped": m}."""

    @abstractmethod
    def stats(self) -> dict:
        """{"wal_entries": ..., "held": ...}."""


class WalDurability(Durability):
    name = "wal"

    def __init__(self, io: IoHooks, path: str, *, fsync: bool, ack_interval_s: float, max_staged: int,
                 writer: str = "process", max_record: int = 64 << 20):
        super().__init__(io)
        if writer not in WAL_WRITERS:
            raise ValueError(f"wal writer must be one of {WAL_WRITERS}, got {writer!r}")
        # process: the io thread hands each batch to a writer process (core/stream/walproc.py), which checksums,
        # writes and fdatasyncs it, and picks up its reply at a later tick; thread: a syncer thread does that work here.
        self.wal = WriteAheadLog(path, fsync=fsync) if writer == "thread" else \
            WriterProcessLog(path, fsync=fsync, ring_bytes=max(RING_BYTES, 2 * max_record + (2 << 20)))
        self.ack_interval_s = ack_interval_s
        self.max_staged = max_staged  # staged payloads are held in memory until the syncer has written them
        self._pending: dict[bytes, list[str]] = {}  # staged (or duplicate) ids to ack after the next sync
        self._n_pending = 0
        self._ack_due = 0.0
        # Group commit: one fdatasync in flight; the next covers everything that arrived meanwhile. It starts once
        # the previous one is done and either ack_interval_s passed since the first pending id or the pending batch
        # reaches what arrives during one fdatasync (measured: EWMA of the sync latency x EWMA of the arrival rate),
        # so a loaded stream does not wait out the interval and a quiet one still groups its syncs.
        self._sync_s = 0.005  # EWMA seconds per sync (hand-over to acks), measured here
        self._rate = 0.0      # EWMA ids per second handed to the syncer
        self._handed_at = 0.0
        # One sync at a time is in flight while the io thread keeps receiving; its batch of acks is sent by the io
        # thread (which owns the socket) once the sync is done, in order.
        self._syncing: dict[bytes, list[str]] | None = None
        self._sync: _ThreadSync | _WriterSync | None = None

    @property
    def acks_ready(self) -> bool:
        return self._sync is not None and self._sync.ready

    def open(self, consumed: frozenset[str]) -> list[str]:
        self.wal.open()
        _fsync_dir(self.wal.path)  # a rename a killed learner left unsynced is durable before any id is forgotten
        self._sync = _WriterSync(self.wal) if isinstance(self.wal, WriterProcessLog) else _ThreadSync(self.wal)
        return [t for t in self.wal.index if t not in consumed]

    def read(self, tid: str) -> bytes:
        return self.wal.read(tid)

    def close(self, timeout: float) -> None:
        if self._sync is not None:
            self._sync.close(timeout)
        self.wal.close()

    @property
    def fatal(self) -> BaseException | None:
        return getattr(self.wal, "fatal", None)

    def holds(self, tid: str) -> bool:
        return tid in self.wal

    def backlogged(self, nbytes: int) -> bool:
        # The writer process's ring is bounded too (walproc.py): no room now means wait, like a full batch.
        return self.wal.staged() >= self.max_staged or not self.wal.room(nbytes + 4096)

    def accept(self, ident: bytes, tid: str, payload) -> None:
        # The same bytes the actor sent, no re-encoding; the syncer thread writes and fdatasyncs them before their
        # ack goes out (staged payloads are bounded by max_staged through backlogged()).
        self.wal.stage(tid, payload)
        self._ack_after_sync(ident, tid)

    def duplicate(self, ident: bytes, tid: str) -> None:
        self._ack_after_sync(ident, tid)  # ack again so the actor can forget it

    def _ack_after_sync(self, ident: bytes, tid: str) -> None:
        self._pending.setdefault(ident, []).append(tid)
        self._n_pending += 1
        if self._ack_due == 0.0:
            self._ack_due = time.monotonic() + self.ack_interval_s

    def batch_target(self) -> int:
        """Ids that arrive during one fdatasync at the measured rate (at least 1, at most half of max_staged; before
        the first measurement, half of max_staged: the interval decides)."""
        cap = max(1, self.max_staged // 2)
        return max(1, min(int(self._rate * self._sync_s), cap)) if self._rate else cap

    def poll_timeout(self, now: float) -> float:
        return 0.001 if self._syncing is not None else 0.005 if not self._pending else max(0.0, self._ack_due - now)

    def tick(self, now: float) -> None:
        if self._collect(None) and self._pending and (now >= self._ack_due or self._n_pending >= self.batch_target()):
            # Hand the pending acks to the syncer (one sync in flight at a time keeps acks in order).
            if self._handed_at:
                dt = max(now - self._handed_at, 1e-4)
                self._rate += 0.2 * (self._n_pending / dt - self._rate)
            self._handed_at = now
            self._syncing, self._pending, self._ack_due, self._n_pending = self._pending, {}, 0.0, 0
            self.io.count("wal_syncs")
            self._sync.begin()

    def flush(self) -> bool:
        if not self._collect(timeout=30.0):
            log.error("WAL sync took over 30s; acks delayed")
            return False
        try:
            self.wal.sync()  # also raises once the log has failed, with nothing pending
        except OSError as e:
            self.io.count("wal_errors")
            self.io.warn("wal", "WAL sync failed, acks withheld: %s", e)
            self._pending, self._ack_due, self._n_pending = {}, 0.0, 0
            return False
        if self._pending:
            self.io.count("wal_syncs")
            self._ack_batch(self._pending)
            self._pending, self._ack_due, self._n_pending = {}, 0.0, 0
        return True

    def _ack_batch(self, batch: dict[bytes, list[str]]) -> None:
        for ident, ids in batch.items():
            self._ack(ident, ids)

    def _collect(self, timeout: float | None) -> bool:
        """Send the acks of a finished sync; timeout=None polls. False if one is still running."""
        if self._syncing is None:
            return True
        ok = self._sync.done(timeout)
        if ok is None:
            return False
        self._sync_s += 0.2 * (time.monotonic() - self._handed_at - self._sync_s)
        batch, self._syncing = self._syncing, None
        if ok:
            self._ack_batch(batch)  # else sticky (WalError from now on): nothing is acked again, actors keep theirs
        return True

    def commit(self, ids: Iterable[str]) -> None:
        """Nothing to do: these ids were acked as soon as their WAL batch was fsynced."""

    def compact(self, consumed: frozenset[str]) -> dict:
        kept, dropped = self.wal.compact(consumed)  # (a rewrite fsyncs the directory itself)
        if not dropped:  # an earlier compaction that failed after its rename: durable from here (confirm.py)
            _fsync_dir(self.wal.path)
        return {"kept": kept, "dropped": dropped}

    def stats(self) -> dict:
        return {"wal_entries": len(self.wal), "held": 0, "wal_sync_ms": round(self._sync_s * 1e3, 2),
                "wal_batch_target": self.batch_target()}


class _ThreadSync:
    """wal_writer="thread": a syncer thread runs wal.sync() (checksum, write, fdatasync in this process)."""

    def __init__(self, wal: WriteAheadLog):
        self.wal, self.ready = wal, False  # ready: a sync just finished (the io thread stops draining, ticks at once)
        self._req: queue.Queue = queue.Queue(maxsize=1)
        self._done: queue.Queue = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._loop, name="traj-wal-sync", daemon=True)
        self._thread.start()

    def begin(self) -> None:
        self._req.put_nowait(True)

    def done(self, timeout: float | None) -> bool | None:
        """True: durable; False: it failed; None: still running."""
        try:
            ok = self._done.get(timeout=timeout) if timeout else self._done.get_nowait()
        except queue.Empty:
            return None
        self.ready = False
        return ok

    def _loop(self) -> None:
        while self._req.get():  # close() sends False
            try:
                self.wal.sync()
                ok = True
            except OSError:
                log.exception("WAL write/fdatasync failed; these trajectories stay unacked")
                ok = False
            self._done.put(ok)
            self.ready = True

    def close(self, timeout: float) -> None:
        try:
            self._req.put(False, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)


class _WriterSync:
    """wal_writer="process": the io thread sends each batch to the writer process and looks for the reply at its
    ticks (no thread of the learner waits on the writer)."""

    ready = False

    def __init__(self, wal: WriterProcessLog):
        self.wal, self._ticket, self._failed = wal, 0, False

    def begin(self) -> None:
        try:
            self._ticket = self.wal.sync_begin()
        except OSError:
            log.exception("WAL write failed; these trajectories stay unacked")
            self._failed = True

    def done(self, timeout: float | None) -> bool | None:
        if self._failed:
            self._failed = False
            return False
        try:
            return True if self.wal.sync_done(self._ticket, timeout or 0.0) else None
        except OSError:
            log.exception("WAL write/fdatasync failed; these trajectories stay unacked")
            return False

    def close(self, timeout: float) -> None:
        """Nothing runs on its own: close() of the log finishes a request in flight."""


class CheckpointDurability(Durability):
    name = "checkpoint"

    def __init__(self, io: IoHooks, run_id: str):
        super().__init__(io)
        self.run_id = run_id  # the held notices name this learner run: a restarted one does not hold them
        self._held: dict[str, bytes] = {}  # id -> actor identity, accepted by this process and not yet committed
        self._pending_held: dict[bytes, list[str]] = {}  # held notices waiting for the next tick
        # Id sets from commit() (training thread) for the io thread; one per checkpoint, drained every tick.
        self._commits: collections.deque[frozenset[str] | set[str]] = collections.deque()

    def open(self, consumed: frozenset[str]) -> list[str]:
        return []  # nothing survives a restart but the checkpoint: the actors re-send everything else

    def read(self, tid: str) -> bytes:
        raise KeyError(f"{tid}: checkpoint durability keeps no trajectory payloads")

    def close(self, timeout: float) -> None:
        """Nothing to close: no file, no thread."""

    def holds(self, tid: str) -> bool:
        return tid in self._held

    def backlogged(self, nbytes: int) -> bool:
        return False  # nothing waits on a disk: the queue's own bound is the limit

    def accept(self, ident: bytes, tid: str, payload) -> None:
        self._held[tid] = ident
        self._pending_held.setdefault(ident, []).append(tid)

    def duplicate(self, ident: bytes, tid: str) -> None:
        if tid in self._held:  # not durable yet: tell the actor again that we hold it
            self._pending_held.setdefault(ident, []).append(tid)
        else:  # consumed and in a durable checkpoint: the actor may forget it
            self._ack(ident, [tid])

    def answer_known(self, ident: bytes, ids: list[str]) -> None:
        held = [t for t in ids if t in self._held]
        if held:  # ours, not yet in a checkpoint: the actor keeps them and does not send them again
            ids = [t for t in ids if t not in self._held]
            self.io.send(ident, Ack(held, held=self.run_id))
        if ids:
            self._ack(ident, ids)

    def flush(self) -> bool:
        self._send_held()
        self._send_commits()
        return True

    def tick(self, now: float) -> None:
        if self._pending_held:
            self._send_held()
        if self._commits:
            self._send_commits()

    def _send_held(self) -> None:
        for ident, ids in self._pending_held.items():
            self.io.send(ident, Ack(ids, held=self.run_id))
        self._pending_held = {}

    def _send_commits(self) -> None:
        while self._commits:
            durable = self._commits.popleft()
            by_actor: dict[bytes, list[str]] = {}
            # O(held), not O(everything ever consumed): a checkpoint lists all consumed ids, most committed long ago.
            for tid in [t for t in self._held if t in durable]:
                by_actor.setdefault(self._held.pop(tid), []).append(tid)
            self.io.count("committed", sum(map(len, by_actor.values())))
            for ident, ids in by_actor.items():
                self._ack(ident, ids)

    def commit(self, ids: Iterable[str]) -> None:
        self._commits.append(ids if isinstance(ids, (set, frozenset)) else frozenset(ids))

    def compact(self, consumed: frozenset[str]) -> dict:
        return {"kept": 0, "dropped": 0}  # no log to compact

    def stats(self) -> dict:
        return {"wal_entries": 0, "held": len(self._held)}


def _fsync_dir(path) -> None:
    fd = os.open(os.path.dirname(os.fspath(path)) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


DURABILITY = ("wal", "checkpoint")
WAL_WRITERS = ("process", "thread")


def make_durability(mode: str, io: IoHooks, wal_path: str, *, run_id: str, fsync: bool, ack_interval_s: float,
                    max_staged: int, wal_writer: str = "process", max_record: int = 64 << 20) -> Durability:
    """learner.stream.durability -> its strategy; ValueError for an unknown mode. wal_writer: "process" or "thread"
    (learner.stream.wal_writer, see WalDurability); max_record: the largest payload the writer's ring must hold."""
    if mode == "wal":
        return WalDurability(io, wal_path, fsync=fsync, ack_interval_s=ack_interval_s, max_staged=max_staged,
                             writer=wal_writer, max_record=max_record)
    if mode == "checkpoint":
        return CheckpointDurability(io, run_id)
    raise ValueError(f"durability must be one of {DURABILITY}, got {mode!r}")
