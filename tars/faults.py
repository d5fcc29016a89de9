"""Fault injection over the real multi-process topology of `tars up`, and the accounting that proves what survived.

A FaultRun starts envd daemon(s), an inference server, the learner and actors through tars.topology, exactly as
`tars up` does (separate processes on loopback, ready files, PDEATHSIG), but lets a test SIGKILL any one of them
and restart it in place (tars.topology.Topology.restart: envd and inference on their old port, the learner with
--resume on its old stream port, an actor under its old id with its spool). `ledger()` then reads what the learner
recorded and reports

  received    distinct trajectory ids that reached the learner (episodes.jsonl, every incarnation)
  trained     ids in the final lineage of updates (trained.jsonl, rolled-back updates dropped)
  masked      ids kept out of the loss (infra_error, too stale)
  pending     ids still waiting in the learner's WAL at the end (durable, trained by the next run)
  spooled     ids still in an actor's spool at the end and not trained (sent again by that actor's next start)
  duplicated  ids trained on more than once, or both trained and masked (goal 0)
  lost        ids seen anywhere (received, in a killed actor's spool, in any spool at the end) that are none of
              trained, masked, pending or spooled (goal 0)

`tars bench faults` (tars/bench/faults.py) kills the roles of a real `tars up` run and lets its supervisor restart
them; FaultRun below restarts them itself, for the soak benchmark and tests that drive one process at a time.
"""
from __future__ import annotations

import collections
import json
import os
import pathlib

from core import config as C
from core.proc import read_jsonl, wait_for
from core.stream.wal import scan_ids
from tars.topology import Topology, plan
from tars.up import build_model

# A quick, small run: no SFT, tiny batches and frequent checkpoints, so every fault lands mid-run within seconds.
# The ledger reads the learner's WAL (acked, not yet trained), so the stream keeps "wal" durability here.
FAST = ["sft.steps=0", "learner.batch_size=16", "actor.concurrency=16", "learner.checkpoint.every=2",
        "learner.stream.durability=wal",
        "actor.max_turns=3", "max_versions=100000", "wall_budget_s=100000", "actor.rpc_timeout_s=10"]


class FaultRun:
    """`tars up`'s processes (a tars.topology.Topology, `topo`), restartable one by one, and what they recorded.
    Use as a context manager (stop() kills what is left)."""

    def __init__(self, out: str | os.PathLike, n_envd: int = 1, n_actors: int = 1, sets: list[str] = ()):
        self.out = pathlib.Path(out).resolve()
        self.cfg = C.load("quickstart", None, [*FAST, *sets])
        self.n_envd, self.n_actors = n_envd, n_actors
        self.topo: Topology | None = None
        self.killed_spools: list[set[str]] = []   # trajectory ids an actor held unacked when it was killed

    # ---- processes ---------------------------------------------------------------------------------------------
    def start(self) -> "FaultRun":
        self.out.mkdir(parents=True, exist_ok=True)
        C.save(self.cfg, self.out / "config.yaml")
        self.model_dir, _ = build_model(self.cfg, self.out, lambda m: None)
        self.topo = Topology(plan(self.cfg, self.out, self.model_dir, n_envd=self.n_envd, n_actors=self.n_actors))
        self.topo.start()
        return self

    @property
    def stream(self) -> str:
        """The learner's trajectory stream address (tcp://host:port)."""
        return self.topo.stream

    def spool(self, i: int) -> pathlib.Path:
        return self.topo.spool(i)

    def kill(self, role: str, i: int = 0) -> None:
        """SIGKILL the process group (the role and anything it started), and reap it. A dead actor's spool is
        read before anything restarts it: what it held unacked when it died."""
        self.topo.kill(role, i)
        if role == "actor":
            self.killed_spools.append(self.spool_ids(i))

    def restart(self, role: str, i: int = 0, timeout: float = 120) -> dict:
        return self.topo.restart(role, i, timeout)

    def signal(self, role: str, i: int, sig: int) -> None:
        self.topo.signal(role, i, sig)

    def returncode(self, role: str, i: int = 0) -> int | None:
        return self.topo.returncode(role, i)

    def alive(self) -> dict[str, bool]:
        return self.topo.alive() if self.topo else {}

    def pids(self) -> dict[str, int]:
        return self.topo.pids()

    def stop(self) -> None:
        """Stop in `tars up` order (actors, learner, inference, envd) with deadlines; kill what does not stop."""
        if self.topo is not None:
            self.topo.stop()

    def __enter__(self) -> "FaultRun":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- observation -------------------------------------------------------------------------------------------
    def status(self, role: str, i: int = 0, timeout: float = 5.0) -> dict:
        """The process's ControlService Status metrics (actors, envd, inference; the learner's control address)."""
        from core import rpc
        from core.v1 import control_pb2, control_pb2_grpc

        addr = self.topo.ready[(role, i)]["address"]  # as announced by its latest start
        ch = rpc.sync_channel(addr, self.cfg.control.auth_token)
        try:
            r = control_pb2_grpc.ControlServiceStub(ch).Status(control_pb2.StatusRequest(), timeout=timeout)
            return json.loads(r.metrics_json)
        finally:
            ch.close()

    def version(self) -> int:
        return trained_version(self.out)

    def received(self) -> collections.Counter:
        return collections.Counter(r["id"] for r in read_jsonl(self.out / "episodes.jsonl"))

    def durable(self) -> set[str]:
        """Ids the learner has received: taken by training (episodes.jsonl) or still waiting in its WAL."""
        try:
            ids = set(scan_ids(self.out / "stream.wal"))  # read-only: the live learner owns the file
        except OSError:
            ids = set()
        return ids | set(self.received())

    def spool_ids(self, i: int) -> set[str]:
        return spool_ids(self.spool(i))

    def wait_versions(self, n: int, timeout: float) -> int:
        return wait_versions(self.out, n, timeout)

    def ledger(self) -> dict:
        """The counts described in the module docstring (call after stop())."""
        return account(self.out, self.killed_spools, [self.spool_ids(i) for i in range(self.n_actors)])


