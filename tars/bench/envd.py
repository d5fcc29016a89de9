"""`tars bench env`: what envd costs, each figure against a baseline measured in the same run.

    tars bench env [--json FILE] [--quick] [--skip-browser] [--skip-miniwob]

Figures (the daemon is a real `tars envd` subprocess on loopback, so client and daemon do not share a GIL):
  noop_step_over_ping      p50 of a no-op Step (`wait` on builtin/click) / p50 of the daemon's bare Ping RPC, both
                           over one sync channel, calls interleaved so drift hits both alike          goal <= 1.5
  miniwob_step_over_inprocess  p50 of a MiniWoB step through envd / the same step on the backend in-process
                           (click-checkboxes, toggling the first checkbox: never ends the episode)    goal <= 1.1
  concurrent_step_p99_ms   p99 Step latency with `--sessions` builtin sessions on one daemon, stepped by one asyncio
                           client with at most `--inflight` steps in flight; baseline: 1 session          goal < 20
  browser_pss_per_session_mb / miniwob_pss_per_session_mb  PSS of the daemon's process tree (drivers, browsers,
                           their helpers) with 1 and with `--mem-sessions` sessions; per extra session.  no goal
  miniwob_screenshots_off_cpu  CPU per MiniWoB episode in a session without screenshots / with them
                           (tars/bench/envd_screens.py)                                               goal <= 0.9
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import platform
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable

from envd import miniwob_chromium, proctree, registry
from core import rpc
from core.v1 import common_pb2, env_pb2, env_pb2_grpc
from tars.bench import report
from tars.bench.envd_screens import bench_screenshots
from tars.topology import LaunchError, Process, daemon_spec, pythonpath

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOOP_OPTIONS = {"max_steps": str(10**9)}        # `wait` never ends a builtin episode before max_steps
MINIWOB_REF = 6                                  # the first checkbox of click-checkboxes: toggling never ends it
MINIWOB_OPTIONS = {"episode_time_s": "600"}      # no time-out in the middle of a measurement
BROWSER_PAGE = "<form>" + "".join(f"<label>Field {i} <input name=f{i}></label><p>Paragraph {i} of some text.</p>"
                                  for i in range(40)) + "<button>Submit</button></form>"
DEADLINE_S = 60.0                                # every RPC here has one
MINIWOB_FIGURES = {"miniwob_step_over_inprocess": ("MiniWoB step through envd / in-process", "ratio", ("<=", 1.1)),
                   "miniwob_pss_per_session_mb": ("PSS per miniwob session", "MB", None),
                   "miniwob_screenshots_off_cpu": ("CPU per MiniWoB episode without screenshots / with them", "ratio",
                                                   ("<=", 0.9))}


def _pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    v = sorted(xs)
    return v[min(len(v), max(1, math.ceil(q / 100 * len(v)))) - 1]


def summary(ms: list[float]) -> dict:
    return {"n": len(ms), "p50_ms": round(_pct(ms, 50), 4), "p99_ms": round(_pct(ms, 99), 4),
            "mean_ms": round(statistics.fmean(ms), 4)}


def figure(what: str, value: float | None, unit: str, goal: tuple[str, float] | None, **detail) -> dict:
    ok = None
    if value is not None and goal is not None:
        ok = value <= goal[1] if goal[0] == "<=" else value < goal[1]
    return {"what": what, "value": value, "unit": unit, "goal": f"{goal[0]} {goal[1]:g}" if goal else None,
            "pass": ok, **detail}


def skipped(what: str, unit: str, goal: tuple[str, float] | None, reason: str) -> dict:
    return figure(what, None, unit, goal, skipped=reason)


def ratio(a: float, b: float) -> float:
    return round(a / b, 4)


# ---- the daemon ------------------------------------------------------------------------------------------------

class Daemon:
    """`tars envd` on 127.0.0.1:0 in a subprocess with a private TMPDIR (so that helpers that leave the process
    tree, like Chromium's crash handler, can still be found by the directory in their command line)."""

    def __init__(self, workers: int = 8):
        self.dir = tempfile.mkdtemp(prefix="tars-bench-envd-")
        os.chmod(self.dir, 0o711)   # a root daemon's sandbox uids pass it to their sessions' directories
        env = {"TMPDIR": self.dir, "PYTHONPATH": pythonpath(REPO)}
        spec = daemon_spec("envd", ["--port", "0", "--set", f"envd.workers={workers}", "--set", "envd.host=127.0.0.1"],
                           pathlib.Path(self.dir), env)
        spec.ready_s, spec.stop_s = DEADLINE_S, 30.0  # graceful stop: the daemon closes every session
        self.log = str(spec.log)
        self.proc = Process(spec)
        try:
            self.address = self.proc.wait_ready()["address"]
        except LaunchError:
            self.stop()
            raise RuntimeError(f"envd did not start; its log ends:\n{self._tail()}") from None

    def _tail(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-2000:]

    def processes(self) -> set[int]:
        """The daemon's children and theirs, plus anything naming its private TMPDIR (not the daemon itself)."""
        return (proctree.descendants({self.proc.pid}) | proctree.mentioning(self.dir)) - {self.proc.pid, os.getpid()}

    def stop(self) -> None:
        self.proc.stop()
        proctree.kill_session(self.proc.pid, needle=self.dir)  # whatever a crash left behind
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _check(r: env_pb2.StepResponse) -> env_pb2.StepResponse:
    if r.outcome != common_pb2.RUNNING:
        raise RuntimeError(f"step answered {common_pb2.Outcome.Name(r.outcome)}: {r.info_json}")
    return r


# ---- no-op step vs ping ------------------------------------------------------------------------------------------

def bench_noop(d: Daemon, steps: int) -> dict:
    stub = env_pb2_grpc.EnvServiceStub(channel := rpc.sync_channel(d.address))
    try:
        sid = stub.CreateSession(env_pb2.CreateSessionRequest(env_id="builtin/click", options=NOOP_OPTIONS),
                                 timeout=DEADLINE_S).session_id
        _check(stub.Reset(env_pb2.ResetRequest(session_id=sid, seed=1), timeout=DEADLINE_S))
        step = env_pb2.StepRequest(session_id=sid, action=env_pb2.Action(type="wait"))
        ping = env_pb2.PingRequest()
        ping_ms, step_ms, backend_ms = [], [], []
        for i in range(steps + 20):  # the first 20 of each warm the channel and the worker threads
            t0 = time.perf_counter()
            stub.Ping(ping, timeout=DEADLINE_S)
            t1 = time.perf_counter()
            r = _check(stub.Step(step, timeout=DEADLINE_S))
            t2 = time.perf_counter()
            if i >= 20:
                ping_ms.append((t1 - t0) * 1e3)
                step_ms.append((t2 - t1) * 1e3)
                backend_ms.append(r.step_ms)
        stub.Close(env_pb2.SessionRef(session_id=sid), timeout=DEADLINE_S)
    finally:
        channel.close()
    s, p = summary(step_ms), summary(ping_ms)
    return figure("no-op Step p50 through envd / Ping p50 over the same channel", ratio(s["p50_ms"], p["p50_ms"]),
                  "ratio", ("<=", 1.5), step=s, ping=p, backend_step_p50_ms=round(_pct(backend_ms, 50), 4))


# ---- many concurrent sessions ------------------------------------------------------------------------------------

async def _concurrent(address: str, sessions: int, steps_each: int, inflight: int) -> dict:
    channel = rpc.channel(address)
    stub = env_pb2_grpc.EnvServiceStub(channel)
    gate = asyncio.Semaphore(inflight)
    step_ms: list[float] = []

    async def open_one() -> str:
        async with gate:
            sid = (await stub.CreateSession(env_pb2.CreateSessionRequest(env_id="builtin/click", options=NOOP_OPTIONS),
                                            timeout=DEADLINE_S)).session_id
            _check(await stub.Reset(env_pb2.ResetRequest(session_id=sid, seed=1), timeout=DEADLINE_S))
            return sid

    async def drive(sid: str) -> None:
        req = env_pb2.StepRequest(session_id=sid, action=env_pb2.Action(type="wait"))
        for _ in range(steps_each):
            async with gate:
                t0 = time.perf_counter()
                _check(await stub.Step(req, timeout=DEADLINE_S))
                step_ms.append((time.perf_counter() - t0) * 1e3)

    async def close_one(sid: str) -> None:
        async with gate:
            await stub.Close(env_pb2.SessionRef(session_id=sid), timeout=DEADLINE_S)

    try:
        sids = await asyncio.gather(*(open_one() for _ in range(sessions)))
        t0 = time.perf_counter()
        await asyncio.gather(*(drive(s) for s in sids))
        wall = time.perf_counter() - t0
        await asyncio.gather(*(close_one(s) for s in sids))
    finally:
        await channel.close()
    return {"sessions": sessions, "inflight": inflight, **summary(step_ms), "steps_per_s": round(len(step_ms) / wall, 1)}


def bench_concurrent(d: Daemon, sessions: int, steps_each: int, inflight: int, more: tuple[int, ...] = ()) -> dict:
    """Latency at `inflight` steps in flight (the figure), and at each of `more` (the throughput/latency curve:
    past the daemon's capacity, latency grows as in-flight / steps per second while throughput stays flat)."""
    one = asyncio.run(_concurrent(d.address, 1, max(steps_each, 200), 1))
    many = asyncio.run(_concurrent(d.address, sessions, steps_each, inflight))
    curve = [asyncio.run(_concurrent(d.address, sessions, steps_each, k)) for k in more if k != inflight]
    return figure(f"p99 no-op Step latency, {sessions} builtin sessions on one daemon, one asyncio client, "
                  f"{inflight} steps in flight", many["p99_ms"], "ms", ("<", 20.0), at_n=many, at_1=one,
                  p99_over_1_session=ratio(many["p99_ms"], one["p99_ms"]), other_inflight=curve)


# ---- MiniWoB step: envd vs in-process ------------------------------------------------------------------------------

def in_turn(ways: dict[str, Callable[[], object]], orders: list[tuple[str, ...]], rounds: int,
            warmup: int = 0) -> dict[str, list[float]]:
    """Each way once a round for `warmup` + `rounds` rounds, round i in the order orders[i % len(orders)] (so load
    drift hits all alike): {name: ms of each call after the warm-up rounds}."""
    timed: dict[str, list[float]] = {name: [] for name in ways}
    for i in range(warmup + rounds):
        for name in orders[i % len(orders)]:
            t0 = time.perf_counter()
            ways[name]()
            if i >= warmup:
                timed[name].append((time.perf_counter() - t0) * 1e3)
    return timed


# The stock gymnasium env (the reference) steps first; envd and in-process then take turns at stepping right after
# it, so each of the two compared ways follows the stock env, and the other, equally often. In a fixed order (envd
# right after the stock env, in-process right after envd) the backend's own time came out 4-7 % slower inside the
# daemon in most runs, 10-14 % faster in others: it measured which browser stepped after which (docs/benchmarks.md).
MINIWOB_ORDERS = [("stock_gymnasium", "envd", "in_process"), ("stock_gymnasium", "in_process", "envd")]


def bench_miniwob(task: str, steps: int) -> dict:
    """The same task, seed and action three ways, one step of each in turn (so load drift hits all alike): through
    envd, on the backend in-process, and on the stock gymnasium env (for reference), in the orders of
    MINIWOB_ORDERS by turns.

    Beside the figure, where an envd step's extra time goes, paired per step: `envd_overhead_ms` is the envd step
    minus the backend's own time inside the daemon (the RPC both ways, the hop to the worker thread and back);
    `inside_envd_over_in_process` is the backend's time inside the daemon over the in-process step's."""
    from core.action import Action
    from envd import miniwob_backend

    miniwob_backend.configure_offline()
    with Daemon() as d, contextlib.ExitStack() as stack:
        stub = env_pb2_grpc.EnvServiceStub(stack.enter_context(rpc.sync_channel(d.address)))
        sid = stub.CreateSession(env_pb2.CreateSessionRequest(env_id=f"miniwob/{task}", options=MINIWOB_OPTIONS),
                                 timeout=DEADLINE_S).session_id
        _check(stub.Reset(env_pb2.ResetRequest(session_id=sid, seed=0, options=MINIWOB_OPTIONS), timeout=DEADLINE_S))
        req = env_pb2.StepRequest(session_id=sid, action=env_pb2.Action(type="click", target=f"[{MINIWOB_REF}]"))
        env = miniwob_backend.make(task, MINIWOB_OPTIONS)
        stack.callback(env.close)
        env.reset(0, MINIWOB_OPTIONS)  # the time limit is an episode option: make() alone does not apply it
        gym = miniwob_backend._gym().make(f"miniwob/{task}-v1", disable_env_checker=True)
        stack.callback(gym.close)
        gym.unwrapped.instance.driver.execute_script("core.EPISODE_MAX_TIME = 600000;")
        gym.reset(seed=0)
        gym_action = gym.unwrapped.create_action("CLICK_ELEMENT", ref=MINIWOB_REF)
        action = Action("click", target=f"[{MINIWOB_REF}]")
        inside: list[float] = []

        def through_envd() -> None:
            inside.append(_check(stub.Step(req, timeout=DEADLINE_S)).step_ms)

        def in_process() -> None:
            local = env.step(action)
            if local.outcome != "running":
                raise RuntimeError(f"in-process step ended the episode: {local.info}")

        timed = in_turn({"envd": through_envd, "in_process": in_process,
                         "stock_gymnasium": lambda: gym.step(gym_action)}, MINIWOB_ORDERS, steps, warmup=6)
        timed["inside_envd"] = inside[6:]
    e, b = summary(timed["envd"]), summary(timed["in_process"])
    overhead = [x - y for x, y in zip(timed["envd"], timed["inside_envd"])]
    return figure(f"MiniWoB {task} step p50 through envd / the same step on the backend in-process",
                  ratio(e["p50_ms"], b["p50_ms"]), "ratio", ("<=", 1.1), envd=e, in_process=b,
                  envd_backend_step_p50_ms=round(_pct(timed["inside_envd"], 50), 4),
                  envd_overhead_ms=summary(overhead),
                  inside_envd_over_in_process=ratio(_pct(timed["inside_envd"], 50), b["p50_ms"]),
                  stock_gymnasium=summary(timed["stock_gymnasium"]))


# ---- memory per session ------------------------------------------------------------------------------------------

def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("Pss:")), 0)
    except OSError:
        return 0  # gone since it was listed


