"""The process topology of a run: which roles run as which processes, how they are started, found and stopped.

`tars up`, `tars eval` and the fault and soak benchmarks all place their processes here, so a run has one layout:

    envd (xN) + inference server   started together, then awaited in order (their addresses go to the others)
      (+ the judge's server)       with actor.judge_model: a frozen model the learner never updates
    learner                        --inference ADDR; announces its trajectory stream
    actors (xN)                    --envd A,B --inference ADDR --stream tcp://...; one after the other

Every role is `python -m tars.cli COMMAND --config OUT/config.yaml ... --ready-file OUT/run/NAME.json` with its
output in OUT/logs/NAME.log, in a session of its own (so a SIGKILL of its group takes anything it started), and
dies with its parent (PDEATHSIG, set by the role itself). NAME is the role ("envd", "inference", "learner") when
the run has one of it, else role + index ("envd0", "envd1"); actors are always "actor0", "actor1", ....

Shutdown goes by tiers (actors, learner, inference, envd by default): every process of a tier gets SIGTERM, each
has its own deadline to exit, and what is left is SIGKILLed with its whole process group, so no orphans remain.
A restarted role comes back where the others already connect: envd and inference on their old port (inference
with the newest published weights), the learner with --resume-or-fresh on its old stream port, an actor with its
spool.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from core.proc import PARENT_ENV
from tars import tokens

ROLES = ("envd", "inference", "judge", "learner", "actor")
# `tars COMMAND` of each role
COMMAND = {"envd": "envd", "inference": "serve", "judge": "serve", "learner": "learner", "actor": "actor"}
READY_S = {"envd": 60.0, "inference": 120.0, "judge": 120.0, "learner": 120.0, "actor": 60.0}  # start -> ready file
STOP_S = {"envd": 15.0, "inference": 15.0, "judge": 15.0, "learner": 60.0, "actor": 15.0}     # SIGTERM -> exit
STOP_TIERS: tuple[tuple[str, ...], ...] = (("actor",), ("learner",), ("inference", "judge"), ("envd",))
RUN_ENV = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}  # a run's roles share the machine's cores
KILL_WAIT_S = 10.0  # after SIGKILL, reaping is immediate; the bound only guards against a stuck kernel


class LaunchError(RuntimeError):
    """A process exited, or did not announce itself, before it was ready. `log` is its output file."""

    def __init__(self, msg: str, log: pathlib.Path):
        super().__init__(msg)
        self.log = log


class StartCancelled(Exception):
    """Topology.start() gave up because its `cancel` said so (Ctrl-C / SIGTERM while the run was starting)."""


def last_line(log: pathlib.Path, limit: int = 300) -> str:
    """': <the log's last non-empty line>' (what a role that exited with status 2 said: one line naming the
    setting), or '' when there is none."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4096))
            lines = [x for x in f.read().decode("utf-8", "replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return f": {lines[-1].strip()[:limit]}" if lines else ""


def role_argv(role: str, *options: str) -> list[str]:
    """`tars ROLE-COMMAND OPTIONS` run by this interpreter: the one place a role's command line is put together."""
    return [sys.executable, "-m", "tars.cli", COMMAND[role], *options]


@dataclasses.dataclass
class RoleSpec:
    """One process to start: its complete command line, where it announces itself and writes its output."""
    role: str
    index: int
    name: str
    argv: list[str]
    ready: pathlib.Path
    log: pathlib.Path
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # on top of this process's environment
    cwd: pathlib.Path | None = None
    ready_s: float = 60.0
    stop_s: float = 15.0


def pythonpath(root: str | os.PathLike) -> str:
    """PYTHONPATH for a child that imports this checkout: root first, then whatever the parent's PYTHONPATH holds
    (dependencies installed with --target stay importable)."""
    return os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)


def daemon_spec(role: str, options: list[str], workdir: pathlib.Path, env: dict[str, str] | None = None,
                cwd: pathlib.Path | None = None) -> RoleSpec:
    """A single role outside any run directory (the benchmarks' daemons): ready file and log in `workdir`."""
    ready, log = workdir / f"{role}.json", workdir / f"{role}.log"
    return RoleSpec(role, 0, role, [*role_argv(role, *options), "--ready-file", str(ready)], ready, log,
                    dict(env or {}), cwd, READY_S[role], STOP_S[role])


class Process:
    """A started RoleSpec: its own session, output appended to spec.log."""

    def __init__(self, spec: RoleSpec):
        self.spec = spec
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(spec.log, "ab")
        try:
            self.popen = subprocess.Popen(spec.argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=spec.cwd,
                                          env={**os.environ, **spec.env, PARENT_ENV: str(os.getpid())},  # die_with_parent
                                          start_new_session=True)
        except OSError:
            self.log.close()
            raise

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """None while it runs."""
        return self.popen.poll()

    def wait(self, timeout: float) -> int:
        """Its exit status once it has exited; subprocess.TimeoutExpired after `timeout` seconds."""
        return self.popen.wait(timeout)

    @property
    def stopped(self) -> bool:
        """Stopped or killed through this object (its log is closed)."""
        return self.log.closed

    def poll_ready(self) -> dict | None:
        """The ready file's JSON ({role, address, pid, ...}) if the process has written it, else None; LaunchError
        if it exited first. Never blocks (the supervisor polls a restarted process with it)."""
        if self.spec.ready.exists():
            return json.loads(self.spec.ready.read_text())  # written to a temporary name and renamed: whole
        if self.popen.poll() is not None:
            raise LaunchError(f"{self.spec.role} exited with {self.popen.returncode} before it was ready"
                              f"{last_line(self.spec.log)}; see {self.spec.log}", self.spec.log)
        return None

    def wait_ready(self, timeout: float | None = None, cancel: Callable[[], bool] | None = None) -> dict:
        """poll_ready() until the process has announced itself; LaunchError after `timeout` (default spec.ready_s),
        StartCancelled as soon as `cancel()` is true."""
        timeout = self.spec.ready_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.poll_ready()
            if info is not None:
                return info
            if cancel is not None and cancel():
                raise StartCancelled(f"{self.spec.role} was starting")
            time.sleep(0.05)
        raise LaunchError(f"{self.spec.role} not ready after {timeout:.0f} s; see {self.spec.log}", self.spec.log)

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL the process group (the role and anything it started), and reap it."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(KILL_WAIT_S)
        self.log.close()

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def finish(self, deadline: float) -> None:
        """After terminate(): wait until `deadline` (monotonic) for it to exit, then kill its group."""
        if self.popen.poll() is None:
            try:
                self.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                return
        self.log.close()

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM, up to `timeout` (default spec.stop_s) to exit, then SIGKILL of the group. Idempotent."""
        if self.stopped:
            return
        self.terminate()
        self.finish(time.monotonic() + (self.spec.stop_s if timeout is None else timeout))


def stop_all(procs: list[Process], tiers: tuple[tuple[str, ...], ...] = STOP_TIERS) -> None:
    """Stop tier by tier: every process of a tier gets SIGTERM at once, then each its own deadline, then SIGKILL.
    Processes of a role named in no tier are stopped last, together."""
    named = {r for t in tiers for r in t}
    for tier in [*tiers, tuple({p.spec.role for p in procs} - named)]:
        group = [p for p in procs if p.spec.role in tier and not p.stopped]
        t0 = time.monotonic()
        for p in group:
            p.terminate()
        for p in group:
            p.finish(t0 + p.spec.stop_s)


# ---- a run's topology ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Plan:
    """What a run starts, and where its files go. Built by plan() from the RunConfig; nothing runs yet."""
    out: pathlib.Path                   # the run directory: run/ (ready files), logs/, spool/, weights/
    config: pathlib.Path                # the saved RunConfig every role reads (--config)
    model: pathlib.Path | None          # HF-layout weights the inference server and the learner start from
    n_envd: int = 1
    inference: bool = True
    learner: bool = True
    n_actors: int = 0
    envd_addrs: tuple[str, ...] = ()    # daemons already running elsewhere (then n_envd = 0)
    inference_addr: str = ""            # an inference server already running (then inference = False)
    metrics_port: int = -1              # telemetry.prometheus_port > 0: the first of the roles' /metrics ports
    judge: pathlib.Path | None = None   # actor.judge_model, served by a server of its own (role "judge")

    def count(self, role: str) -> int:
        return {"envd": self.n_envd, "inference": int(self.inference), "judge": int(self.judge is not None),
                "learner": int(self.learner), "actor": self.n_actors}[role]

    def name(self, role: str, i: int) -> str:
        return role if role != "actor" and self.count(role) == 1 else f"{role}{i}"

    def metrics_ports(self) -> dict[tuple[str, int], int]:
        """With a fixed telemetry.prometheus_port N > 0, each role's own /metrics port: N, N+1, ... in the order envd
        0.., inference, judge, actor 0.., learner (last, so an accelerate launch's ranks n > 0 take the ports above
        it). Empty for 0 (a free port per role, in its run file) or -1 (off)."""
        if self.metrics_port <= 0:
            return {}
        keys = [("envd", i) for i in range(self.n_envd)] + [("inference", 0)] * self.inference
        keys += [("judge", 0)] * self.count("judge")
        keys += [("actor", i) for i in range(self.n_actors)] + [("learner", 0)] * self.learner
        return {k: self.metrics_port + n for n, k in enumerate(keys)}


def prepare(out: pathlib.Path) -> None:
    """The run directory's run/ and logs/, with no ready file left from an earlier run (`tars ctl` reads them).
    A run directory is the owner's alone (0700): trajectories, episodes and logs are the task data of a run, and
    only config.yaml (0600) guarded them before. An existing directory that is not a run's is left as it is."""
    if not out.exists() or not any(out.iterdir()) or (out / "config.yaml").exists():
        out.mkdir(parents=True, exist_ok=True)
        os.chmod(out, 0o700)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "run").mkdir(exist_ok=True)
    for f in (out / "run").glob("*.json"):
        f.unlink()


