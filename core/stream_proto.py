"""Wire protocol of the trajectory stream (actor DEALER <-> learner ROUTER), shared by both ends.

Every message is multipart: [tag (1 byte), body (msgpack map)] and, for TRAJ only, a third frame holding the
Trajectory.encode() bytes untouched (the learner decodes it once to validate, and writes those same bytes to its WAL).
The ROUTER sees an identity frame in front (the actor id, set by the DEALER as its routing id).

actor -> learner
  HELLO  {actor, incarnation, hello_id, pending_ids, inflight}
                                                       (re)introduce: incarnation is a fresh uuid per actor process,
         pending_ids the unacked trajectory ids in the outbox, inflight the admitted episodes not yet sent
  TRAJ   {seq, id, images} + payload + image frames    one trajectory; spends one credit. images names the extra
                                                       frames (sha256 hex of each), screenshots not yet sent on
                                                       this connection (core/stream_images.py)
  ADMIT  {rid, n}                                      ask for n episode starts (staleness manager)
  LOST   {n}                                           give back n admitted episodes that will never be sent
  PING   {}                                            heartbeat; answered by PONG (or WHO from a learner that
                                                       does not know this actor, e.g. after a learner restart)
learner -> actor
  WELCOME {run_id, hello_id, version, credit, max_frame_bytes}
                                                       answer to HELLO; credit is ABSOLUTE (resets the actor's count);
                                                       the actor ignores a WELCOME answering an older HELLO
  CREDIT  {n}                                          n more TRAJ may be sent (queue drained)
  ACK     {ids, held?}                                 without held: these ids are durable (fsynced in the WAL, or
                                                       in a durable checkpoint): forget them. held=run_id
                                                       (durability "checkpoint"): that learner run has them in
                                                       memory and will ack them again once a checkpoint covers
                                                       them; keep them, do not re-send them to that run
  NACK    {id, reason, retry, missing?}                retry=False: the frame is bad, drop it and count it;
                                                       retry=True: the learner had no room, send it again later;
                                                       missing: image hashes to attach again on the re-send
  GRANT   {rid, granted, version}                      answer to ADMIT
  VERSION {v}                                          the policy version changed
  PONG    {run_id}                                     heartbeat answer; a changed run_id means a learner restart
  WHO     {}                                           "say HELLO first"
"""
from __future__ import annotations

import msgpack

HELLO, TRAJ, ADMIT, LOST, PING = b"H", b"T", b"A", b"L", b"P"
WELCOME, CREDIT, ACK, NACK, GRANT, VERSION, PONG, WHO = b"W", b"C", b"K", b"N", b"G", b"V", b"O", b"?"

# Largest control body we will unpack (pending_ids of a 64k window fits easily); bounds msgpack's allocations.
MAX_BODY_BYTES = 8 << 20


def pack(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def unpack(b: bytes) -> dict:
    """A control body; raises ValueError for anything that is not a small msgpack map."""
    if len(b) > MAX_BODY_BYTES:
        raise ValueError(f"control body of {len(b)} bytes")
    try:
        d = msgpack.unpackb(b, raw=False, strict_map_key=False, max_bin_len=MAX_BODY_BYTES,
                            max_str_len=MAX_BODY_BYTES)
    except Exception as e:  # msgpack raises several types for garbage
        raise ValueError(f"body is not msgpack: {type(e).__name__}") from None
    if not isinstance(d, dict):
        raise ValueError(f"body is a {type(d).__name__}, expected a map")
    return d


def curve_server(sock, secret_key: bytes | None) -> None:
    """CURVE hook (server side): with a Z85 secret key the ROUTER only talks to CURVE clients. Needs libzmq+sodium.

    Client authorisation (a ZAP handler with the allowed actor public keys) is the follow-up item; with only this,
    traffic is encrypted and any client that knows the server public key may connect.
    """
    if secret_key:
        sock.curve_secretkey = secret_key
        sock.curve_server = True


def curve_client(sock, server_key: bytes | None, public_key: bytes | None, secret_key: bytes | None) -> None:
    """CURVE hook (client side): all three Z85 keys or none."""
    if server_key:
        if not (public_key and secret_key):
            raise ValueError("curve_server_key needs curve_public_key and curve_secret_key")
        sock.curve_serverkey = server_key
        sock.curve_publickey = public_key
        sock.curve_secretkey = secret_key
