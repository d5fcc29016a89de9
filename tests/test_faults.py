"""Faults over a real `tars up` run (tars/bench/faults.py): each role SIGKILLed once at a random time, without
warning, and restarted by the run's own supervisor; then the ledger over the learner's records and every actor's
spool: nothing lost, nothing trained twice, no infra_error trajectory in the loss, the run finishes with its report.

With TARS_FAULTS_JSON=FILE the result is written there.
"""
import json
import os

import pytest

from tars.bench import faults as faults_bench
from tars.faults import account, lineage


def _check(res: dict) -> None:
    path = os.environ.get("TARS_FAULTS_JSON")
    if path:
        with open(path, "w") as f:
            json.dump({**res, "summary": faults_bench.summary(res)}, f, indent=2, default=str)
    for mode, r in res["modes"].items():
        led = r["ledger"]
        assert led["lost"] == 0, (mode, led)
        assert led["duplicated"] == 0, (mode, led)
        assert r["infra_error_trained"] == 0, mode
        assert r["up_exit"] == 130 and r["status"] == "interrupted", (mode, r["status"])  # Ctrl-C: 130
        # the supervisor restarted each killed process once, and the report says so
        assert sorted(r["restarts"]) == sorted(k["name"] for k in r["kills"]), (mode, r["restarts"], r["kills"])
        assert all(n == 1 for n in r["restarts"].values()), r["restarts"]
        assert led["trained"] > 0 and led["versions"] >= 3, (mode, led)


@pytest.mark.slow  # two whole `tars up` runs with four kills each: minutes on 2 cores
@pytest.mark.parametrize("seed", [0])
def test_kill_every_role_of_tars_up_once(tmp_path, seed):
    """Both stream durability modes (the quickstart's "checkpoint", and "wal"): every role killed once at a random
    time; the run goes on under its supervisor and finishes with its report."""
    res = faults_bench.run(faults_bench.MODES, str(tmp_path / "runs"), seed=seed)
    _check(res)
    assert res["ok"]


def test_account_counts_every_spool(tmp_path):
    """An id that only an actor's spool holds at the end is `spooled`, not silently dropped; one seen in a killed
    actor's spool that arrived nowhere and is held nowhere is lost."""
    (tmp_path / "episodes.jsonl").write_text(
        "".join(json.dumps({"id": i, "outcome": "success"}) + "\n" for i in ("a", "b")))
    (tmp_path / "trained.jsonl").write_text(json.dumps({"version": 1, "ids": ["a", "b"]}) + "\n")
    led = account(tmp_path, killed_spools=[{"b", "c"}], final_spools=[{"a", "d"}, set()])
    assert (led["trained"], led["spooled"], led["lost"], led["lost_ids"]) == (2, 1, 1, ["c"])
    led = account(tmp_path, killed_spools=[{"b", "c"}], final_spools=[{"c"}])
    assert (led["spooled"], led["lost"]) == (1, 0)


def test_lineage_drops_rolled_back_updates():
    recs = [{"resume": 0}, {"version": 1, "ids": ["a"]}, {"version": 2, "ids": ["b"]}, {"version": 3, "ids": ["c"]},
            {"resume": 2}, {"version": 3, "ids": ["c", "d"]}]
    lin = lineage(recs)
    assert sorted(lin) == [1, 2, 3] and lin[3]["ids"] == ["c", "d"]