def served_judge(cfg, n_actors: int) -> str:
    """actor.judge_model when the run must serve it (actors that judge with it and no actor.judge_inference), else
    "" (no judge server)."""
    return cfg.actor.judge_model if n_actors and cfg.actor.unserved_judge else ""


def plan(cfg, out: str | os.PathLike, model: str | os.PathLike | None, *, n_envd: int = 1, inference: bool = True,
         learner: bool = True, n_actors: int | None = None, envd_addrs: tuple[str, ...] = (),
         inference_addr: str = "") -> Plan:
    """The topology of a run of `cfg` in `out` (whose config.yaml the caller has saved): by default the whole
    training topology of `tars up` (one envd, the inference server, the learner, cfg.actors actors; with actors
    judging by actor.judge_model and no actor.judge_inference, the judge's server). Empty tokens of the services it
    starts, and control.auth_token, get per-run values, saved to config.yaml (0600; tars.tokens)."""
    out = pathlib.Path(out).resolve()
    tokens.issue(cfg, out / "config.yaml", envd=n_envd > 0 and not envd_addrs, inference=inference and not inference_addr,
                 learner=learner)
    n_actors = cfg.actors if n_actors is None else n_actors
    judge = served_judge(cfg, n_actors)
    return Plan(out, out / "config.yaml", pathlib.Path(model).resolve() if model else None,
                0 if envd_addrs else n_envd, inference and not inference_addr, learner, n_actors, tuple(envd_addrs),
                inference_addr, cfg.telemetry.prometheus_port if cfg.telemetry.enabled else -1,
                pathlib.Path(judge).resolve() if judge else None)