def _exe(pid: int) -> str:
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return ""


def tree_memory(d: Daemon) -> dict:
    """PSS of the daemon's process tree once its process count has held still for a second (pages settle)."""
    deadline, last, still = time.monotonic() + 20, None, 0
    while time.monotonic() < deadline and still < 4:
        pids = d.processes()
        still, last = (still + 1, pids) if pids == last else (0, pids)
        time.sleep(0.25)
    pss = {p: _pss_kb(p) for p in last or ()}
    chromium = [p for p in pss if _exe(p) == "chromium"]
    return {"processes": len(pss), "pss_mb": round(sum(pss.values()) / 1024, 1),
            "chromium_processes": len(chromium), "chromium_pss_mb": round(sum(pss[p] for p in chromium) / 1024, 1)}


def bench_memory(env_id: str, options: dict[str, str], sessions: int) -> dict:
    with Daemon() as d:
        stub = env_pb2_grpc.EnvServiceStub(channel := rpc.sync_channel(d.address))
        try:
            rows = {}
            for n in range(1, sessions + 1):
                sid = stub.CreateSession(env_pb2.CreateSessionRequest(env_id=env_id, options=options),
                                         timeout=DEADLINE_S).session_id
                _check(stub.Reset(env_pb2.ResetRequest(session_id=sid, seed=n, options=options), timeout=DEADLINE_S))
                if n in (1, sessions):
                    rows[n] = tree_memory(d)
        finally:
            channel.close()
    one, many = rows[1], rows[sessions]
    extra = max(1, sessions - 1)
    per = round((many["pss_mb"] - one["pss_mb"]) / extra, 1) if sessions > 1 else one["pss_mb"]
    return figure(f"PSS added per {env_id} session (daemon's process tree, 1 -> {sessions} sessions)", per, "MB",
                  None, at_1=one, **{f"at_{sessions}": many}, first_session_pss_mb=one["pss_mb"],
                  chromium_pss_per_session_mb=round((many["chromium_pss_mb"] - one["chromium_pss_mb"]) / extra, 1))


