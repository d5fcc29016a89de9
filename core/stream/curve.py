"""CURVE encryption hooks for the trajectory stream's sockets (both need libzmq built with libsodium)."""
from __future__ import annotations


def curve_server(sock, secret_key: bytes | None) -> None:
    """Server side: with a Z85 secret key the ROUTER only talks to CURVE clients.

    Client authorisation (a ZAP handler with the allowed actor public keys) is the follow-up item; with only this,
    traffic is encrypted and any client that knows the server public key may connect.
    """
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
