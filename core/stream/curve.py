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

log = logging.getLogger(__name__)


def curve_server(sock, secret_key: bytes | None) -> None:
    """Server side: with a Z85 secret key the ROUTER only talks to CURVE clients (which ones: start_allowlist)."""
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
    authenticator's thread only)."""

    def __init__(self, keys):
        self.keys = frozenset(k.encode() if isinstance(k, str) else bytes(k) for k in keys)
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:  # key: the client's public key, Z85
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

    def __init__(self, ctx, keys):
        from zmq.auth.thread import ThreadAuthenticator

        self.allow = Allowlist(keys)
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
