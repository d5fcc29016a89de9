"""`tars bench env`'s figure for the session option screenshots=0 (core.session_options): a MiniWoB episode through
envd in a session created without screenshots, against the same episodes in a session with them, in one run.

    miniwob_screenshots_off_cpu  busy CPU-seconds of the machine (envd, its chromedrivers and Chromium, this client)
                                 per episode (a Reset and `steps` Steps toggling the first checkbox of
                                 click-checkboxes) without screenshots / with them. The two sessions play the same
                                 seeds, an episode of each in turn (the order swapping every round), so load drift
                                 hits both alike; beside it the wall time per episode of each.            goal <= 0.9
"""
from __future__ import annotations

import contextlib
import os
import time

from core import rpc
from core.session_options import SCREENSHOTS
from core.v1 import env_pb2, env_pb2_grpc

TICK = os.sysconf("SC_CLK_TCK")


def busy_cpu_s() -> float:
    """CPU-seconds the whole machine has spent busy (not idle, not waiting for I/O) since boot: /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / TICK


def bench_screenshots(daemon, task: str, options: dict[str, str], episodes: int, steps: int = 3,
                      ref: int = 6, deadline_s: float = 60.0) -> dict:
    """{'with_screenshots' | 'without': {cpu_s_per_episode, wall_s_per_episode, images}} and the CPU ratio (the
    caller makes it a figure). `daemon`: tars.bench.envd.Daemon; `options`: the sessions' other options."""
    ways = {"with_screenshots": {**options}, "without": {**options, SCREENSHOTS: "0"}}
    out: dict[str, dict] = {}
    with contextlib.closing(rpc.sync_channel(daemon.address)) as channel:
        stub = env_pb2_grpc.EnvServiceStub(channel)
        sids = {w: stub.CreateSession(env_pb2.CreateSessionRequest(env_id=f"miniwob/{task}", options=o),
                                      timeout=deadline_s).session_id for w, o in ways.items()}
        cpu = {w: 0.0 for w in ways}
        wall = {w: 0.0 for w in ways}
        images = {w: 0 for w in ways}
        action = env_pb2.Action(type="click", target=f"[{ref}]")
        for i in range(-1, episodes):            # round -1 warms both sessions up, uncounted
            for w in (list(ways) if i % 2 == 0 else list(ways)[::-1]):
                c0, t0 = busy_cpu_s(), time.perf_counter()
                rs = [stub.Reset(env_pb2.ResetRequest(session_id=sids[w], seed=1000 + max(i, 0)), timeout=deadline_s)]
                rs += [stub.Step(env_pb2.StepRequest(session_id=sids[w], action=action), timeout=deadline_s)
                       for _ in range(steps)]
                if i >= 0:
                    cpu[w] += busy_cpu_s() - c0
                    wall[w] += time.perf_counter() - t0
                    images[w] += sum(len(r.observation.images) for r in rs)
        for sid in sids.values():
            stub.Close(env_pb2.SessionRef(session_id=sid), timeout=deadline_s)
    for w in ways:
        out[w] = {"cpu_s_per_episode": round(cpu[w] / episodes, 4), "wall_s_per_episode": round(wall[w] / episodes, 4),
                  "images": images[w]}
    out["cpu_ratio"] = round(cpu["without"] / cpu["with_screenshots"], 4) if cpu["with_screenshots"] > 0 else None
    out["wall_ratio"] = round(wall["without"] / wall["with_screenshots"], 4)
    out["episodes"], out["steps_per_episode"] = episodes, steps
    return out
