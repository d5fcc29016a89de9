"""How far an evaluation's success rates can be trusted: a 95% interval per rate, and for two policies played on the
same episodes (the same task seeds: `tars eval --compare` of comparable directories, the held-out evaluation of
`tars up`) the difference with its standard error, paired episode by episode.

A difference of 0.1 on 50 episodes a task is within two standard errors of none for most success rates; runs of
the miniwob preset moved single tasks by that much either way (docs/miniwob.md). The overall figure is the mean of
the tasks' means, so its standard error is sqrt(sum of the tasks' variances) / number of tasks.
"""
from __future__ import annotations

import math

Z95 = 1.959964


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float] | None:
    """The Wilson score interval of a success rate (None without episodes): unlike p +- z*se it stays inside [0, 1]
    and is not empty at 0 or 1 successes."""
    if n <= 0:
        return None
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _ci(m: float, se: float) -> tuple[float, float]:
    """m +- 1.96 se, within what a difference of two rates can be ([-1, 1]; with few pairs the normal
    approximation would reach past it)."""
    return max(-1.0, m - Z95 * se), min(1.0, m + Z95 * se)


def _diff(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """(mean of b - a, its variance) over paired episodes."""
    n = len(pairs)
    d = [b - a for a, b in pairs]
    m = sum(d) / n
    var = sum((x - m) ** 2 for x in d) / (n - 1) / n if n > 1 else 0.0
    return m, var


def paired(a: dict[tuple[str, int], dict], b: dict[tuple[str, int], dict], infra: str = "infra_error") -> dict:
    """B - A success, per task and over the tasks, from two sets of episode records keyed (task, episode) (as
    evalsuite.latest gives them). Only episodes both scored on the same seed count (an infra error on either side, or
    seeds that differ, leave the pair out). Per task: pairs, delta, se, ci95; overall: the mean of the tasks' deltas,
    its se and ci95."""
    tasks: dict[str, dict] = {}
    for (task, i), ra in a.items():
        rb = b.get((task, i))
        if rb is None or infra in (ra.get("outcome"), rb.get("outcome")) or ra.get("seed") != rb.get("seed"):
            continue
        tasks.setdefault(task, []).append((float(bool(ra["success"])), float(bool(rb["success"]))))
    out: dict = {"tasks": {}}
    total_var, deltas = 0.0, []
    for task, pairs in tasks.items():
        m, var = _diff(pairs)
        se = math.sqrt(var)
        out["tasks"][task] = {"pairs": len(pairs), "delta": m, "se": se, "ci95": _ci(m, se)}
        deltas.append(m)
        total_var += var
    if deltas:
        m, se = sum(deltas) / len(deltas), math.sqrt(total_var) / len(deltas)
        out.update(delta=m, se=se, ci95=_ci(m, se))
    return out


def interval(ci: tuple[float, float] | None) -> str:
    return "-" if ci is None else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"
