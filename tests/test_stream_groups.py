"""GRPO groups over the real stream and admission: a group belongs to the actor that sends it. Group ids are
predictable (`<actor>-g<seed>`), so before, any peer of the stream could send a member into another actor's group:
it completed the group early (the honest member that came after it was trained as a group of its own) and moved
the honest members' advantages."""
import collections
import io
import threading

import torch

from core.config_learner import GroupConfig
from core.stream import messages as P
from learner.admission import Admission
from learner.algorithms import grouped_advantages
from learner.batch import collate
from learner.staleness import StalenessManager
from tests.test_poison import V, answers, good
from tests.test_stream import raw_actor, receiver, recv_until


def member(tid: str, actor: str, group: str, ret: float):
    t = good(tid, reward=ret)
    t.actor, t.group = actor, group
    return t


def hello(addr: str, name: str):
    d = raw_actor(addr, name.encode())
    d.send_multipart(P.Hello(name, "i", 1).encode())
    recv_until(d, P.WELCOME)
    return d


def send(d, *trs) -> dict:
    for i, t in enumerate(trs):
        d.send_multipart([P.TRAJ, P.pack({"seq": i, "id": t.id}), t.encode()])
    return answers(d, [t.id for t in trs])


def test_a_peer_cannot_join_or_complete_another_actors_group(tmp_path):
    stal = StalenessManager(batch_size=3, eta=100)
    rx = receiver(tmp_path, stal=stal, vocab_size=V, fsync=False)
    addr = rx.start()
    honest, evil = hello(addr, "actor-0"), hello(addr, "evil")
    g = "actor-0-g7"
    try:
        assert send(honest, member("h0", "actor-0", g, 0.0), member("h1", "actor-0", g, 0.0)) == \
            {"h0": ("ack", ""), "h1": ("ack", "")}
        # Its own name on a member of someone else's group: a group of its own, never theirs.
        assert send(evil, member("e0", "evil", g, 1.0)) == {"e0": ("ack", "")}
        # Another actor's name in the trajectory: refused, the stream's identity is the one that counts.
        kind, why = send(evil, member("e1", "actor-0", g, 1.0))["e1"]
        assert kind == "nack" and why.startswith("invalid: ") and "'actor-0'" in why and "'evil'" in why, why
        assert send(honest, member("h2", "actor-0", g, 1.0)) == {"h2": ("ack", "")}
        adm = Admission(rx, stal, max_lag=8, group=GroupConfig(size=3, timeout_s=600.0), episodes=io.StringIO(),
                        counters=collections.Counter())
        batch = adm.collect(3, 0, threading.Event())
        assert [t.id for t in batch] == ["h0", "h1", "h2"]  # released whole, on its own members only
        assert list(adm.pending_groups) == [("evil", g)]
        b = collate(batch)
        adv = grouped_advantages(torch.tensor([t.ret for t in batch]), b.groups)
        assert torch.allclose(adv, torch.tensor([-1 / 3, -1 / 3, 2 / 3]))
        assert rx.stats()["invalid"] == 1
    finally:
        honest.close()
        evil.close()
        rx.stop()


def test_groups_that_never_complete_are_held_in_bounded_memory(tmp_path):
    """A peer sends members of groups that never complete, each of another name: admission took each off the stream's
    bounded queue (which then granted credit for more) and held it in its pending groups until the group timeout, with
    no bound on how many (300 here, and as many as the peer could send in timeout_s). Past `max_pending` held members
    the oldest pending group is released as it is, as if it had timed out."""
    stal = StalenessManager(batch_size=8, eta=1000)
    rx = receiver(tmp_path, stal=stal, vocab_size=V, fsync=False)
    d = hello(rx.start(), "flood")
    try:
        trs = [member(f"f{i}", "flood", f"flood-g{i}", 0.0) for i in range(300)]
        got = {}
        for k in range(0, 300, 50):  # within the credit WELCOME and the re-grants give
            got.update(send(d, *trs[k:k + 50]))
        assert set(got.values()) == {("ack", "")}
        adm = Admission(rx, stal, max_lag=8, group=GroupConfig(size=4, timeout_s=600.0), episodes=io.StringIO(),
                        counters=collections.Counter(), max_pending=64)
        batch = adm.collect(300 - 64, 0, threading.Event())
        assert [t.id for t in batch] == [f"f{i}" for i in range(300 - 64)]  # the oldest, in arrival order
        assert len(adm.pending_groups) == 64 == adm.held() and adm.counters["groups_evicted"] == 300 - 64
    finally:
        d.close()
        rx.stop()
