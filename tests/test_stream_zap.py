"""ZAP client authentication on the trajectory stream: with learner.stream.curve_client_keys only the listed actor
keys get past the CURVE handshake (core/stream/curve.py); the settings, `tars up`'s keys and the bind rule."""
from __future__ import annotations

import asyncio
import threading

import pytest
import zmq

from core import auth
from core import config as C
from test_stream import Consumer, receiver, traj, wait_until

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE (libsodium)")


def _zap_threads() -> list[threading.Thread]:
    from zmq.auth.thread import AuthenticationThread

    return [t for t in threading.enumerate() if isinstance(t, AuthenticationThread)]


async def _attempt(addr, tag, start_timeout, **keys) -> bool:
    from core.stream.sender import TrajectorySender

    tx = TrajectorySender(addr, f"actor-{tag}", heartbeat_s=0.05, dead_after_s=1.0, **keys)
    try:
        await tx.start(timeout=start_timeout)
        await tx.send(traj(f"t-{tag}"), timeout=10.0)
        await tx.flush(timeout=10.0)  # returns once the learner acked it
        return True
    except TimeoutError:
        return False
    finally:
        await tx.close()


def test_only_allowlisted_client_keys_get_through(tmp_path):
    server_pub, server_sec = zmq.curve_keypair()
    good_pub, good_sec = zmq.curve_keypair()
    other_pub, other_sec = zmq.curve_keypair()  # knows the server key, but is not on the allowlist
    before = len(_zap_threads())
    rx = receiver(tmp_path, curve_secret_key=server_sec, curve_client_keys=[good_pub.decode()])
    addr = rx.start()
    con = Consumer(rx)
    con.start()
    try:
        assert len(_zap_threads()) == before + 1
        assert not asyncio.run(_attempt(addr, "other", 2.0, curve_server_key=server_pub, curve_public_key=other_pub,
                                        curve_secret_key=other_sec))
        assert wait_until(lambda: rx.stats()["clients_refused"] >= 1, 10)
        st = rx.stats()  # nothing of the refused client reached the receiver
        assert (st["hellos"], st["received"], st["acked"], st["actors"]) == (0, 0, 0, 0), st
        assert asyncio.run(_attempt(addr, "good", 20.0, curve_server_key=server_pub, curve_public_key=good_pub,
                                    curve_secret_key=good_sec))
        assert wait_until(lambda: "t-good" in con.ids, 10)
        assert set(rx._actors) == {b"actor-good"} and con.ids == ["t-good"]
        assert rx.stats()["acked"] == 1
    finally:
        con.halt.set()
        con.join(5)
        rx.stop()
    # the authenticator's thread stops with the receiver (and the context terminated: every socket closed)
    assert not rx._thread.is_alive() and rx._zap.auth.thread is None and len(_zap_threads()) == before
    assert rx._zap.auth.zap_socket is None and rx.stats()["clients_refused"] >= 1


def test_no_allowlist_is_encryption_only(tmp_path):
    """Without curve_client_keys no ZAP handler runs: any client that knows the server key connects (as before)."""
    server_pub, server_sec = zmq.curve_keypair()
    pub, sec = zmq.curve_keypair()
    before = len(_zap_threads())
    rx = receiver(tmp_path, curve_secret_key=server_sec)
    addr = rx.start()
    try:
        assert len(_zap_threads()) == before and rx._zap is None
        assert asyncio.run(_attempt(addr, "any", 20.0, curve_server_key=server_pub, curve_public_key=pub,
                                    curve_secret_key=sec))
    finally:
        rx.stop()


def test_an_allowlist_needs_curve(tmp_path):
    with pytest.raises(ValueError, match="curve_client_keys needs curve_secret_key"):
        receiver(tmp_path, curve_client_keys=[zmq.curve_keypair()[0].decode()])


