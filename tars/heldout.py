"""The held-out evaluation at the end of `tars up` (evaluation.episodes > 0).

Two policies, the same episodes: the run's starting point (out/model after the SFT warm start, else the fresh
out/model_init or model.path) and the final RL policy (out/final), each played by `tars eval`'s model policy (its own
envd and inference server, the training config's prompts and parse rules), on every task of actor.env_ids, with
seeds from a held-out suite (core.config.HELD_OUT_SEED_BASE and above: no training episode, demonstration or
tokenizer-corpus episode drew one), episode i of a task getting the same seed for both.

    out/heldout/start/, out/heldout/final/   tars eval's directories (episodes.jsonl, results.json/.md/.png);
                                             (eval.json names the policy's weights and the seeds: a directory of
                                             another policy or other seeds, e.g. an earlier `tars up` in the same
                                             --out, is started over, never resumed; tars/evaldir.py)
    out/heldout/summary.md                   per-task success of both, the means, the differences with their
                                             95% intervals (paired episode by episode: tars/evalstats.py)
    report.json "held_out"                   the same figures

Success is the env's own (MiniWoB++: undecayed reward > 0) over scored episodes; infra errors are counted apart.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib

from core import config as C
from tars import evalsuite as S
from tars.evalstats import interval


def suite(cfg: C.RunConfig) -> S.Suite:
    tasks = [S.TaskSpec(name=e, env_id=e, episodes=cfg.evaluation.episodes, max_turns=cfg.actor.max_turns,
                        options={k: str(v) for k, v in cfg.actor.env_options.items()})
             for e in dict.fromkeys(cfg.actor.env_ids)]
    return S.Suite(name="held-out", path="", tasks=tasks, seed=cfg.seed, held_out=True,
                   description="the run's tasks on held-out seeds")


def run(cfg: C.RunConfig, out: pathlib.Path, start: pathlib.Path, start_label: str, say) -> dict:
    """Evaluate `start` and out/final on the held-out suite -> the summary (also written to summary.md)."""
    from tars.eval import ModelPolicy, evaluate

    ecfg = cfg
    if cfg.evaluation.temperature >= 0:
        ecfg = dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, temperature=cfg.evaluation.temperature))
    su = suite(cfg)
    results = {}
    for key, model in (("start", start), ("final", out / "final")):
        say(f"held-out evaluation of {key} ({model}): {len(su.tasks)} tasks x {cfg.evaluation.episodes} episodes")
        # restart: the directory may hold an earlier run's evaluation (another policy, other seeds): started over
        results[key] = asyncio.run(evaluate(su, ModelPolicy(str(model), ecfg), out / "heldout" / key,
                                            cfg.evaluation.concurrency, say=say, restart=True))
    pairs = S.paired_dirs(out / "heldout" / "start", out / "heldout" / "final")
    summ = summary(results["start"], results["final"], start_label, cfg.evaluation.episodes, pairs)
    (out / "heldout" / "summary.md").write_text(markdown(summ))
    return summ


def _rates(res: dict) -> dict[str, float | None]:
    return {t: r.get("success_rate") for t, r in res["tasks"].items()}


def summary(start: dict, final: dict, start_label: str, episodes: int, pairs: dict | None = None) -> dict:
    """`pairs`: evalstats.paired of the two evaluations' episodes (the differences' 95% intervals)."""
    a, b = _rates(start), _rates(final)
    pairs = pairs or {"tasks": {}}
    tasks = {}
    for t in a:
        d = None if a[t] is None or b.get(t) is None else b[t] - a[t]
        ci = pairs["tasks"].get(t, {}).get("ci95")
        tasks[t] = {"start": a[t], "final": b.get(t), "delta": d, "delta_ci95": None if ci is None else list(ci)}
    both = [v for v in tasks.values() if v["delta"] is not None]
    mean = lambda k: sum(v[k] for v in both) / len(both) if both else None  # noqa: E731
    ms, mf = mean("start"), mean("final")
    return {
        "start_model": start_label,
        "episodes_per_task": episodes,
        "seeds": f"held out: >= {C.HELD_OUT_SEED_BASE}, the same for both",
        "tasks": tasks,
        "mean_start": ms,
        "mean_final": mf,
        "delta": None if ms is None else mf - ms,
        "delta_se": pairs.get("se"), "delta_ci95": list(pairs["ci95"]) if "ci95" in pairs else None,
        "worst_delta": min((v["delta"] for v in both), default=None),
        "infra_errors": {"start": start["overall"].get("infra_errors", 0), "final": final["overall"].get("infra_errors", 0)},
        "complete": bool(start.get("complete", True) and final.get("complete", True)),
    }


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def markdown(h: dict) -> str:
    lines = [f"# Held-out evaluation ({h['episodes_per_task']} episodes a task, seeds {h['seeds']})", "",
             f"| task | {h['start_model']} | final (RL) | difference | 95% interval |", "|---|---|---|---|---|"]
    for t, v in h["tasks"].items():
        lines.append(f"| {t} | {_f(v['start'])} | {_f(v['final'])} | "
                     f"{'-' if v['delta'] is None else format(v['delta'], '+.3f')} | {interval(v.get('delta_ci95'))} |")
    lines.append(f"| **mean** | **{_f(h['mean_start'])}** | **{_f(h['mean_final'])}** | "
                 f"**{'-' if h['delta'] is None else format(h['delta'], '+.3f')}** | {interval(h.get('delta_ci95'))} |")
    lines += ["", f"infra errors (not scored): {json.dumps(h['infra_errors'])}", "",
              "The intervals are of the difference, paired episode by episode (the same seeds): a task whose interval "
              "holds 0 did not change beyond what its episodes' luck explains (tars/evalstats.py).", ""]
    return "\n".join(lines)
