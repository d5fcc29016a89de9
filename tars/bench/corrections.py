"""`tars bench corrections`: the quickstart under each learner.correction at several staleness bounds, same start.

    tars bench corrections [--json FILE] [--versions N] [--corrections a,b] [--etas 0,2,8] [--model DIR] ...

One shared warm start, made once: the quickstart preset's SFT (its demonstrator and steps, `--sft-steps` to change
them) into OUT/shared, or `--model DIR` to reuse a checkpoint made before. Then, for every correction in
--corrections (default decoupled, vtrace, tis, none) and every eta in --etas (default 0, 2, 8), one real `tars up`
run of the quickstart from that checkpoint with sft.steps=0, learner.correction.kind and learner.staleness.eta set,
and nothing else changed. Each run is budgeted by policy versions (max_versions = --versions, the quickstart's value
pretraining included), not by wall time, so a slower or busier host runs longer but does not learn less;
target_success is 0, so no run stops early. The wall budget is only a safety limit (--run-timeout).

Per run (from the run's report.json, episodes.jsonl and learner.jsonl):
  final_success        report.json success_last: success over the last 10 % of scored episodes
  episodes_to_target   scored episodes received when the success over the last --window scored episodes first
                       reached --target (default 0.8); null ("not reached") when it never did
  is_weight_mean       mean over the RL updates of the learner's is_weight_mean: the importance weight the
                       correction puts on a generated token (decoupled min(pi_prox / pi_behav, behav_cap), vtrace
                       min(rho_bar, pi_prox / pi_behav), tis min(pi_theta / pi_behav, tis_cap), none 1)
  is_ratio_mean        the same for is_ratio_mean: the raw pi_learner / pi_behav, whatever the correction
  policy_versions, rl_updates, episodes, wall_s, status

The JSON has the settings, the machine and every run; the markdown table (printed, and in the JSON as "table") is
what docs/learner.md "Comparing corrections" holds. Runs go one after another on this host (the same machine for
every cell of the table); their order is the grid's, corrections outer, etas inner.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import statistics
import tempfile
import time

from core.config_learner import CorrectionConfig
from core.proc import read_jsonl
from tars.bench.async_rl import tars_up

DEFAULT_VERSIONS = 400
DEFAULT_ETAS = (0, 2, 8)
DEFAULT_TARGET = 0.8
DEFAULT_WINDOW = 256           # the rolling window `tars up` prints and stops on (tars/report.py Monitor)
DEFAULT_RUN_TIMEOUT_S = 3 * 3600.0
# A smoke setting for `tars bench all`, not the table: a shorter warm start, no value pretraining (whose versions
# would be the whole budget), 20 versions at eta 2.
QUICK = dict(versions=20, etas=(2,), sft_steps=300, set=("learner.value_pretrain.steps=0",))


def build_shared_model(a: argparse.Namespace, out: pathlib.Path) -> pathlib.Path:
    """The checkpoint every run starts from: --model, or the quickstart's fresh model and SFT warm start, made here."""
    if a.model:
        return pathlib.Path(a.model).resolve()
    from core import config as C
    from tars.up import build_model

    over = [f"seed={a.seed}", *a.set]
    if a.sft_steps is not None:
        over.append(f"sft.steps={a.sft_steps}")
    cfg = C.load("quickstart", None, over)
    out.mkdir(parents=True, exist_ok=True)
    path, _ = build_model(cfg, out, lambda msg: print(f"[bench corrections] {msg}", flush=True))
    return path


def run_config(a: argparse.Namespace, kind: str, eta: int, model: pathlib.Path):
    from core import config as C

    return C.load("quickstart", None, [
        f"seed={a.seed}", *a.set,  # --set first: the grid's own settings below are not overridden
        f"model.path={model}", "sft.steps=0", f"max_versions={a.versions}", "target_success=0",
        f"wall_budget_s={a.run_timeout}", f"learner.correction.kind={kind}", f"learner.staleness.eta={eta}",
    ])