def _backend_missing(env_id: str) -> str | None:
    try:
        registry.resolve(env_id)
    except KeyError:
        return f"no `{env_id.split('/')[0]}` backend is registered in envd/registry.py"
    if env_id.startswith("miniwob/") and (lacking := miniwob_chromium.missing()):
        return f"{', '.join(lacking)} not installed"
    if not os.path.exists("/usr/bin/chromium"):
        return "/usr/bin/chromium is not installed"
    return None


# ---- the command ---------------------------------------------------------------------------------------------------

def machine() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)), "cpu": model,
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(),
            "platform": platform.platform()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="FILE", help="write every figure here as JSON")
    p.add_argument("--quick", action="store_true", help="small sizes (tests, smoke runs)")
    p.add_argument("--skip-browser", action="store_true", help="leave out the browser memory figure")
    p.add_argument("--skip-miniwob", action="store_true", help="leave out the MiniWoB latency and memory figures")
    p.add_argument("--steps", type=int, help="sequential steps per latency figure (default 2000; quick 200)")
    p.add_argument("--sessions", type=int, help="concurrent builtin sessions (default 1000; quick 100)")
    p.add_argument("--inflight", type=int, default=8, help="most steps in flight at once across those sessions (default "
                   "8 = envd.workers, the backend calls the daemon runs at once; 64 and 256 are measured too)")
    p.add_argument("--mem-sessions", type=int, default=8, help="sessions open for the memory figures")
    p.add_argument("--task", default="click-checkboxes", help="MiniWoB task (its first checkbox is clicked)")


