"""The supervisor of `tars up`: a role whose process dies is started again, with backoff, up to a limit.

    poll()  every half second from the run's watch loop; never blocks on a starting process
      a process that exited (and was not stopped by us)    -> "down": restart due after backoff_s * 2**(n-1), <= 30 s
      due                                                   -> Topology.relaunch(): "starting"
      "starting" and its ready file appeared                -> "up" (its address is the old one)
      "starting" and it exited, or no ready file in time    -> counts as another death: backoff, try again
      a role that died more than max_restarts times         -> poll() returns why the run must end
      a role that exited with status 2 (a user error)       -> poll() returns why at once: no restart can fix a
                                                               refused checkpoint, a bad config or a model that does
                                                               not fit; the reason is its log's last line

Where a restarted role comes back (tars/topology.py): envd and the inference server on their old ports (inference
with the newest published weights), the learner with --resume from its checkpoint on its old stream port, an actor
under its old id with its spool (its unacknowledged trajectories are sent again). The others ride it out: actors
retry envd and inference with backoff (actor.unavailable_retry_s) and end what cannot go on as infra_error (kept out
of the loss); their stream re-sends whatever a dead learner had not made durable.

A process that is up but does not answer (SIGSTOPped, deadlocked, its event loop blocked) is found too: a thread
asks each one for its ControlService Status every PROBE_EVERY_S (deadline PROBE_DEADLINE_S, the run's control
token; both at most hang_s / 3); one that has not answered for hang_s (supervisor.hang_s) is SIGKILLed and restarted
like a dead one.

The learner exiting with status 0 is the end of the run (it reached max_versions), not a death. Every death and
restart is one JSON line in RUN/supervisor.jsonl; the report counts them (report.json "restarts").
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import threading
import time
from collections.abc import Callable

from core.config import EXIT_USER
from tars.topology import LaunchError, Topology, last_line

MAX_BACKOFF_S = 30.0
PROBE_EVERY_S, PROBE_DEADLINE_S = 5.0, 5.0
TAIL_LINES = 5  # of a dead process's log, shown on screen


def log_tail(path: pathlib.Path, n: int, max_bytes: int = 16384) -> list[str]:
    """The last n non-empty lines of a log file (its last max_bytes only); [] if it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - max_bytes))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [ln.rstrip() for ln in text.splitlines() if ln.strip()][-n:]


@dataclasses.dataclass
class _Role:
    role: str
    index: int
    name: str
    state: str = "up"             # up | down (waiting for its backoff) | starting | given_up
    deaths: int = 0               # exits since the run started (a failed restart counts)
    restarts: int = 0             # successful restarts
    due: float = 0.0              # down: when to start it again (monotonic)
    started: float = 0.0          # starting: when (monotonic)
    down_since: float = 0.0       # wall clock of the latest death
    up_since: float = 0.0         # monotonic: when it was (last) seen up
    why: str = ""                 # given_up: why the run must end


