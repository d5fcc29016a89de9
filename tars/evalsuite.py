"""Benchmark suites and their results: suite files -> task list; episodes.jsonl -> results.json / .md / .png;
two result directories -> a comparison.

A suite is a YAML file (shipped ones live in tars/suites/, users pass their own path):

    name: builtin
    description: the built-in widget tasks
    episodes: 20            # per task, unless a task says otherwise (the CLI's --episodes overrides all)
    max_turns: 6            # step budget per episode (default: the config's actor.max_turns)
    seed: 0                 # episode i of task t always gets the same env seed, whatever the policy
    held_out: false         # true: seeds no training episode draws (core.config.HELD_OUT_SEED_BASE and above)
    options: {}             # env options for every task (CreateSession options)
    tasks:
      - builtin/click                       # a bare env id
      - env: builtin/menu                   # or a mapping
        name: menu-long                     # result key (default: the env id); must be unique
        episodes: 10
        max_turns: 8
        options: {max_steps: 8}
        human_score: 120.0                  # optional: reported as a human-normalised score

Human-normalised score: when a task has a human score (from the suite, or `human_score` in the env's final info),
each episode's agent score (the env's `score` in its final info if it reports one, else the episode return) is
averaged per task, normalised = 100 * agent / human, and the overall figure averages that over such tasks.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pathlib
from dataclasses import dataclass, field
from typing import Any

import yaml

from core.config import HELD_OUT_SEED_BASE, UserError, load_yaml
from tars.evalstats import interval, paired, wilson

SUITES = pathlib.Path(__file__).parent / "suites"
INFRA = "infra_error"


class SuiteError(ValueError):
    """A suite file is missing or malformed; the message says which file and which entry."""


class EvalError(UserError):
    """What `tars eval` was asked cannot be done (a model, a tokenizer, a results directory of another
    evaluation, a results file it cannot read): one line, exit status 2."""


@dataclass
class TaskSpec:
    name: str
    env_id: str
    episodes: int
    max_turns: int | None = None
    options: dict[str, str] = field(default_factory=dict)
    human_score: float | None = None


@dataclass
class Suite:
    name: str
    path: str
    tasks: list[TaskSpec]
    seed: int = 0
    description: str = ""
    held_out: bool = False

    def seed_of(self, task: str, episode: int) -> int:
        # Stable across runs and policies (not Python's salted hash): baselines and models see the same episodes.
        h = int.from_bytes(hashlib.sha256(f"{self.seed}:{task}:{episode}".encode()).digest()[:4], "little")
        if self.held_out:  # the upper half of the seed range, which training never draws from
            return HELD_OUT_SEED_BASE | (h % HELD_OUT_SEED_BASE)
        return h & 0x7FFFFFFF


def available() -> list[str]:
    return sorted(p.stem for p in SUITES.glob("*.yaml"))


def _positive_int(v: Any, what: str, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise SuiteError(f"{where}: {what} must be a positive integer, got {v!r}")
    return v


def _options(v: Any, where: str) -> dict[str, str]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise SuiteError(f"{where}: options must be a mapping of name -> value, got {type(v).__name__}")
    return {str(k): str(x) for k, x in v.items()}


def load_suite(name_or_path: str, episodes: int | None = None, only: list[str] | None = None) -> Suite:
    """Load a shipped suite by name or a suite file by path; `episodes` overrides every task's count; `only`
    keeps the named tasks (by name or env id) and fails on names the suite does not have."""
    p = pathlib.Path(name_or_path)
    if not p.suffix and not p.exists():
        p = SUITES / f"{name_or_path}.yaml"
        if not p.exists():
            raise SuiteError(f"no suite {name_or_path!r}: shipped suites are {available()}; or pass a YAML file path")
    if not p.is_file():
        raise SuiteError(f"suite file {str(p)!r} does not exist")
    try:
        d = load_yaml(p.read_text())
    except yaml.YAMLError as e:
        raise SuiteError(f"{p}: not valid YAML: {e}") from None
    where = str(p)
    if not isinstance(d, dict) or not isinstance(d.get("tasks"), list) or not d["tasks"]:
        raise SuiteError(f"{where}: a suite is a mapping with a non-empty `tasks` list")
    unknown = set(d) - {"name", "description", "episodes", "max_turns", "seed", "held_out", "options", "tasks"}
    if unknown:
        raise SuiteError(f"{where}: unknown keys {sorted(unknown)}")
    default_eps = _positive_int(d.get("episodes", 10), "episodes", where)
    default_turns = d.get("max_turns")
    if default_turns is not None:
        _positive_int(default_turns, "max_turns", where)
    base_opts = _options(d.get("options"), where)
    seed = d.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise SuiteError(f"{where}: seed must be an integer, got {seed!r}")
    held_out = d.get("held_out", False)
    if not isinstance(held_out, bool):
        raise SuiteError(f"{where}: held_out must be true or false, got {held_out!r}")
    tasks: list[TaskSpec] = []
    for i, t in enumerate(d["tasks"]):
        at = f"{where}: tasks[{i}]"
        if isinstance(t, str):
            t = {"env": t}
        if not isinstance(t, dict) or not isinstance(t.get("env"), str) or not t["env"].strip():
            raise SuiteError(f"{at}: a task is an env id string or a mapping with an `env` id, got {t!r}")
        bad = set(t) - {"env", "name", "episodes", "max_turns", "options", "human_score"}
        if bad:
            raise SuiteError(f"{at}: unknown keys {sorted(bad)}")
        hs = t.get("human_score")
        if hs is not None and (isinstance(hs, bool) or not isinstance(hs, (int, float)) or hs == 0):
            raise SuiteError(f"{at}: human_score must be a non-zero number, got {hs!r}")
        mt = t.get("max_turns", default_turns)
        tasks.append(TaskSpec(
            name=str(t.get("name") or t["env"]).strip(), env_id=t["env"].strip(),
            episodes=_positive_int(t.get("episodes", default_eps), "episodes", at),
            max_turns=None if mt is None else _positive_int(mt, "max_turns", at),
            options={**base_opts, **_options(t.get("options"), at)},
            human_score=None if hs is None else float(hs)))
    names = [t.name for t in tasks]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise SuiteError(f"{where}: task names must be unique; repeated: {dup} (give repeats a `name`)")
    if only:
        known = {t.name for t in tasks} | {t.env_id for t in tasks}
        missing = [x for x in only if x not in known]
        if missing:
            raise SuiteError(f"{where}: --tasks names {missing} are not in the suite")
        tasks = [t for t in tasks if t.name in only or t.env_id in only]
    if episodes is not None:
        tasks = [dataclasses.replace(t, episodes=_positive_int(episodes, "--episodes", "command line")) for t in tasks]
    return Suite(name=str(d.get("name") or p.stem), path=str(p.resolve()), tasks=tasks, seed=seed,
                 description=str(d.get("description") or ""), held_out=held_out)


def check_env_ids(suite: Suite, env_options: dict | None = None, local: bool = False) -> None:
    """Every task's env id must have a backend, which must take the task's session options: `env_options` (the
    config's actor.env_options) under the task's own, as the episodes will create them (checked before anything
    starts); with `local` (envd will run on this host) the host programs its backend needs must be installed."""
    from core.config import UserError
    from tars.checks import env_hosts, env_ids, env_options as check_options

    for t in suite.tasks:
        try:  # a backend for its prefix, and its task among the ones the backend lists (tars up checks the same)
            env_ids([t.env_id], f"{suite.path}: task {t.name!r}")
            check_options([t.env_id], {**(env_options or {}), **t.options},
                          f"{suite.path}: task {t.name!r}: actor.env_options with the suite's options")
            if local:
                env_hosts([t.env_id], f"{suite.path}: task {t.name!r} (envd runs on this host; --envd names another)")
        except UserError as e:
            raise SuiteError(str(e)) from None


# ---- episodes.jsonl ---------------------------------------------------------------------------------------

REQUIRED = ("task", "episode", "outcome", "success", "return", "steps")


def read_episodes(path: pathlib.Path) -> list[dict]:
    """Every whole record; a line cut short by a crash is skipped. A record missing a field the results need is an
    EvalError naming the file and the line."""
    out = []
    if path.exists():
        for n, line in enumerate(path.read_bytes().splitlines(), 1):
            try:
                r = json.loads(line)
            except ValueError:
                continue
            missing = [k for k in REQUIRED if k not in r] if isinstance(r, dict) else list(REQUIRED)
            if not missing:
                try:
                    r["episode"] = int(r["episode"])
                except (TypeError, ValueError):
                    missing = ["episode (an integer)"]
            if missing:
                raise EvalError(f"{path}:{n}: not an episode record (no {', '.join(missing)}): remove or repair the "
                                "line, or use another --out")
            out.append(r)
    return out


def latest(records: list[dict]) -> dict[tuple[str, int], dict]:
    """(task, episode) -> its last record (a retried infra_error is replaced by the retry)."""
    return {(r["task"], int(r["episode"])): r for r in records}


# ---- aggregation ------------------------------------------------------------------------------------------

def _mean(xs: list[float]) -> float | None:
    return float(sum(xs) / len(xs)) if xs else None


def summarise(suite: Suite, records: list[dict], meta: dict | None = None) -> dict:
    """results.json: per task and overall. Infra errors are counted apart and left out of every rate."""
    by = latest(records)
    tasks: dict[str, dict] = {}
    norm: list[float] = []
    pooled: list[dict] = []  # every task's scored episodes within its plan: overall.episode_success_rate
    for t in suite.tasks:
        rs = [r for (name, i), r in sorted(by.items()) if name == t.name and i < t.episodes]
        ok = [r for r in rs if r["outcome"] != INFRA]
        pooled += ok
        human = t.human_score
        if human is None:
            hs = [r["human_score"] for r in ok if isinstance(r.get("human_score"), (int, float)) and r["human_score"]]
            human = _mean(hs)
        row = {
            "env_id": t.env_id, "planned": t.episodes, "episodes": len(rs), "scored": len(ok),
            "infra_errors": len(rs) - len(ok),
            "success_rate": _mean([float(bool(r["success"])) for r in ok]),
            "success_ci95": wilson(sum(bool(r["success"]) for r in ok), len(ok)),   # tars/evalstats.py
            "mean_return": _mean([float(r["return"]) for r in ok]),
            "mean_steps": _mean([float(r["steps"]) for r in ok]),
        }
        if human is not None:
            agent = _mean([float(r["score"] if r.get("score") is not None else r["return"]) for r in ok])
            row["human_score"] = human
            row["agent_score"] = agent
            row["normalised_score"] = None if agent is None else 100.0 * agent / human
            if row["normalised_score"] is not None:
                norm.append(row["normalised_score"])
        tasks[t.name] = row
    scored = [r for r in tasks.values() if r["success_rate"] is not None]
    overall = {
        "tasks": len(tasks),
        # the rates below average over these tasks only: a task with no scored episode has no rate, not a rate of 0
        "tasks_scored": len(scored),
        "tasks_unscored": [name for name, r in tasks.items() if r["episodes"] and r["success_rate"] is None],
        "episodes": sum(r["episodes"] for r in tasks.values()),
        "planned": sum(r["planned"] for r in tasks.values()),
        "scored": sum(r["scored"] for r in tasks.values()),
        "infra_errors": sum(r["infra_errors"] for r in tasks.values()),
        # the suite's headline: every task weighs the same, however many episodes it ran
        "success_rate": _mean([r["success_rate"] for r in scored]),
        "episode_success_rate": _mean([float(bool(r["success"])) for r in pooled]),
        "mean_return": _mean([r["mean_return"] for r in scored]),
        "mean_steps": _mean([r["mean_steps"] for r in scored]),
    }
    if norm:
        overall["normalised_score"] = _mean(norm)
        overall["normalised_tasks"] = len(norm)
    return {"suite": suite.name, **(meta or {}), "overall": overall, "tasks": tasks, "warnings": warnings(overall)}


def warnings(overall: dict) -> list[str]:
    """What a reader of the results must not miss: many infra errors (the 10 % rule of `tars up`'s report,
    tars.report.infra_warning), and tasks whose rate is missing because none of their episodes was scored."""
    from tars.report import infra_warning

    out = []
    if w := infra_warning(overall["infra_errors"], overall["episodes"], "every rate", "the `error` field of "
                          "episodes.jsonl and the envd/inference logs; `--retry-infra` reruns them"):
        out.append(w)
    if overall["tasks_unscored"]:
        n = len(overall["tasks_unscored"])
        out.append(f"{n} of {overall['tasks']} task(s) had no scored episode (all infra errors) and are not in the "
                   f"overall figures: {', '.join(overall['tasks_unscored'])}")
    return out


def headline(o: dict) -> str:
    """The overall figure in words: over how many tasks it averages and what it leaves out."""
    sr = _f(o["success_rate"])
    over = (f"over {o['tasks']} tasks" if o["tasks_scored"] == o["tasks"] else
            f"over {o['tasks_scored']} of {o['tasks']} tasks ({o['tasks'] - o['tasks_scored']} with no scored episode)")
    return f"success {sr} {over}, {o['scored']} scored episodes, {o['infra_errors']} unscored (infra errors)"


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def markdown(res: dict) -> str:
    has_norm = any("normalised_score" in r for r in res["tasks"].values())
    head = (["task", "episodes", "scored", "success", "95% interval", "mean return", "mean steps",
             "unscored (infra errors)"]
            + (["normalised"] if has_norm else []))
    lines = [f"# {res['suite']}: {res.get('model', '')}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = [*res["tasks"].items(), ("**overall**", res["overall"])]
    for name, r in rows:
        ci = r.get("success_ci95")
        cells = [name, str(r["episodes"]), str(r["scored"]), _f(r["success_rate"]),
                 f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "-", _f(r["mean_return"]),
                 _f(r["mean_steps"], ".2f"), str(r["infra_errors"])]
        if has_norm:
            cells.append(_f(r.get("normalised_score"), ".1f"))
        lines.append("| " + " | ".join(cells) + " |")
    o = res["overall"]
    n_sc = o.get("tasks_scored", o["tasks"])
    lines += ["", f"Overall success is the mean of per-task success rates over the {n_sc} of {o['tasks']} tasks "
              f"with a scored episode ({o['scored']} scored episodes; {o['infra_errors']} infra errors excluded)."]
    if res.get("warnings"):
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in res["warnings"]]
    return "\n".join(lines) + "\n"


def figure(res: dict):
    """results.png's figure: one bar per task with a scored episode (its success rate); a task without one gets no
    bar and an "n/a" label instead (a bar of height 0 would read as a success rate of 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["tasks"])
    rates = [res["tasks"][n]["success_rate"] for n in names]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.22 * len(names) + 2), 4.5))
    scored = [i for i, v in enumerate(rates) if v is not None]
    ax.bar(scored, [rates[i] for i in scored], color="tab:blue")
    for i, v in enumerate(rates):
        if v is None:
            ax.text(i, 0.02, "n/a", ha="center", va="bottom", rotation=90, fontsize=7, color="0.4")
    ax.set_xticks(range(len(names)), names, rotation=90, fontsize=7 if len(names) > 20 else 9)
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("success rate (infra errors excluded; n/a: no scored episode)")
    o = res["overall"]
    ax.set_title(f"{res['suite']} - {res.get('model', '')}: overall {_f(o['success_rate'])}")
    fig.tight_layout()
    return fig


