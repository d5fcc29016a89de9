"""`tars bench inference --quick`: the figures come out, with the properties that hold whatever the machine's speed."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from tars.cli import main

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_quick_bench_figures(tmp_path, capsys):
    out = tmp_path / "b.json"
    gpu = ["--gpu"] if torch.cuda.is_available() else []
    assert main(["bench", "inference", "--quick", "--skip-front", *gpu, "--json", str(out)]) == 0
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
    figs_gpu = [f for n, f in figs.items() if n.startswith("gpu_")]
    assert len(figs_gpu) == len(gpu) and all(f["value"] > 0 for f in figs_gpu)
    if gpu:  # the engine was built as `tars serve` builds it: on CUDA, bf16
        assert d["gpu"]["engine_device"].startswith("cuda") and d["gpu"]["engine_dtype"] == "torch.bfloat16"
    assert "| update_discarded_share |" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_without_cuda_is_refused_in_one_line(tmp_path):
    """--gpu asked for where there is no CUDA: one line, exit 2, before any other figure runs (no JSON written)."""
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, "-m", "tars.cli", "bench", "inference", "--quick", "--gpu", "--json", str(out)],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("tars bench: ") and "--gpu needs CUDA" in lines[0], lines
    assert not out.exists()
