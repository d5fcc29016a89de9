"""`tars bench corrections`: its figures from a run directory, its arguments, and (slow) a tiny grid of real runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tars.bench import BENCHES
from tars.bench import corrections as BC

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tars(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "tars.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def eps(successes):
    return [{"success": bool(s), "outcome": "terminated"} for s in successes]


def test_episodes_to_target_needs_a_full_window_at_the_target():
    assert BC.episodes_to_target(eps([1, 1, 1]), 0.8, 4) is None          # too few for a window
    assert BC.episodes_to_target(eps([0, 1, 1, 1, 1]), 0.8, 4) == 5       # 3/4 at the 4th, 4/4 at the 5th
    assert BC.episodes_to_target(eps([0, 0, 1, 1, 1, 1, 1]), 0.8, 5) == 6  # [0,1,1,1,1] = 0.8 at the 6th
    assert BC.episodes_to_target(eps([1, 0] * 50), 0.8, 10) is None
    with pytest.raises(ValueError):
        BC.episodes_to_target(eps([1]), 0.8, 0)


def test_a_run_directory_summarised_and_tabled(tmp_path):
    """success_last from report.json; the importance figures are means over the RL updates only (value pretraining
    logs none); episodes to the target counts scored episodes, infra errors left out."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "report.json").write_text(json.dumps({"status": "done", "success_last": 0.75, "success_first": 0.25}))
    e = [{"success": i >= 3, "outcome": "terminated", "t": float(i)} for i in range(8)]
    e.insert(2, {"success": False, "outcome": "infra_error", "t": 1.5})
    (d / "episodes.jsonl").write_text("".join(json.dumps(x) + "\n" for x in e))
    steps = [{"version": 1, "phase": "value_pretrain", "v_loss": 1.0},
             {"version": 2, "phase": "ppo", "is_weight_mean": 1.0, "is_ratio_mean": 1.5},
             {"version": 3, "phase": "ppo", "is_weight_mean": 0.5, "is_ratio_mean": 2.5, "nonfinite_steps": 1}]
    (d / "learner.jsonl").write_text("".join(json.dumps(x) + "\n" for x in steps))
    s = BC.summarise(d, 0.75, 4)
    assert s["final_success"] == 0.75 and s["status"] == "done"
    assert s["is_weight_mean"] == 0.75 and s["is_ratio_mean"] == 2.0
    assert s["policy_versions"] == 3 and s["rl_updates"] == 2 and s["nonfinite_updates"] == 1
    assert s["episodes"] == 9 and s["scored_episodes"] == 8
    assert s["episodes_to_target"] == 6  # scored: F F F T T T T T; the last 4 at the 6th are F T T T = 0.75
    out = {"settings": {"target": 0.75}, "runs": [
        {"correction": "tis", "eta": 2, "wall_s": 12.0, **s},
        {"correction": "none", "eta": 0, "wall_s": 9.0, **{**s, "episodes_to_target": None, "is_weight_mean": None}}]}
    t = BC.table(out).splitlines()
    assert t[0].startswith("| correction | eta | final success | episodes to 0.75 | mean importance weight")
    assert t[2] == "| tis | 2 | 0.750 | 6 | 0.750 | 2.000 | 3 (2) | 9 | 12 | done |"
    assert "| none | 0 | 0.750 | not reached | - |" in t[3]


def test_arguments_are_checked_before_anything_runs(tmp_path):
    assert BENCHES["corrections"] == "corrections"
    a = BC.parse(["--versions", "3", "--corrections", "decoupled,none", "--etas", "0"])
    assert a.versions == 3 and a.corrections == ("decoupled", "none") and a.etas == (0,)
    d = BC.parse([])
    assert d.versions == BC.DEFAULT_VERSIONS and d.etas == (0, 2, 8) and d.corrections == ("decoupled", "vtrace", "tis", "none")
    q = BC.parse(["--quick"])
    assert q.versions == BC.QUICK["versions"] and q.etas == (2,) and q.set == ["learner.value_pretrain.steps=0"]
    for bad in (["--corrections", "retrace"], ["--etas", "0,-1"], ["--etas", "2,2"], ["--versions", "0"],
                ["--target", "1.5"], ["--model", str(tmp_path)], ["--set", "nonsense.key=1"]):
        with pytest.raises(SystemExit):
            BC.parse(bad)


def test_each_run_differs_from_the_quickstart_only_in_the_grid(tmp_path):
    a = BC.parse(["--versions", "7", "--set", "actor.concurrency=8"])
    cfg = BC.run_config(a, "vtrace", 8, tmp_path)
    assert cfg.learner.correction.kind == "vtrace" and cfg.learner.staleness.eta == 8
    assert cfg.max_versions == 7 and cfg.sft.steps == 0 and cfg.target_success == 0
    assert cfg.model.path == str(tmp_path) and cfg.actor.concurrency == 8
    assert cfg.learner.batch_size == 64 and cfg.actor.max_turns == 3  # the quickstart's


@pytest.mark.slow  # a shared warm start and two real `tars up` runs: ~75 s on 2 cores
def test_a_tiny_grid_of_real_runs(tmp_path):
    out = tmp_path / "corr.json"
    p = tars("bench", "corrections", "--versions", "2", "--corrections", "decoupled,none", "--etas", "0",
             "--sft-steps", "5", "--set", "learner.value_pretrain.steps=0", "--set", "actor.concurrency=16",
             "--set", "learner.batch_size=16", "--json", str(out), "--out", str(tmp_path / "runs"))
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    r = json.loads(out.read_text())
    assert [(x["correction"], x["eta"]) for x in r["runs"]] == [("decoupled", 0), ("none", 0)]
    for x in r["runs"]:
        assert x["rc"] == 0 and x["status"] == "done" and x["policy_versions"] == 2 and x["rl_updates"] == 2, x
        assert x["is_weight_mean"] is not None and 0 <= x["final_success"] <= 1
        cfg = (tmp_path / "runs" / f"{x['correction']}-eta0" / "bench-config.yaml").read_text()
        assert f"kind: {x['correction']}" in cfg and "eta: 0" in cfg
    assert r["runs"][1]["is_weight_mean"] == 1.0  # none puts no weight on a token
    assert r["table"] in p.stdout