def check_arguments(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    a.steps = a.steps if a.steps is not None else (200 if a.quick else 2000)
    a.sessions = a.sessions if a.sessions is not None else (100 if a.quick else 1000)
    for name in ("steps", "sessions", "inflight", "mem_sessions"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.json and not os.path.isdir(os.path.dirname(os.path.abspath(a.json))):
        p.error(f"--json {a.json}: directory {os.path.dirname(os.path.abspath(a.json))} does not exist")


def run(a: argparse.Namespace) -> dict:
    out = {"machine": machine(), "started_unix": int(time.time()),
           "settings": {k: getattr(a, k) for k in ("quick", "steps", "sessions", "inflight", "mem_sessions", "task")},
           "figures": {}}
    figs = out["figures"]
    steps_each = max(2, a.steps // 100) if a.quick else 20
    with Daemon() as d:
        figs["noop_step_over_ping"] = bench_noop(d, a.steps)
        figs["concurrent_step_p99_ms"] = bench_concurrent(d, a.sessions, steps_each, a.inflight,
                                                          () if a.quick else (64, 256))
    mw_steps = min(a.steps, 200)  # a browser step is ~50 ms: 200 are enough for a p50
    why = "--skip-miniwob" if a.skip_miniwob else _backend_missing(f"miniwob/{a.task}")
    if why is not None:
        figs.update({k: skipped(*v, why) for k, v in MINIWOB_FIGURES.items()})
    else:
        figs["miniwob_step_over_inprocess"] = bench_miniwob(a.task, mw_steps)
        figs["miniwob_pss_per_session_mb"] = bench_memory(f"miniwob/{a.task}", MINIWOB_OPTIONS, a.mem_sessions)
        with Daemon() as d:
            r = bench_screenshots(d, a.task, MINIWOB_OPTIONS, 10 if a.quick else 60, ref=MINIWOB_REF)
        what, unit, goal = MINIWOB_FIGURES["miniwob_screenshots_off_cpu"]
        figs["miniwob_screenshots_off_cpu"] = figure(f"{what} ({a.task})", r.pop("cpu_ratio"), unit, goal, **r)
    why = "--skip-browser" if a.skip_browser else _backend_missing("browser")
    if why is not None:
        figs["browser_pss_per_session_mb"] = skipped("PSS per browser session", "MB", None, why)
    else:
        figs["browser_pss_per_session_mb"] = bench_memory("browser", {"html": BROWSER_PAGE}, a.mem_sessions)
    return out


def table(out: dict) -> str:
    rows = [("figure", "value", "goal", "pass", "baseline / detail")]
    for name, f in out["figures"].items():
        if f["value"] is None:
            rows.append((name, "-", f["goal"] or "-", "-", f"skipped: {f['skipped']}"))
            continue
        if "step" in f:
            detail = f"step p50 {f['step']['p50_ms']:.3f} ms / ping p50 {f['ping']['p50_ms']:.3f} ms"
        elif "at_n" in f:
            detail = (f"1 session: p99 {f['at_1']['p99_ms']:.2f} ms; {f['at_n']['sessions']}: p50 "
                      f"{f['at_n']['p50_ms']:.2f} ms, {f['at_n']['steps_per_s']:.0f} steps/s")
        elif "with_screenshots" in f:
            detail = (f"{f['without']['cpu_s_per_episode']:.3f} / {f['with_screenshots']['cpu_s_per_episode']:.3f} "
                      f"CPU-s an episode; wall {f['wall_ratio']:.3f} of it")
        elif "envd" in f:
            detail = f"envd p50 {f['envd']['p50_ms']:.1f} ms / in-process p50 {f['in_process']['p50_ms']:.1f} ms"
            if "envd_overhead_ms" in f:
                detail += (f"; RPC + thread hop p50 {f['envd_overhead_ms']['p50_ms']:.2f} ms, backend inside envd / "
                           f"in-process {f['inside_envd_over_in_process']:.3f}")
        else:
            detail = f"first session {f['first_session_pss_mb']:.0f} MB"
        ok = "-" if f["pass"] is None else ("PASS" if f["pass"] else "FAIL")
        rows.append((name, f"{f['value']:g} {f['unit']}", f["goal"] or "-", ok, detail))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tars bench env", description=__doc__.splitlines()[0])
    add_arguments(ap)
    a = ap.parse_args(argv)
    check_arguments(ap, a)
    return a


def main(argv: list[str] | None = None) -> int:
    """`tars bench env ARGS`: argparse errors exit with status 2 and a message naming the argument."""
    a = parse(argv)
    return report(run(a), table, a.json)


if __name__ == "__main__":
    sys.exit(main())
