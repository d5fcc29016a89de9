"""The intervals of tars/evalstats.py against closed forms and numpy, and what they promise: a 95% interval of the
difference between two policies of the same success rate holds 0 in about 95% of evaluations."""
from __future__ import annotations

import random

import numpy as np
import pytest

from tars import evalstats


def test_wilson_against_its_closed_form():
    z = 1.959964
    assert evalstats.wilson(0, 50) == pytest.approx((0.0, z * z / (50 + z * z)))      # the upper end at 0 successes
    lo, hi = evalstats.wilson(25, 50)
    half = z * np.sqrt(0.25 / 50 + z * z / (4 * 2500)) / (1 + z * z / 50)
    assert (lo, hi) == pytest.approx((0.5 - half, 0.5 + half))
    assert evalstats.wilson(50, 50)[1] == pytest.approx(1.0) and evalstats.wilson(0, 0) is None


def _records(successes: dict[str, list[int]], seed_of=lambda t, i: 1000 + i, outcome="terminated"):
    return {(t, i): {"task": t, "episode": i, "success": bool(s), "seed": seed_of(t, i), "outcome": outcome}
            for t, ss in successes.items() for i, s in enumerate(ss)}


def test_paired_difference_against_numpy():
    rng = np.random.default_rng(3)
    a = {t: rng.integers(0, 2, 50).tolist() for t in "xyz"}
    b = {t: rng.integers(0, 2, 50).tolist() for t in "xyz"}
    got = evalstats.paired(_records(a), _records(b))
    var = 0.0
    for t in "xyz":
        d = np.array(b[t], float) - np.array(a[t], float)
        se = d.std(ddof=1) / np.sqrt(len(d))
        assert got["tasks"][t]["delta"] == pytest.approx(d.mean()) and got["tasks"][t]["se"] == pytest.approx(se)
        var += se ** 2
    means = [np.mean(np.array(b[t]) - np.array(a[t])) for t in "xyz"]
    assert got["delta"] == pytest.approx(np.mean(means)) and got["se"] == pytest.approx(np.sqrt(var) / 3)
    lo, hi = got["ci95"]
    assert lo == pytest.approx(got["delta"] - 1.959964 * got["se"]) and hi == pytest.approx(got["delta"] + 1.959964 * got["se"])


def test_only_pairs_both_scored_on_one_seed_count():
    a = _records({"t": [1, 0, 1, 1]})
    b = _records({"t": [1, 1, 0, 1]})
    b[("t", 1)]["outcome"] = "infra_error"          # not scored on one side
    b[("t", 2)]["seed"] = 7                         # another seed: not the same episode
    got = evalstats.paired(a, b)
    assert got["tasks"]["t"]["pairs"] == 2 and got["delta"] == 0.0
    assert evalstats.paired(a, {})["tasks"] == {} and "ci95" not in evalstats.paired(a, {})
    one = evalstats.paired(_records({"t": [0, 0, 0]}), _records({"t": [1, 1, 1]}))
    assert one["ci95"] == (1.0, 1.0)                # within [-1, 1] whatever the approximation says


def test_the_interval_holds_no_change_about_95_percent_of_the_time():
    """Two policies of the same success rates (different per task), 8 tasks x 50 episodes, correlated episode by
    episode (the same seeds make the same pages easy or hard): the overall interval holds 0 in ~95% of 2000 seeded
    evaluations."""
    rng = random.Random(11)
    rates = [0.2, 0.3, 0.5, 0.95, 1.0, 0.45, 0.0, 0.35]
    held = 0
    for _ in range(2000):
        a, b = {}, {}
        for k, p in enumerate(rates):
            hard = [rng.random() < 0.5 for _ in range(50)]           # the seed's page: shifts both policies' odds
            q = [min(1.0, p * 1.5) if not h else p * 0.5 for h in hard]
            a[str(k)] = [int(rng.random() < x) for x in q]
            b[str(k)] = [int(rng.random() < x) for x in q]
        lo, hi = evalstats.paired(_records(a), _records(b))["ci95"]
        held += lo <= 0 <= hi
    assert 0.92 <= held / 2000 <= 0.98, held / 2000
