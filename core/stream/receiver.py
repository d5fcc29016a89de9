"""The trajectory stream, learner side: a ZeroMQ ROUTER with credit flow control, durability and acknowledgements.

One background thread owns the socket (its own zmq context and poller), so the training thread never blocks on the
network; training takes validated trajectories from a bounded queue with `get(timeout)`. The wire protocol is in
core/stream/messages.py; the actor side is core/stream/sender.py.

Memory is bounded by slots: queue_size slots are either free, promised to an actor as credit, or hold a queued
trajectory. An actor may only send what it has credit for, so the queue can never overflow and the io thread never
has to block or buffer; credit is re-granted as `get()` drains the queue (fair: the actor with the least credit first).

Delivery is exactly-once for training, across learner restarts:
  * a trajectory is acked only once it is durable (core/stream/durability.py: fsynced in the WAL, or covered by a
    checkpoint); the actor keeps it (and re-sends it after a learner restart) until then;
  * ids the durability already has, or already consumed, are duplicates: answered again so the actor forgets them
    (or keeps them held), never re-queued;
  * the training loop calls mark_consumed(ids) for what it trained on and stores checkpoint_state() with its weights;
    a new receiver given those consumed_ids replays the logged entries not consumed into the queue before anything
    new; after each durable checkpoint the loop calls compact_wal() and commit(its consumed ids);
  * an actor confirms (PING's forgot) the ids it got the final ACK for and deleted; a consumed id is forgotten once
    confirmed and gone from the durability, so the consumed set stays bounded (core/stream/confirm.py).
Staleness bookkeeping (which side calls what) is described in learner/staleness.py: this receiver calls try_admit,
adopt, adopt_claim (core/stream/peers.py), on_lost and on_rejected (for NACKed frames only); the training loop calls
on_accepted/on_rejected once for every trajectory get() returns. What cannot be trained on is NACKed "invalid".
"""
from __future__ import annotations

import errno
import logging
import threading
import time
import uuid
import zmq

from core.config import UserError
from core.schema import InvalidTrajectory, SchemaError, Trajectory
from core.stream import messages as M
from core.stream.confirm import ConsumedIds
from core.stream.curve import Zap, close_server, curve_server
from core.stream.durability import IoHooks, make_durability
from core.stream.images import ImageError, ImageStore, referenced, resolve, take_attached
from core.stream.ioloop import HandOver, Throttled, TickPacer, recv_message
from core.stream.peers import MAX_PEERS, Peer, regrant
from core.stream.wal import WalError

log = logging.getLogger(__name__)
_BIND = (errno.EADDRINUSE, errno.EADDRNOTAVAIL)  # a bind that fails for these is the user's to fix


