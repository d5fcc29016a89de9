"""StalenessManager: AReaL's admission rule, accounting, thread safety, live eta, and the lag histogram."""
import random
import threading

import numpy as np
import pytest

from learner.staleness import StalenessManager


def test_capacity_formula_and_version_bump():
    s = StalenessManager(batch_size=4, eta=1)
    assert s.capacity() == 8                       # (eta + version + 1) * B
    assert s.try_admit(10) == 8
    assert s.capacity() == 0 and s.try_admit(1) == 0
    s.on_accepted(4)                               # moving running -> accepted frees nothing
    assert s.capacity() == 0
    s.set_version(1)
    assert s.capacity() == 4
    s.on_rejected(2)                               # rejected episodes give their budget back
    assert s.capacity() == 6
    s.on_lost(2)
    st = s.stats()
    assert (st["running"], st["accepted"], st["rejected"], st["lost"], st["capacity"]) == (0, 4, 2, 2, 8)


def test_max_concurrent_caps_running():
    s = StalenessManager(batch_size=100, eta=2, max_concurrent=5)
    assert s.try_admit(10) == 5
    s.on_accepted(3)
    assert s.capacity() == 3
    assert s.try_admit(10) == 3


def test_eta_zero_is_synchronous():
    B = 8
    s = StalenessManager(batch_size=B, eta=0)
    for v in range(5):
        s.set_version(v)
        got = sum(s.try_admit(3) for _ in range(10))
        assert got == B                            # exactly one batch per version, never more
        s.on_accepted(B)                           # the batch trains -> next version
    assert s.stats()["accepted"] == 5 * B


def test_live_eta_change():
    s = StalenessManager(batch_size=4, eta=0)
    assert s.try_admit(100) == 4
    s.set_eta(2)
    assert s.capacity() == 8 and s.try_admit(100) == 8
    s.set_eta(0)                                   # lowering stops admissions; running episodes stay
    assert s.capacity() == 0 and s.stats()["running"] == 12
    s.on_accepted(12)
    s.set_version(3)
    assert s.capacity() == 4
    with pytest.raises(ValueError):
        s.set_eta(-1)


def test_double_finish_is_an_error():
    s = StalenessManager(batch_size=2, eta=0)
    s.try_admit(1)
    s.on_accepted(1)
    with pytest.raises(ValueError):
        s.on_accepted(1)
    with pytest.raises(ValueError):
        s.on_lost(1)
    s.adopt(2)                                     # a restarted learner adopts episodes admitted before
    s.on_rejected(2)
    assert s.stats()["running"] == 0


def test_state_dict_round_trip():
    s = StalenessManager(batch_size=4, eta=1)
    s.try_admit(4)
    s.on_accepted(3)
    s.on_rejected(1)
    s.set_version(2)
    t = StalenessManager(batch_size=4, eta=1)
    t.load_state_dict(s.state_dict())
    assert t.stats()["accepted"] == 3 and t.version == 2 and t.stats()["running"] == 0
    assert t.capacity() == (1 + 2 + 1) * 4 - 3


def test_thread_safety_invariants_hold():
    B, eta, maxc = 16, 1, 24
    s = StalenessManager(batch_size=B, eta=eta, max_concurrent=maxc)
    stop = threading.Event()
    violations = []
    bump = threading.Lock()

    def monitor():
        while not stop.is_set():
            st = s.stats()  # one atomic snapshot under the manager's lock
            if not (0 <= st["running"] <= maxc and st["accepted"] + st["running"] <= (eta + st["version"] + 1) * B):
                violations.append(st)

    def worker(seed):
        rng = random.Random(seed)
        for _ in range(400):
            g = s.try_admit(rng.randint(1, 3))
            for _ in range(g):
                r = rng.random()
                (s.on_accepted if r < 0.7 else s.on_rejected if r < 0.9 else s.on_lost)(1)
            with bump:  # the "learner": one update per B accepted
                st = s.stats()
                if st["accepted"] >= (st["version"] + 1) * B:
                    s.set_version(st["version"] + 1)

    mon = threading.Thread(target=monitor)
    mon.start()
    ws = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for w in ws:
        w.start()
    for w in ws:
        w.join(30)
    stop.set()
    mon.join(5)
    st = s.stats()
    assert not violations, violations[:3]
    assert st["running"] == 0
    assert st["admitted"] == st["accepted"] + st["rejected"] + st["lost"]
    assert st["version"] > 10


def test_staleness_histogram():
    s = StalenessManager(batch_size=4, eta=1, max_lag=3)
    s.record_staleness(np.array([-1, 5, 5, 4, 0], np.int32), train_version=5)   # lags 0, 0, 1, 5 (-1 = not generated)
    s.record_staleness(np.array([3, 6]), train_version=5)                      # lags 2, -1
    h = s.histogram()
    assert h["bins"] == [2, 1, 1, 0] and h["overflow"] == 1 and h["negative"] == 1
    assert h["tokens"] == 6 and h["max"] == 5 and h["mean"] == pytest.approx((0 + 0 + 1 + 5 + 2) / 5)
    s.record_staleness(np.array([], np.int32), train_version=1)                # no-op
    assert s.histogram()["tokens"] == 6


# ---- admission: whole GRPO groups, sized and timed by learner.group ------------------------------------------------
class _Arrivals:
    """A receiver stand-in: hands out the given trajectories, then nothing (get returns None at once)."""

    def __init__(self, trs):
        self.trs, self.consumed = list(trs), []

    def get(self, timeout):
        return self.trs.pop(0) if self.trs else None

    def mark_consumed(self, ids):
        self.consumed += list(ids)