def plot(res: dict, path: pathlib.Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(res)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_results(out: pathlib.Path, res: dict) -> None:
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(res, indent=2))
    tmp.replace(out / "results.json")
    (out / "results.md").write_text(markdown(res))
    plot(res, out / "results.png")


# ---- comparison -------------------------------------------------------------------------------------------

def paired_dirs(dir_a: str | pathlib.Path, dir_b: str | pathlib.Path) -> dict:
    """evalstats.paired over two `tars eval` directories' episodes.jsonl: B - A episode by episode."""
    return paired(*(latest(read_episodes(pathlib.Path(d) / "episodes.jsonl")) for d in (dir_a, dir_b)))


def compare(dir_a: str, dir_b: str, out: str | None = None) -> str:
    """A side-by-side Markdown table of two results.json (B - A per task), also written to OUT/compare.md
    (default: DIR_B/compare.md)."""
    res = []
    for d in (dir_a, dir_b):
        p = pathlib.Path(d) / "results.json"
        if not p.is_file():
            raise SuiteError(f"{d}: no results.json (run `tars eval ... --out {d}` first)")
        try:
            r = json.loads(p.read_text())
        except (ValueError, OSError) as e:
            raise SuiteError(f"{p} is not readable ({type(e).__name__}: {e})") from None
        if not isinstance(r, dict) or not isinstance(r.get("tasks"), dict) or not isinstance(r.get("overall"), dict):
            raise SuiteError(f"{p} is not a tars eval results.json (no `tasks` and `overall`)")
        res.append(r)
    a, b = res
    la, lb = a.get("model", dir_a), b.get("model", dir_b)
    pairs = paired_dirs(dir_a, dir_b)   # the same episodes (evaldir.comparable): B - A paired episode by episode
    lines = [f"# compare: A = {la} ({dir_a}), B = {lb} ({dir_b})", "",
             "| task | A success | B success | B - A | B - A 95% interval | A return | B return | A infra | B infra |",
             "|---|---|---|---|---|---|---|---|---|"]
    names = list(a["tasks"]) + [n for n in b["tasks"] if n not in a["tasks"]]
    # B - A overall only over the tasks both scored: each side's own overall may average other tasks
    both = [n for n in names if all(r["tasks"].get(n, {}).get("success_rate") is not None for r in (a, b))]
    over = lambda r, k: _mean([r["tasks"][n][k] for n in both if r["tasks"][n][k] is not None])  # noqa: E731
    own = all({n for n, x in r["tasks"].items() if x["success_rate"] is not None} == set(both) for r in (a, b))
    label = "**overall**" if own else f"**overall** ({len(both)} task(s) both scored)"
    ov = [{**r["overall"], "success_rate": over(r, "success_rate"), "mean_return": over(r, "mean_return")}
          for r in (a, b)]
    for n, ra, rb, ci in [*((n, a["tasks"].get(n), b["tasks"].get(n), pairs["tasks"].get(n, {}).get("ci95"))
                            for n in names), (label, *ov, pairs.get("ci95"))]:
        sa = ra["success_rate"] if ra else None
        sb = rb["success_rate"] if rb else None
        diff = None if sa is None or sb is None else sb - sa
        lines.append(f"| {n} | {_f(sa)} | {_f(sb)} | {'-' if diff is None else f'{diff:+.3f}'} | {interval(ci)} | "
                     f"{_f(ra['mean_return'] if ra else None)} | {_f(rb['mean_return'] if rb else None)} | "
                     f"{ra['infra_errors'] if ra else '-'} | {rb['infra_errors'] if rb else '-'} |")
    if not own:
        lines += ["", f"The overall success and return average the {len(both)} task(s) both directories scored "
                  f"({', '.join(both) or 'none'}), not each one's own overall (A {_f(a['overall']['success_rate'])}, "
                  f"B {_f(b['overall']['success_rate'])}); the infra columns are each directory's total."]
    lines += ["", "The intervals are of B - A paired episode by episode (episodes both scored on the same seed; the "
              "overall one over the tasks with pairs): one that holds 0 is within the episodes' luck "
              "(tars/evalstats.py)."]
    text = "\n".join(lines) + "\n"
    dest = pathlib.Path(out or dir_b)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "compare.md").write_text(text)
    return text
