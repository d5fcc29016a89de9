"""CURVE encryption and client authentication for the trajectory stream's sockets (libzmq built with libsodium).

The server (the learner's ROUTER) talks CURVE when it has a secret key. With an allowlist of client public keys
(learner.stream.curve_client_keys) it also runs a ZAP handler, pyzmq's zmq.auth.thread.ThreadAuthenticator, in the
socket's context: libzmq asks it about every CURVE handshake, and a client whose public key is not listed is refused
before the handshake completes, so nothing it sends reaches the receiver. Without an allowlist no ZAP handler is
bound and libzmq accepts any client that completes the handshake (that knows the server's public key): encryption
only.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

log = logging.getLogger(__name__)


def _keyset(keys) -> frozenset[bytes]:
    return frozenset(k.encode() if isinstance(k, str) else bytes(k) for k in keys)


def curve_server(sock, secret_key: bytes | None) -> None:
    """Server side: with a Z85 secret key the ROUTER only talks to CURVE clients (which of them: Zap)."""
    if secret_key:
        sock.curve_secretkey = secret_key
        sock.curve_server = True


def curve_client(sock, server_key: bytes | None, public_key: bytes | None, secret_key: bytes | None) -> None:
    """Client side: all three Z85 keys or none."""
    if server_key:
        if not (public_key and secret_key):
            raise ValueError("curve_server_key needs curve_public_key and curve_secret_key")
        sock.curve_serverkey = server_key
        sock.curve_publickey = public_key
        sock.curve_secretkey = secret_key


class Allowlist:
    """The ZAP credentials provider: a client key is allowed iff listed. `refused` counts the others (written by the
    authenticator's thread only).

    reload: where the list came from (learner.stream.curve_client_keys_file: a file, or a Kubernetes Secret volume
    that the kubelet updates in place), re-read at most every `every_s` seconds while handshakes come, so an actor
    key added to (or taken out of) it takes effect without restarting the learner. A list that cannot be read or
    holds a malformed key is logged and the last good one kept. Only new handshakes are judged: a connection
    authenticated before a key was taken out stays up until it reconnects."""

    def __init__(self, keys, reload: Callable[[], list[str]] | None = None, every_s: float = 2.0):
        self.keys = _keyset(keys)
        self.refused, self.reloads = 0, 0
        self._reload, self.every_s, self._checked = reload, every_s, time.monotonic()

    def _refresh(self) -> None:
        now = time.monotonic()
        if self._reload is None or now - self._checked < self.every_s:
            return
        self._checked = now
        try:
            keys = _keyset(self._reload())
        except (OSError, ValueError) as e:  # SecretFileError: unreadable, empty, a malformed key
            log.warning("trajectory stream: keeping the %d allowed client keys: %s", len(self.keys), e)
            return
        if keys != self.keys:
            log.info("trajectory stream: allowed client keys reloaded (%d, were %d)", len(keys), len(self.keys))
            self.keys = keys
            self.reloads += 1

    def callback(self, domain: str, key: bytes) -> bool:  # key: the client's public key, Z85
        self._refresh()
        if key in self.keys:
            return True
        self.refused += 1
        if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
            log.warning("trajectory stream: refused a CURVE client whose public key %s is not in "
                        "learner.stream.curve_client_keys (%d refused so far)", key.decode("ascii", "replace"),
                        self.refused)
        return False


class Zap:
    """A ZAP handler bound in `ctx` that allows only these client public keys (Z85). Start it before the server
    socket binds; stop() it after the socket is closed, before ctx.term() (its thread then ends at once)."""

    def __init__(self, ctx, keys, reload: Callable[[], list[str]] | None = None):
        from zmq.auth.thread import ThreadAuthenticator

        self.allow = Allowlist(keys, reload)
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("tars.stream.zap"))
        self.auth.configure_curve_callback(domain="*", credentials_provider=self.allow)  # "*": any ZAP domain
        self.auth.start()

    def stop(self) -> None:
        self.auth.stop()


def close_server(sock, ctx, zap: Zap | None) -> None:
    """Close the server socket, then its ZAP handler (whose refused count stays readable), then the context."""
    sock.close(0)
    if zap is not None:
        zap.stop()
    ctx.term()
