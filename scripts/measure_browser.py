"""Measure the browser backend: memory per session, step latency, and random-policy scores of the games.

    PYTHONPATH=$PWD .venv/bin/python scripts/measure_browser.py memory    # RSS/PSS of Chromium, 1 vs 8 sessions
    PYTHONPATH=$PWD .venv/bin/python scripts/measure_browser.py latency   # click + screenshot step, browser and games
    PYTHONPATH=$PWD .venv/bin/python scripts/measure_browser.py random    # random-key scores per game (for <game>.json)
"""
from __future__ import annotations

import random
import statistics
import sys
import time

from core.action import Action
from envd.browser import HOST, BrowserEnv
from envd.browser_host import process_group
from envd.games import GameEnv, game_info, names

PAGE = ("<!doctype html><title>Form</title><h1>Sign up</h1><button onclick='n.textContent=++c'>Add</button>"
        "<p id=n>0</p><label>Name <input></label><label>Email <input></label><script>let c=0</script>"
        + "".join(f"<p>Paragraph {i} with some text to lay out and paint.</p>" for i in range(40)))


def _kb(pid: int, field: str) -> int:
    """A field of /proc/<pid>/smaps_rollup (Rss, Pss) in kB; 0 if the process is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def chromium_memory() -> dict[str, float]:
    pids = process_group(HOST.browser_pid)
    return {"processes": len(pids), "rss_mb": sum(_kb(p, "Rss") for p in pids) / 1024,
            "pss_mb": sum(_kb(p, "Pss") for p in pids) / 1024, "driver_rss_mb": _kb(HOST.driver_pid, "Rss") / 1024}


def memory() -> None:
    envs = [BrowserEnv({"html": PAGE})]
    envs[0].reset(0, {})
    time.sleep(1.0)
    one = chromium_memory()
    for _ in range(7):
        envs.append(BrowserEnv({"html": PAGE}))
        envs[-1].reset(0, {})
    time.sleep(1.0)
    eight = chromium_memory()
    print(f"1 session : {one}")
    print(f"8 sessions: {eight}")
    print(f"per extra session: RSS {(eight['rss_mb'] - one['rss_mb']) / 7:.1f} MB, "
          f"PSS {(eight['pss_mb'] - one['pss_mb']) / 7:.1f} MB, processes {(eight['processes'] - one['processes']) / 7:.1f}")
    for e in envs:
        e.close()


def _latency(env, action: Action, n: int = 40) -> str:
    ms = []
    for _ in range(n):
        t0 = time.perf_counter()
        env.step(action)
        ms.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(ms, n=10)
    return f"median {statistics.median(ms):.1f} ms, p90 {q[-1]:.1f} ms over {n} steps"


def latency() -> None:
    for settle in ("0", "50"):
        e = BrowserEnv({"html": PAGE, "settle_ms": settle, "max_steps": "1000"})
        e.reset(0, {})
        _latency(e, Action("click", point=(30, 80)), 5)  # warm-up
        print(f"browser click+screenshot (1280x720 png, settle_ms={settle}): "
              f"{_latency(e, Action('click', point=(30, 80)))}")
        e.close()
    g = GameEnv("2048", {"max_steps": "1000"})
    g.reset(0, {})
    print(f"games/2048 hotkey+100 ms clock+screenshot (640x560 png): {_latency(g, Action('hotkey', key='left'))}")
    g.close()


def random_scores(episodes: int = 3) -> None:
    keys = ["up", "down", "left", "right"]
    for name in names():
        scores = []
        for ep in range(episodes):
            rng = random.Random(ep)
            e = GameEnv(name, {})
            r = e.reset(1000 + ep, {})
            total = 0.0
            while r.outcome == "running":
                r = e.step(Action("hotkey", key=rng.choice(keys)))
                total += r.reward
            scores.append(total)
            e.close()
        print(f"{name}: random-key score {statistics.mean(scores):.1f} (episodes {scores}, "
              f"max_steps {game_info(name)['max_steps']}); human reference {game_info(name)['human_score']}")


if __name__ == "__main__":
    {"memory": memory, "latency": latency, "random": random_scores}[sys.argv[1] if len(sys.argv) > 1 else "memory"]()
    HOST.shutdown()
