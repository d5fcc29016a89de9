"""A dropped link between an actor and the learner (core/stream/link.py): ZeroMQ reconnects the actor by itself and
what was in flight is lost both ways. A lost TRAJ or ACK comes again (resend_after_s), but a lost CREDIT or the final
ACK of a "held" entry nothing re-sends: the actor re-introduces itself (HELLO) after the reconnect."""
import asyncio
import socket
import threading

from core.stream.sender import TrajectorySender
from test_stream import receiver, traj, wait_until  # tests/ is on sys.path (rootless test dir)


class Relay:
    """TCP between the actor and the learner; bounce() drops its connections (a blip of the network)."""

    def __init__(self, upstream: str):
        host, port = upstream.removeprefix("tcp://").rsplit(":", 1)
        self.up = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "tcp://127.0.0.1:%d" % self.listener.getsockname()[1]
        self.open = threading.Event()
        self.open.set()
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            client, _ = self.listener.accept()
            self.open.wait(30)  # while closed, the reconnected actor does not reach the learner
            learner = socket.create_connection(self.up, timeout=10)
            learner.settimeout(None)
            with self.lock:
                self.conns += [client, learner]
            for a, b in ((client, learner), (learner, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a, b):
        try:
            while data := a.recv(1 << 16):
                b.sendall(data)
        except OSError:
            pass

    def bounce(self):
        """Drop every connection, and keep new ones from the learner until reopen()."""
        self.open.clear()
        with self.lock:
            conns, self.conns = self.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def reopen(self):
        self.open.set()


def test_a_credit_lost_with_the_link_does_not_stall_the_actor(tmp_path):
    """The CREDIT that re-grants the slots the learner freed was sent while the link was down: the learner counted it
    as the actor's, the actor never got it, and every later send() waited out its timeout (no credit) for good."""
    rx = receiver(tmp_path, credits=4, queue_size=4)
    relay = Relay(rx.start())

    async def main():
        s = TrajectorySender(relay.address, "c0", window=64, heartbeat_s=0.05, dead_after_s=5.0)
        await s.start()
        for i in range(4):
            await s.send(traj(f"c{i}"), timeout=5)
        await s.flush(timeout=5)
        assert s.stats()["credit"] == 0  # all four slots hold a trajectory
        relay.bounce()
        granted = rx.stats()["credits_granted"]
        for _ in range(4):  # the training thread frees them: the io thread re-grants them while the link is down
            rx.staleness.on_accepted(1)
            rx.mark_consumed([rx.get(timeout=5).id])
        assert await asyncio.to_thread(wait_until, lambda: rx.stats()["credits_granted"] >= granted + 4, 5)
        relay.reopen()
        for i in range(4, 8):
            await s.send(traj(f"c{i}"), timeout=5)
        await s.flush(timeout=5)
        st = s.stats()
        await s.close()
        return st

    try:
        st = asyncio.run(main())
        assert [rx.get(timeout=5).id for _ in range(4)] == [f"c{i}" for i in range(4, 8)]
        assert st["pending"] == 0 and st["hellos"] == 2  # the start, and once after the reconnect
    finally:
        rx.stop()


def test_a_held_entrys_ack_lost_with_the_link_is_answered_after_the_reconnect(tmp_path):
    """"checkpoint" durability: the commit's ACK (the checkpoint covers these) went out while the link was down; the
    actor kept the four entries held for good (no re-send timer for held entries), out of max_outbox, unflushable."""
    rx = receiver(tmp_path, durability="checkpoint", credits=16, queue_size=64)
    relay = Relay(rx.start())

    async def main():
        s = TrajectorySender(relay.address, "h0", window=8, heartbeat_s=0.05, dead_after_s=5.0)
        await s.start()
        for i in range(4):
            await s.send(traj(f"h{i}"), timeout=5)
        await s.flush(timeout=5, held_ok=True)
        ids = [rx.get(timeout=5).id for _ in range(4)]
        rx.mark_consumed(ids)
        relay.bounce()
        rx.commit(frozenset(ids))  # a checkpoint listing them is durable: acked while the link is down
        assert await asyncio.to_thread(wait_until, lambda: rx.stats()["committed"] == 4, 5)
        relay.reopen()
        await s.flush(timeout=5)  # acked for good, none held
        st = s.stats()
        await s.close()
        return st

    try:
        st = asyncio.run(main())
        assert st["pending"] == 0 and st["held"] == 0 and st["acked"] == 4 and st["resent"] == 0
        assert rx.get(timeout=0.2) is None  # answered, not delivered again
    finally:
        rx.stop()
