"""`tars bench async`: asynchronous vs synchronous (eta = 0) RL end to end, on a long-tail multi-turn workload.

    tars bench async [--json FILE] [--quick | --tiny] [--wall S] [--eta N] [--batch B] [--delay SPEC] ...

Two real `tars up` runs (envd, inference server, learner, actor: separate processes on loopback) from the same
warm-started model, with the same processes, actor concurrency, batch size, model, env workload and wall-clock
budget. They differ in one setting: learner.staleness.eta (the staleness bound) is --eta in one and 0 in the other. With
eta = 0 the learner admits exactly one batch of episodes per policy version, so each version waits for the
slowest episode of its batch while the finished episodes' actor slots stay empty, and generation stops while
the learner trains; with eta > 0, finished slots start new episodes at once and the learner trains alongside.

The workload: builtin/mixed GUI tasks (1-2 steps when solved, up to max_turns) with a simulated slow GUI: every
reset and step sleeps a delay drawn from a lognormal distribution (envd step_delay option, envd/latency.py;
default median 0.2 s, sigma 1.0, capped at 10 s: p90 0.72 s, p99 2.0 s). Batch size = actor concurrency, so
the synchronous run can fill every actor slot at the start of each version: the gain measured is what the tail
and the learner's own time cost it, not idle slots by configuration.

Figures (the synchronous run is the baseline, measured in the same invocation):
  async_over_sync_trajectories_per_s   trajectories received per second of RL time, async / sync     goal >= 3.0
  final_success_async / _sync          success over the last 10 % of scored episodes of each run     (no goal)
  learner_idle_share_async / _sync     1 - (learner update + weight publish time) / RL time          (no goal)
  sync_max_staleness                   largest version lag of any trained token in the eta=0 run     goal <= 0
  async_max_staleness                  the same in the async run (eta bounds starts, not finishes)   (no goal)
Each run also reports learner_ceiling_trajectories_per_s = batch / mean learner update time: when the async run
sits at it (learner idle share ~0), the learner, not the environments, bounds the ratio.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from envd.latency import DelaySpec
from core.proc import read_jsonl

REPO = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_DELAY = "lognormal:0.2,1.0,10"
RUN_MARGIN_S = 240.0      # a run's set-up (4 processes starting) and shutdown, on top of its wall budget


def figure(what: str, value, unit: str, goal: tuple[str, float] | None, **detail) -> dict:
    """One figure as tars/bench/envd.py writes them: value, unit, goal ("OP N") and pass (None without a goal)."""
    ok = None
    if value is not None and goal is not None:
        ok = {">=": value >= goal[1], "<=": value <= goal[1]}[goal[0]]
    return {"what": what, "value": value, "unit": unit, "goal": f"{goal[0]} {goal[1]:g}" if goal else None,
            "pass": ok, **detail}


def delay_stats(spec: str, max_turns: int, n: int = 20000, seed: int = 0) -> dict:
    """The step delay distribution, sampled (documents the workload next to the figures)."""
    d, rng = DelaySpec(spec), random.Random(seed)
    xs = sorted(d.draw(rng) for _ in range(n))
    q = lambda p: xs[min(n - 1, int(p * n))]  # noqa: E731
    return {**d.describe(), "mean_s": round(statistics.fmean(xs), 4), "p50_s": round(q(0.5), 4),
            "p90_s": round(q(0.9), 4), "p99_s": round(q(0.99), 4), "max_turns": max_turns,
            "note": "slept before every reset and step of a session (simulated slow GUI), drawn i.i.d. per call"}


def settings(a: argparse.Namespace) -> dict:
    if a.tiny:
        base = dict(wall=5.0, batch=4, sft_steps=0, delay="lognormal:0.05,1.0,2")
    elif a.quick:
        base = dict(wall=45.0, batch=32, sft_steps=300, delay=DEFAULT_DELAY)
    else:
        base = dict(wall=120.0, batch=32, sft_steps=300, delay=DEFAULT_DELAY)
    for k in base:
        v = getattr(a, k, None)
        if v is not None:
            base[k] = v
    base.update(eta=a.eta, max_turns=a.max_turns, seed=a.seed, order=a.order)
    return base


def run_config(s: dict, eta: int, model_path: str):
    from core import config as C

    opts = {"strict_targets": "1", "step_delay": s["delay"]}
    return C.load("quickstart", None, [
        f"wall_budget_s={s['wall']}", "max_versions=1000000", f"seed={s['seed']}", "target_success=0",
        f"model.path={model_path}", "sft.steps=0",
        f"learner.staleness.eta={eta}", f"learner.batch_size={s['batch']}", f"actor.concurrency={s['batch']}",
        f"actor.max_turns={s['max_turns']}", f"actor.env_options={json.dumps(opts)}",
        # every concurrent session may be asleep in a worker at once; fewer workers would queue and add delay
        f"envd.workers={s['batch'] + 8}", "envd.step_timeout_s=60",
    ])


def build_shared_model(s: dict, out: pathlib.Path) -> pathlib.Path:
    """The policy both runs start from: the quickstart model, SFT warm-started (in this process) when asked."""
    from core import config as C
    from tars.up import build_model

    cfg = C.load("quickstart", None, [f"sft.steps={s['sft_steps']}", f"seed={s['seed']}",
                                      f"actor.max_turns={s['max_turns']}"])
    out.mkdir(parents=True, exist_ok=True)
    path, _ = build_model(cfg, out, lambda msg: print(f"[bench async] {msg}", flush=True))
    return path


def tars_up(cfg, run_dir: pathlib.Path, timeout: float) -> tuple[int, str]:
    from core import config as C
    from tars.topology import pythonpath

    run_dir.mkdir(parents=True, exist_ok=True)
    C.save(cfg, run_dir / "bench-config.yaml")
    env = {**os.environ, "PYTHONPATH": pythonpath(REPO)}
    try:
        p = subprocess.run([sys.executable, "-m", "tars.cli", "up", "--config", str(run_dir / "bench-config.yaml"),
                            "--out", str(run_dir), "--quiet"], capture_output=True, text=True, timeout=timeout,
                           env=env, cwd=str(REPO))
        return p.returncode, (p.stdout + p.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:  # `tars up` stops its children itself on SIGTERM; run() killed it
        return 124, f"tars up did not finish within {timeout:.0f} s: {str(e.stdout or '')[-1000:]}"


def summarise(run_dir: pathlib.Path, rc: int, log_tail: str) -> dict:
    """The figures of one run from its report.json, episodes.jsonl and learner.jsonl."""
    rep = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").exists() else {}
    eps, steps = read_jsonl(run_dir / "episodes.jsonl"), read_jsonl(run_dir / "learner.jsonl")
    t0 = eps[0]["t"] if eps else 0.0
    t_end = max([eps[-1]["t"] if eps else 0.0] + [m["t"] for m in steps])
    rl_s = t_end - t0 if eps else 0.0
    busy = sum(m.get("step_s", 0.0) for m in steps)  # the learner's step_s includes its publish_s
    scored = [e for e in eps if e["outcome"] != "infra_error"]
    lags = [e["train_version"] - e["vmin"] for e in scored if e["vmin"] >= 0]
    mixed = sum(1 for e in scored if e["vmin"] >= 0 and e["vmax"] != e["vmin"])
    hist: dict[str, int] = {}
    for lag in lags:
        hist[str(lag)] = hist.get(str(lag), 0) + 1
    turns = [e["turns"] for e in scored]
    return {
        "rc": rc, "status": rep.get("status", "no report"), "episodes": len(eps), "scored_episodes": len(scored),
        "infra_errors": len(eps) - len(scored), "policy_versions": steps[-1]["version"] if steps else 0,
        "rl_s": round(rl_s, 3), "trajectories_per_s": round(len(eps) / rl_s, 4) if rl_s > 0 else 0.0,
        "success_first": rep.get("success_first"), "final_success": rep.get("success_last"),
        "learner_busy_s": round(busy, 3), "learner_idle_share": round(max(0.0, 1 - busy / rl_s), 4) if rl_s > 0 else None,
        "learner_step_s_mean": round(statistics.fmean(m["step_s"] for m in steps), 4) if steps else None,
        "max_staleness": max((int(m.get("max_staleness", 0)) for m in steps), default=0),
        "arrival_lag_histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
        "episodes_spanning_versions": mixed,
        "turns_mean": round(statistics.fmean(turns), 3) if turns else None,
        "arrivals": [round(e["t"] - t0, 3) for e in eps],
        "success_curve": _curve(scored, t0),
        "log_tail": log_tail if rc != 0 else "",
    }


def _curve(scored: list[dict], t0: float, points: int = 40) -> list[list[float]]:
    """(seconds, rolling success) at up to `points` places, for the plot."""
    if not scored:
        return []
    w = max(1, len(scored) // 10)
    out = []
    for i in range(w - 1, len(scored), max(1, len(scored) // points)):
        win = scored[i - w + 1: i + 1]
        out.append([round(scored[i]["t"] - t0, 3), round(sum(e["success"] for e in win) / len(win), 4)])
    return out


def run(a: argparse.Namespace) -> dict:
    s = settings(a)
    work = pathlib.Path(a.out) if a.out else pathlib.Path(tempfile.mkdtemp(prefix="tars-bench-async-"))
    t_start, load_start = time.time(), os.getloadavg()
    model = build_shared_model(s, work / "shared")
    runs: dict[str, dict] = {}
    names = {"sync": 0, "async": s["eta"]}
    order = ["sync", "async"] if s["order"] == "sync-first" else ["async", "sync"]
    for name in order:
        print(f"[bench async] {name} run (eta={names[name]}, {s['wall']:.0f} s of RL)", flush=True)
        d = work / name
        rc, tail = tars_up(run_config(s, names[name], str(model)), d, s["wall"] + RUN_MARGIN_S)
        r = summarise(d, rc, tail)
        r["trained_trajectories_per_s"] = round(r["policy_versions"] * s["batch"] / r["rl_s"], 4) if r["rl_s"] else 0.0
        # What the learner alone could consume (a batch per mean update): async cannot beat it, whatever the envs do.
        r["learner_ceiling_trajectories_per_s"] = round(s["batch"] / r["learner_step_s_mean"], 4) if r["learner_step_s_mean"] else None
        runs[name] = {"eta": names[name], "run_dir": str(d) if a.out else None, **r}
    if not a.out:
        shutil.rmtree(work, ignore_errors=True)
    sy, asy = runs["sync"], runs["async"]
    ratio = round(asy["trajectories_per_s"] / sy["trajectories_per_s"], 4) if sy["trajectories_per_s"] else None
    figs = {
        "async_over_sync_trajectories_per_s": figure(
            f"trajectories/s, async (eta={s['eta']}) / synchronous (eta=0), same processes, concurrency, batch, "
            "model, workload and wall time", ratio, "ratio", (">=", 3.0),
            async_trajectories_per_s=asy["trajectories_per_s"], sync_trajectories_per_s=sy["trajectories_per_s"],
            reference="AReaL reports 2.77x"),
        "final_success_async": figure("success over the last 10 % of scored episodes, async run",
                                      asy["final_success"], "rate", None, first=asy["success_first"]),
        "final_success_sync": figure("success over the last 10 % of scored episodes, synchronous run",
                                     sy["final_success"], "rate", None, first=sy["success_first"]),
        "learner_idle_share_async": figure("share of RL time the learner is not updating or publishing, async",
                                           asy["learner_idle_share"], "share", None),
        "learner_idle_share_sync": figure("share of RL time the learner is not updating or publishing, sync",
                                          sy["learner_idle_share"], "share", None),
        "async_max_staleness": figure(
            f"largest version lag of any trained token, async run (eta={s['eta']} bounds episode starts; a slow "
            "episode overtaken by later ones is trained later, up to learner.staleness.max_lag)", asy["max_staleness"],
            "versions", None, eta=s["eta"], arrival_lag_histogram=asy["arrival_lag_histogram"]),
        "sync_max_staleness": figure("largest version lag of any trained token, eta=0 run", sy["max_staleness"],
                                     "versions", ("<=", 0), episodes_spanning_versions=sy["episodes_spanning_versions"]),
    }
    out = {
        "machine": {"cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
                    "loadavg_start": [round(x, 2) for x in load_start],
                    "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
        "settings": {**s, "quick": bool(a.quick), "tiny": bool(a.tiny), "concurrency": s["batch"],
                     "env_ids": ["builtin/mixed"], "work_dir": a.out},
        "workload": delay_stats(s["delay"], s["max_turns"]),
        "figures": figs,
        "runs": runs,
        "wall_s": round(time.time() - t_start, 1),
    }
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(out, indent=2))
        out["plot"] = plot(out, str(pathlib.Path(a.json).with_suffix(".png")))
        pathlib.Path(a.json).write_text(json.dumps(out, indent=2))
    return out


def plot(out: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = out["runs"]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for name, r in runs.items():
        arr = r["arrivals"]
        ax[0].plot(arr, range(1, len(arr) + 1), label=f"{name} (eta={r['eta']}): {r['trajectories_per_s']:.1f}/s")
        if r["success_curve"]:
            t, sc = zip(*r["success_curve"])
            ax[1].plot(t, sc, label=f"{name}: final {r['final_success'] if r['final_success'] is None else round(r['final_success'], 3)}")
    ratio = out["figures"]["async_over_sync_trajectories_per_s"]["value"]
    ax[0].set(xlabel="seconds of RL", ylabel="trajectories received", title=f"async / sync = {ratio}")
    ax[1].set(xlabel="seconds of RL", ylabel="rolling success", ylim=(-0.05, 1.05), title="success")
    names = list(runs)
    idle = [runs[n]["learner_idle_share"] or 0.0 for n in names]
    ax[2].bar(names, idle)
    ax[2].set(ylabel="share of RL time", ylim=(0, 1), title="learner idle share")
    for x in ax[:2]:
        x.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def table(out: dict) -> str:
    rows = [f"{'figure':<38} {'value':>10}  {'goal':<8} pass"]
    for name, f in out["figures"].items():
        v = f["value"]
        vs = "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
        rows.append(f"{name:<38} {vs:>10}  {f['goal'] or '':<8} {'' if f['pass'] is None else f['pass']}")
    rows.append("")
    rows.append(f"{'run':<6} {'eta':>3} {'episodes':>8} {'traj/s':>8} {'versions':>8} {'final':>6} {'idle':>6} "
                f"{'max lag':>7} status")
    for name, r in out["runs"].items():
        fs = "-" if r["final_success"] is None else f"{r['final_success']:.3f}"
        idle = "-" if r["learner_idle_share"] is None else f"{r['learner_idle_share']:.3f}"
        rows.append(f"{name:<6} {r['eta']:>3} {r['episodes']:>8} {r['trajectories_per_s']:>8.2f} "
                    f"{r['policy_versions']:>8} {fs:>6} {idle:>6} {r['max_staleness']:>7} {r['status']}")
    w = out["workload"]
    rows.append(f"workload: step delay {w['spec']} (mean {w['mean_s']} s, p50 {w['p50_s']}, p90 {w['p90_s']}, "
                f"p99 {w['p99_s']}), max_turns {w['max_turns']}")
    return "\n".join(rows)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tars bench async", description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="FILE", help="write the figures here as JSON (and the plot beside it, .png)")
    ap.add_argument("--quick", action="store_true", help="45 s of RL per run (the same 300-step warm start: fewer steps leave success at ~0)")
    ap.add_argument("--tiny", action="store_true", help="5 s per run, batch 4, no SFT, short delays (tests)")
    ap.add_argument("--wall", type=float, help="seconds of RL per run (default 120)")
    ap.add_argument("--batch", type=int, help="batch size = actor concurrency (default 32)")
    ap.add_argument("--eta", type=int, default=2, help="staleness bound of the async run (default 2)")
    ap.add_argument("--delay", help=f"envd step_delay spec (default {DEFAULT_DELAY}; see envd/latency.py)")
    ap.add_argument("--sft-steps", dest="sft_steps", type=int, help="SFT warm start of the shared model (default 300)")
    ap.add_argument("--max-turns", dest="max_turns", type=int, default=3, help="episode step budget (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--order", choices=["sync-first", "async-first"], default="sync-first")
    ap.add_argument("--out", help="keep the two runs' directories here (default: a temporary directory)")
    a = ap.parse_args(argv)
    if a.eta < 1:
        ap.error("--eta must be >= 1 (the synchronous run is the eta=0 baseline)")
    for k in ("wall", "batch", "sft_steps"):
        v = getattr(a, k)
        if v is not None and (v < 0 or (k != "sft_steps" and v <= 0) or (isinstance(v, float) and not math.isfinite(v))):
            ap.error(f"--{k.replace('_', '-')} must be positive")
    if a.delay:
        try:
            DelaySpec(a.delay)
        except ValueError as e:
            ap.error(str(e))
    return a


def main(argv: list[str] | None = None) -> int:
    out = run(parse(argv))
    print(table(out))
    if out["figures"]["async_over_sync_trajectories_per_s"]["value"] is None:
        return 1
    return 0