def _admission(trs, size, timeout_s):
    import collections
    import io

    from core.config import GroupConfig
    from learner.admission import Admission

    stal = StalenessManager(batch_size=8, eta=100)
    stal.try_admit(len(trs))
    return Admission(_Arrivals(trs), stal, max_lag=8, group=GroupConfig(size=size, timeout_s=timeout_s),
                     episodes=io.StringIO(), counters=collections.Counter())


def test_admission_releases_whole_groups_of_the_configured_size():
    from learner.dist_check import batch

    trs = batch(0, n=12)  # groups g0, g1, g2 of 4
    order = [trs[i] for i in (0, 4, 1, 5, 2, 6, 3, 8, 7, 9, 10, 11)]  # g0 completes first, then g1, then g2
    adm = _admission(order, size=4, timeout_s=3600.0)
    got = adm.collect(4, version=0, stop=threading.Event())
    assert [t.group for t in got] == ["g0"] * 4
    got = adm.collect(4, version=0, stop=threading.Event())
    assert [t.group for t in got] == ["g1"] * 4 and set(adm.pending_groups) == {("", "g2")}


def test_admission_releases_an_incomplete_group_after_the_configured_timeout():
    from learner.dist_check import batch

    trs = batch(0, n=12)[:1]  # one of g0's four members ever arrives
    adm = _admission(trs, size=4, timeout_s=0.0)
    got = adm.collect(1, version=0, stop=threading.Event())
    assert [t.id for t in got] == [trs[0].id] and adm.counters["groups_timed_out"] == 1 and not adm.pending_groups
    stop = threading.Event()
    stop.set()
    assert _admission([], size=4, timeout_s=0.0).collect(1, version=0, stop=stop) is None


def test_a_long_update_does_not_time_out_a_group_whose_members_wait_in_the_queue(monkeypatch):
    """The group timeout counts the time spent collecting, not an update: members that arrived while the learner
    trained (queued in the receiver) still join their group, which is released whole."""
    import types

    import learner.admission as admission
    from learner.dist_check import batch

    clock = types.SimpleNamespace(now=0.0, time=lambda: 0.0)

    def monotonic():  # a second per reading: a group left incomplete times out after a bounded number of polls
        clock.now += 1.0
        return clock.now

    clock.monotonic = monotonic
    monkeypatch.setattr(admission, "time", clock)
    trs = batch(0, n=12)  # groups g0, g1, g2 of 4
    adm = _admission([trs[0], *trs[4:8]], size=4, timeout_s=120.0)  # g0's first member, then all of g1
    adm.staleness.try_admit(3)  # g0's other members, admitted too
    got = adm.collect(4, version=0, stop=threading.Event())
    assert [t.group for t in got] == ["g1"] * 4 and set(adm.pending_groups) == {("", "g0")}
    clock.now += 600.0  # an update 5x the group timeout, while g0's other members arrive and wait in the queue
    adm.receiver.trs += trs[1:4]
    got = adm.collect(4, version=1, stop=threading.Event())
    assert [t.id for t in got] == [t.id for t in trs[:4]] and adm.counters["groups_timed_out"] == 0

    # A checkpoint taken while collecting (on_idle) is time away too.
    adm.receiver.trs += [trs[8]]  # g2's first member; the rest arrive during the checkpoint
    adm.staleness.try_admit(4)

    late = [trs[9:12]]

    def checkpoint():  # the first idle poll: a checkpoint 5x the group timeout, g2's other members queued meanwhile
        if late:
            clock.now += 600.0
            adm.receiver.trs += late.pop()

    got = adm.collect(4, version=2, stop=threading.Event(), on_idle=checkpoint)
    assert [t.id for t in got] == [t.id for t in trs[8:12]] and adm.counters["groups_timed_out"] == 0


def test_a_group_member_that_ages_past_max_lag_while_its_group_waits_is_dropped():
    """max_lag bounds the lag a token is trained at. A GRPO member is checked on arrival, but then waits for the rest
    of its group, over updates (its clock stops while the learner trains): released at a later version it must be
    checked again, not trained past the bound (it was: lag 3 with max_lag 1, counted nowhere)."""
    import collections
    import io

    from core.config import GroupConfig
    from learner.admission import Admission
    from learner.dist_check import batch

    trs = batch(0, n=12)  # groups g0, g1, g2 of 4, every generated token of version 0
    stal = StalenessManager(batch_size=4, eta=100)
    stal.try_admit(12)
    adm = Admission(_Arrivals([trs[0], *trs[4:8]]), stal, max_lag=1, group=GroupConfig(size=4, timeout_s=3600.0),
                    episodes=io.StringIO(), counters=collections.Counter())
    assert [t.group for t in adm.collect(4, version=0, stop=threading.Event())] == ["g1"] * 4  # g0's first waits
    adm.receiver.trs += trs[8:12]
    assert [t.group for t in adm.collect(4, version=1, stop=threading.Event())] == ["g2"] * 4
    for t in trs[1:4]:  # g0's other members, generated by the weights of version 3
        t.versions = np.where(t.mask > 0, 3, -1).astype(np.int32)
    adm.receiver.trs += trs[1:4]
    got = adm.collect(3, version=3, stop=threading.Event())
    assert [t.id for t in got] == [t.id for t in trs[1:4]]  # trs[0], lag 3 > 1 at version 3, is out
    assert adm.counters["too_stale"] == 1 and adm.take_masked() == [trs[0].id] and adm.held() == 0
    st = stal.stats()
    assert (st["accepted"], st["rejected"], st["running"]) == (11, 1, 0)
