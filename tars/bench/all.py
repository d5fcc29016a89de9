"""`tars bench all`: every benchmark registered in tars.bench.BENCHES, then the async-vs-sync headline.

    tars bench all --json FILE [--full] [--only a,b] [--skip a,b] [--args NAME="ARGS"] [--timeout S]

The list is read from BENCHES when this runs, so benchmarks registered after this file was written are included.
Each runs as its own `tars bench NAME` subprocess (a crash, a hang or a sys.exit in one cannot take the others
down) with a short setting suited to a combined run: `--quick` when its `--help` offers it (or the setting named
in QUICK_ARGS), unless --full. Its JSON (through its own `--json`, or its stdout when it has no such option) is
nested under its name with status ok | failed | timeout, the exit status, the seconds it took and the last lines
of its output when it failed. `async` runs last: its figures are the headline (async / synchronous trajectories/s
on a long-tail multi-turn workload, goal >= 3.0, and the final success of both).

Beside FILE: FILE-NAME.json for each benchmark (and any plot it writes next to it, e.g. FILE-async.png) and
FILE.png, every ratio figure of the run against its goal.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shlex
import signal
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
HEADLINE = "async"
# The combined run's setting for benchmarks whose --quick is not the right one (or that have none).
# learner and inference run their defaults: their ratio figures (stream/raw, gRPC front/direct) from the quick
# settings (2 x 1,000 trajectories; 5 rounds) swung by +-0.1 between runs of the same code (gRPC front: 0.86-0.99),
# more than the differences they are there to show; the defaults (3 x 2,000; 11 rounds) add about two minutes.
QUICK_ARGS: dict[str, list[str]] = {"env": ["--quick"], "async": ["--quick"], "learner": [], "inference": [],
                                     "soak": ["--minutes", "2", "--every", "3"]}  # a long soak is its own run
DEFAULT_TIMEOUT_S = 1200.0
HELP_TIMEOUT_S = 60.0


def _env() -> dict:
    from tars.topology import pythonpath

    return {**os.environ, "PYTHONPATH": pythonpath(REPO)}


def bench_names() -> list[str]:
    """Every registered benchmark but this one, the headline last."""
    from tars.bench import BENCHES

    names = [n for n in BENCHES if n != "all"]
    return [n for n in names if n != HEADLINE] + [n for n in names if n == HEADLINE]


def _run(argv: list[str], timeout: float) -> tuple[int | None, str, str]:
    """(exit status or None on timeout, stdout, stderr); on timeout the whole process group is killed."""
    p = subprocess.Popen([sys.executable, "-m", "tars.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=_env(), cwd=str(REPO), start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGTERM)   # `tars up` and the daemons stop their own children on SIGTERM
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate(timeout=10)
        return None, out or "", err or ""


def options_of(name: str) -> set[str]:
    """The --flags a benchmark's --help names (empty when --help fails)."""
    rc, out, _ = _run(["bench", name, "--help"], HELP_TIMEOUT_S)
    if rc != 0:
        return set()
    return {w.strip("[],") for w in out.split() if w.startswith(("--", "[--"))}


def _parse_stdout(out: str) -> dict | None:
    """A benchmark without --json prints its JSON: the whole stdout, or from its first `{` line on."""
    for start in [0] + [i for i, line in enumerate(out.splitlines()) if line.startswith("{")]:
        try:
            r = json.loads("\n".join(out.splitlines()[start:]))
            return r if isinstance(r, dict) else None
        except ValueError:
            continue
    return None


def run_one(name: str, base: pathlib.Path, full: bool, extra: list[str] | None, timeout: float) -> dict:
    flags = options_of(name)
    args = list(extra) if extra is not None else ([] if full else QUICK_ARGS.get(name, ["--quick"] if "--quick" in flags else []))
    json_path = base.with_name(f"{base.stem}-{name}.json")
    if json_path.exists():
        json_path.unlink()
    use_json = "--json" in flags
    argv = ["bench", name, *args, *(["--json", str(json_path)] if use_json else [])]
    print(f"[bench all] {name}: tars {' '.join(argv)}", flush=True)
    t0 = time.monotonic()
    rc, out, err = _run(argv, timeout)
    rec = {"args": args, "rc": rc, "seconds": round(time.monotonic() - t0, 1)}
    result = None
    if use_json and json_path.exists():
        try:
            result = json.loads(json_path.read_text())
        except ValueError:
            pass
    elif not use_json:
        result = _parse_stdout(out)
    if rc is None:
        rec.update(status="timeout", error=f"no result within {timeout:.0f} s")
    elif rc != 0 or result is None:
        rec.update(status="failed", error=f"exit status {rc}" + ("" if result is not None else ", no JSON result"))
    else:
        rec["status"] = "ok"
    rec["result"] = result
    rec["json"] = str(json_path) if use_json and json_path.exists() else None
    if rec["status"] != "ok":
        rec["output_tail"] = (out[-1500:] + "\n" + err[-2500:]).strip()
    return rec


def headline(rec: dict | None) -> dict:
    """The async-vs-sync figures, or why there are none."""
    if rec is None:
        return {"status": "not run"}
    figs = (rec.get("result") or {}).get("figures") or {}
    if "async_over_sync_trajectories_per_s" not in figs:
        return {"status": rec["status"], "error": rec.get("error", "no async_over_sync figure")}
    r = figs["async_over_sync_trajectories_per_s"]
    return {"status": rec["status"], "async_over_sync_trajectories_per_s": r["value"], "goal": r["goal"],
            "pass": r["pass"], "async_trajectories_per_s": r.get("async_trajectories_per_s"),
            "sync_trajectories_per_s": r.get("sync_trajectories_per_s"),
            **{k: figs[k]["value"] for k in ("final_success_async", "final_success_sync", "learner_idle_share_async",
                                             "learner_idle_share_sync", "sync_max_staleness") if k in figs},
            "reference": "AReaL reports 2.77x"}


