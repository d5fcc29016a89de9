"""Hostile input on the trajectory stream (core/stream/): garbage, truncated, wrong-schema and huge frames from a
raw ZMQ peer, and raw bytes on the TCP port. The receiver must count every bad frame, never queue one, keep its io
thread alive, and still deliver a real actor's trajectories exactly once afterwards.
TARS_FUZZ_EXAMPLES sets the number of frames (default 300; 10000 for the full run).
"""
import asyncio
import os
import socket

import msgpack
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from core.stream import messages as P
from core.stream.sender import TrajectorySender
from test_stream import Consumer, receiver, traj, wait_until

N = int(os.environ.get("TARS_FUZZ_EXAMPLES", "300"))

_body = st.one_of(
    st.binary(max_size=256),
    st.dictionaries(st.text(max_size=8), st.one_of(st.integers(-2**63, 2**64 - 1), st.text(max_size=16), st.none(),
                                                   st.lists(st.integers(-2**63, 2**63 - 1), max_size=4), st.binary(max_size=16)),
                    max_size=5).map(lambda d: msgpack.packb(d, use_bin_type=True)),
    st.sampled_from([msgpack.packb({"id": "x"}), msgpack.packb([1, 2]), msgpack.packb("str"), b"\x80",
                     msgpack.packb({"n": -5}), msgpack.packb({"n": 2**63}), msgpack.packb({"ids": "notalist"})]),
)
_tag = st.one_of(st.sampled_from([P.HELLO, P.TRAJ, P.ADMIT, P.LOST, P.PING, b"", b"ZZ", b"\x00"]), st.binary(max_size=3))


def _payload(data) -> bytes:
    good = traj(f"fz-{data.draw(st.integers(0, 10**9))}").encode()
    kind = data.draw(st.sampled_from(["garbage", "truncated", "flipped", "schema", "none"]))
    if kind == "garbage":
        return data.draw(st.binary(max_size=512))
    if kind == "truncated":
        return good[: data.draw(st.integers(0, len(good) - 1))]
    if kind == "flipped":
        b = bytearray(good)
        i = data.draw(st.integers(0, len(b) - 1))
        b[i] ^= data.draw(st.integers(1, 255))
        return bytes(b)
    if kind == "schema":  # a well-formed msgpack map of the wrong shape
        return msgpack.packb(data.draw(st.dictionaries(st.text(max_size=6), st.integers(-2**63, 2**63 - 1), max_size=4)))
    return good


def test_receiver_survives_hostile_frames(tmp_path):
    rx = receiver(tmp_path, max_frame_bytes=1 << 20)
    addr = rx.start()
    ctx = zmq.Context()
    peers = []
    try:
        def peer(hello: bool):
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            s.routing_id = f"fuzz-{len(peers)}".encode()
            s.connect(addr)
            if hello:
                s.send_multipart([P.HELLO, P.pack({"actor": "fz", "incarnation": "i", "hello_id": 1})])
            peers.append(s)
            return s

        introduced, stranger = peer(True), peer(False)

        @settings(max_examples=N, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def one(data):
            s = introduced if data.draw(st.booleans()) else stranger
            frames = [data.draw(_tag), data.draw(_body)]
            if data.draw(st.booleans()):
                frames[0], frames[1] = P.TRAJ, P.pack({"seq": 1, "id": data.draw(st.text(max_size=12))})
                frames.append(_payload(data))
            frames += [data.draw(st.binary(max_size=32))] * data.draw(st.integers(0, 2))
            s.send_multipart(frames)

        one()
        # huge: over max_frame_bytes (NACKed oversize) and over the socket's hard cap (connection dropped)
        introduced.send_multipart([P.TRAJ, P.pack({"seq": 2, "id": "huge"}), b"\0" * (2 << 20)])
        peer(True).send_multipart([P.TRAJ, P.pack({"seq": 3, "id": "huger"}), b"\0" * (8 << 20)])
        # raw bytes on the TCP port: not even ZMTP
        host, port = addr.replace("tcp://", "").rsplit(":", 1)
        for junk in (b"\xff" * 64, b"GET / HTTP/1.1\r\n\r\n", os.urandom(4096)):
            with socket.create_connection((host, int(port)), timeout=5) as c:
                c.sendall(junk)
        assert wait_until(lambda: rx.stats()["received"] + rx.stats()["protocol_errors"] > 0, 10)
        assert rx._thread.is_alive()
        st_ = rx.stats()
        assert st_["oversize"] >= 1 or st_["malformed"] >= 1
        # Only well-formed trajectories can have been queued; everything queued decodes and has its header id.
        bad = st_["malformed"] + st_["unknown_schema"] + st_["oversize"] + st_["protocol_errors"]
        assert bad > 0

        # A real actor still gets through, exactly once.
        con = Consumer(rx)
        con.start()

        async def real():
            tx = TrajectorySender(addr, "real-actor", heartbeat_s=0.05, dead_after_s=1.0)
            await tx.start(timeout=10)
            for i in range(20):
                await tx.send(traj(f"real-{i}"), timeout=10)
            await tx.flush(timeout=10)
            await tx.close()

        asyncio.run(real())
        assert wait_until(lambda: sum(1 for t in con.ids if t.startswith("real-")) == 20, 10)
        con.halt.set()
        con.join(5)
        real_ids = [t for t in con.ids if t.startswith("real-")]
        assert sorted(real_ids) == sorted(f"real-{i}" for i in range(20))
        assert rx._thread.is_alive()
        print(f"\nstream fuzz: {N} frames, stats {dict((k, v) for k, v in rx.stats().items() if v)}")
    finally:
        for s in peers:
            s.close(0)
        ctx.term()
        rx.stop()


def test_action_parser_on_adversarial_model_output():
    """Random and adversarial model output: parse_response returns actions or raises ParseError, nothing else."""
    from actor.parsing import ParseError, parse_response

    pieces = st.sampled_from(["Action:", "Thought:", "click(", "start_box='", "<|box_start|>", "(", ")", ",", "'", '"',
                              "\\", "drag(start_box='(1,2)', end_box='(3,4)')", "<point>", "</point>", "9" * 400,
                              "type(content='", "\n", "Action_Summary:", "scroll(direction='up')", "\x00", "：", "=" * 50])
    text = st.one_of(st.text(max_size=400), st.lists(pieces, max_size=60).map("".join),
                     st.lists(pieces, max_size=8).map(lambda p: "".join(p) * 200))
    seen = {"parsed": 0, "ParseError": 0}

    @settings(max_examples=N, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(text)
    def one(t):
        try:
            _, actions = parse_response(t)
            assert actions and all(a.to_dict()["type"] for a in actions)
            seen["parsed"] += 1
        except ParseError:
            seen["ParseError"] += 1

    one()
    print(f"\nparser fuzz: {seen}")