def episodes_to_target(scored: list[dict], target: float, window: int) -> int | None:
    """How many scored episodes had been received when the success over the last `window` of them first reached
    `target` (a full window first: a lucky handful of early episodes is not a success rate); None if never."""
    if window <= 0:
        raise ValueError(f"window must be > 0, got {window}")
    wins = 0
    for i, e in enumerate(scored):
        wins += bool(e["success"])
        if i >= window:
            wins -= bool(scored[i - window]["success"])
        if i + 1 >= window and wins / window >= target:
            return i + 1
    return None


def summarise(run_dir: pathlib.Path, target: float, window: int) -> dict:
    """One run's figures from its report.json, episodes.jsonl and learner.jsonl."""
    rep = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").exists() else {}
    eps, steps = read_jsonl(run_dir / "episodes.jsonl"), read_jsonl(run_dir / "learner.jsonl")
    scored = [e for e in eps if e["outcome"] != "infra_error"]
    rl = [m for m in steps if m.get("phase") != "value_pretrain"]

    def mean_of(key: str) -> float | None:
        xs = [m[key] for m in rl if isinstance(m.get(key), (int, float))]
        return round(statistics.fmean(xs), 4) if xs else None

    return {
        "status": rep.get("status", "no report"), "final_success": rep.get("success_last"),
        "success_first": rep.get("success_first"), "episodes_to_target": episodes_to_target(scored, target, window),
        "is_weight_mean": mean_of("is_weight_mean"), "is_ratio_mean": mean_of("is_ratio_mean"),
        "policy_versions": steps[-1]["version"] if steps else 0, "rl_updates": len(rl), "episodes": len(eps),
        "scored_episodes": len(scored), "nonfinite_updates": sum(1 for m in steps if m.get("nonfinite_steps")),
    }