def figures_of(result: dict | None) -> dict[str, dict]:
    """A benchmark's figures: its `figures` mapping, or (house style not followed) its top-level numbers."""
    if not isinstance(result, dict):
        return {}
    if isinstance(result.get("figures"), dict):
        return {k: v for k, v in result["figures"].items() if isinstance(v, dict) and "value" in v}
    if isinstance(result.get("figures"), list):  # [{"name", "value", "baseline", "goal", "pass"}, ...]
        return {f["name"]: {"unit": "ratio" if f.get("baseline") == 1.0 or "_over_" in f["name"] else "", **f}
                for f in result["figures"] if isinstance(f, dict) and "name" in f and "value" in f}
    return {k: {"value": v, "goal": None, "pass": None, "unit": "ratio" if "_over_" in k else ""}
            for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def table(out: dict) -> str:
    rows = [f"{'benchmark':<11} {'status':<8} {'seconds':>8}  {'figure':<38} {'value':>10}  {'goal':<8} pass"]
    for name, rec in out["benchmarks"].items():
        figs = figures_of(rec["result"])
        first = True
        for fname, f in figs.items() or [("", None)]:
            head = f"{name:<11} {rec['status']:<8} {rec['seconds']:>8.1f}" if first else " " * 29
            first = False
            if f is None:
                rows.append(f"{head}  {rec.get('error', '')}")
                continue
            v = f.get("value")
            vs = "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
            p = f.get("pass")
            rows.append(f"{head}  {fname:<38} {vs:>10}  {f.get('goal') or '':<8} {'' if p is None else p}")
    h = out["headline"]
    rows.append("")
    if "async_over_sync_trajectories_per_s" in h:
        rows.append(f"HEADLINE async / sync (eta=0) trajectories/s: {h['async_over_sync_trajectories_per_s']} "
                    f"(goal {h['goal']}, AReaL 2.77x; {h['async_trajectories_per_s']} vs {h['sync_trajectories_per_s']}/s); "
                    f"final success async {h.get('final_success_async')} sync {h.get('final_success_sync')}")
    else:
        rows.append(f"HEADLINE async / sync: {h['status']} {h.get('error', '')}")
    return "\n".join(rows)


def plot(out: dict, path: str) -> str | None:
    """Every figure whose unit is a ratio, against its goal (marker), one bar per figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(f"{n}: {k}", f["value"], f.get("goal")) for n, rec in out["benchmarks"].items()
            for k, f in figures_of(rec["result"]).items() if f.get("unit") == "ratio" and isinstance(f.get("value"), (int, float))]
    if not bars:
        return None
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(bars) + 1.5))
    ys = range(len(bars))
    ax.barh(ys, [b[1] for b in bars], color="tab:blue")
    for y, (_, v, goal) in zip(ys, bars):
        ax.text(v, y, f" {v:.3g}", va="center")
        if goal:
            ax.plot([float(goal.split()[-1])] * 2, [y - 0.4, y + 0.4], color="tab:red")
    ax.set_yticks(list(ys), [b[0] for b in bars], fontsize=8)
    ax.axvline(1.0, color="gray", lw=0.5)
    ax.set(xlabel="ratio to the baseline measured in the same run (red: goal)", title="tars bench all")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tars bench all", description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="FILE", required=True, help="write every benchmark's figures here")
    ap.add_argument("--full", action="store_true", help="each benchmark's default (long) setting, not --quick")
    ap.add_argument("--only", default="", help="only these benchmarks, comma-separated")
    ap.add_argument("--skip", default="", help="leave these out, comma-separated")
    ap.add_argument("--args", action="append", default=[], metavar='NAME="ARGS"',
                    help="a benchmark's own arguments instead of its quick setting, e.g. --args async=\"--wall 60\"")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds one benchmark may take")
    a = ap.parse_args(argv)
    known = bench_names()
    a.extra = {}
    for s in a.args:
        name, sep, rest = s.partition("=")
        if not sep or name not in known:
            ap.error(f"--args {s!r}: expected NAME=ARGS with NAME one of {known}")
        a.extra[name] = shlex.split(rest)
    for opt in ("only", "skip"):
        bad = [n for n in getattr(a, opt).split(",") if n and n not in known]
        if bad:
            ap.error(f"--{opt}: unknown benchmark(s) {bad}; have {known}")
    if a.timeout <= 0:
        ap.error("--timeout must be positive")
    return a


def run(a: argparse.Namespace) -> dict:
    only = [n for n in a.only.split(",") if n]
    skip = {n for n in a.skip.split(",") if n}
    names = [n for n in bench_names() if (not only or n in only) and n not in skip]
    base = pathlib.Path(a.json).resolve()
    base.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    out = {"machine": {"cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
                       "loadavg_start": [round(x, 2) for x in os.getloadavg()]},
           "settings": {"full": a.full, "benchmarks": names, "timeout_s": a.timeout}, "benchmarks": {}}
    for name in names:
        out["benchmarks"][name] = run_one(name, base, a.full, a.extra.get(name), a.timeout)
        base.write_text(json.dumps({**out, "headline": {"status": "running"}}, indent=2))  # partial results survive
    out["headline"] = headline(out["benchmarks"].get(HEADLINE))
    out["wall_s"] = round(time.time() - t0, 1)
    out["plot"] = plot(out, str(base.with_suffix(".png")))
    base.write_text(json.dumps(out, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    out = run(parse(argv))
    print(table(out))
    return 0 if all(r["status"] == "ok" for r in out["benchmarks"].values()) else 1