class Supervisor:
    """Watches every process of a started Topology and restarts the ones that die (module docstring)."""

    def __init__(self, topo: Topology, max_restarts: int = 5, backoff_s: float = 1.0,
                 say: Callable[[str], None] = lambda m: None, log: pathlib.Path | None = None, hang_s: float = 0.0,
                 control_token: str = ""):
        self.topo, self.max_restarts, self.backoff_s, self.say = topo, max_restarts, backoff_s, say
        self.log = log if log is not None else topo.plan.out / "supervisor.jsonl"
        now = time.monotonic()
        self.roles = {key: _Role(key[0], key[1], topo.plan.name(*key), up_since=now) for key in topo.procs}
        self.hang_s, self.answered = hang_s, {}  # answered: key -> monotonic time of its last Status answer
        # A healthy process must be asked (and answer) more than once within hang_s: with the fixed 5 s cadence, a
        # hang_s under it killed every healthy process as hung each hang_s, and the run ended at max_restarts.
        self.probe_every_s, self.probe_deadline_s = min(PROBE_EVERY_S, hang_s / 3), min(PROBE_DEADLINE_S, hang_s / 3)
        self._stop = threading.Event()
        if hang_s > 0:
            threading.Thread(target=self._probe, args=(control_token,), name="supervisor-probe", daemon=True).start()

    def close(self) -> None:
        self._stop.set()

    def _probe(self, token: str) -> None:
        import grpc

        from core import rpc
        from core.v1 import control_pb2, control_pb2_grpc

        while not self._stop.wait(self.probe_every_s):
            for key, r in list(self.roles.items()):
                addr = self.topo.ready.get(key, {}).get("address")
                if r.state != "up" or not addr:
                    continue
                ch = rpc.sync_channel(addr, token)
                try:
                    control_pb2_grpc.ControlServiceStub(ch).Status(control_pb2.StatusRequest(), timeout=self.probe_deadline_s)
                    self.answered[key] = time.monotonic()
                except grpc.RpcError as e:  # nothing listening (a learner shutting its service down to stop): not
                    if e.code() == grpc.StatusCode.UNAVAILABLE:  # hung; a stopped process accepts and says nothing
                        self.answered[key] = time.monotonic()
                except Exception:  # noqa: BLE001 - no answer, whatever the reason: the clock keeps running
                    pass
                finally:
                    ch.close()

    # ---- the loop's one call ------------------------------------------------------------------------------------
    def poll(self) -> str | None:
        """Handle deaths, due restarts and restarts that became ready. Returns why the run must end, or None:
        "done" once the learner exited with status 0, or the role that died more often than allowed."""
        now = time.monotonic()
        for key, r in self.roles.items():
            proc = self.topo.procs[key]
            if r.state == "up":
                rc = proc.returncode
                if rc is None and self.hang_s and now - max(self.answered.get(key, 0.0), r.up_since) > self.hang_s:
                    proc.kill()  # up but silent (stopped, deadlocked): SIGKILL, then restarted as if it had died
                    self._died(r, None, now, f"did not answer for {self.hang_s:.0f} s (hung)")
                    continue
                if rc is None:
                    continue
                if r.role == "learner" and rc == 0:
                    return "done"
                self._died(r, rc, now, "exited")
            elif r.state == "starting":
                try:
                    info = proc.poll_ready()
                except LaunchError:
                    info = None
                    self._died(r, proc.returncode, now, "exited before it was ready")
                if info is not None:
                    self.topo.ready[key] = info
                    r.state, r.restarts, r.up_since = "up", r.restarts + 1, now
                    self._event(r, "up", down_s=round(time.time() - r.down_since, 2))
                    self.say(f"{r.name} is back ({time.time() - r.down_since:.1f} s down, restart {r.restarts})")
                elif r.state == "starting" and now - r.started > proc.spec.ready_s:
                    proc.kill()
                    self._died(r, None, now, f"not ready after {proc.spec.ready_s:.0f} s")
            if r.state == "given_up":
                return r.why
            if r.state == "down" and now >= r.due:
                self._start(r, now)
        return None

    def _died(self, r: _Role, rc: int | None, now: float, how: str) -> None:
        r.deaths += 1
        r.down_since = time.time() if r.state == "up" else r.down_since
        self._event(r, "died", rc=rc, how=how)
        log = self.topo.procs[(r.role, r.index)].spec.log
        if rc == EXIT_USER:  # a user error (tars/cli.py): the same start would be refused again
            r.state = "given_up"
            r.why = f"{r.name} {how} with status {rc} (a user error: no restart can fix it){last_line(log)}; see {log}"
            self.say(f"{r.name} {how} (rc {rc}): a user error, not restarted")
            self._say_tail(r)
            return
        if r.deaths > self.max_restarts:
            r.state = "given_up"
            r.why = f"{r.name} died {r.deaths} times (supervisor.max_restarts={self.max_restarts}); see {log}"
            self.say(f"{r.name} {how} (rc {rc}); it died {r.deaths} times: giving up")
            self._say_tail(r)
            return
        delay = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (r.deaths - 1))
        r.state, r.due = "down", now + delay
        self.say(f"{r.name} {how} (rc {rc}); restarting in {delay:.0f} s ({r.deaths}/{self.max_restarts})")
        self._say_tail(r)

    def _say_tail(self, r: _Role) -> None:
        """The last lines of the dead process's log, so the reason is on screen, not only in logs/."""
        log = self.topo.procs[(r.role, r.index)].spec.log
        for line in log_tail(log, TAIL_LINES):
            self.say(f"  {r.name}| {line}")

    def _start(self, r: _Role, now: float) -> None:
        try:
            self.topo.relaunch(r.role, r.index)
        except OSError as e:  # could not even exec: counts as a death
            self._died(r, None, now, f"could not start: {e}")
            return
        r.state, r.started = "starting", now
        self._event(r, "restarting")

    def _event(self, r: _Role, what: str, **kw) -> None:
        rec = {"t": round(time.time(), 3), "role": r.role, "name": r.name, "event": what, "deaths": r.deaths, **kw}
        try:
            with open(self.log, "a") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError as e:  # a full disk must not end supervision (it once tore the whole run down, no report)
            print(f"[tars up] cannot record {r.name} {what} in {self.log}: {e}", file=sys.stderr, flush=True)

    # ---- what the report shows --------------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """{"envd": 1, "actor0": 2, ...}: successful restarts per process (names as in the run's logs/)."""
        return {r.name: r.restarts for r in self.roles.values() if r.restarts}

    def restarting(self) -> list[str]:
        return [r.name for r in self.roles.values() if r.state in ("down", "starting")]


def read_events(run_dir: pathlib.Path) -> list[dict]:
    """RUN/supervisor.jsonl (whole lines only)."""
    p = pathlib.Path(run_dir) / "supervisor.jsonl"
    out = []
    if p.exists():
        for line in p.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out