def _fmt(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(out: dict) -> str:
    """The markdown table of the comparison (one row per run)."""
    s = out["settings"]
    rows = [f"| correction | eta | final success | episodes to {s['target']:g} | mean importance weight | "
            "mean pi_learner / pi_behav | versions (RL updates) | episodes | wall s | status |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in out["runs"]:
        reach = "not reached" if r["episodes_to_target"] is None else str(r["episodes_to_target"])
        rows.append(f"| {r['correction']} | {r['eta']} | {_fmt(r['final_success'])} | {reach} | "
                    f"{_fmt(r['is_weight_mean'])} | {_fmt(r['is_ratio_mean'])} | {r['policy_versions']} "
                    f"({r['rl_updates']}) | {r['episodes']} | {r['wall_s']:.0f} | {r['status']} |")
    return "\n".join(rows)


def run(a: argparse.Namespace) -> dict:
    work = pathlib.Path(a.out).resolve() if a.out else pathlib.Path(tempfile.mkdtemp(prefix="tars-bench-corr-"))
    t_start, load_start = time.time(), os.getloadavg()
    t0 = time.perf_counter()
    model = build_shared_model(a, work / "shared")
    shared_s = time.perf_counter() - t0
    runs = []
    for kind in a.corrections:
        for eta in a.etas:
            d = work / f"{kind}-eta{eta}"
            print(f"[bench corrections] {kind}, eta={eta}: {a.versions} policy versions from {model}", flush=True)
            t0 = time.perf_counter()
            rc, tail = tars_up(run_config(a, kind, eta, model), d, a.run_timeout + 300)
            r = {"correction": kind, "eta": eta, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1),
                 **summarise(d, a.target, a.window), "run_dir": str(d) if a.out else None,
                 "log_tail": tail if rc != 0 else ""}
            runs.append(r)
            print(f"[bench corrections]   -> success_last {_fmt(r['final_success'])}, episodes to {a.target:g}: "
                  f"{r['episodes_to_target'] or 'not reached'}, is_weight_mean {_fmt(r['is_weight_mean'])}, "
                  f"{r['policy_versions']} versions, {r['wall_s']:.0f} s ({r['status']})", flush=True)
    if not a.out:
        shutil.rmtree(work, ignore_errors=True)
    out = {
        "machine": {"cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
                    "loadavg_start": [round(x, 2) for x in load_start],
                    "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
        "settings": {"preset": "quickstart", "versions": a.versions, "corrections": list(a.corrections),
                     "etas": list(a.etas), "target": a.target, "window": a.window, "seed": a.seed, "set": list(a.set),
                     "model": str(model) if a.model else None, "sft_steps": a.sft_steps, "work_dir": a.out,
                     "shared_model_s": round(shared_s, 1) if not a.model else None},
        "runs": runs,
        "wall_s": round(time.time() - t_start, 1),
    }
    out["table"] = table(out)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(out, indent=2))
    return out


def _csv(kind, choices=None):
    def parse(text: str):
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        vals = []
        for x in items:
            try:
                v = kind(x)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{x!r} is not a {kind.__name__}") from None
            if choices is not None and v not in choices:
                raise argparse.ArgumentTypeError(f"{x!r} is not one of {' | '.join(map(str, choices))}")
            if kind is int and v < 0:
                raise argparse.ArgumentTypeError(f"{x!r} must be >= 0")
            vals.append(v)
        if len(set(vals)) != len(vals):
            raise argparse.ArgumentTypeError(f"{text!r} names one value twice")
        return tuple(vals)
    return parse


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tars bench corrections", description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="FILE", help="write every run's figures, the settings and the table here")
    ap.add_argument("--versions", type=int, help=f"policy versions per run (max_versions; default {DEFAULT_VERSIONS})")
    ap.add_argument("--corrections", type=_csv(str, CorrectionConfig.KINDS), default=CorrectionConfig.KINDS,
                    help="comma-separated learner.correction.kind values (default: all four)")
    ap.add_argument("--etas", type=_csv(int), help="comma-separated learner.staleness.eta values (default 0,2,8)")
    ap.add_argument("--quick", action="store_true",
                    help=f"a smoke setting: {QUICK['versions']} versions at eta {QUICK['etas'][0]}, "
                         f"{QUICK['sft_steps']} SFT steps, no value pretraining (not the table)")
    ap.add_argument("--model", metavar="DIR", help="start every run from this checkpoint (no SFT here)")
    ap.add_argument("--sft-steps", dest="sft_steps", type=int, help="SFT steps of the shared warm start "
                    "(default: the quickstart's)")
    ap.add_argument("--target", type=float, default=DEFAULT_TARGET, help="the success of episodes_to_target (0.8)")
    ap.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                    help=f"scored episodes the success of episodes_to_target is taken over ({DEFAULT_WINDOW})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for the shared model and every run (e.g. actor.concurrency=8)")
    ap.add_argument("--run-timeout", dest="run_timeout", type=float, default=DEFAULT_RUN_TIMEOUT_S,
                    help="safety wall limit of one run in seconds (its budget is --versions)")
    ap.add_argument("--out", help="keep the shared model and the runs' directories here (default: a temporary one)")
    a = ap.parse_args(argv)
    a.versions = a.versions if a.versions is not None else (QUICK["versions"] if a.quick else DEFAULT_VERSIONS)
    a.etas = a.etas if a.etas is not None else (QUICK["etas"] if a.quick else DEFAULT_ETAS)
    if a.quick:
        a.sft_steps = a.sft_steps if a.sft_steps is not None else QUICK["sft_steps"]
        a.set = [*QUICK["set"], *a.set]
    if a.versions <= 0:
        ap.error("--versions must be > 0")
    if not 0 < a.target <= 1:
        ap.error("--target must be in (0, 1]")
    if a.window <= 0:
        ap.error("--window must be > 0")
    if a.sft_steps is not None and a.sft_steps < 0:
        ap.error("--sft-steps must be >= 0")
    if not a.run_timeout > 0:
        ap.error("--run-timeout must be > 0")
    if a.model and not pathlib.Path(a.model, "config.json").is_file():
        ap.error(f"--model {a.model}: no config.json there")
    from core import config as C

    try:  # a bad --set is one clear error now, not a failed run per grid cell later
        C.load("quickstart", None, list(a.set))
    except C.ConfigError as e:
        ap.error(f"--set: {e}")
    return a


def main(argv: list[str] | None = None) -> int:
    out = run(parse(argv))
    print(out["table"])
    return 0 if all(r["rc"] == 0 for r in out["runs"]) else 1
