"""`tars bench faults`: SIGKILL each role of a running topology in turn, restart it, and count what survived.

Faults (each mid-run, on one shared topology of 2 envd daemons, 1 inference server, the learner and 2 actors):
  envd       SIGKILL envd0, restart it on its port: its sessions end infra_error, those episodes are rerun on a
             live daemon (actor.episode_attempts), the broken attempts are never sent, the run goes on
  inference  SIGKILL the server, restart it with the newest weights: actors keep retrying with backoff
             (actor.unavailable_retry_s) and their in-flight rollouts continue where they were
  actor      SIGKILL actor0, restart it with its spool: its unacked trajectories are re-sent (goal 0 lost)
  learner    SIGKILL the learner between checkpoints, restart with --resume: every trajectory trained exactly once
The JSON holds the ledger (tars/faults.py: received, trained, masked, pending, duplicated, lost) and, per fault,
the actors' retry counters. Goals: lost 0, duplicated 0, no infra_error trajectory trained, the run finishes.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import signal
import tempfile
import time

from tars.faults import FaultRun
from core.proc import read_jsonl, wait_for

FAULTS = ("envd", "inference", "actor", "learner")


def _actor_totals(topo: FaultRun) -> dict:
    tot: dict[str, float] = {}
    for i in range(topo.n_actors):
        try:
            st = topo.status("actor", i)
        except Exception:  # a process just restarted may not answer yet; its counters are new anyway
            continue
        for k in ("episodes", "episodes_retried", "inference_retries", "infra_error", "episode_crashes", "send_failures"):
            tot[k] = tot.get(k, 0) + (st.get(k) or 0)
    return tot


def _running(topo: FaultRun, i: int) -> int:
    try:
        return topo.status("actor", i).get("running") or 0
    except Exception:  # not answering this instant: ask again
        return 0


def fault_envd(topo: FaultRun, down_s: float = 1.0) -> dict:
    topo.wait_versions(1, 120)
    topo.kill("envd", 0)
    time.sleep(down_s)
    topo.restart("envd", 0)
    topo.wait_versions(2, 120)
    return {"actors": _actor_totals(topo)}


def fault_inference(topo: FaultRun, down_s: float = 2.0) -> dict:
    topo.wait_versions(1, 120)
    before = _actor_totals(topo)
    topo.kill("inference", 0)
    time.sleep(down_s)  # rollouts are now stuck mid-episode, retrying
    topo.restart("inference", 0)
    topo.wait_versions(2, 180)
    after = _actor_totals(topo)
    return {"actors": after, "inference_retries": after.get("inference_retries", 0) - before.get("inference_retries", 0),
            "infra_errors_during": after.get("infra_error", 0) - before.get("infra_error", 0)}


def fault_actor(topo: FaultRun, attempts: int = 6) -> dict:
    topo.wait_versions(1, 120)
    # Freeze the learner so acks stop: the actor's finished trajectories pile up unacked in its outbox (and spool),
    # which is exactly what a kill must not lose. A frozen learner grants no admissions, so only the episodes actor0
    # already runs can finish meanwhile: freeze while it runs some, and thaw and try again if none of them lands in
    # its spool within the window (the admission budget may have been spent by the other actor).
    held_now = 0
    for _ in range(attempts):
        wait_for(lambda: _running(topo, 0) >= 2, 60, "episodes running in actor0")
        topo.signal("learner", 0, signal.SIGSTOP)
        try:
            try:
                wait_for(lambda: len(topo.spool_ids(0)) >= 1, 15, "unacked trajectories in actor0's spool")
            except TimeoutError:
                continue
            time.sleep(1.0)  # let the rest of its running episodes finish into the spool too
            held_now = len(topo.spool_ids(0))
            topo.kill("actor", 0)
            break
        finally:
            topo.signal("learner", 0, signal.SIGCONT)
    if not held_now:
        raise TimeoutError(f"actor0 held no unacked trajectory in {attempts} freezes of the learner")
    held = topo.killed_spools[-1]
    topo.restart("actor", 0)
    # The restarted actor re-sends what its predecessor held unacked; wait until every one of them arrived.
    wait_for(lambda: held <= topo.durable(), 120, f"{len(held)} re-sent trajectories to arrive")
    topo.wait_versions(1, 120)
    return {"held_unacked_at_kill": len(held), "actors": _actor_totals(topo)}


def fault_learner(topo: FaultRun) -> dict:
    every = topo.cfg.learner.checkpoint.every
    # Kill between two checkpoints, so the updates after the last one are rolled back and trained again.
    wait_for(lambda: topo.version() >= 1 and topo.version() % every != 0, 120, "a version between checkpoints")
    v_killed = topo.version()
    topo.kill("learner", 0)
    topo.restart("learner", 0)
    topo.wait_versions(2, 180)
    return {"killed_at_version": v_killed, "resumed_from": v_killed - v_killed % every, "actors": _actor_totals(topo)}


RUNNERS = {"envd": fault_envd, "inference": fault_inference, "actor": fault_actor, "learner": fault_learner}


def run(faults=FAULTS, out: str | None = None) -> dict:
    """Start the topology, inject the faults in order, stop, and return {faults: {...}, ledger: {...}, ok}."""
    tmp = None
    if out is None:
        tmp = tempfile.TemporaryDirectory(prefix="tars-faults-")
        out = tmp.name
    t0 = time.monotonic()
    res: dict = {"faults": {}}
    topo = FaultRun(out, n_envd=2, n_actors=2)
    try:
        topo.start()
        for f in faults:
            t = time.monotonic()
            before = _actor_totals(topo).get("episodes_retried", 0)
            res["faults"][f] = RUNNERS[f](topo)
            after = res["faults"][f]["actors"].get("episodes_retried", 0)
            res["faults"][f]["retried"] = after - before if after >= before else after  # a restarted actor counts anew
            res["faults"][f]["s"] = round(time.monotonic() - t, 1)
            res["faults"][f]["alive"] = all(topo.alive().values())
        res["actors"] = _actor_totals(topo)
    finally:
        topo.stop()
    lrn = topo.returncode("learner")
    led = topo.ledger()
    eps = {}
    for line in (pathlib.Path(out) / "episodes.jsonl").read_text().splitlines():
        try:
            r = json.loads(line)
            eps[r["id"]] = r["outcome"]
        except ValueError:
            pass
    lin_trained = _trained_ids(pathlib.Path(out))
    res["ledger"] = led
    res["retried"] = sum(f.get("retried", 0) for f in res["faults"].values())
    res["infra_error_trained"] = sum(1 for t in lin_trained if eps.get(t) == "infra_error")
    res["learner_exit"] = lrn
    res["wall_s"] = round(time.monotonic() - t0, 1)
    res["ok"] = (led["lost"] == 0 and led["duplicated"] == 0 and res["infra_error_trained"] == 0 and lrn == 0
                 and all(v.get("alive", True) for v in res["faults"].values()))
    if tmp is not None:
        tmp.cleanup()
    return res


def _trained_ids(out: pathlib.Path) -> set[str]:
    from tars.faults import lineage

    return {t for r in lineage(read_jsonl(out / "trained.jsonl")).values() for t in r.get("ids", ())}


def summary(res: dict) -> dict:
    """The counts the issue asks for: lost, duplicated, retried, masked."""
    led = res["ledger"]
    return {"lost": led["lost"], "duplicated": led["duplicated"], "retried": res["retried"], "masked": led["masked"],
            "received": led["received"], "trained": led["trained"], "pending": led["pending"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tars bench faults", description=__doc__.split("\n")[0])
    ap.add_argument("--json", metavar="FILE", help="write the figures here as JSON")
    ap.add_argument("--faults", default=",".join(FAULTS), help="which, in order (comma-separated): " + ", ".join(FAULTS))
    ap.add_argument("--out", help="keep the run directory here (default: a temporary one)")
    a = ap.parse_args(argv)
    res = run([f for f in a.faults.split(",") if f], a.out)
    res["summary"] = summary(res)
    print(f"{'fault':<10} {'s':>6} {'retried':>8} {'alive':>6}")
    for f, r in res["faults"].items():
        print(f"{f:<10} {r['s']:>6} {r.get('retried', 0):>8} {str(r['alive']):>6}")
    print(json.dumps(res["summary"]), "goals: lost 0, duplicated 0, no infra_error trained ->", "OK" if res["ok"] else "FAILED")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(res, indent=2, default=str))
    return 0 if res["ok"] else 1
