"""Run monitoring and the run report: reads the learner's episodes.jsonl / learner.jsonl as they grow.

report.json (stable, read by outside checks):
  episodes          trajectories received by the learner in this run (infra_error included, counted apart); a run
                    in a directory used before counts only what was logged since it started
  infra_errors      infra_error episodes; infra_errors_by_fault: the same by the part that broke ({"inference": n, ...})
  truncated         truncated episodes; truncated_by: the same by what cut them ({"context": n, "max_turns": n, ...};
                    "unknown" for episodes logged before the learner recorded it)
  success_first     success rate over the first 10 % of scored episodes (infra_error excluded)
  success_last      success rate over the last 10 %
  success_sft       success of episodes generated entirely by the warm-started policy (version 0), or null
  policy_version    final policy version
  wall_s            whole command, set-up of the model and SFT included
  trajectories_per_s episodes per second of RL time
  max_staleness     largest (train version - oldest token version) seen in a training batch
  episode_staleness_mean  mean (learner version on arrival - oldest token version) of received episodes
  trajectories_per_s_peak best 10 s window
  status            why the run ended; with "; not written: ..." appended when an output is missing
  not_written       output -> why it is not there (final/ the learner did not export in this run, a plot that
                    failed); {} when everything was written
  held_out          only with evaluation.episodes > 0 (tars/heldout.py): per-task success of the start and the final
                    policy on held-out seeds, their means and differences ({"error": ...} when it could not run)
learning.png: success/return, per-version batch figures, throughput over time, staleness histogram and per update.

write_report returns the report plus "written": the paths it checked or wrote successfully, and only those (a full
disk, an unwritable or occupied final/ path is in not_written with its error instead; report.json itself too, when
it could not be written).
"""
from __future__ import annotations

import json
import os
import pathlib

import numpy as np


class Monitor:
    def __init__(self, run_dir: pathlib.Path):
        self.run = pathlib.Path(run_dir)
        self.eps: list[dict] = []
        self.steps: list[dict] = []
        self._pos = {"episodes.jsonl": 0, "learner.jsonl": 0}
        # A restarted learner replays the trajectories it had not trained on and logs each arrival again: an episode
        # counts once, at its first line.
        self._ids: set[str] = set()

    def _tail(self, name: str, into: list) -> None:
        p = self.run / name
        if not p.exists():
            return
        with open(p, "rb") as f:
            f.seek(self._pos[name])
            data = f.read()
        end = data.rfind(b"\n") + 1  # only whole lines; a half-written one waits for the next poll
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if name == "episodes.jsonl" and isinstance(rec, dict) and rec.get("id"):
                if rec["id"] in self._ids:
                    continue
                self._ids.add(rec["id"])
            into.append(rec)
        self._pos[name] += end

    def poll(self) -> None:
        self._tail("episodes.jsonl", self.eps)
        self._tail("learner.jsonl", self.steps)

    def at_end(self) -> "Monitor":
        """Read only what is appended from now on (the logs of earlier runs in the same directory are left out)."""
        for name in self._pos:
            p = self.run / name
            self._pos[name] = p.stat().st_size if p.exists() else 0
        return self

    def since(self, t: float) -> "Monitor":
        """The records logged at or after time t: a new `tars up` in the same directory appends to the logs of the
        runs before it, whose episodes are not this run's."""
        m = Monitor(self.run)
        m.eps = [e for e in self.eps if e.get("t", t) >= t]
        m.steps = [s for s in self.steps if s.get("t", t) >= t]
        m._pos, m._ids = dict(self._pos), set(self._ids)
        return m

    @property
    def episodes(self) -> int:
        return len(self.eps)

    def scored(self) -> list[dict]:
        return [e for e in self.eps if e["outcome"] != "infra_error"]

    def _count(self, outcome: str, key: str) -> dict[str, int]:
        """Episodes of `outcome` by their `key` ("unknown" where an older log lacks it), sorted by name."""
        out: dict[str, int] = {}
        for e in self.eps:
            if e["outcome"] == outcome:
                k = e.get(key) or "unknown"
                out[k] = out.get(k, 0) + 1
        return dict(sorted(out.items()))

    def infra_by_fault(self) -> dict[str, int]:
        """infra_error episodes by the part that broke (core.outcome.Fault: envd, env, inference, judge; "unknown"
        for episodes logged before the learner recorded it)."""
        return self._count("infra_error", "fault")

    def truncated_by(self) -> dict[str, int]:
        """truncated episodes by what cut them (core.schema.CUTS: max_turns, env, parse_error, context)."""
        return self._count("truncated", "truncated_by")

    def rolling_success(self, n: int = 256) -> float | None:
        s = self.scored()[-n:]
        return float(np.mean([e["success"] for e in s])) if s else None

    def progress_line(self, elapsed: float) -> str:
        v = self.steps[-1]["version"] if self.steps else 0
        st = self.steps[-1].get("max_staleness", 0) if self.steps else 0
        rs = self.rolling_success()
        by = self.infra_by_fault()
        infra = f"{sum(by.values())}" + (f" ({', '.join(f'{k} {n}' for k, n in by.items())})" if by else "")
        return (f"t={elapsed:5.0f}s  episodes={len(self.eps):6d}  success(last 256)="
                f"{'-' if rs is None else f'{rs:.3f}'}  version={v:4d}  staleness={st}  "
                f"traj/s={len(self.eps) / max(elapsed, 1e-9):6.1f}  infra_errors={infra}")


