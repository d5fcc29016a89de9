"""`tars bench faults`: SIGKILL every role of a real `tars up` run once, at a random time, and count what survived.

The run is the command users run, `tars up --preset quickstart` (no SFT, small batches, two actors, frequent
checkpoints, so that faults land mid-run within seconds), in its own process, and its own supervisor
(tars/supervisor.py) does every restart: the benchmark only kills. Each role (envd, inference, the learner, one
actor picked at random) is killed once, in a random order, after a random number of updates plus a random delay:
no SIGSTOP first, so a kill can land anywhere, in the middle of a spool or WAL write, a weight publish or an RPC.
In "checkpoint" mode the learner's kill is aimed at the middle of a checkpoint write (the moment its acks depend
on). After the last restart the run trains on, then gets SIGINT (Ctrl-C) and writes its report.

The durability modes (learner.stream.durability) are measured one after the other: "checkpoint" (the quickstart's)
and "wal". The ledger (tars/faults.py `account`) reads what the learner recorded and every actor's spool:

  received    distinct trajectory ids that reached the learner (episodes.jsonl of every incarnation, the WAL)
  trained     ids in the final lineage of updates (trained.jsonl, rolled-back updates dropped)
  masked      ids kept out of the loss (infra_error, too stale)
  pending     ids acked into the WAL but not yet trained when the run stopped (wal mode; a resumed learner trains them)
  spooled     ids still in an actor's spool when the run stopped, never trained (sent again by that actor's next start)
  duplicated  ids trained more than once, or both trained and masked (goal 0)
  lost        ids seen anywhere (received, in a killed actor's spool just after its death, in a spool at the end)
              that are none of trained, masked, pending, spooled (goal 0)

Goals per mode: lost 0, duplicated 0, no infra_error trajectory trained, the run finishes (status "interrupted",
exit 0) with its report, and the report counts one restart per kill.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time

from core.proc import read_jsonl, wait_for
from tars.faults import account, lineage, spool_ids, trained_version, wait_versions

ROLES = ("envd", "inference", "actor", "learner")
MODES = ("checkpoint", "wal")
N_ACTORS = 2
# The quickstart, made quick: no SFT, small batches, frequent checkpoints, a fast first restart.
FAST = ["sft.steps=0", "learner.batch_size=16", "actor.concurrency=16", "learner.checkpoint.every=2",
        "actor.max_turns=3", f"actors={N_ACTORS}", "max_versions=100000", "wall_budget_s=100000",
        "actor.rpc_timeout_s=10", "supervisor.backoff_s=1", "telemetry.enabled=false"]
READY_S = 300.0  # tars up builds its fresh model, then starts five processes


def _ready(out: pathlib.Path, name: str) -> dict | None:
    try:
        return json.loads((out / "run" / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def run_mode(durability: str, out: pathlib.Path, seed: int = 0, roles=ROLES, tail_versions: int = 2,
             learner_mid_checkpoint: bool | None = None, say=lambda m: None) -> dict:
    """One `tars up` run with `durability`, each of `roles` killed once; returns the figures (module docstring).
    learner_mid_checkpoint (default: in "checkpoint" mode): the learner's kill lands while it writes a checkpoint."""
    if learner_mid_checkpoint is None:
        learner_mid_checkpoint = durability == "checkpoint"
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "tars.cli", "up", "--preset", "quickstart", "--out", str(out),
            *[a for s in [*FAST, f"learner.stream.durability={durability}", f"seed={seed}"] for a in ("--set", s)]]
    t0 = time.monotonic()
    log = open(out.parent / f"{out.name}.up.log", "wb")
    up = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    kills: list[dict] = []
    held: list[set[str]] = []
    try:
        names = ["envd", "inference", "learner", *[f"actor{i}" for i in range(N_ACTORS)]]
        wait_for(lambda: up.poll() is not None or all(_ready(out, n) for n in names), READY_S, "the run's processes")
        if up.poll() is not None:
            raise RuntimeError(f"tars up exited with {up.returncode} before its processes were ready; see {log.name}")
        order = list(roles)
        rng.shuffle(order)
        for role in order:
            name = f"actor{rng.randrange(N_ACTORS)}" if role == "actor" else role
            wait_versions(out, rng.randint(1, 3), 240)
            mid = ""
            if role == "learner" and learner_mid_checkpoint:
                # ckpt.* exists only while a checkpoint is being written and swapped in (learner/checkpoint.py)
                wait_for(lambda: any(out.glob("ckpt.*")), 120, "a checkpoint being written", every=0.001)
                mid = " while it wrote a checkpoint"
            else:
                time.sleep(rng.uniform(0.0, 3.0))
            info = _ready(out, name)
            v = trained_version(out)
            try:
                os.killpg(info["pid"], signal.SIGKILL)  # the role and whatever it started; no warning
            except ProcessLookupError:
                pass
            t_kill = time.monotonic()
            if role == "actor":
                # The dead actor's spool, before the supervisor's restart reads it: every whole record counts.
                held.append(spool_ids(out / "spool" / name))
            say(f"{durability}: killed {name} (pid {info['pid']}) at version {v}{mid}")
            wait_for(lambda: (_ready(out, name) or {}).get("pid", info["pid"]) != info["pid"], 180,
                     f"the supervisor to restart {name}")
            kills.append({"name": name, "at_version": v, "back_after_s": round(time.monotonic() - t_kill, 1),
                          "mid_checkpoint": bool(mid),
                          "held_unacked": len(held[-1]) if role == "actor" else None})
            say(f"{durability}: {name} back after {kills[-1]['back_after_s']} s")
        wait_versions(out, tail_versions, 240)
        up.send_signal(signal.SIGINT)  # Ctrl-C: the run stops in order and writes its report
        rc = up.wait(300)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(30)
            rc = None
        log.close()
    rep = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    spools = [spool_ids(d) for d in sorted((out / "spool").glob("actor*"))]
    led = account(out, held, spools)
    outcome = {r["id"]: r["outcome"] for r in read_jsonl(out / "episodes.jsonl")}
    trained = {t for r in lineage(read_jsonl(out / "trained.jsonl")).values() for t in r.get("ids", ())}
    infra_trained = sum(1 for t in trained if outcome.get(t) == "infra_error")
    res = {"durability": durability, "kills": kills, "ledger": led, "up_exit": rc, "status": rep.get("status"),
           "restarts": rep.get("restarts", {}), "infra_error_trained": infra_trained,
           "episodes": rep.get("episodes"), "policy_version": rep.get("policy_version"),
           "wall_s": round(time.monotonic() - t0, 1)}
    res["ok"] = (led["lost"] == 0 and led["duplicated"] == 0 and infra_trained == 0 and rc == 130 and bool(rep)
                 and sum(res["restarts"].values()) == len(kills) == len(roles))
    return res