def trained_version(out: str | os.PathLike) -> int:
    """The newest whole policy version a run directory's learner recorded (trained.jsonl; 0 before the first)."""
    recs = [r for r in read_jsonl(pathlib.Path(out) / "trained.jsonl") if "version" in r and not r.get("partial")]
    return max((r["version"] for r in recs), default=0)


def wait_versions(out: str | os.PathLike, n: int, timeout: float) -> int:
    """Wait until the run's learner has made n more updates; returns the version reached."""
    v0 = trained_version(out)
    return wait_for(lambda: (v := trained_version(out)) >= v0 + n and v, timeout, f"{n} updates after v{v0}")


def spool_ids(directory: str | os.PathLike) -> set[str]:
    """The trajectory ids of the whole records in an actor's spool directory (core/stream/spool.py's layout: a
    record is renamed into place once written, so a *.traj file is whole unless the disk lied)."""
    ids = set()
    for p in pathlib.Path(directory).glob("*.traj"):
        try:
            data = p.read_bytes()
            n = int.from_bytes(data[:4], "little")
            if 4 + n <= len(data):
                ids.add(data[4:4 + n].decode())
        except (OSError, UnicodeDecodeError):
            pass
    return ids


def lineage(records: list[dict]) -> dict[int, dict]:
    """The update records of the final lineage: a {"resume": v} record drops every earlier record above v."""
    by_version: dict[int, dict] = {}
    for r in records:
        if "resume" in r:
            for v in [v for v in by_version if v > r["resume"]]:
                del by_version[v]
        elif "version" in r:
            by_version[r["version"]] = r
    return by_version


def _rolled_back(records: list[dict]) -> set[str]:
    """Ids of update records that a later {"resume": v} dropped (trained into weights that died unsaved)."""
    live: dict[int, dict] = {}
    dropped: set[str] = set()
    for r in records:
        if "resume" in r:
            for v in [v for v in live if v > r["resume"]]:
                dropped.update(live.pop(v).get("ids", ()))
        elif "version" in r:
            live[r["version"]] = r
    return dropped


def account(out: str | os.PathLike, killed_spools: list[set[str]] = (), final_spools: list[set[str]] = ()) -> dict:
    """The ledger of a run directory (module docstring). `killed_spools`: what each killed actor's spool held just
    after its death; `final_spools`: every actor's spool once the run stopped (held, not yet trained: sent again by
    that actor's next start, so counted as `spooled`, not lost)."""
    from core.stream.wal import WriteAheadLog

    out = pathlib.Path(out)
    episodes = read_jsonl(out / "episodes.jsonl")
    received = {r["id"] for r in episodes}
    outcomes = collections.Counter()
    for r in {r["id"]: r for r in episodes}.values():
        outcomes[r["outcome"]] += 1
    records = read_jsonl(out / "trained.jsonl")
    lin = lineage(records)
    # Trained by a learner that was killed before its next checkpoint: those updates were lost with it.
    rolled_back = _rolled_back(records)
    trained = collections.Counter(t for r in lin.values() for t in r.get("ids", ()))
    masked = collections.Counter(t for r in lin.values() for t in r.get("masked", ()))
    in_wal: set[str] = set()
    if (out / "stream.wal").exists():  # the "wal" durability mode's log ("checkpoint" mode keeps none)
        wal = WriteAheadLog(out / "stream.wal", fsync=False)
        in_wal = set(wal.open().index)
        wal.close()
    done = set(trained) | set(masked)
    pending = in_wal - done
    received |= in_wal  # durable and acked, but not yet taken by the training loop (so not in episodes.jsonl)
    dup = [t for t in trained if trained[t] > 1 or t in masked] + [t for t in masked if masked[t] > 1]
    held = set().union(*killed_spools) if killed_spools else set()
    at_end = set().union(*final_spools) if final_spools else set()
    spooled = at_end - done - pending
    lost = (received | held | at_end) - done - pending - spooled
    return {"received": len(received), "trained": len(trained), "masked": len(masked), "pending": len(pending),
            "spooled": len(spooled), "duplicated": len(set(dup)), "lost": len(lost),
            "lost_ids": sorted(lost)[:20], "duplicated_ids": sorted(set(dup))[:20],
            "held_by_killed_actors": len(held), "rolled_back_then_retrained": len(rolled_back & set(trained)),
            "outcomes": dict(outcomes), "versions": max((v for v, r in lin.items() if not r.get("partial")), default=0)}