def test_key_settings_are_checked_and_read_from_files(tmp_path):
    keys = [zmq.curve_keypair() for _ in range(3)]
    pubs = [p.decode() for p, _ in keys]
    a_pub, a_sec = (k.decode() for k in keys[0])
    bad = {("learner.stream.curve_client_keys=" + pubs[0] + "," + pubs[1][:-1],):
               "learner.stream.curve_client_keys (key 2 of 2): not a CURVE key",
           ("actor.stream_curve_public_key=" + a_pub,): "actor.stream_curve_public_key and actor.stream_curve_secret_key: set both",
           ("actor.stream_curve_secret_key=notakey",): "actor.stream_curve_secret_key: not a CURVE key",
           ("actor.stream_curve_public_key=" + pubs[1], "actor.stream_curve_secret_key=" + a_sec):
               "actor.stream_curve_public_key is not the public key of actor.stream_curve_secret_key"}
    for sets, want in bad.items():
        with pytest.raises(C.ConfigError) as e:
            C.load(None, None, list(sets))
        assert str(e.value).startswith(want) and "\n" not in str(e.value), str(e.value)
    cfg = C.load(None, None, [f"learner.stream.curve_client_keys={pubs[0]} {pubs[1]}",
                              f"actor.stream_curve_public_key={a_pub}", f"actor.stream_curve_secret_key={a_sec}"])
    assert auth.client_keys(cfg.learner.stream.curve_client_keys) == pubs[:2]
    # a file of keys (lines, commas, spaces), or a directory of key files (a Kubernetes Secret volume)
    (tmp_path / "list").write_text(f"{pubs[0]}\n{pubs[1]}, {pubs[2]}\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "..data").mkdir()  # the volume's own entries are skipped
    for i, p in enumerate(pubs):
        (tmp_path / "dir" / f"actor-{i}").write_text(p + "\n")
    for where in ("list", "dir"):
        cfg = C.load(None, None, [f"learner.stream.curve_client_keys_file={tmp_path / where}"])
        assert auth.client_keys(cfg.learner.stream.curve_client_keys) == pubs, where
    (tmp_path / "badlist").write_text(pubs[0] + "\nnot-a-key\n")
    with pytest.raises(C.ConfigError, match=r"learner.stream.curve_client_keys \(key 2 of 2\): not a CURVE key"):
        C.load(None, None, [f"learner.stream.curve_client_keys_file={tmp_path / 'badlist'}"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(C.ConfigError, match="learner.stream.curve_client_keys_file: .* empty directory"):
        C.load(None, None, [f"learner.stream.curve_client_keys_file={tmp_path / 'empty'}"])


def test_an_open_stream_needs_an_allowlist_or_the_opt_out():
    from learner.main import check_bind

    pub, sec = (k.decode() for k in zmq.curve_keypair())
    client = zmq.curve_keypair()[0].decode()
    base = ["learner.stream.host=0.0.0.0", f"learner.stream.curve_secret_key={sec}"]
    with pytest.raises(auth.InsecureBind, match="learner.stream.curve_client_keys"):
        check_bind(C.load(None, None, base))
    check_bind(C.load(None, None, [*base, f"learner.stream.curve_client_keys={client}"]))
    check_bind(C.load(None, None, [*base, "learner.stream.curve_allow_any_client=true"]))
    with pytest.raises(C.ConfigError, match="curve_client_keys is set but learner.stream.curve_secret_key is not"):
        check_bind(C.load(None, None, [f"learner.stream.curve_client_keys={client}"]))


def test_a_run_gets_an_actor_keypair_on_its_learners_allowlist(tmp_path):
    from actor.main import _curve_keys
    from tars import tokens

    cfg = C.load(None, None, [])
    made = tokens.issue(cfg, tmp_path / "config.yaml", learner=True)
    s, a = cfg.learner.stream, cfg.actor
    assert made["learner.stream.curve"] and made["learner.stream.curve_client_keys"]
    assert s.curve_client_keys == a.stream_curve_public_key != s.curve_public_key
    assert zmq.curve_public(a.stream_curve_secret_key.encode()).decode() == a.stream_curve_public_key
    again = C.load(None, str(tmp_path / "config.yaml"), [])  # what the roles read
    assert (again.learner.stream.curve_client_keys, again.actor.stream_curve_secret_key) == (
        s.curve_client_keys, a.stream_curve_secret_key)
    keys = _curve_keys(s.curve_public_key, a)  # the actor talks CURVE with that keypair
    assert keys["curve_public_key"].decode() == a.stream_curve_public_key
    # an allowlist the user set is kept (and no keypair made); a run without a learner gets none
    mine = zmq.curve_keypair()[0].decode()
    cfg = C.load(None, None, [f"learner.stream.curve_client_keys={mine}"])
    assert not tokens.issue(cfg, tmp_path / "c2.yaml", learner=True)["learner.stream.curve_client_keys"]
    assert cfg.learner.stream.curve_client_keys == mine and not cfg.actor.stream_curve_secret_key
    cfg = C.load(None, None, [])
    assert not tokens.issue(cfg, tmp_path / "c3.yaml")["learner.stream.curve_client_keys"]


def test_a_changed_key_file_is_reloaded_without_a_restart(tmp_path, caplog):
    """curve_client_keys_file re-read while the learner runs (a Secret volume the kubelet updates): an actor key added
    gets in, one taken out no longer does, and a broken file keeps the last good list."""
    server_pub, server_sec = zmq.curve_keypair()
    a_pub, a_sec = zmq.curve_keypair()
    b_pub, b_sec = zmq.curve_keypair()
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "a").write_text(a_pub.decode())
    path, setting = str(keys), "learner.stream.curve_client_keys_file"
    rx = receiver(tmp_path, curve_secret_key=server_sec, curve_client_keys=auth.load_key_list(path, setting),
                  keys_reload=lambda: auth.load_key_list(path, setting))
    addr = rx.start()
    rx._zap.allow.every_s = 0.0  # re-read at every handshake (the learner's: at most every 2 s)
    con = Consumer(rx)
    con.start()
    b = dict(curve_server_key=server_pub, curve_public_key=b_pub, curve_secret_key=b_sec)
    try:
        assert not asyncio.run(_attempt(addr, "b1", 2.0, **b))
        assert rx.stats()["clients_refused"] >= 1
        (keys / "b").write_text(b_pub.decode())  # an actor added
        assert asyncio.run(_attempt(addr, "b2", 20.0, **b))
        assert wait_until(lambda: "t-b2" in con.ids, 10) and rx._zap.allow.reloads == 1
        (keys / "a").write_text("x" * 39)  # a broken update: the last good list stays
        with caplog.at_level("WARNING", logger="core.stream.curve"):
            assert asyncio.run(_attempt(addr, "b3", 20.0, **b))
        assert "keeping the 2 allowed client keys" in caplog.text and "key 1 of 2" in caplog.text
        (keys / "a").write_text(a_pub.decode())
        (keys / "b").unlink()  # an actor taken out
        assert not asyncio.run(_attempt(addr, "b4", 2.0, **b))
        assert rx._zap.allow.reloads == 2 and "t-b4" not in con.ids
        assert asyncio.run(_attempt(addr, "a", 20.0, curve_server_key=server_pub, curve_public_key=a_pub,
                                    curve_secret_key=a_sec))
    finally:
        con.halt.set()
        con.join(5)
        rx.stop()


def test_the_allowlist_rereads_its_source_at_most_every_every_s():
    from core.stream.curve import Allowlist

    a_pub, b_pub = zmq.curve_keypair()[0], zmq.curve_keypair()[0]
    calls = []

    def reload():
        calls.append(1)
        return [a_pub.decode(), b_pub.decode()]
    allow = Allowlist([a_pub.decode()], reload, every_s=3600.0)
    assert not allow.callback("*", b_pub) and not allow.callback("*", b_pub) and calls == []  # not yet due
    allow.every_s = 0.0
    assert allow.callback("*", b_pub) and allow.callback("*", a_pub) and len(calls) == 2 and allow.reloads == 1