def final_problem(final: pathlib.Path, since: float | None) -> str | None:
    """None if `final` is a model directory the learner exported (at or after `since`, a time.time()), else why not."""
    if not final.exists():
        return "missing (the learner did not export it)"
    if not final.is_dir():
        return "not a directory (the learner's export could not replace it)"
    cfg = final / "config.json"
    weights = ("model.safetensors", "model.safetensors.index.json")
    if not cfg.is_file() or not any((final / w).is_file() for w in weights):
        return "incomplete (no config.json or weights)"
    if since is not None and cfg.stat().st_mtime < since - 1.0:
        return "left from an earlier run (the learner did not export it in this one)"
    return None


def write_report(run_dir: pathlib.Path, mon: Monitor, wall_s: float, sft_used: bool, sft_s: float | None,
                 status: str, since: float | None = None, restarts: dict[str, int] | None = None,
                 held_out: dict | None = None, max_versions: int | None = None) -> dict:
    """report.json and learning.png, and a check of the learner's final/ export (written at or after `since`).
    Returns the report with "written" (paths actually there) and "not_written" (path -> error); never raises on I/O.
    With `since`, only the episodes and updates logged from then on count (an earlier run's are left out)."""
    if since is not None:
        mon = mon.since(since)
    scored = mon.scored()
    k = max(1, len(scored) // 10)
    first = [e["success"] for e in scored[:k]]
    last = [e["success"] for e in scored[-k:]]
    v0 = [e["success"] for e in scored if e["vmax"] == 0]
    t0 = mon.eps[0]["t"] if mon.eps else 0.0
    rl_s = (mon.eps[-1]["t"] - t0) if len(mon.eps) > 1 else 0.0
    rep = {
        "episodes": len(mon.eps),
        "scored_episodes": len(scored),
        "infra_errors": len(mon.eps) - len(scored),
        "infra_errors_by_fault": mon.infra_by_fault(),   # e.g. {"inference": 12}: which part broke
        "truncated": sum(mon.truncated_by().values()),
        "truncated_by": mon.truncated_by(),              # e.g. {"context": 40, "max_turns": 3}: what cut them
        "success_first": float(np.mean(first)) if first else None,
        "success_last": float(np.mean(last)) if last else None,
        "success_sft": (float(np.mean(v0)) if v0 else None) if sft_used else None,
        "policy_version": mon.steps[-1]["version"] if mon.steps else 0,
        "max_versions": max_versions,   # the run's update budget (None: not known to the caller)
        "wall_s": wall_s,
        "rl_s": rl_s,
        "sft_s": sft_s,
        "trajectories_per_s": len(mon.eps) / rl_s if rl_s > 0 else 0.0,
        "max_staleness": max((s.get("max_staleness", 0) for s in mon.steps), default=0),
        "episode_staleness_mean": float(episode_lags(mon).mean()) if len(episode_lags(mon)) else None,
        "trajectories_per_s_peak": float(throughput(mon)[1].max(initial=0.0)),
        "status": status,
        "restarts": dict(restarts or {}),
        "restarts_total": sum((restarts or {}).values()),
    }
    if held_out is not None:
        rep["held_out"] = held_out   # tars/heldout.py: per-task held-out success of the start and the final policy
    rep["warnings"] = warnings(rep)
    written: list[str] = []
    failed: dict[str, str] = {}
    png, final, out = run_dir / "learning.png", run_dir / "final", run_dir / "report.json"
    try:
        plot(png, mon)
        written.append(str(png))
    except Exception as e:  # a full disk (OSError) or anything else matplotlib raises: reported, not fatal
        failed[str(png)] = f"{type(e).__name__}: {e}"
    why = final_problem(final, since)
    if why is None:
        written.append(str(final))
    else:
        failed[str(final)] = why
    if failed:
        rep["status"] = f"{status}; not written: {', '.join(pathlib.Path(k).name for k in failed)}"
    rep["not_written"] = dict(failed)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(rep, indent=2))  # whole or not at all: a full disk leaves the old one
        os.replace(tmp, out)
        written.insert(0, str(out))
    except OSError as e:
        failed[str(out)] = f"{type(e).__name__}: {e}"
        tmp.unlink(missing_ok=True)
    return {**rep, "written": written, "not_written": failed}


