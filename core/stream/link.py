"""The actor's view of its connection to the learner (core/stream/sender.py): a reconnect after a dropped link.

ZeroMQ reconnects a DEALER by itself, and what was in flight when the link dropped is lost both ways: a TRAJ or an
ACK (the sender re-sends an unacked entry after resend_after_s), but also a CREDIT, a "held" entry's final ACK after
a checkpoint, which nothing re-sends: the actor then waits for credit the learner thinks it has, or keeps acked
entries for good. The learner sees nothing (same identity), so the actor re-introduces itself after a reconnect.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message


class LinkWatch:
    """Calls on_reconnect() from the event loop each time `sock` completes a handshake after its link dropped (not at
    the first one)."""

    def __init__(self, sock: zmq.Socket, loop: asyncio.AbstractEventLoop, on_reconnect: Callable[[], None]):
        """Before sock.connect(), so that no event is missed."""
        self._sock, self._loop, self._on_reconnect = sock, loop, on_reconnect
        self._mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._dropped = False  # the link went down since its last handshake
        loop.add_reader(self._mon.FD, self._events)
        self._events()  # a pipe never read signals nothing: read it once, then each event wakes the reader

    def _events(self) -> None:
        while not self._mon.closed and self._mon.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # edge-triggered: drain it
            if recv_monitor_message(self._mon, zmq.NOBLOCK)["event"] == zmq.EVENT_DISCONNECTED:
                self._dropped = True
            elif self._dropped:
                self._dropped = False
                self._on_reconnect()

    def close(self) -> None:
        """Before the watched socket is closed."""
        if not self._mon.closed:
            self._loop.remove_reader(self._mon.FD)
            self._sock.disable_monitor()
            self._mon.close(0)
