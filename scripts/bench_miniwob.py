"""MiniWoB step latency three ways, and memory per extra session.

    PYTHONPATH=. .venv/bin/python scripts/bench_miniwob.py [--task click-checkboxes] [--steps 100] [--sessions 4]

The same task, seed and action (toggle the first checkbox: CLICK_ELEMENT on ref 6, which never ends the episode)
is stepped (1) through the stock gymnasium env (`gymnasium.make("miniwob/<task>-v1")`), (2) through envd's backend
in-process (MiniWoBEnv.step: action mapping, element text, PNG), and (3) through a `tars envd` subprocess over
gRPC on loopback. Then sessions are opened one by one and the memory each adds is measured: the summed RSS and PSS
of its processes, and the drop in the machine's MemAvailable.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from envd import miniwob_backend, proctree  # noqa: E402

REF = 6  # the first checkbox of click-checkboxes


def _summary(ms: list[float]) -> dict:
    ms = sorted(ms)
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2), "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 2),
            "mean_ms": round(statistics.fmean(ms), 2)}


def bench_gym(task: str, steps: int) -> dict:
    miniwob_backend.configure_offline()
    gym = miniwob_backend._gym()
    env = gym.make(f"miniwob/{task}-v1", disable_env_checker=True)
    try:
        env.unwrapped.instance.driver.execute_script("core.EPISODE_MAX_TIME = 600000;")
        env.reset(seed=0)
        action = env.unwrapped.create_action("CLICK_ELEMENT", ref=REF)
        ms = []
        for _ in range(steps):
            t0 = time.perf_counter()
            _, _, done, _, _ = env.step(action)
            ms.append((time.perf_counter() - t0) * 1e3)
            assert not done
        return _summary(ms)
    finally:
        env.close()


def bench_backend(task: str, steps: int) -> dict:
    env = miniwob_backend.make(task, {"episode_time_s": "600"})
    try:
        env.reset(0)
        ms = []
        for _ in range(steps):
            t0 = time.perf_counter()
            r = env.step({"type": "click", "target": f"[{REF}]"})
            ms.append((time.perf_counter() - t0) * 1e3)
            assert r.outcome == "running"
        return _summary(ms)
    finally:
        env.close()


def bench_envd(task: str, steps: int) -> dict:
    from tars import rpc
    from tars.v1 import env_pb2, env_pb2_grpc

    ready = os.path.join(tempfile.mkdtemp(), "envd.json")
    proc = subprocess.Popen([sys.executable, "-m", "tars.cli", "envd", "--port", "0", "--ready-file", ready],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(ready):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("envd did not start")
            time.sleep(0.05)
        stub = env_pb2_grpc.EnvServiceStub(rpc.sync_channel(json.load(open(ready))["address"]))
        opts = {"episode_time_s": "600"}
        sid = stub.CreateSession(env_pb2.CreateSessionRequest(env_id=f"miniwob/{task}", options=opts), timeout=60).session_id
        stub.Reset(env_pb2.ResetRequest(session_id=sid, seed=0, options=opts), timeout=60)
        action = env_pb2.Action(type="click", target=f"[{REF}]")
        ms, backend_ms = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            r = stub.Step(env_pb2.StepRequest(session_id=sid, action=action), timeout=60)
            ms.append((time.perf_counter() - t0) * 1e3)
            backend_ms.append(r.step_ms)
            assert r.outcome == 1  # RUNNING
        stub.Close(env_pb2.SessionRef(session_id=sid), timeout=60)
        return {**_summary(ms), "backend_p50_ms": round(statistics.median(backend_ms), 2)}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _mem_kb(pids: set[int]) -> tuple[int, int]:
    rss = pss = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1])
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1])
        except OSError:
            pass
    return rss, pss


def _available_kb() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))


def bench_memory(task: str, sessions: int) -> dict:
    envs, rows = [], []
    try:
        for _ in range(sessions):
            before = _available_kb()
            env = miniwob_backend.make(task)
            env.reset(0)
            time.sleep(1.0)  # let the renderer settle
            pids = proctree.session_processes(env.browser.pid, {env.browser.pid}, needle=env._dir)
            rss, pss = _mem_kb(pids)
            rows.append({"processes": len(pids), "rss_mb": round(rss / 1024), "pss_mb": round(pss / 1024),
                         "mem_available_drop_mb": round((before - _available_kb()) / 1024)})
            envs.append(env)
    finally:
        for env in envs:
            env.close()
    return {"per_session": rows,
            "mean_rss_mb": round(statistics.fmean(r["rss_mb"] for r in rows)),
            "mean_pss_mb": round(statistics.fmean(r["pss_mb"] for r in rows)),
            "mean_available_drop_mb": round(statistics.fmean(r["mem_available_drop_mb"] for r in rows))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="click-checkboxes")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--sessions", type=int, default=4)
    a = ap.parse_args()
    out = {"task": a.task, "gym_in_process": bench_gym(a.task, a.steps),
           "backend_in_process": bench_backend(a.task, a.steps), "through_envd": bench_envd(a.task, a.steps)}
    out["envd_over_backend_p50"] = round(out["through_envd"]["p50_ms"] / out["backend_in_process"]["p50_ms"], 2)
    out["envd_over_gym_p50"] = round(out["through_envd"]["p50_ms"] / out["gym_in_process"]["p50_ms"], 2)
    out["memory"] = bench_memory(a.task, a.sessions)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
