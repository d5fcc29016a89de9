"""`tars bench env`: the quick run through the real CLI (a real `tars envd` subprocess), its JSON, and bad arguments."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tars.bench import envd as bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tars(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "tars.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-3 * max(abs(a), abs(b))


def check_latency(s: dict, n: int) -> None:
    assert s["n"] == n
    assert 0 < s["p50_ms"] <= s["p99_ms"] < 60_000
    assert s["mean_ms"] > 0


def test_quick_run_reports_every_figure(tmp_path):
    out = tmp_path / "env.json"
    p = tars("bench", "env", "--quick", "--skip-browser", "--skip-miniwob", "--steps", "100", "--sessions", "50",
             "--json", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["machine"]["cores"] >= 1 and r["settings"]["quick"] is True
    figs = r["figures"]

    noop = figs["noop_step_over_ping"]
    check_latency(noop["step"], 100)
    check_latency(noop["ping"], 100)
    assert close(noop["value"], noop["step"]["p50_ms"] / noop["ping"]["p50_ms"])
    assert noop["goal"] == "<= 1.5" and noop["pass"] == (noop["value"] <= 1.5)
    assert noop["backend_step_p50_ms"] > 0

    conc = figs["concurrent_step_p99_ms"]
    assert conc["at_n"]["sessions"] == 50 and conc["at_1"]["sessions"] == 1
    check_latency(conc["at_n"], 50 * 2)  # quick: 2 steps per session (steps // 100)
    check_latency(conc["at_1"], 200)
    assert conc["value"] == conc["at_n"]["p99_ms"] and conc["pass"] == (conc["value"] < 20)
    assert close(conc["p99_over_1_session"], conc["at_n"]["p99_ms"] / conc["at_1"]["p99_ms"])
    assert conc["at_n"]["steps_per_s"] > 0

    for name in ("miniwob_step_over_inprocess", "miniwob_pss_per_session_mb", "miniwob_screenshots_off_cpu",
                 "browser_pss_per_session_mb"):
        assert figs[name]["value"] is None and figs[name]["pass"] is None and figs[name]["skipped"], name
    # The printed table names every figure and its verdict.
    for name in figs:
        assert name in p.stdout
    assert ("PASS" if noop["pass"] else "FAIL") in p.stdout


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--inflight", "-3"], "--inflight must be >= 1, got -3"),
    (["--sessions", "many"], "argument --sessions: invalid int value: 'many'"),
    (["--json", "/no/such/dir/out.json"], "directory /no/such/dir does not exist"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_arguments_fail_before_benchmarking(args, message):
    p = tars("bench", "env", *args, timeout=60)
    assert p.returncode == 2
    assert message in p.stderr and "tars bench env" in p.stderr


def test_unknown_benchmark_is_named():
    p = tars("bench", "no-such-bench", timeout=60)
    assert p.returncode == 2 and "invalid choice: 'no-such-bench'" in p.stderr and "'env'" in p.stderr


def test_miniwob_ways_take_turns():
    """envd and in-process each step first after the stock env and each right after the other equally often, and
    each as often in each place (a fixed order put envd always right after the stock env, which biased the figure)."""
    import collections
    log: list[str] = []
    ways = {name: (lambda name=name: log.append(name)) for name in ("envd", "in_process", "stock_gymnasium")}
    timed = bench.in_turn(ways, bench.MINIWOB_ORDERS, rounds=6, warmup=2)
    assert {k: len(v) for k, v in timed.items()} == {"envd": 6, "in_process": 6, "stock_gymnasium": 6}
    assert all(ms >= 0 for v in timed.values() for ms in v)
    rounds = [log[i:i + 3] for i in range(0, len(log), 3)]
    assert len(rounds) == 8 and all(sorted(r) == sorted(ways) for r in rounds)
    for way in ("envd", "in_process"):
        assert collections.Counter(r.index(way) for r in rounds) == {1: 4, 2: 4}
    after = collections.Counter((r[i], r[i + 1]) for r in rounds for i in range(2))
    assert after[("stock_gymnasium", "envd")] == after[("stock_gymnasium", "in_process")] == 4
    assert after[("envd", "in_process")] == after[("in_process", "envd")] == 4


def test_percentiles_and_goals():
    xs = [float(i) for i in range(1, 101)]
    assert bench._pct(xs, 50) == 50 and bench._pct(xs, 99) == 99 and bench._pct(xs, 100) == 100
    assert bench._pct([3.0], 99) == 3.0
    assert bench.figure("x", 20.0, "ms", ("<", 20.0))["pass"] is False
    assert bench.figure("x", 1.5, "ratio", ("<=", 1.5))["pass"] is True
    assert bench.figure("x", 9.0, "MB", None)["pass"] is None


def test_missing_backend_is_a_reason_not_a_crash():
    why = bench._backend_missing("no-such-backend/x")
    assert why and "envd/registry.py" in why
    assert bench._backend_missing("builtin/click") is None


@pytest.mark.slow
def test_miniwob_and_browser_figures(tmp_path):
    """The browser-backed figures at small sizes (about a minute: a few Chromiums)."""
    out = tmp_path / "env.json"
    p = tars("bench", "env", "--quick", "--steps", "20", "--sessions", "10", "--mem-sessions", "2", "--json", str(out),
             timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    figs = json.loads(out.read_text())["figures"]
    mw = figs["miniwob_step_over_inprocess"]
    check_latency(mw["envd"], 20)
    check_latency(mw["in_process"], 20)
    assert close(mw["value"], mw["envd"]["p50_ms"] / mw["in_process"]["p50_ms"])
    # where the extra goes, paired per step: the RPC and thread hops, and the backend inside the daemon vs here
    assert mw["envd_overhead_ms"]["n"] == 20 and 0 < mw["envd_overhead_ms"]["p50_ms"] < mw["envd"]["p50_ms"]
    assert close(mw["inside_envd_over_in_process"], mw["envd_backend_step_p50_ms"] / mw["in_process"]["p50_ms"])
    mem = figs["miniwob_pss_per_session_mb"]
    assert mem["at_1"]["chromium_processes"] >= 1 and mem["at_1"]["pss_mb"] > 10
    assert mem["at_2"]["processes"] > mem["at_1"]["processes"]
    assert abs(mem["value"] - (mem["at_2"]["pss_mb"] - mem["at_1"]["pss_mb"])) < 0.11  # both rounded to 0.1 MB
    shots = figs["miniwob_screenshots_off_cpu"]
    check_screenshots(shots, 10)
    assert close(shots["value"], shots["without"]["cpu_s_per_episode"] / shots["with_screenshots"]["cpu_s_per_episode"])
    b = figs["browser_pss_per_session_mb"]
    assert b["value"] is not None or "registry" in b["skipped"]


def check_screenshots(r: dict, episodes: int) -> None:
    """Both sessions played every episode; only the one with screenshots was sent any (a Reset and 3 Steps each)."""
    assert r["episodes"] == episodes and r["steps_per_episode"] == 3
    assert r["with_screenshots"]["images"] == episodes * 4 and r["without"]["images"] == 0
    for w in ("with_screenshots", "without"):
        assert r[w]["cpu_s_per_episode"] > 0 and r[w]["wall_s_per_episode"] > 0


@pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"), reason="Debian's chromium is not installed")
def test_screenshots_figure_plays_both_sessions():
    pytest.importorskip("miniwob")
    from tars.bench.envd_screens import bench_screenshots

    with bench.Daemon() as d:
        r = bench_screenshots(d, "click-checkboxes", bench.MINIWOB_OPTIONS, 2, ref=bench.MINIWOB_REF)
    check_screenshots(r, 2)
    assert r["cpu_ratio"] > 0 and r["wall_ratio"] > 0