class Topology:
    """Starts a Plan's processes in order, restarts any one of them in place, and stops them all.
    Use as a context manager (leaving it stops whatever is still running)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        prepare(plan.out)
        self.procs: dict[tuple[str, int], Process] = {}
        self.ready: dict[tuple[str, int], dict] = {}   # each process's ready file, as last announced
        self._resume = False                            # the learner's next start continues from its checkpoint
        self._weights: tuple[pathlib.Path, int] | None = None  # the inference server's next weights and version

    # ---- addresses ----------------------------------------------------------------------------------------
    @property
    def envd(self) -> str:
        """Every envd address, comma-separated (what actors take)."""
        own = [self.ready[("envd", i)]["address"] for i in range(self.plan.n_envd) if ("envd", i) in self.ready]
        return ",".join([*self.plan.envd_addrs, *own])

    @property
    def inference(self) -> str:
        return self.ready[("inference", 0)]["address"] if ("inference", 0) in self.ready else self.plan.inference_addr

    @property
    def judge(self) -> str:
        """The judge's server (actor.judge_inference of the actors), "" without one."""
        return self.ready[("judge", 0)]["address"] if ("judge", 0) in self.ready else ""

    @property
    def stream(self) -> str:
        return self.ready[("learner", 0)]["stream"]

    def _port(self, role: str, i: int, key: str = "address") -> str | None:
        """The port this role announced at its first start: a restart listens there again."""
        info = self.ready.get((role, i))
        return info[key].rsplit(":", 1)[1] if info else None

    # ---- the one place a run's role argv is built ---------------------------------------------------------
    def spec(self, role: str, i: int = 0) -> RoleSpec:
        p, name = self.plan, self.plan.name(role, i)
        opts = ["--config", str(p.config)]
        if role == "envd":
            port = self._port(role, i)
            opts += ["--port", port] if port else []
        elif role == "inference":
            model, version = self._weights or (p.model, None)
            opts += ["--model", str(model)] + (["--version", str(version)] if version is not None else [])
            port = self._port(role, i)
            opts += ["--port", port] if port else []
        elif role == "judge":  # its own frozen model, at every start: the learner publishes to "inference" only
            port = self._port(role, i)  # on the embedded engine (engine=sglang's servers are the policy's)
            opts += ["--model", str(p.judge), "--set", "inference.engine=local"] + (["--port", port] if port else [])
        elif role == "learner":
            opts += ["--run-dir", str(p.out), "--model", str(p.model), "--inference", self.inference]
            port = self._port(role, i, "stream")
            opts += ["--set", f"learner.stream.port={port}"] if port else []
            opts += ["--resume-or-fresh"] if self._resume else []  # killed before its first checkpoint: version 0
        elif role == "actor":
            opts += ["--envd", self.envd, "--inference", self.inference, "--stream", self.stream,
                     "--tokenizer", str(p.model), "--actor-id", f"actor{i}",
                     "--spool-dir", str(self.spool(i))]
            opts += ["--set", f"actor.judge_inference={self.judge}"] if self.judge else []
        else:
            raise ValueError(f"no role {role!r}")
        mport = p.metrics_ports().get((role, i))
        opts += ["--set", f"telemetry.prometheus_port={mport}"] if mport else []
        ready = p.out / "run" / f"{name}.json"
        return RoleSpec(role, i, name, [*role_argv(role, *opts), "--ready-file", str(ready)], ready,
                        p.out / "logs" / f"{name}.log", dict(RUN_ENV), None, READY_S[role], STOP_S[role])

    def spool(self, i: int) -> pathlib.Path:
        """Actor i's spool: its unacknowledged trajectories, re-sent by the next actor under its id."""
        return self.plan.out / "spool" / f"actor{i}"

    # ---- starting -----------------------------------------------------------------------------------------
    def launch(self, role: str, i: int = 0) -> Process:
        """Start one role (its old ready file removed first); wait_ready() on the result."""
        spec = self.spec(role, i)
        spec.ready.unlink(missing_ok=True)
        proc = self.procs[(role, i)] = Process(spec)
        return proc

    def await_ready(self, role: str, i: int = 0, timeout: float | None = None,
                    cancel: Callable[[], bool] | None = None) -> dict:
        info = self.ready[(role, i)] = self.procs[(role, i)].wait_ready(timeout, cancel)
        return info

    def start(self, cancel: Callable[[], bool] | None = None) -> Topology:
        """Everything the plan holds, in dependency order; raises LaunchError, or StartCancelled once `cancel()` is
        true (checked while waiting for each process, and before each launch: nothing more is started). Call stop()
        after either."""
        p = self.plan
        first = [("envd", i) for i in range(p.n_envd)] + ([("inference", 0)] if p.inference else [])
        first += [("judge", 0)] * p.count("judge")
        rest = [("learner", 0)] * p.learner + [("actor", i) for i in range(p.n_actors)]
        for key in first:  # the daemons start side by side: neither needs the other
            self.launch(*key)
        for key in first:
            self.await_ready(*key, cancel=cancel)
        for key in rest:
            if cancel is not None and cancel():
                raise StartCancelled(f"before {self.plan.name(*key)} was started")
            self.launch(*key)
            self.await_ready(*key, cancel=cancel)
        return self

    def relaunch(self, role: str, i: int = 0) -> Process:
        """Start a dead role again where the others expect it (see the module docstring), without waiting for it:
        the supervisor (tars/supervisor.py) watches its ready file while the run goes on."""
        if role == "learner":
            self._resume = True
        if role == "inference":
            from core.model_files import newest_published

            # Come back with the newest published weights (what an orchestrator restarting it would load).
            self._weights = newest_published(self.plan.out / "weights")
        old = self.procs.get((role, i))
        if old is not None and not old.stopped:
            old.kill()  # reaped, its log closed, and anything it started gone with its group
        return self.launch(role, i)

    def restart(self, role: str, i: int = 0, timeout: float | None = None) -> dict:
        """relaunch() and wait until it is ready."""
        self.relaunch(role, i)
        return self.await_ready(role, i, timeout)

    # ---- watching and stopping ----------------------------------------------------------------------------
    def kill(self, role: str, i: int = 0) -> None:
        self.procs[(role, i)].kill()

    def signal(self, role: str, i: int, sig: int) -> None:
        self.procs[(role, i)].signal(sig)

    def returncode(self, role: str, i: int = 0) -> int | None:
        return self.procs[(role, i)].returncode

    def alive(self) -> dict[str, bool]:
        """{"envd0": True, "actor1": False, ...}: role + index of every process started."""
        return {f"{r}{i}": p.returncode is None for (r, i), p in self.procs.items()}

    def pids(self) -> dict[str, int]:
        return {f"{r}{i}": p.pid for (r, i), p in self.procs.items()}

    def exited(self, roles: tuple[str, ...]) -> list[str]:
        """The roles (one entry per process) among `roles` whose process has exited."""
        return [r for (r, _), p in self.procs.items() if r in roles and p.returncode is not None]

    def stop(self, tiers: tuple[tuple[str, ...], ...] = STOP_TIERS) -> None:
        """Stop everything still running, tier by tier (stop_all); killed processes are left as they are. Then the
        shared-memory weight segments of this run go: a learner that exits removes its own, one killed mid-publish
        leaves its segment to its next start (learner/publish.py), and after the run there is none (a 7B policy's
        segment is ~15 GB of /dev/shm, held until the host reboots)."""
        stop_all(list(self.procs.values()), tiers)
        if self.plan.learner:
            from core import weights_shm  # (imports torch: not at module level, which tars ctl / eval import)
            if gone := weights_shm.clean_stale(weights_shm.run_prefix(self.plan.out)):
                print(f"tars: removed {len(gone)} weight segment(s) a killed learner left in /dev/shm", file=sys.stderr)

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