class TrajectoryReceiver:
    def __init__(self, bind: str, wal_path: str, staleness, credits: int = 512, queue_size: int = 4096,
                 max_frame_bytes: int = 64 << 20, consumed_ids=(), on_reject=None, *, confirmed_ids=(), id_owners=None,
                 ack_interval_s: float = 0.002, fsync: bool = True, actor_timeout_s: float = 60.0, grant_ttl_s=1800.0,
                 log_every_s: float = 10.0, curve_secret_key: bytes | None = None, durability: str = "wal",
                 vocab_size: int | None = None, wal_writer: str = "process", curve_client_keys=(), keys_reload=None):
        """bind: "tcp://host:port" (port 0 = a free port). on_reject(actor, id, reason) is called from the io thread
        for every NACKed frame (keep it cheap). curve_secret_key, curve_client_keys (Z85 public keys of the clients
        allowed; empty: any), keys_reload (re-reads them: curve.Allowlist): see core/stream/curve.py. durability,
        wal_writer: see core/stream/durability.py. vocab_size: the learner's model's (other token ids are NACKed
        "invalid"). actor_timeout_s: an actor silent that long is dropped; it bounds HELLO's claims too; grant_ttl_s:
        ADMIT's grants not borne out by then are given back, 0 = never (peers.py).
        consumed_ids, confirmed_ids, id_owners: the checkpoint's (checkpoint_state())."""
        if credits < 1 or queue_size < 1 or (curve_client_keys and not curve_secret_key):
            raise ValueError("credits and queue_size must be >= 1; curve_client_keys needs curve_secret_key")
        self.bind, self.staleness, self.credits, self.queue_size = bind, staleness, credits, queue_size
        self.max_frame_bytes, self.on_reject, self.actor_timeout_s = max_frame_bytes, on_reject, actor_timeout_s
        self.log_every_s, self.curve_secret_key, self.curve_client_keys = log_every_s, curve_secret_key, curve_client_keys
        self.keys_reload, self.grant_ttl_s = keys_reload, grant_ttl_s
        self._zap: Zap | None = None  # the ZAP handler (core/stream/curve.py), with an allowlist
        self.vocab_size, self._claims_until = vocab_size, 0.0  # HELLO inflight is adopted until then (set by start)
        self.run_id = uuid.uuid4().hex  # actors compare it to detect a learner restart
        self._warn = Throttled(log, log_every_s)
        self.durability = make_durability(durability, IoHooks(self._send, self._count, self._warn), wal_path,
                                          run_id=self.run_id, fsync=fsync, ack_interval_s=ack_interval_s,
                                          max_staged=queue_size, wal_writer=wal_writer, max_record=max_frame_bytes)
        self.images = ImageStore(wal_path + ".images")  # screenshots by hash, beside the WAL that refers to them
        self._q = HandOver(queue_size)  # core/stream/ioloop.py: the consumer is woken once per burst
        self._ids = ConsumedIds(consumed_ids, confirmed_ids, id_owners, self._warn)  # consumed, confirmed, forgotten: confirm.py
        self._stop, self._ready = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._sock: zmq.Socket | None = None  # the io thread's, from bind to close
        # The io thread's clock (once per burst); credit_low: an actor spent half its credit (core/stream/ioloop.py).
        self._now, self._credit_low = time.monotonic(), False
        self.address = ""
        self._actors: dict[bytes, Peer] = {}
        self._replay: list[str] = []
        self._version_sent = -1
        self._stats = dict.fromkeys((
            "received", "accepted", "duplicates", "malformed", "unknown_schema", "oversize", "acked", "nacked", "busy",
            "replayed", "credits_granted", "hellos", "admits", "granted", "lost", "dead_actors", "protocol_errors",
            "wal_syncs", "wal_errors", "queue_max", "images_stored", "missing_images", "committed", "invalid",
            "claimed", "claims_capped", "claims_expired", "grants_expired", "credits_reclaimed", "peers_refused"), 0)

    # --- training-thread API --------------------------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> str:
        """Open the durability, queue its unconsumed entries for replay, bind; returns tcp://host:port."""
        self.images.open()
        self._replay = self.durability.open(frozenset(self._ids.consumed))  # no lock: no io thread yet
        self._ids.settle(self.durability.holds)  # confirmed by the actors and not in the log: forgotten now
        if self._replay:  # admitted by a previous learner; the training loop resolves each (on_accepted/rejected)
            self.staleness.adopt(len(self._replay))
        self._replay.reverse()  # popped from the end, so replay goes in file (arrival) order
        self._claims_until = time.monotonic() + self.actor_timeout_s
        self._thread = threading.Thread(target=self._run, name="traj-receiver", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("trajectory receiver did not bind in time")
        if self._error:
            raise self._error
        return self.address

    def get(self, timeout: float) -> Trajectory | None:
        """The next trajectory to train on, or None after `timeout` seconds."""
        if self.durability.fatal is not None:  # the WAL writer process died: the learner must stop (and restart)
            raise self.durability.fatal
        if self._error is not None:  # the io thread crashed: nothing will ever arrive
            raise RuntimeError(f"trajectory receiver io thread crashed: {self._error!r}") from self._error
        return self._q.get(timeout)

    def qsize(self) -> int:
        return self._q.qsize()

    def mark_consumed(self, ids) -> None:
        """These ids went into a policy update: never deliver them again (store checkpoint_state() with the weights)."""
        self._ids.add(ids := list(ids))
        self.images.release(ids)  # their screenshots may go at the next compaction (not mid-replay: see images.py)

    def checkpoint_state(self) -> dict:
        """Goes into the learner checkpoint; pass its consumed_ids, confirmed_ids, id_owners to the next receiver's."""
        return self._ids.state()

    def commit(self, ids) -> None:
        """A checkpoint listing these ids as consumed is durable: with "checkpoint" durability, ack them to their
        actors (call it with the checkpoint's own consumed_ids; ids not held by this process are skipped)."""
        self.durability.commit(ids)

    def compact_wal(self) -> dict:
        """Drop consumed entries from the WAL (call after the checkpoint that covers them is durable), then the images
        no unconsumed trajectory holds, unless mid-replay (unread entries hold nothing; replay pops under the lock).
        Then the consumed ids their actors confirmed and the log no longer holds are forgotten."""
        out = self.durability.compact(self._ids.unsettle())  # (an error leaves them unsettled: nothing forgotten)
        self._ids.settle(self.durability.holds)
        with self.images.lock:
            replaying = bool(self._replay)
        return {**out, "images_collected": 0 if replaying else self.images.collect()}

    def stats(self) -> dict:
        return {**self._stats, "queue": self._q.qsize(), **self.durability.stats(), **self._ids.stats(),
                "replay_pending": len(self._replay),
                "actors": len(self._actors), "clients_refused": self._zap.allow.refused if self._zap else 0}

    def stop(self, timeout: float = 5.0) -> None:
        """Make everything durable, send the last acks, close. Queued but unconsumed trajectories stay in the WAL."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("trajectory receiver thread did not stop within %.1fs", timeout)
        self.durability.close(timeout)

    # --- io thread ------------------------------------------------------------------------------------------------
    def _count(self, key: str, n: int = 1) -> None:
        # Only the io thread writes counters, so no lock: stats() copies the dict, which is safe against value updates.
        self._stats[key] += n

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        try:
            self._zap = Zap(ctx, self.curve_client_keys, self.keys_reload) if self.curve_client_keys else None  # before the bind
            sock.linger = 0
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted actor (same id) takes over its old route
            # Hard cap against non-conforming peers (libzmq drops the connection beyond it); conforming ones learn
            # max_frame_bytes from WELCOME, and frames in between are NACKed "oversize".
            sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_frame_bytes + (1 << 20))
            sock.rcvhwm = sock.sndhwm = 0  # bounded by credits, not by silently dropping
            curve_server(sock, self.curve_secret_key)
            sock.bind(self.bind)
            self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException as e:
            self._error = UserError(f"cannot bind the trajectory stream to {self.bind} (learner.stream.host, .port): {e}; "
                                    "choose another port, or 0 for any free one") if getattr(e, "errno", 0) in _BIND else e
            close_server(sock, ctx, self._zap)
            self._ready.set()
            return
        self._sock = sock
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        dur = self.durability
        pace = TickPacer(self.credits, time.monotonic())  # when to tick: core/stream/ioloop.py
        try:
            while not self._stop.is_set():
                got, full = 0, False
                if poller.poll(pace.wait(time.monotonic(), dur.poll_timeout(time.monotonic())) * 1000):
                    # Drain a short burst, then see whether a tick is due: credit and acks must flow back while the
                    # actor still has work in hand, or the two ends take turns instead of overlapping.
                    self._now = time.monotonic()
                    for _ in range(32):
                        try:
                            msg = recv_message(sock)
                        except zmq.Again:
                            break
                        got += 1
                        self._handle(msg)
                        if dur.acks_ready:
                            break
                    else:
                        full = True
                if pace.due(got, full, time.monotonic(), dur.acks_ready or self._credit_low):
                    self._tick()
                self._q.wake()  # once for what the burst and the tick queued (core/stream/ioloop.HandOver)
            dur.flush()
        except Exception as e:
            log.exception("trajectory receiver io thread crashed")
            self._error = e  # get() raises it: the learner stops (and is restarted) instead of waiting for nothing
            raise
        finally:
            self._sock = None
            close_server(sock, ctx, self._zap)
    def _send(self, ident: bytes, msg: M.Message) -> None:
        try:
            self._sock.send_multipart([ident, *msg.encode()], zmq.NOBLOCK)
        except zmq.Again:  # unreachable with sndhwm=0; an actor that stopped reading just loses the message
            self._warn("send", "could not send %r to %r", msg.TAG, ident)

    def _handle(self, msg: list[bytes]) -> None:
        if len(msg) < 3 or len(msg[1]) != 1:
            self._count("protocol_errors")
            self._warn("proto", "malformed message of %d frames", len(msg))
            return
        ident, tag = msg[0], msg[1]
        st = self._actors.get(ident)
        if st is None and tag != M.HELLO:
            # A learner restart (or a timed-out actor): the actor re-introduces itself (nothing of it is decoded).
            self._send(ident, M.Who())
            return
        try:
            raw = M.unpack(msg[2])
        except M.ProtocolError as e:
            self._count("protocol_errors")
            self._warn("proto", "bad %r body from %r: %s", tag, ident, e)
            return
        if st is not None:
            st.last_seen = self._now
        try:
            m = M.parse(M.TO_LEARNER, tag, raw)
        except M.ProtocolError as e:
            if tag == M.TRAJ:  # a map but no valid header: refused like any malformed trajectory (it spent a credit)
                self._traj_refused(ident, st, e.msg_id, f"malformed: {e}")
            else:
                self._count("protocol_errors")
                self._warn("proto", "bad %r message from %r: %s", tag, ident, e)
            return
        if isinstance(m, M.Traj):
            self._traj(ident, st, m, msg[3] if len(msg) >= 4 else None, msg[4:])
        elif isinstance(m, M.Hello):
            self._hello(ident, m)
        elif isinstance(m, M.Admit):
            g = self.staleness.try_admit(m.n) if m.n > 0 else 0
            st.grant(self._now, g)
            self._count("admits")
            self._count("granted", g)
            self._send(ident, M.Grant(m.rid, g, self.staleness.version))
        elif isinstance(m, M.Lost):
            k = min(m.n, st.ledger) if m.n > 0 else 0
            if k:
                st.finish(k)
                self.staleness.on_lost(k)
            self._count("lost", k)
        elif isinstance(m, M.Ping):
            if m.forgot:
                self._ids.confirm(ident, m.forgot, self.durability.holds)
            self._send(ident, M.Pong(self.run_id, m.cseq))

    def _hello(self, ident: bytes, m: M.Hello) -> None:
        self._count("hellos")
        inflight = max(m.inflight, 0)
        st = self._actors.get(ident)
        if st is not None and st.incarnation != m.incarnation:
            # The actor process restarted: its old admitted-but-unfinished episodes are gone for good.
            if st.ledger:
                self.staleness.on_lost(st.ledger)
                self._count("lost", st.ledger)
            st = None
        now = time.monotonic()
        if st is None and len(self._actors) >= MAX_PEERS:
            self._count("peers_refused")  # (HELLO floods from new identities: each peer costs every tick)
            self._warn("peers", "HELLO from %r refused: %d actors already", ident, len(self._actors))
            return
        if st is None:
            # Admitted by a previous learner, still running on the actor: bounded claims (core/stream/peers.py).
            claim = self.staleness.adopt_claim(inflight) if inflight and now < self._claims_until else 0
            if claim < inflight:
                self._count("claims_capped")
                self._warn("claim", "HELLO from %r claims %d episodes in flight: %d taken", ident, inflight, claim)
            self._count("claimed", claim)
            st = self._actors[ident] = Peer(m.incarnation, ledger=claim, claimed=claim, claim_deadline=now + self.actor_timeout_s)
        st.last_seen = st.last_traj = now
        st.credit = 0  # WELCOME's credit is absolute: whatever was granted before is void on both sides
        # Durable and acked first, then answer the pending ids we have: the actor's outbox then holds exactly what
        # must be re-sent when WELCOME arrives (same pipe, in order). Only then: a sync per HELLO let a HELLO loop
        # starve the stream. A failed or slow log: ids it holds may not be durable; they come again.
        known = [t for t in m.pending_ids if self._known(t)]
        if known and self.durability.flush():
            self.durability.answer_known(ident, known)
        st.credit = min(self.credits, self._free_slots())
        self._count("credits_granted", st.credit)
        self._send(ident, M.Welcome(self.run_id, m.hello_id, self.staleness.version, st.credit, self.max_frame_bytes,
                                    confirms=True))

    def _known(self, tid: str) -> bool:
        return self.durability.holds(tid) or self._ids.known(tid)

    def _traj_refused(self, ident: bytes, st: Peer, tid: str | None, reason: str) -> None:
        """A TRAJ without a usable header or payload: counted as received and malformed, NACKed for good."""
        self._count("received")
        st.credit -= 1  # (below 0 while trajectories sent under reclaimed credit land: peers.regrant)
        self._warn("malformed", "TRAJ from %r refused: %s", ident, reason)
        self._nack(ident, st, tid, reason, "malformed")

    def _nack(self, ident: bytes, st: Peer, tid: str | None, reason: str, counter: str, retry: bool = False) -> None:
        self._count(counter)
        self._count("nacked")
        self._send(ident, M.Nack(tid, reason, retry))
        self.images.release([tid])  # a busy one holds its images again when it is re-sent
        if not retry and st.ledger:
            # The episode finished but can never be trained on: it stops counting as running.
            st.finish(1)
            self.staleness.on_rejected(1)
        if self.on_reject is not None:
            try:
                self.on_reject(ident.decode("utf-8", "replace"), tid, reason)
            except Exception:
                log.exception("on_reject callback failed")

    def _traj(self, ident: bytes, st: Peer, m: M.Traj, payload, image_frames=()) -> None:
        """payload: the encoded trajectory (bytes or a memoryview), image_frames: the attached screenshots."""
        if payload is None:
            self._traj_refused(ident, st, m.id, "malformed: no id or payload")
            return
        self._count("received")
        st.credit -= 1
        st.last_traj = self._now
        if st.credit <= self.credits >> 1:
            self._credit_low = True
        tid = m.id
        if self._known(tid):
            self._count("duplicates")
            self.durability.duplicate(ident, tid)
            return
        if len(payload) > self.max_frame_bytes:
            self._warn("oversize", "dropping %d-byte trajectory %s from %r", len(payload), tid, ident)
            self._nack(ident, st, tid, f"oversize: {len(payload)} > {self.max_frame_bytes}", "oversize")
            return
        if self._q.full() or self.durability.backlogged(len(payload)):
            # Only a peer that ignores credit (or a disk far behind) gets here; it keeps the trajectory and retries.
            # Before its images are stored: a refused trajectory's frames filled the disk, held by nothing.
            self._nack(ident, st, tid, "busy: no queue slot", "busy", retry=True)
            return
        try:
            n_img = len(self.images)
            tr = Trajectory.decode(payload, self.max_frame_bytes, self.vocab_size)
            if tr.id != tid:
                raise SchemaError(f"header id {tid!r} != payload id {tr.id!r}")
            if tr.group and tr.actor != (sender := ident.decode("utf-8", "replace")):  # groups are per actor:
                raise InvalidTrajectory(f"group {tr.group!r} of actor {tr.actor!r} sent by {sender!r} (a group "
                                        "belongs to the actor that sends it)")  # core.schema.group_key
            with self.images.lock:  # stored and held as one step (a compaction between them would collect them)
                if m.images or image_frames:  # only with a trajectory that decoded (garbage with images grew the store),
                    take_attached(self.images, m.images, [bytes(f) for f in image_frames], self.max_frame_bytes,
                                  set(referenced(tr.turns, tr.image_refs)))  # and only the ones it refers to
                missing = resolve(self.images, tr)
            self._count("images_stored", len(self.images) - n_img)
        except OSError as e:  # the image store's disk (full, gone): the actor keeps it and retries
            self._warn("images", "cannot store the images of %s: %s", tid, e)
            self._nack(ident, st, tid, "busy: the image store failed", "busy", retry=True)
            return
        except (SchemaError, ImageError) as e:
            counter = getattr(e, "kind", "malformed")  # SchemaError: malformed | unknown_schema | invalid
            self._warn(counter, "dropping trajectory %s from %r: %s", tid, ident, e)
            self._nack(ident, st, tid, f"{counter}: {e}", counter)
            return
        if missing:  # images this learner never got (or collected): the actor re-sends them attached
            self._count("missing_images")
            self._count("nacked")
            self._send(ident, M.Nack(tid, f"missing images: {len(missing)}", True, missing))
            return
        try:
            self.durability.accept(ident, tid, payload)
        except WalError as e:
            self._warn("wal", "cannot log trajectory %s: %s", tid, e)
            self._nack(ident, st, tid, "busy: write-ahead log failed", "wal_errors", retry=True)
            return
        self._ids.own(tid, ident)  # (after accept: a compaction's settle() drops owners of ids nothing tracks)
        # Accounting before the put: the training thread may call on_accepted the instant the item is queued.
        if not st.arrived(self._now, self.actor_timeout_s):
            self.staleness.adopt(1)     # admitted by a previous learner, or sent without ADMIT
        self._q.put(tr)
        self._count("accepted")
        n = self._q.qsize()
        if n > self._stats["queue_max"]:
            self._stats["queue_max"] = n

    def _free_slots(self) -> int:  # qsize only shrinks behind our back (get): a safe under-estimate
        return self.queue_size - self._q.qsize() - sum(max(a.credit, 0) for a in self._actors.values())

    def _tick(self) -> None:
        now = time.monotonic()
        self._credit_low = False
        self.durability.tick(now)
        free = self._free_slots()
        # WAL replay first: a restarted learner trains on what it had before taking anything new.
        while self._replay and free > 0:
            try:
                with self.images.lock:  # popped and held as one step: a compaction between them may not collect
                    tid = self._replay.pop()
                    tr = Trajectory.decode(self.durability.read(tid), self.max_frame_bytes, self.vocab_size)
                    if resolve(self.images, tr):
                        raise SchemaError("refers to images missing from the image store")
            except (SchemaError, ImageError) as e:  # crc-checked, so a schema change or a lost image store
                self._warn("replay", "cannot replay %s: %s", tid, e)
                self.staleness.on_rejected(1)
                continue
            if tr.group:  # its actor was checked against the sender on arrival: the owner (confirm.py)
                self._ids.own(tid, tr.actor.encode())
            self._q.put(tr)
            self._count("replayed")
            free -= 1
        if not self._replay and self._actors:  # fair re-grant, and credit idle actors hold taken back (peers.py)
            for ident, g in regrant(self._actors, self.credits, max(free, 0), now):
                self._count("credits_granted" if g > 0 else "credits_reclaimed", abs(g))
                self._send(ident, M.Credit(g))
        v = self.staleness.version
        if v != self._version_sent:
            for ident in self._actors:
                self._send(ident, M.Version(v))
            self._version_sent = v
        for ident, st in list(self._actors.items()):
            for counter, k in st.expire(now, self.grant_ttl_s):  # claims never borne out, grants past their ttl
                self.staleness.on_lost(k)
                self._count(counter, k)
            if now - st.last_seen > self.actor_timeout_s:
                # Silent for too long (actors PING every heartbeat): free its credit and give back its admissions.
                self._warn("dead", "actor %r silent for %.0fs: dropping it", ident, now - st.last_seen)
                if st.ledger:
                    self.staleness.on_lost(st.ledger)
                    self._count("lost", st.ledger)
                self._count("dead_actors")
                del self._actors[ident]
