"""What a `tars eval` results directory holds (DIR/eval.json), so that a rerun resumes only the same evaluation.

eval.json names the suite, the policy (its name and an identity of what it is: for a checkpoint directory a hash of
its config.json and of the name, size and modification time of its weight files; with the sampling temperature for
a model), the suite's seed rule (seed, held_out) and each task's settings (env id, step budget, env options). The
number of episodes is not in it: a rerun with another --episodes or --tasks resumes the same episodes.

A rerun whose meta differs from the directory's is refused (`tars eval`: use another --out) or, for the held-out
evaluation of `tars up` (whose directories belong to the run and are re-used by every run in the same --out), started
over: the earlier episodes.jsonl is kept as episodes.previous.N.jsonl (N = 1, 2, ...: every earlier one stays) and
the results files are removed. Either way
the message names what differs. eval.json is written whole (a temporary file renamed over it).
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re

from tars import evalsuite as S
from tars.evalsuite import EvalError

WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
STALE = ("results.json", "results.md", "results.png")


def checkpoint_identity(path: str | os.PathLike) -> str:
    """A cheap identity of a checkpoint directory's contents: config.json's bytes and each weight file's name, size
    and mtime (no hashing of gigabytes of weights: a rewritten or replaced file changes its mtime)."""
    p = pathlib.Path(path)
    h = hashlib.sha256()
    cfg = p / "config.json"
    h.update(cfg.read_bytes() if cfg.is_file() else b"")
    for f in sorted(p.iterdir()):
        if f.is_file() and f.name.endswith(WEIGHTS):
            st = f.stat()
            h.update(f"\0{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return "sha256:" + h.hexdigest()[:16]


def suite_meta(suite: S.Suite) -> dict:
    """The suite's part of eval.json: what decides which episodes are played (not how many)."""
    return {"suite": suite.name, "suite_path": suite.path, "seed": suite.seed, "held_out": suite.held_out,
            "tasks": {t.name: {"env_id": t.env_id, "max_turns": t.max_turns, "options": dict(sorted(t.options.items()))}
                      for t in suite.tasks}}


def read_meta(out: pathlib.Path) -> dict | None:
    p = out / "eval.json"
    if not p.exists():
        return None
    try:
        old = json.loads(p.read_text())
    except (ValueError, OSError) as e:
        raise EvalError(f"{p} is not readable ({type(e).__name__}: {e}): the directory's evaluation cannot be "
                        "identified; remove eval.json to start it over, or use another --out") from None
    if not isinstance(old, dict):
        raise EvalError(f"{p} is not an eval.json (not a JSON object): remove it to start over, or use another --out")
    return old


def differences(old: dict, meta: dict) -> list[str]:
    """What the directory's evaluation (old) and this one (meta) disagree on, in words."""
    out = []
    for k in ("suite", "model", "policy", "seed", "held_out"):  # not suite_path: a moved suite file is the same
        if old.get(k, "(not recorded)") != meta[k]:
            out.append(f"{k} {old.get(k, '(not recorded)')!r}, not {meta[k]!r}")
    was = old.get("tasks")
    if not isinstance(was, dict):
        out.append("task settings (not recorded)")
    else:
        for name, t in meta["tasks"].items():
            if name in was and was[name] != t:
                out.append(f"task {name!r} settings {was[name]!r}, not {t!r}")
    return out


def write_meta(out: pathlib.Path, meta: dict) -> None:
    p = out / "eval.json"
    tmp = p.with_name(f"eval.json.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(meta, indent=2))
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check(out: pathlib.Path, meta: dict, restart: bool = False, say=None) -> dict:
    """Compare the directory's eval.json with this evaluation's meta; refuse (EvalError) or start over (restart)
    when they differ. Writes eval.json (the tasks of both merged: a later --tasks keeps the others' settings);
    returns what was written."""
    old = read_meta(out)
    if old is not None and (diff := differences(old, meta)):
        if not restart:
            raise EvalError(f"{out} holds another evaluation ({'; '.join(diff)}): use another --out (results are "
                            "resumed from the directory)")
        log, kept = out / "episodes.jsonl", "no episodes"
        if log.exists():
            kept = f"its episodes are now in {keep_previous(log).name}"
        for name in STALE:
            (out / name).unlink(missing_ok=True)
        if say:
            say(f"{out} held another evaluation ({'; '.join(diff)}): starting it over ({kept})")
        old = None
    tasks = {**(old or {}).get("tasks", {}), **meta["tasks"]}
    meta = {**meta, "tasks": tasks}
    write_meta(out, meta)
    return meta


def keep_previous(log: pathlib.Path) -> pathlib.Path:
    """Move an evaluation's episodes.jsonl aside to episodes.previous.N.jsonl, N one past the highest kept so far:
    every earlier evaluation stays (a third run in the same --out must not overwrite the first's episodes)."""
    nums = [int(m.group(1)) for f in log.parent.glob("episodes.previous.*.jsonl")
            if (m := re.fullmatch(r"episodes\.previous\.(\d+)\.jsonl", f.name))]
    dest = log.with_name(f"episodes.previous.{max(nums, default=0) + 1}.jsonl")
    os.replace(log, dest)
    return dest


def comparable(dir_a: str | os.PathLike, dir_b: str | os.PathLike) -> None:
    """`tars eval --compare`: the two directories must have played the same episodes of the tasks they share (the
    same seed rule, each shared task with the same env id, step budget and options), else B - A would set one
    policy's episodes against another's. EvalError naming what differs; a directory with no eval.json is judged by
    its results.json's seed and held_out."""
    metas = []
    for d in (pathlib.Path(dir_a), pathlib.Path(dir_b)):
        meta = read_meta(d)
        if meta is None:
            try:  # its "tasks" are result rows, not settings
                meta = {k: v for k, v in json.loads((d / "results.json").read_text()).items() if k != "tasks"}
            except (ValueError, OSError, AttributeError):
                meta = {}
        metas.append(meta)
    a, b = metas
    diff = [f"{k} {a[k]!r} and {b[k]!r}" for k in ("seed", "held_out") if k in a and k in b and a[k] != b[k]]
    ta, tb = a.get("tasks"), b.get("tasks")
    if isinstance(ta, dict) and isinstance(tb, dict):
        diff += [f"task {n!r} settings {ta[n]!r} and {tb[n]!r}" for n in ta if n in tb and ta[n] != tb[n]]
    if diff:
        raise EvalError(f"{dir_a} and {dir_b} did not play the same episodes ({'; '.join(diff)}): compare evaluations "
                        "of the same seeds and task settings")


def current(suite: S.Suite, records: list[dict]) -> tuple[list[dict], int]:
    """The records played on this suite's seeds (episode i of a task on suite.seed_of(task, i)), and how many others
    were left out (a directory written under another seed rule)."""
    keep = [r for r in records if r.get("seed") == suite.seed_of(r["task"], int(r["episode"]))]
    return keep, len(records) - len(keep)
