"""The trajectory stream, actor side: an asyncio DEALER that sends within its credit and keeps everything until acked.

An encoded trajectory stays in the outbox (and, with spool_dir, in a file) until the learner acks it, i.e. until it
is fsynced in the learner's WAL. The outbox is re-sent whenever the learner may have lost it:
  * WELCOME after a HELLO (start, a WHO from a learner that does not know us, a PONG with a new run_id, silence
    longer than dead_after_s, a reconnect: core/stream/link.py): the learner first acks the pending ids it already
    has, so only the rest is re-sent (and WELCOME's credit is absolute);
  * an entry unacked for resend_after_s (a lost ack on a bounced connection); the learner dedupes by id.
Re-sends go before new trajectories and spend credit like any TRAJ. Every wait has a deadline (TimeoutError).
With spool_dir set, a restarted actor (same actor_id) re-sends the trajectories its previous process never got acked;
a spool file that does not parse is set aside with a warning (stats()["spool_skipped"]) and the rest are re-sent; a
trajectory the spool cannot take (a full disk) is sent unspooled (stats()["spool_errors"]).
A learner with "checkpoint" durability answers a TRAJ with a "held" notice first and acks it only once a checkpoint
covers it: a held entry stays in the outbox (max_outbox bounds it) but leaves the send window and is never re-sent
to the run that holds it; a WELCOME from a different run (the holder died) sends it again.
Ids acked for good and unspooled are confirmed to a learner that reads them (WELCOME's confirms) in heartbeat PINGs,
so it can forget them (core/stream/confirm.py Forgotten: bounded by max_outbox, sent until a PONG echoes them).

Screenshots are content-addressed (core/stream/images.py): send() keeps a trajectory's images beside its encoded
frame, and each transmission attaches only the images not yet sent on this learner connection (a new learner run_id
starts over; a learner that answers "missing images" gets them again).

The socket is a plain DEALER driven by the event loop: sends are non-blocking (the HWM is unlimited, credit bounds
what is in flight), loop.add_reader on its FD drains incoming messages (zmq.asyncio cost a future, a callback and
EVENTS checks per send, as much as the rest of the hot path). The FD is edge-triggered: any call on the socket may
consume the edge, so a send schedules a drain (which checks EVENTS) for the loop's next pass.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import time
import uuid
from dataclasses import dataclass

import zmq

from core.schema import Trajectory
from core.stream import messages as M
from core.stream.confirm import Forgotten
from core.stream.curve import curve_client
from core.stream.images import SentImages
from core.stream.link import LinkWatch
from core.stream.spool import Spool

log = logging.getLogger(__name__)

_PING = M.Ping().encode()  # the same two frames every heartbeat


@dataclass
class _Entry:
    frame: bytes
    seq: int
    sent_at: float = 0.0    # monotonic time of the last transmission; 0 = waiting in the re-send queue
    images: dict | None = None  # sha256 hex -> bytes the frame refers to; attached when not yet sent on this connection
    held: str = ""              # run_id of a learner that holds it in memory until a checkpoint ("checkpoint" durability)


class TrajectorySender:
    def __init__(self, address: str, actor_id: str, window: int = 256, *, spool_dir: str | None = None,
                 heartbeat_s: float = 0.5, dead_after_s: float = 5.0, resend_after_s: float = 30.0,
                 curve_server_key: bytes | None = None, curve_public_key: bytes | None = None,
                 curve_secret_key: bytes | None = None, dedupe_images: bool = True,
                 max_remembered_images: int = 1 << 18, max_outbox: int = 1 << 16):
        """window: trajectories sent and not yet acked or held (the learner's "held" notice frees a window slot but
        not the outbox); max_outbox: everything kept for re-send, held ones included (checkpoint durability)."""
        if window < 1 or max_outbox < window:
            raise ValueError("need 1 <= window <= max_outbox")
        self.address, self.actor_id, self.window, self.max_outbox = address, actor_id, window, max_outbox
        self._n_held, self.spool_dir = 0, spool_dir  # _n_held: outbox entries with held set
        self._spool = Spool(spool_dir) if spool_dir else None
        self._forgot = Forgotten(max_outbox, max(dead_after_s, 2 * heartbeat_s), self._spool and self._spool.sync)
        self._confirms = False                # the learner reads PING's forgot (from WELCOME)
        self.heartbeat_s, self.dead_after_s, self.resend_after_s = heartbeat_s, dead_after_s, resend_after_s
        self._curve = (curve_server_key, curve_public_key, curve_secret_key)
        self.dedupe_images = dedupe_images
        self._sent_images = SentImages(max_remembered_images)  # hashes sent on the current connection
        self.incarnation = uuid.uuid4().hex
        self.run_id: str | None = None        # the learner's, from WELCOME
        self.version = 0                      # latest policy version heard of
        self.max_frame_bytes = 64 << 20       # the learner's limit, from WELCOME
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._link: LinkWatch | None = None   # HELLO again after a reconnect
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_scheduled = False
        self._wake: asyncio.Future | None = None  # resolved (and dropped) by _notify: every _wait re-checks
        self._outbox: dict[str, _Entry] = {}
        self._resend: collections.deque[str] = collections.deque()
        self._credit, self._closed = 0, False
        self._ready = False                   # WELCOME received since the last HELLO
        self._inflight = 0                    # admitted episodes not yet sent (told to the learner in HELLO)
        self._seq, self._rid = itertools.count(1), itertools.count(1)  # TRAJ seq, ADMIT request ids
        self._grants: dict[int, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._last_rx = self._last_hello = 0.0
        self._hello_id = 0                    # WELCOMEs answering an older HELLO are ignored (their credit is void)
        self._stats = dict.fromkeys(("sent", "acked", "resent", "nacked", "retried", "hellos", "restarts_seen",
                                     "spooled", "unspooled", "bytes_sent", "image_bytes_sent", "images_sent",
                                     "images_deduped", "images_missing", "spool_skipped", "spool_errors"), 0)

    # --- public API -----------------------------------------------------------------------------------------------
    async def start(self, timeout: float = 10.0) -> None:
        """Connect, load the spool, introduce ourselves; returns once the learner answered (WELCOME)."""
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.routing_id = self.actor_id.encode("utf-8")
        self._sock.linger = 0
        # Credits bound what is in flight, so unlimited HWMs never buffer more than window + control messages.
        self._sock.sndhwm = self._sock.rcvhwm = 0
        curve_client(self._sock, *self._curve)
        self._link = LinkWatch(self._sock, self._loop, self._hello)
        self._sock.connect(self.address)
        if self._spool is not None:
            for tid, frame, images in self._spool.load():
                self._outbox[tid] = _Entry(frame, next(self._seq), 0.0, images)
            self._stats["spool_skipped"] += len(self._spool.skipped)  # unreadable files, set aside (logged)
        self._loop.add_reader(self._sock.FD, self._drain)
        self._tasks = [asyncio.create_task(self._heartbeat(), name=f"sender-hb-{self.actor_id}"),
                       asyncio.create_task(self._pump(), name=f"sender-pump-{self.actor_id}")]
        self._hello()
        await self._wait(lambda: self._ready, time.monotonic() + timeout, "learner did not answer HELLO")

    async def admit(self, n: int, timeout: float) -> tuple[int, int]:
        """Ask the learner's staleness manager for n episode starts; returns (granted, policy version)."""
        rid = next(self._rid)
        fut = asyncio.get_running_loop().create_future()
        self._grants[rid] = fut
        try:
            self._send(M.Admit(rid, n).encode())
            granted, version = await asyncio.wait_for(fut, timeout)
        finally:
            self._grants.pop(rid, None)
        self._inflight += granted
        return granted, version

    async def lost(self, n: int) -> None:
        """Give back n admitted episodes that will never be sent (FINISHED_LOST)."""
        n = min(n, self._inflight)
        if n > 0:
            self._inflight -= n
            self._send(M.Lost(n).encode())

    async def send(self, traj: Trajectory, timeout: float) -> None:
        if self.dedupe_images and traj.images:
            # The frame goes without its images; they travel as extra frames, once per connection.
            frame = dataclasses.replace(traj, images={}).encode()
            await self.send_frame(traj.id, frame, timeout, images=dict(traj.images))
        else:
            await self.send_frame(traj.id, traj.encode(), timeout)

    async def send_frame(self, tid: str, frame: bytes, timeout: float, images: dict | None = None) -> None:
        """Send an encoded trajectory; waits (until timeout -> TimeoutError) for credit and outbox room.

        images: sha256 hex -> bytes that the frame refers to by hash and does not carry itself."""
        # The learner's two limits (core/stream/receiver.py): the frame, and the images attached to one message
        # (all of them after a reconnect, when none is known to have arrived), each at most max_frame_bytes.
        img = sum(len(b) for b in (images or {}).values())
        if len(frame) > self.max_frame_bytes or img > self.max_frame_bytes:
            raise ValueError(f"trajectory {tid} is {len(frame)} bytes with {img} bytes of images; the learner takes "
                             f"at most {self.max_frame_bytes} of each")
        deadline = time.monotonic() + timeout
        if self._spool is not None:
            # Spooled before waiting for credit: an actor killed while it waits (learner backlogged or down)
            # still re-sends this trajectory after its restart instead of losing it. A spool that cannot be written
            # (a full disk) costs that protection, not the trajectory: it is sent all the same.
            try:
                self._spool.save(tid, frame, images)
                self._stats["spooled"] += 1
            except OSError as e:
                self._stats["spool_errors"] += 1
                log.warning("could not spool trajectory %s (%s); sending it unspooled", tid, e)
        try:
            if not self._can_send():  # the common case (credit in hand) skips the waiter's closure and coroutine
                await self._wait(self._can_send, deadline, f"no credit to send {tid}")
        except BaseException as e:
            # A wait that ran out keeps the file: a caller that tries again writes it again, and an actor that stops
            # instead leaves it to its next start, as one killed while waiting does. A cancelled send is abandoned.
            if self._spool is not None and not self._closed and not isinstance(e, TimeoutError):
                self._unspool(tid)
            raise
        self._credit -= 1
        e = self._outbox[tid] = _Entry(frame, next(self._seq), 0.0, images or None)  # _transmit stamps sent_at
        self._inflight = max(0, self._inflight - 1)
        self._transmit(tid, e)
        self._stats["sent"] += 1

    def _can_send(self) -> bool:
        return (self._ready and self._credit > 0 and not self._resend
                and len(self._outbox) - self._n_held < self.window and len(self._outbox) < self.max_outbox)

    async def flush(self, timeout: float, held_ok: bool = False) -> None:
        """Wait until every trajectory sent so far is acked (or NACKed); held_ok: or held by the learner."""
        await self._wait(lambda: len(self._outbox) == (self._n_held if held_ok else 0), time.monotonic() + timeout,
                         lambda: f"{len(self._outbox)} trajectories still unacked")

    def pending(self) -> int:
        return len(self._outbox)

    def stats(self) -> dict:
        return {**self._stats, "pending": len(self._outbox), "held": self._n_held, "credit": self._credit,
                "inflight": self._inflight, "unconfirmed": len(self._forgot), "confirms_dropped": self._forgot.dropped,
                "resend_queue": len(self._resend), "version": self.version}

    async def close(self) -> None:
        """Stop at once; unacked trajectories are lost unless spooled (flush first to wait for them)."""
        self._closed = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        for fut in self._grants.values():
            fut.cancel()
        if self._link is not None:
            self._link.close()
        if self._sock is not None:
            if self._loop is not None and not self._sock.closed:
                self._loop.remove_reader(self._sock.FD)
            self._sock.close(0)
        if self._ctx is not None:
            self._ctx.term()

    # --- internals ------------------------------------------------------------------------------------------------
    async def _wait(self, pred, deadline: float, what) -> None:
        """Until pred() holds (re-checked after every _notify), or TimeoutError at deadline."""
        while not pred():  # one event loop: nothing changes between this check and the caller's next line
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(what() if callable(what) else what)
            if self._wake is None:
                self._wake = self._loop.create_future()
            try:
                # shield: a waiter timing out must not cancel the future the other waiters share
                await asyncio.wait_for(asyncio.shield(self._wake), None if left == float("inf") else left)
            except TimeoutError:
                pass  # re-check the predicate once more, then raise above

    def _notify(self) -> None:
        w, self._wake = self._wake, None
        if w is not None and not w.done():
            w.set_result(None)

    def _send(self, parts, copy: bool = True) -> None:
        """Non-blocking send. The HWM is unlimited and a connected DEALER always has its pipe, so it cannot meet EAGAIN;
        if libzmq still refuses, the message is dropped like one lost on a bounced connection (TRAJ is re-sent after
        resend_after_s, control messages are retried by their own timeouts)."""
        try:
            self._sock.send_multipart(parts, zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            log.warning("stream send would block; dropped a %r message", parts[0])
        if not self._drain_scheduled:
            # The send may have consumed the FD's edge for messages that arrived meanwhile: drain soon (_drain checks
            # EVENTS itself). One check per pass of the event loop, not one EVENTS lookup per send: a burst of sends
            # between two awaits costs one.
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _transmit(self, tid: str, e: _Entry) -> None:
        e.sent_at = time.monotonic()
        if not e.images:  # no screenshots: the header and the frame, nothing else to track
            self._stats["bytes_sent"] += len(e.frame)
            self._send([M.TRAJ, M.pack({"seq": e.seq, "id": tid, "images": []}), e.frame], copy=False)
            return
        new = self._sent_images.take(e.images)
        parts = [*M.Traj(e.seq, tid, new).encode(), e.frame, *(e.images[h] for h in new)]
        img_bytes = sum(len(e.images[h]) for h in new)
        self._stats["bytes_sent"] += len(e.frame) + img_bytes
        self._stats["image_bytes_sent"] += img_bytes
        self._stats["images_sent"] += len(new)
        self._stats["images_deduped"] += (len(e.images) if e.images else 0) - len(new)
        self._send(parts, copy=False)

    def _hello(self) -> None:
        self._ready = False
        self._last_hello = time.monotonic()
        self._hello_id += 1
        self._stats["hellos"] += 1
        self._send(M.Hello(self.actor_id, self.incarnation, self._hello_id, list(self._outbox),
                           self._inflight).encode())

    def _drain(self) -> None:
        """add_reader callback (and after sends): handle every message waiting, in a bounded burst."""
        self._drain_scheduled = False
        sock = self._sock
        if sock is None or sock.closed:
            return
        handled = False
        try:
            for _ in range(1024):
                if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    break
                msg = sock.recv_multipart(zmq.NOBLOCK)
                self._last_rx = time.monotonic()
                handled = True
                self._dispatch(msg)
            else:  # more waiting: yield to the loop, come back at once
                self._drain_scheduled = True
                self._loop.call_soon(self._drain)
        except zmq.Again:
            pass
        except zmq.ZMQError as e:
            if not self._closed:
                log.warning("stream receive failed: %s", e)
        if handled:
            self._notify()

    def _dispatch(self, msg: list[bytes]) -> None:
        if len(msg) < 2:
            return
        try:
            m = M.decode(M.TO_ACTOR, msg[0], msg[1])
        except M.ProtocolError as e:
            log.warning("bad %r message from learner: %s", msg[0], e)
            return
        if isinstance(m, M.Ack):
            self._on_ack(m)
        elif isinstance(m, M.Credit):
            if self._ready:  # credit from before our last HELLO is void (WELCOME resets it)
                self._credit += m.n
        elif isinstance(m, M.Welcome):
            if m.hello_id == self._hello_id:
                self._welcome(m)
        elif isinstance(m, M.Nack):
            self._on_nack(m)
        elif isinstance(m, M.Grant):
            fut = self._grants.get(m.rid)
            if fut is not None and not fut.done():
                fut.set_result((m.granted, m.version))
            self.version = m.version
        elif isinstance(m, M.Version):
            self.version = m.v
        elif isinstance(m, M.Pong):
            self._forgot.echoed(m.cseq)
            if self.run_id is not None and m.run_id != self.run_id:
                self._hello()
        elif isinstance(m, M.Who):
            if time.monotonic() - self._last_hello > 0.05 or self._ready:  # one HELLO per burst of WHOs
                self._hello()

    def _on_ack(self, m: M.Ack) -> None:
        for tid in m.ids:
            if m.held:  # that learner run keeps it in memory until a checkpoint: no re-send timer, free the window
                e = self._outbox.get(tid)
                if e is not None:
                    self._n_held += not e.held
                    e.held = m.held
            elif self._pop(tid) is not None:
                self._stats["acked"] += 1
                if self._spool is None or self._unspool(tid):  # a file left behind: it may come again
                    self._forgot.add(tid)

    def _on_nack(self, m: M.Nack) -> None:
        for h in m.missing:  # the learner lost these images: attach them again
            self._sent_images.discard(h)
            self._stats["images_missing"] += 1
        e = self._outbox.get(m.id) if m.id is not None else None
        # Images we do not hold either can never be supplied: drop the trajectory rather than loop.
        resendable = e is not None and all(h in (e.images or {}) for h in m.missing)
        if m.retry and resendable:
            self._stats["retried"] += 1
            e.sent_at = 0.0
            self._resend.append(m.id)
        elif m.id is not None and self._pop(m.id) is not None:
            self._stats["nacked"] += 1
            log.warning("learner rejected trajectory %s: %s", m.id, m.reason)
            if m.retry:  # the learner still counts the episode as running: give it back
                self._send(M.Lost(1).encode())
            if self._spool is not None:
                self._unspool(m.id)

    def _welcome(self, m: M.Welcome) -> None:
        rid = m.run_id
        if self.run_id is not None and rid != self.run_id:
            self._stats["restarts_seen"] += 1
            self._sent_images.clear()  # a new learner process: it may not have our images
            log.info("learner restarted (run %s -> %s): re-sending %d trajectories", self.run_id, rid,
                     len(self._outbox))
        self.run_id = rid
        self.version = m.version
        self.max_frame_bytes = m.max_frame_bytes
        self._credit = m.credit
        self._confirms = m.confirms
        self._forgot.resend()  # this run may not have heard them (a restart, PINGs lost on a reconnect)
        # Held by another (dead) learner run: that memory is gone, send them again.
        for e in self._outbox.values():
            if e.held and e.held != rid:
                e.held = ""
                self._n_held -= 1
        # The learner acked (or marked held) what it already had just before WELCOME: everything else is sent again.
        self._resend = collections.deque(sorted((t for t, e in self._outbox.items() if not e.held),
                                                key=lambda t: self._outbox[t].seq))
        for tid in self._resend:
            self._outbox[tid].sent_at = 0.0
        self._ready = True

    async def _pump(self) -> None:
        """Re-sends, in order, ahead of new trajectories and within credit."""
        while True:
            await self._wait(lambda: self._ready and self._credit > 0 and self._resend, float("inf"), "")
            tid = self._resend.popleft()
            e = self._outbox.get(tid)
            if e is None or e.held:
                continue  # acked (or held by this learner) meanwhile
            self._credit -= 1
            self._transmit(tid, e)
            self._stats["resent"] += 1
            if not self._resend:
                self._notify()  # new sends wait for the re-send queue to empty

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            now = time.monotonic()
            if now - self._last_rx > self.dead_after_s and now - self._last_hello > self.dead_after_s:
                self._hello()  # the learner went silent: maybe restarted on a new address/port binding
            else:  # a PING, or PINGs that confirm forgotten ids to a learner that reads them
                for ping in (self._forgot.pings(now) if self._ready and self._confirms else None) or [_PING]:
                    self._send(ping)
            if self._ready and self.resend_after_s > 0:
                stale = [t for t, e in self._outbox.items()
                         if e.sent_at and not e.held and now - e.sent_at > self.resend_after_s]
                if stale:
                    for t in sorted(stale, key=lambda t: self._outbox[t].seq):
                        self._outbox[t].sent_at = 0.0
                        self._resend.append(t)
                    self._notify()

    def _pop(self, tid: str) -> _Entry | None:
        e = self._outbox.pop(tid, None)
        if e is not None and e.held:
            self._n_held -= 1
        return e

    def _unspool(self, tid: str) -> bool:
        """Remove tid's spool file; False (counted, logged) if it stays: loaded and re-sent after a restart."""
        try:
            self._stats["unspooled"] += self._spool.remove(tid)
            return True
        except OSError as e:  # (raised out of the ACK's drain, it left the rest of that ACK's ids unread)
            self._stats["spool_errors"] += 1
            log.warning("could not remove trajectory %s from the spool (%s); re-sent after a restart", tid, e)
            return False