INFRA_WARN = 0.10  # infra_error share of episodes above which a report (tars up, tars eval) warns


def infra_warning(infra: int, episodes: int, kept_out: str, see: str, by_fault: dict | None = None) -> str | None:
    """The one rule for both reports: more than INFRA_WARN of the episodes were infra errors -> the warning line
    (what they were kept out of, their faults when known, where to look), else None."""
    if episodes <= 0 or infra <= INFRA_WARN * episodes:
        return None
    faults = " (" + ", ".join(f"{k} {n}" for k, n in by_fault.items()) + ")" if by_fault else ""
    return (f"{infra} of {episodes} episodes ({infra / episodes:.0%}) were infra errors{faults} (kept out of "
            f"{kept_out}): see {see}")


CONTEXT_WARN = 0.10  # share of episodes cut by the context above which `tars up`'s report warns


def context_warning(cut: int, episodes: int) -> str | None:
    """More than CONTEXT_WARN of the episodes ended because the next prompt + max_new_tokens would not fit the
    inference server's max_context -> the warning line naming the settings, else None. (A UI-TARS prompt with one
    screenshot of a vision-language checkpoint is already over 1,000 tokens: core.vlm.VLSpec.image_tokens.)"""
    if episodes <= 0 or cut <= CONTEXT_WARN * episodes:
        return None
    return (f"{cut} of {episodes} episodes ({cut / episodes:.0%}) were cut by the context (prompt + "
            "actor.max_new_tokens > inference.max_context): raise inference.max_context, or lower "
            "actor.image_history / actor.max_obs_tokens")


HELD_OUT_DROP = 0.05  # a task whose held-out success fell by more than this is named in the warnings


def held_out_warnings(h: dict) -> list[str]:
    """tars/heldout.py's summary -> the tasks whose held-out success fell by more than HELD_OUT_DROP, and an
    evaluation cut short."""
    out = []
    worse = {t: v["delta"] for t, v in h["tasks"].items() if v["delta"] is not None and v["delta"] < -HELD_OUT_DROP}
    if worse:
        out.append("held-out success fell by more than " + f"{HELD_OUT_DROP:.2f} on " +
                   ", ".join(f"{t} ({d:+.2f})" for t, d in sorted(worse.items())) + " (heldout/summary.md)")
    if not h["complete"]:
        out.append("the held-out evaluation was interrupted: its figures cover the episodes that finished")
    return out


def warnings(rep: dict) -> list[str]:
    """What a reader of the report must not miss: a run that mostly failed for infrastructure reasons, or did not
    train at all, would otherwise look like a policy that learnt nothing."""
    out = []
    if rep["episodes"] == 0:
        out.append("no episode reached the learner: see logs/ (envd, inference, actor)")
    elif w := infra_warning(rep["infra_errors"], rep["episodes"], "the loss", "logs/envd*.log and logs/inference.log",
                            rep.get("infra_errors_by_fault")):
        out.append(w)
    if w := context_warning(rep["truncated_by"].get("context", 0), rep["episodes"]):
        out.append(w)
    if rep["policy_version"] == 0:
        out.append("no policy update happened: the policy is the one the run started from")
    elif (rep["status"] == "wall budget reached" and rep.get("max_versions")
          and rep["policy_version"] < rep["max_versions"]):
        out.append(f"the wall budget (wall_budget_s) stopped RL at policy version {rep['policy_version']} of "
                   f"max_versions {rep['max_versions']}: this host trained fewer updates than the run asked for, so "
                   "its figures are not comparable with a run that reached max_versions")
    if rep.get("held_out"):
        out += (held_out_warnings(rep["held_out"]) if "error" not in rep["held_out"]
                else [f"the held-out evaluation failed: {rep['held_out']['error']}"])
    if rep["restarts_total"]:
        out.append("restarted: " + ", ".join(f"{k} x{v}" for k, v in sorted(rep["restarts"].items()))
                   + " (supervisor.jsonl)")
    return out