def run(modes=MODES, out: str | None = None, seed: int = 0, roles=ROLES, say=lambda m: None) -> dict:
    """run_mode() for each durability mode, in out/<mode> (a temporary directory by default)."""
    tmp = tempfile.TemporaryDirectory(prefix="tars-faults-") if out is None else None
    base = pathlib.Path(out or tmp.name)
    try:
        res = {m: run_mode(m, base / m, seed, roles, say=say) for m in modes}
    finally:
        if tmp is not None:
            tmp.cleanup()
    return {"modes": res, "ok": all(r["ok"] for r in res.values())}


def summary(res: dict) -> dict:
    """Per mode: lost, duplicated, masked, spooled, pending, trained, received, restarts."""
    return {m: {**{k: r["ledger"][k] for k in ("lost", "duplicated", "masked", "spooled", "pending", "trained",
                                               "received", "held_by_killed_actors")},
                "restarts": sum(r["restarts"].values()), "infra_error_trained": r["infra_error_trained"],
                "status": r["status"], "ok": r["ok"]}
            for m, r in res["modes"].items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tars bench faults", description=__doc__.split("\n")[0])
    ap.add_argument("--json", metavar="FILE", help="write the figures here as JSON")
    ap.add_argument("--modes", default=",".join(MODES), help="stream durability modes, in order: " + ", ".join(MODES))
    ap.add_argument("--roles", default=",".join(ROLES), help="which roles to kill (each once): " + ", ".join(ROLES))
    ap.add_argument("--seed", type=int, default=0, help="the kills' order and timing (and the run's seed)")
    ap.add_argument("--out", help="keep the run directories here (default: a temporary one)")
    a = ap.parse_args(argv)
    res = run([m for m in a.modes.split(",") if m], a.out, a.seed, [r for r in a.roles.split(",") if r],
              say=lambda m: print(f"[faults] {m}", flush=True))
    res["summary"] = summary(res)
    print(f"{'mode':<11} {'kills':<40} {'lost':>5} {'dup':>4} {'masked':>7} {'spooled':>8} {'trained':>8} {'restarts':>9}")
    for m, r in res["modes"].items():
        s = res["summary"][m]
        kills = ",".join(f"{k['name']}@v{k['at_version']}" for k in r["kills"])
        print(f"{m:<11} {kills:<40} {s['lost']:>5} {s['duplicated']:>4} {s['masked']:>7} {s['spooled']:>8} "
              f"{s['trained']:>8} {s['restarts']:>9}")
    print("goals: lost 0, duplicated 0, no infra_error trained, the run finishes with its report ->",
          "OK" if res["ok"] else "FAILED")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(res, indent=2, default=str))
    return 0 if res["ok"] else 1
