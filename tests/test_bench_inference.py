"""`tars bench inference --quick`: the figures come out, with the properties that hold whatever the machine's speed."""
from __future__ import annotations

import json

from tars.cli import main


def test_quick_bench_figures(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert main(["bench", "inference", "--quick", "--skip-front", "--gpu", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    figs = {f["name"]: f for f in d["figures"]}
    u = d["updates"]
    assert u["partial"]["weight_updates"] >= 2 and u["restart"]["weight_updates"] >= 2
    # Partial rollouts never throw a sampled token away; restarting cancels calls and regenerates them.
    assert u["partial"]["tokens_discarded"] == 0 and u["partial"]["interrupted_requests"] > 0
    assert u["restart"]["requests_restarted"] > 0 and u["restart"]["tokens_discarded"] >= 0
    assert figs["update_discarded_share"]["value"] == 0.0 and figs["update_discarded_share"]["pass"] is True
    # Every token a later turn shares with the previous turn's KV is served from the cache (sticky routing).
    m = d["multiturn"]
    assert m["hit_over_reusable"] == 1.0 and m["episodes_on_one_replica"] == m["episodes"]
    assert 0.5 < figs["multiturn_cache_hit_share"]["value"] < 1.0
    gpu = [f for n, f in figs.items() if n.startswith("gpu_")]
    assert len(gpu) == 1 and (gpu[0].get("skipped") or gpu[0]["value"] > 0)
    assert "| update_discarded_share |" in capsys.readouterr().out