def _no_data(ax) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey", fontsize=14)


def plot(path: pathlib.Path, mon: Monitor) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scored = mon.scored()
    fig, grid = plt.subplots(2, 3, figsize=(15, 8))
    axes = grid[0]
    plot_throughput(grid[1][0], mon)
    plot_staleness(grid[1][1], grid[1][2], mon)
    if scored:
        t0 = scored[0]["t"]
        t = np.array([e["t"] - t0 for e in scored])
        s = np.array([float(e["success"]) for e in scored])
        r = np.array([e["return"] for e in scored])
        w = max(1, min(256, len(s) // 10))
        kern = np.ones(w) / w
        sm, rm = np.convolve(s, kern, "valid"), np.convolve(r, kern, "valid")
        axes[0].plot(t[w - 1:], sm, label="success")
        axes[0].plot(t[w - 1:], rm, label="return", alpha=0.7)
        axes[0].set_xlabel("seconds of RL")
        axes[0].set_title(f"rolling mean over {w} episodes")
        axes[0].legend()
        axes[0].set_ylim(-0.15, 1.05)
    else:
        _no_data(axes[0])
    if mon.steps:
        v = [m["version"] for m in mon.steps]
        axes[1].plot(v, [m["success"] for m in mon.steps], ".", alpha=0.4, label="batch success")
        axes[1].plot(v, [m["ret"] for m in mon.steps], "-", alpha=0.6, label="batch return")
        axes[1].set_xlabel("policy version")
        axes[1].set_ylim(-0.15, 1.05)
        axes[1].legend()
        axes[2].plot(v, [m.get("max_staleness", 0) for m in mon.steps], label="max staleness")
        axes[2].plot(v, [m.get("entropy", 0) for m in mon.steps], label="entropy")
        axes[2].set_xlabel("policy version")
        axes[2].legend()
    else:
        _no_data(axes[1])
        _no_data(axes[2])
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def throughput(mon: Monitor, window_s: float = 10.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(window end in seconds of RL, trajectories/s, policy updates/s) over consecutive windows."""
    if len(mon.eps) < 2:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    t0 = mon.eps[0]["t"]
    te = np.array([e["t"] - t0 for e in mon.eps])
    ts = np.array([m["t"] - t0 for m in mon.steps if "t" in m])
    w = max(1.0, min(window_s, te[-1] / 5)) if te[-1] > 0 else 1.0
    edges = np.arange(0.0, te[-1] + w, w)
    if len(edges) < 2:
        edges = np.array([0.0, w])
    traj = np.histogram(te, edges)[0] / w
    ups = np.histogram(ts, edges)[0] / w if len(ts) else np.zeros(len(edges) - 1)
    return edges[1:], traj, ups


def episode_lags(mon: Monitor) -> np.ndarray:
    """Per received episode: learner version on arrival - oldest policy version among its tokens."""
    return np.array([e["train_version"] - e["vmin"] for e in mon.eps if e.get("vmin", -1) >= 0], np.int64)


def plot_throughput(ax, mon: Monitor) -> None:
    t, traj, ups = throughput(mon)
    if len(t):
        ax.plot(t, traj, "-o", ms=3, label="trajectories/s")
        ax.plot(t, ups * 10, "-", alpha=0.7, label="policy updates/s x10")
        ax.legend()
    else:
        _no_data(ax)
    ax.set_xlabel("seconds of RL")
    ax.set_title("throughput")


def plot_staleness(ax_hist, ax_steps, mon: Monitor) -> None:
    lags = episode_lags(mon)
    if len(lags):
        ax_hist.bar(*np.unique(lags, return_counts=True), width=0.8)
    else:
        _no_data(ax_hist)
    ax_hist.set_xlabel("versions behind on arrival (oldest token)")
    ax_hist.set_ylabel("episodes")
    ax_hist.set_title("staleness of received episodes")
    if mon.steps:
        ax_steps.plot([m["version"] for m in mon.steps], [m.get("max_staleness", 0) for m in mon.steps], label="max in batch")
        ax_steps.plot([m["version"] for m in mon.steps], [m.get("queue", 0) for m in mon.steps], alpha=0.7,
                      label="learner queue depth")
        ax_steps.legend()
    else:
        _no_data(ax_steps)
    ax_steps.set_xlabel("policy version")
    ax_steps.set_title("staleness and buffer per update")
