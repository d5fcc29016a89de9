"""The trajectory stream, learner side: a ZeroMQ ROUTER with credit flow control, a WAL and acknowledgements.

One background thread owns the socket (its own zmq context and poller), so the training thread never blocks on the
network; training takes validated trajectories from a bounded queue with `get(timeout)`. The wire protocol is in
core/stream_proto.py; the actor side is core/stream_sender.py (re-exported here as TrajectorySender).

Memory is bounded by slots: queue_size slots are either free, promised to an actor as credit, or hold a queued
trajectory. An actor may only send what it has credit for, so the queue can never overflow and the io thread never
has to block or buffer; credit is re-granted as `get()` drains the queue (fair: the actor with the least credit first).

Delivery is exactly-once for training, across learner restarts:
  * a trajectory is acked only after it is written to the WAL and fsynced (batched: the io thread stages it, the
    syncer thread writes, checksums and fdatasyncs each batch, one per ack_interval_s, then the io thread acks);
    the actor keeps it (and re-sends it after a learner restart) until then;
  * ids already in the WAL or already consumed are duplicates: acked again so the actor forgets them, never re-queued;
  * the training loop calls mark_consumed(ids) for what it trained on and stores checkpoint_state() with its weights;
    a new receiver given those consumed_ids replays the WAL entries not consumed into the queue before anything new.
  * compact_wal() after a checkpoint drops consumed entries from the log.
With durability="checkpoint" there is no WAL: the learner's checkpoint is the durable record. An accepted trajectory
is answered at once with a "held" notice (the actor keeps it but stops its re-send timer), and acked for good only
when the training loop calls commit(ids) after a checkpoint that lists those ids as consumed is on disk. A killed
learner loses what it held in memory, and the actors re-send exactly that (the new run does not know those ids).
This takes the WAL's write, checksum and fdatasync of every byte off the learner's hot path; the price is actor
memory: an actor keeps everything since the last checkpoint (bounded by its max_outbox), so it suits frequent
checkpoints and small trajectories; with big screenshots and rare checkpoints use the WAL.
Staleness bookkeeping (which side calls what) is described in learner/staleness.py: this receiver calls try_admit,
adopt, on_lost and on_rejected (for NACKed frames only); the training loop calls on_accepted/on_rejected once for
every trajectory get() returns.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass

import zmq

from core import stream_proto as P
from core.schema import SchemaError, Trajectory
from core.stream_images import ImageError, ImageStore, resolve, take_attached
from core.stream_wal import WalError, WriteAheadLog

log = logging.getLogger(__name__)

DURABILITY = ("wal", "checkpoint")


@dataclass
class _Actor:
    incarnation: str
    credit: int = 0         # credit granted and not yet spent: each unit is a reserved queue slot
    ledger: int = 0         # episodes this receiver admitted for the actor and has not seen finish
    last_seen: float = 0.0


def _recv_message(sock) -> list:
    """One multipart message (raises zmq.Again if none): the identity, tag and body frames as bytes, the payload and
    image frames as zero-copy memoryviews of libzmq's buffers (decoded from there; the WAL batch keeps the payload by
    reference until the syncer has written it). One recv_multipart call: per-frame recv and RCVMORE lookups cost
    more than the rest of the receive."""
    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
    return [f.bytes if i < 3 else f.buffer for i, f in enumerate(frames)]


class TrajectoryReceiver:
    def __init__(self, bind: str, wal_path: str, staleness, credits: int = 512, queue_size: int = 4096,
                 max_frame_bytes: int = 64 << 20, consumed_ids=(), on_reject=None, *,
                 ack_interval_s: float = 0.002, fsync: bool = True, actor_timeout_s: float = 60.0,
                 log_every_s: float = 10.0, curve_secret_key: bytes | None = None, durability: str = "wal"):
        """bind: "tcp://host:port" (port 0 = a free port). on_reject(actor, id, reason) is called from the io thread
        for every NACKed frame (keep it cheap). curve_secret_key: see stream_proto.curve_server."""
        if credits < 1 or queue_size < 1:
            raise ValueError("credits and queue_size must be >= 1")
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {DURABILITY}, got {durability!r}")
        self.durability = durability
        self.bind = bind
        self.staleness = staleness
        self.credits = credits
        self.queue_size = queue_size
        self.max_frame_bytes = max_frame_bytes
        self.on_reject = on_reject
        self.ack_interval_s = ack_interval_s
        self.actor_timeout_s = actor_timeout_s
        self.log_every_s = log_every_s
        self.curve_secret_key = curve_secret_key
        self.run_id = uuid.uuid4().hex  # actors compare it to detect a learner restart
        self.wal = WriteAheadLog(wal_path, fsync=fsync) if durability == "wal" else None
        # durability="checkpoint": id -> actor identity for every trajectory accepted by this process and not yet
        # covered by a checkpoint; held notices waiting for the next tick; id lists from commit() for the io thread.
        self._held: dict[str, bytes] = {}
        self._pending_held: dict[bytes, list[str]] = {}
        self._commits: collections.deque[frozenset[str] | set[str]] = collections.deque()
        self.images = ImageStore(wal_path + ".images")  # screenshots by hash, beside the WAL that refers to them
        self._q: queue.Queue = queue.Queue(maxsize=queue_size)
        self._consumed: set[str] = set(consumed_ids)
        self._consumed_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.address = ""
        self._actors: dict[bytes, _Actor] = {}
        self._pending_acks: dict[bytes, list[str]] = {}
        self._ack_due = 0.0
        # One fdatasync at a time runs on the syncer thread while the io thread keeps receiving; its batch of acks
        # comes back through _sync_done and is sent by the io thread (which owns the socket), in order.
        self._sync_req: queue.Queue = queue.Queue(maxsize=1)
        self._sync_done: queue.Queue = queue.Queue(maxsize=1)
        self._syncing: dict[bytes, list[str]] | None = None
        self._sync_finished = False
        self._syncer: threading.Thread | None = None
        self._replay: list[str] = []
        self._version_sent = -1
        self._stats = dict.fromkeys(
            ("received", "accepted", "duplicates", "malformed", "unknown_schema", "oversize", "acked", "nacked",
             "busy", "replayed", "credits_granted", "hellos", "admits", "granted", "lost", "dead_actors",
             "protocol_errors", "wal_syncs", "wal_errors", "queue_max", "images_stored", "missing_images",
             "committed"), 0)
        self._last_log: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    # --- training-thread API --------------------------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> str:
        """Open the WAL, queue its unconsumed entries for replay, bind; returns tcp://host:port."""
        self.images.open()
        if self.wal is not None:
            self.wal.open()
            with self._consumed_lock:
                self._replay = [t for t in self.wal.index if t not in self._consumed]
        if self._replay:
            # These were admitted by a previous learner; the training loop will resolve each with on_accepted/rejected.
            self.staleness.adopt(len(self._replay))
        self._replay.reverse()  # popped from the end, so replay goes in file (arrival) order
        if self.wal is not None:
            self._syncer = threading.Thread(target=self._sync_loop, name="traj-wal-sync", daemon=True)
            self._syncer.start()
        self._thread = threading.Thread(target=self._run, name="traj-receiver", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("trajectory receiver did not bind in time")
        if self._error:
            raise self._error
        return self.address

    def get(self, timeout: float) -> Trajectory | None:
        """The next trajectory to train on, or None after `timeout` seconds."""
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            return None

    def qsize(self) -> int:
        return self._q.qsize()

    def mark_consumed(self, ids) -> None:
        """These ids went into a policy update: never deliver them again (store checkpoint_state() with the weights)."""
        with self._consumed_lock:
            self._consumed.update(ids)

    def consumed_ids(self) -> set[str]:
        with self._consumed_lock:
            return set(self._consumed)

    def checkpoint_state(self) -> dict:
        """Goes into the learner checkpoint; pass state["consumed_ids"] to the next receiver's consumed_ids."""
        with self._consumed_lock:
            return {"consumed_ids": sorted(self._consumed)}

    def commit(self, ids) -> None:
        """durability="checkpoint": a checkpoint listing these ids as consumed is durable; ack them to their actors.
        (Call it with the checkpoint's own consumed_ids; ids not held by this process are skipped.)"""
        if self.wal is None:
            self._commits.append(ids if isinstance(ids, (set, frozenset)) else frozenset(ids))

    def compact_wal(self) -> dict:
        """Drop consumed entries from the WAL (call after the checkpoint that covers them is durable)."""
        if self.wal is None:
            return {"kept": 0, "dropped": 0}
        with self._consumed_lock:
            drop = frozenset(self._consumed)
        kept, dropped = self.wal.compact(drop)
        return {"kept": kept, "dropped": dropped}

    def stats(self) -> dict:
        s = dict(self._stats)
        s["queue"] = self._q.qsize()
        s["wal_entries"] = len(self.wal) if self.wal is not None else 0
        s["held"] = len(self._held)
        s["replay_pending"] = len(self._replay)
        s["actors"] = len(self._actors)
        return s

    def stop(self, timeout: float = 5.0) -> None:
        """Sync the WAL, send the last acks, close. Queued but unconsumed trajectories stay in the WAL for replay."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("trajectory receiver thread did not stop within %.1fs", timeout)
        if self._syncer:
            try:
                self._sync_req.put(None, timeout=timeout)
            except queue.Full:
                pass
            self._syncer.join(timeout)
        if self.wal is not None:
            self.wal.close()

    # --- io thread ------------------------------------------------------------------------------------------------
    def _count(self, key: str, n: int = 1) -> None:
        # Only the io thread writes counters, so no lock: stats() copies the dict, which is safe against value updates.
        self._stats[key] += n

    def _warn(self, reason: str, msg: str, *args) -> None:
        """Rate-limited logging: a flood of bad frames must not flood the log too."""
        now = time.monotonic()
        if now - self._last_log.get(reason, -1e9) >= self.log_every_s:
            n = self._suppressed.pop(reason, 0)
            log.warning(msg + (f" (+{n} similar suppressed)" if n else ""), *args)
            self._last_log[reason] = now
        else:
            self._suppressed[reason] = self._suppressed.get(reason, 0) + 1

    def _sync_loop(self) -> None:
        while True:
            batch = self._sync_req.get()
            if batch is None:
                return
            try:
                self.wal.sync()
            except OSError:
                # Sticky (WalError from now on): nothing is acked again, actors keep what they sent.
                log.exception("WAL write/fdatasync failed; these trajectories stay unacked")
                batch = {}
            self._sync_done.put(batch)
            self._sync_finished = True  # the io thread looks at this after every message: acks go out at once

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        try:
            sock.linger = 0
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted actor (same id) takes over its old route
            # Hard cap against non-conforming peers (libzmq drops the connection beyond it); conforming actors learn
            # max_frame_bytes from WELCOME and never send more, and frames in between are NACKed "oversize".
            sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_frame_bytes + (1 << 20))
            sock.rcvhwm = sock.sndhwm = 0  # bounded by credits, not by silently dropping
            P.curve_server(sock, self.curve_secret_key)
            sock.bind(self.bind)
            self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException as e:
            self._error = e
            sock.close(0)
            ctx.term()
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                wait = (0.001 if self._syncing is not None else
                        0.005 if not self._pending_acks else max(0.0, self._ack_due - now))
                if poller.poll(wait * 1000):
                    # Drain a short burst, then tick: credit and acks must flow back while the actor still has
                    # work in hand, or the two ends take turns instead of overlapping.
                    for _ in range(32):
                        try:
                            msg = _recv_message(sock)
                        except zmq.Again:
                            break
                        self._handle(sock, msg)
                        if self._sync_finished:
                            break
                self._tick(sock)
            self._flush_acks(sock)
        except Exception:
            log.exception("trajectory receiver io thread crashed")
            raise
        finally:
            sock.close(0)
            ctx.term()

    def _send(self, sock, ident: bytes, tag: bytes, body: dict) -> None:
        try:
            sock.send_multipart([ident, tag, P.pack(body)], zmq.NOBLOCK)
        except zmq.Again:  # unreachable with sndhwm=0; an actor that stopped reading just loses the message
            self._warn("send", "could not send %r to %r", tag, ident)

    def _handle(self, sock, msg: list[bytes]) -> None:
        if len(msg) < 3 or len(msg[1]) != 1:
            self._count("protocol_errors")
            self._warn("proto", "malformed message of %d frames", len(msg))
            return
        ident, tag = msg[0], msg[1]
        try:
            body = P.unpack(msg[2])
        except ValueError as e:
            self._count("protocol_errors")
            self._warn("proto", "bad %r body from %r: %s", tag, ident, e)
            return
        st = self._actors.get(ident)
        if st is not None:
            st.last_seen = time.monotonic()
        if tag == P.HELLO:
            self._hello(sock, ident, body)
        elif st is None:
            # A learner restart (or a timed-out actor): make the actor re-introduce itself; its outbox is re-sent.
            self._send(sock, ident, P.WHO, {})
        elif tag == P.TRAJ:
            self._traj(sock, ident, st, body, msg[3] if len(msg) >= 4 else None, msg[4:])
        elif tag == P.ADMIT:
            n = body.get("n", 0)
            g = self.staleness.try_admit(int(n)) if isinstance(n, int) and n > 0 else 0
            st.ledger += g
            self._count("admits")
            self._count("granted", g)
            self._send(sock, ident, P.GRANT, {"rid": body.get("rid"), "granted": g, "version": self.staleness.version})
        elif tag == P.LOST:
            n = body.get("n", 0)
            m = min(int(n), st.ledger) if isinstance(n, int) and n > 0 else 0
            if m:
                st.ledger -= m
                self.staleness.on_lost(m)
            self._count("lost", m)
        elif tag == P.PING:
            self._send(sock, ident, P.PONG, {"run_id": self.run_id})
        else:
            self._count("protocol_errors")
            self._warn("proto", "unknown tag %r from %r", tag, ident)

    def _hello(self, sock, ident: bytes, body: dict) -> None:
        self._count("hellos")
        inc = str(body.get("incarnation", ""))
        inflight = body.get("inflight", 0)
        inflight = inflight if isinstance(inflight, int) and inflight > 0 else 0
        pending = body.get("pending_ids") or []
        st = self._actors.get(ident)
        if st is not None and st.incarnation != inc:
            # The actor process restarted: its old admitted-but-unfinished episodes are gone for good.
            if st.ledger:
                self.staleness.on_lost(st.ledger)
                self._count("lost", st.ledger)
            st = None
        if st is None:
            st = self._actors[ident] = _Actor(incarnation=inc, ledger=inflight)
            if inflight:
                self.staleness.adopt(inflight)  # admitted by a previous learner, still running on the actor
        st.last_seen = time.monotonic()
        st.credit = 0  # WELCOME's credit is absolute: whatever was granted before is void on both sides
        # Make everything received so far durable and acked first, then ack pending ids we already have, so the
        # actor's outbox holds exactly what must be re-sent when WELCOME arrives (same pipe, so in order).
        self._flush_acks(sock)
        have = [t for t in pending if isinstance(t, str) and self._known(t)]
        held = [t for t in have if t in self._held]
        if held:  # checkpoint durability: ours, not yet in a checkpoint (the actor keeps them, sends them not again)
            have = [t for t in have if t not in self._held]
            self._send(sock, ident, P.ACK, {"ids": held, "held": self.run_id})
        if have:
            self._send(sock, ident, P.ACK, {"ids": have})
            self._count("acked", len(have))
        st.credit = min(self.credits, self._free_slots())
        self._count("credits_granted", st.credit)
        self._send(sock, ident, P.WELCOME, {"run_id": self.run_id, "hello_id": body.get("hello_id"),
                                            "version": self.staleness.version,
                                            "credit": st.credit, "max_frame_bytes": self.max_frame_bytes})

    def _known(self, tid: str) -> bool:
        if tid in self._held or (self.wal is not None and tid in self.wal):
            return True
        with self._consumed_lock:
            return tid in self._consumed

    def _nack(self, sock, ident: bytes, st: _Actor, tid, reason: str, counter: str, retry: bool = False) -> None:
        self._count(counter)
        self._count("nacked")
        self._send(sock, ident, P.NACK, {"id": tid, "reason": reason, "retry": retry})
        if not retry and st.ledger:
            # The episode finished but can never be trained on: it stops counting as running.
            st.ledger -= 1
            self.staleness.on_rejected(1)
        if self.on_reject is not None:
            try:
                self.on_reject(ident.decode("utf-8", "replace"), tid, reason)
            except Exception:
                log.exception("on_reject callback failed")

    def _traj(self, sock, ident: bytes, st: _Actor, body: dict, payload, image_frames=()) -> None:
        """payload: the encoded trajectory (bytes or a memoryview), image_frames: the attached screenshots."""
        self._count("received")
        if st.credit > 0:
            st.credit -= 1
        tid = body.get("id")
        if not isinstance(tid, str) or not tid or payload is None:
            self._warn("malformed", "TRAJ from %r without id or payload", ident)
            self._nack(sock, ident, st, tid if isinstance(tid, str) else None, "malformed: no id or payload",
                       "malformed")
            return
        if self._known(tid):
            self._count("duplicates")
            if tid in self._held:  # not durable yet: tell the actor again that we hold it
                self._pending_held.setdefault(ident, []).append(tid)
            elif self.wal is None:  # in a durable checkpoint: the actor may forget it
                self._send(sock, ident, P.ACK, {"ids": [tid]})
                self._count("acked")
            else:
                self._pending_acks.setdefault(ident, []).append(tid)  # ack again so the actor can forget it
                self._arm_ack()
            return
        if len(payload) > self.max_frame_bytes:
            self._warn("oversize", "dropping %d-byte trajectory %s from %r", len(payload), tid, ident)
            self._nack(sock, ident, st, tid, f"oversize: {len(payload)} > {self.max_frame_bytes}", "oversize")
            return
        try:
            n_img = len(self.images)
            # Stored even if the trajectory is then refused: later trajectories may refer to them.
            take_attached(self.images, body.get("images"), [bytes(f) for f in image_frames], self.max_frame_bytes)
            tr = Trajectory.decode(payload, self.max_frame_bytes)
            if tr.id != tid:
                raise SchemaError(f"header id {tid!r} != payload id {tr.id!r}")
            missing = resolve(self.images, tr)
            self._count("images_stored", len(self.images) - n_img)
        except (SchemaError, ImageError) as e:
            counter = "unknown_schema" if "unknown schema version" in str(e) else "malformed"
            self._warn(counter, "dropping trajectory %s from %r: %s", tid, ident, e)
            self._nack(sock, ident, st, tid, f"{counter}: {e}", counter)
            return
        if missing:
            # Refers to images this learner never got (e.g. an image frame went to a previous learner process):
            # the actor forgets it sent them and re-sends the trajectory with them attached.
            self._count("missing_images")
            self._count("nacked")
            self._send(sock, ident, P.NACK, {"id": tid, "reason": f"missing images: {len(missing)}", "retry": True,
                                             "missing": missing})
            return
        if self._q.full() or (self.wal is not None and self.wal.staged() >= self.queue_size):
            # Only a peer that ignores credit (or a disk far behind) gets here; it keeps the trajectory and retries.
            self._nack(sock, ident, st, tid, "busy: no queue slot", "busy", retry=True)
            return
        if self.wal is not None:
            try:
                # The same bytes the actor sent, no re-encoding; the syncer thread writes and fdatasyncs them before
                # their ack goes out (staged payloads are bounded by queue_size just above).
                self.wal.stage(tid, payload)
            except WalError as e:
                self._warn("wal", "cannot log trajectory %s: %s", tid, e)
                self._nack(sock, ident, st, tid, "busy: write-ahead log failed", "wal_errors", retry=True)
                return
        # Accounting before the put: the training thread may call on_accepted the instant the item is queued.
        if st.ledger:
            st.ledger -= 1
        else:
            self.staleness.adopt(1)     # admitted by a previous learner, or sent without ADMIT
        self._q.put_nowait(tr)
        self._count("accepted")
        self._note_qsize()
        if self.wal is None:
            self._held[tid] = ident
            self._pending_held.setdefault(ident, []).append(tid)
        else:
            self._pending_acks.setdefault(ident, []).append(tid)
            self._arm_ack()

    def _arm_ack(self) -> None:
        if self._ack_due == 0.0:
            self._ack_due = time.monotonic() + self.ack_interval_s

    def _note_qsize(self) -> None:
        n = self._q.qsize()
        if n > self._stats["queue_max"]:
            self._stats["queue_max"] = n

    def _send_acks(self, sock, batch: dict[bytes, list[str]]) -> None:
        for ident, ids in batch.items():
            self._send(sock, ident, P.ACK, {"ids": ids})
            self._count("acked", len(ids))

    def _collect_sync(self, sock, timeout: float | None) -> bool:
        """Send the acks of a finished background sync; timeout=None polls. False if one is still running."""
        if self._syncing is None:
            return True
        try:
            batch = self._sync_done.get(timeout=timeout) if timeout else self._sync_done.get_nowait()
        except queue.Empty:
            return False
        self._syncing = None
        self._sync_finished = False
        self._send_acks(sock, batch)
        return True

    def _start_sync(self) -> None:
        """Hand the pending acks to the syncer (one sync in flight at a time keeps acks in order)."""
        self._syncing, self._pending_acks, self._ack_due = self._pending_acks, {}, 0.0
        self._count("wal_syncs")
        self._sync_req.put_nowait(self._syncing)

    def _flush_acks(self, sock) -> None:
        """Synchronous: everything appended so far is fsynced and acked when this returns (HELLO, stop)."""
        if self.wal is None:
            self._send_held(sock)
            self._send_commits(sock)
            return
        if not self._collect_sync(sock, timeout=30.0):
            log.error("WAL sync took over 30s; acks delayed")
            return
        if not self._pending_acks:
            return
        try:
            self.wal.sync()
        except OSError as e:
            self._count("wal_errors")
            self._warn("wal", "WAL sync failed, acks withheld: %s", e)
            self._pending_acks, self._ack_due = {}, 0.0
            return
        self._count("wal_syncs")
        self._send_acks(sock, self._pending_acks)
        self._pending_acks = {}
        self._ack_due = 0.0

    def _send_held(self, sock) -> None:
        for ident, ids in self._pending_held.items():
            self._send(sock, ident, P.ACK, {"ids": ids, "held": self.run_id})
        self._pending_held = {}

    def _send_commits(self, sock) -> None:
        while self._commits:
            durable = self._commits.popleft()
            by_actor: dict[bytes, list[str]] = {}
            # O(held), not O(everything ever consumed): a checkpoint lists all consumed ids, most committed long ago.
            for tid in [t for t in self._held if t in durable]:
                by_actor.setdefault(self._held.pop(tid), []).append(tid)
            self._count("committed", sum(map(len, by_actor.values())))
            self._send_acks(sock, by_actor)

    def _free_slots(self) -> int:
        # qsize only shrinks behind our back (get), so this is a safe under-estimate of the free slots.
        return self.queue_size - self._q.qsize() - sum(a.credit for a in self._actors.values())

    def _tick(self, sock) -> None:
        now = time.monotonic()
        if self._collect_sync(sock, None) and self._pending_acks and now >= self._ack_due:
            self._start_sync()
        if self._pending_held:
            self._send_held(sock)
        if self._commits:
            self._send_commits(sock)
        free = self._free_slots()
        # WAL replay first: a restarted learner trains on what it had before taking anything new.
        while self._replay and free > 0:
            tid = self._replay.pop()
            try:
                tr = Trajectory.decode(self.wal.read(tid), self.max_frame_bytes)
                if resolve(self.images, tr):
                    raise SchemaError("refers to images missing from the image store")
            except (SchemaError, ImageError) as e:  # crc-checked, so a schema change or a lost image store
                self._warn("replay", "cannot replay %s: %s", tid, e)
                self.staleness.on_rejected(1)
                continue
            self._q.put_nowait(tr)
            self._count("replayed")
            free -= 1
        if not self._replay and free > 0 and self._actors:
            # Fair re-grant: least credit first; batch small grants (one CREDIT per ~1/8 window) to save messages.
            batch = max(1, self.credits // 8)
            for ident, st in sorted(self._actors.items(), key=lambda kv: kv[1].credit):
                want = self.credits - st.credit
                g = min(want, free)
                if g <= 0 or (g < batch and g < want and st.credit > 0):
                    continue
                st.credit += g
                free -= g
                self._count("credits_granted", g)
                self._send(sock, ident, P.CREDIT, {"n": g})
        v = self.staleness.version
        if v != self._version_sent:
            for ident in self._actors:
                self._send(sock, ident, P.VERSION, {"v": v})
            self._version_sent = v
        for ident, st in list(self._actors.items()):
            if now - st.last_seen > self.actor_timeout_s:
                # Silent for too long (actors PING every heartbeat): free its credit and give back its admissions.
                self._warn("dead", "actor %r silent for %.0fs: dropping it", ident, now - st.last_seen)
                if st.ledger:
                    self.staleness.on_lost(st.ledger)
                    self._count("lost", st.ledger)
                self._count("dead_actors")
                del self._actors[ident]


from core.stream_sender import TrajectorySender  # noqa: E402  (re-export; the sender does not import this module)

__all__ = ["TrajectoryReceiver", "TrajectorySender"]
