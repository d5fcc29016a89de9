"""`tars bench actor`: what the actor itself costs, and what image dedupe saves on the trajectory stream.

    tars bench actor [--json FILE] [--quick] [--concurrency 1,100,1000] [--skip-miniwob]

Figures:
  episodes_per_s / actor_overhead_p99_ms at each concurrency C: C episodes (at least `--min-episodes`) of
        builtin/click run by one asyncio process with C in flight, through a real `tars envd` subprocess and a real
        InferenceService subprocess whose engine is scripted (inference_server/scripted.py: every answer is
        `wait()`, so model time is ~0 and each episode runs its full step budget). Actor overhead per turn is the
        turn's wall time minus the awaited envd and inference calls (timings["actor_ms"] in actor/episode.py): the
        prompt, token bookkeeping, decoding and parsing, i.e. what the actor adds per turn. The figure is its CPU-time
        form (actor_cpu_ms: on a shared machine the wall form also counts time the process was descheduled); both
        are reported. Baseline: C = 1 in the same run.          goal: p99 (CPU) at the largest C <= 5 ms, no failures
  bytes_per_trajectory (MiniWoB): `--groups` groups of `--group-size` episodes (same task and seed, as GRPO samples
        them) on miniwob/<task> with a random-click scripted policy; their trajectories sent through a real
        TrajectorySender -> TrajectoryReceiver twice, with image dedupe and without (every trajectory carries its own
        distinct screenshots once). Ratio deduped / not deduped, measured in the same run; beside it, the bytes if
        every turn carried its screenshot inline (no content addressing at all).  no goal (the saving depends on how
        often screens repeat: group resets, actions that change nothing)
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import pathlib
import random
import shutil
import sys
import tempfile
import time

from tars.bench import report
from tars.bench.envd import Daemon, figure, machine, skipped, summary
from tars.topology import LaunchError, Process, RoleSpec, pythonpath

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEADLINE_S = 60.0


class ScriptedServer:
    """`python -m inference_server.scripted` in a subprocess: its own GIL, like a real inference server."""

    def __init__(self, answer: str):
        self.dir = tempfile.mkdtemp(prefix="tars-bench-actor-")
        ready, log = pathlib.Path(self.dir, "ready.json"), pathlib.Path(self.dir, "inference.log")
        env = {"PYTHONPATH": pythonpath(REPO)}
        # Not a `tars serve`: the scripted engine's own entry point, started and stopped like any role.
        self.proc = Process(RoleSpec("inference", 0, "inference", [sys.executable, "-m", "inference_server.scripted",
                                                                   "--answer", answer, "--tokenizer", _tok_dir(),
                                                                   "--ready-file", str(ready)],
                                     ready, log, env, None, DEADLINE_S, 10.0))
        try:
            self.address = self.proc.wait_ready()["address"]
        except LaunchError:
            self.stop()
            raise RuntimeError("scripted inference server did not start") from None

    def stop(self) -> None:
        self.proc.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _tok_dir() -> str:
    from tars.fresh import shared_tokenizer

    return shared_tokenizer().path


async def _run_episodes(envd: str, inference: str, n: int, concurrency: int, env_id: str, cfg_kw: dict,
                        infer=None, tok=None, group_size: int = 1):
    from actor.envclient import EnvClient
    from actor.episode import EpisodeContext, run_episode
    from core.inference_client import InferenceClient
    from core.config import ActorConfig
    from tars.fresh import shared_tokenizer

    cfg = ActorConfig(**{"rpc_timeout_s": DEADLINE_S, "retries": 3, **cfg_kw})
    own = infer is None
    infer = infer or InferenceClient([inference], timeout_s=DEADLINE_S, retries=3)
    env = EnvClient(envd, "", DEADLINE_S, 3)
    ctx = EpisodeContext(cfg, tok or shared_tokenizer(), infer, "bench")
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int):
        async with sem:
            seed = 1000 + i // group_size
            return await run_episode(ctx, env, f"bench-{i:07d}", env_id, seed, 0, group=str(seed))

    try:
        t0 = time.perf_counter()
        trs = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    finally:
        if own:
            await infer.close()
        await env.close()
    return trs, wall


def bench_concurrency(envd: str, inference: str, levels: list[int], min_episodes: int, max_turns: int) -> dict:
    import gc

    rows = {}
    for c in levels:
        n = max(c, min_episodes)
        gc.collect()
        trs, wall = asyncio.run(_run_episodes(envd, inference, n, c, "builtin/click",
                                              {"max_turns": max_turns, "env_options": {"max_steps": str(max_turns)}}))
        over = [x for t in trs for x in t.timings["actor_ms"]]
        cpu = [x for t in trs for x in t.timings["actor_cpu_ms"]]
        turns = sum(len(t.turns) for t in trs)
        env_ms = [u.env_ms for t in trs for u in t.turns]
        gen_ms = [u.gen_ms for t in trs for u in t.turns]
        rows[c] = {"episodes": n, "turns": turns, "wall_s": round(wall, 3), "episodes_per_s": round(n / wall, 2),
                   "turns_per_s": round(turns / wall, 1), "infra_errors": sum(t.outcome == "infra_error" for t in trs),
                   "actor_overhead": summary(over), "actor_overhead_cpu": summary(cpu), "env_call": summary(env_ms), "inference_call": summary(gen_ms)}
    top, base = rows[max(levels)], rows[min(levels)]
    fig = figure(f"p99 per-turn actor overhead at {max(levels)} concurrent episodes, CPU time (env and model time "
                 "excluded)", top["actor_overhead_cpu"]["p99_ms"], "ms", ("<=", 5.0),
                 wall_p99_ms=top["actor_overhead"]["p99_ms"],
                 baseline_p99_ms_at_1=base["actor_overhead_cpu"]["p99_ms"],
                 ratio_to_baseline=round(top["actor_overhead_cpu"]["p99_ms"] / base["actor_overhead_cpu"]["p99_ms"], 3),
                 levels={str(k): v for k, v in rows.items()})
    if any(r["infra_errors"] for r in rows.values()):
        fig["pass"] = False
    return fig


async def _miniwob_trajectories(envd: str, task: str, groups: int, group_size: int, max_turns: int, seed: int):
    from core.inference_client import InferenceClient
    from inference_server.scripted import ScriptedEngine
    from inference_server.server import InferenceServer
    from core.config import InferenceConfig
    from tars.fresh import shared_tokenizer

    tok = shared_tokenizer()
    rng = random.Random(seed)

    def click(_ids, _imgs):  # a random-click policy in MiniWoB's 160 x 210 screen (the task text is the top 50)
        return tok.answer(f"click(point='<point>{rng.randrange(4, 156)} {rng.randrange(54, 206)}</point>')")

    eng = ScriptedEngine(click, tok.vocab_size)
    srv = InferenceServer(InferenceConfig(host="127.0.0.1", port=0), eng)
    await srv.start()
    infer = InferenceClient([srv.address], timeout_s=DEADLINE_S, retries=3)
    try:
        trs, _ = await _run_episodes(envd, "", groups * group_size, min(8, group_size * groups), f"miniwob/{task}",
                                     # screenshots kept: their traffic is what this measures (a text policy's
                                     # sessions are otherwise created without, actor/uitars.session_options)
                                     {"max_turns": max_turns, "env_options": {"episode_time_s": "600",
                                                                              "screenshots": "1"}},
                                     infer=infer, tok=tok, group_size=group_size)
    finally:
        await infer.close()
        await srv.stop(0.5)
    return trs


async def _stream_bytes(trs, dedupe: bool) -> dict:
    from learner.staleness import StalenessManager
    from core.stream.receiver import TrajectoryReceiver
    from core.stream.sender import TrajectorySender

    tmp = tempfile.mkdtemp(prefix="tars-bench-stream-")
    rx = TrajectoryReceiver("tcp://127.0.0.1:0", os.path.join(tmp, "wal"), StalenessManager(batch_size=8, eta=10**6),
                            fsync=False)
    addr = rx.start()
    s = TrajectorySender(addr, "bench", dedupe_images=dedupe)
    try:
        await s.start()
        for t in trs:
            await s.send(t, timeout=DEADLINE_S)
            got = await asyncio.to_thread(rx.get, DEADLINE_S)
            if got is None or got.images.keys() != t.images.keys():
                raise RuntimeError(f"trajectory {t.id} did not arrive with its images")
        await s.flush(timeout=DEADLINE_S)
        st = s.stats()
    finally:
        await s.close()
        rx.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"bytes_per_trajectory": round(st["bytes_sent"] / len(trs), 1), "images_sent": st["images_sent"],
            "images_deduped": st["images_deduped"], "image_bytes_sent": st["image_bytes_sent"]}


def bench_bytes(d: Daemon, task: str, groups: int, group_size: int, max_turns: int) -> dict:
    trs = asyncio.run(_miniwob_trajectories(d.address, task, groups, group_size, max_turns, seed=7))
    ok = [t for t in trs if t.outcome != "infra_error"]
    if not ok:
        raise RuntimeError(f"every MiniWoB episode failed: {trs[0].error}")
    on = asyncio.run(_stream_bytes(ok, True))
    off = asyncio.run(_stream_bytes(ok, False))
    turns = sum(len(t.turns) for t in ok)
    # What a stream without any content addressing would carry: every turn's screenshot inline (computed from the
    # frame without images plus each turn's screenshot; not sent).
    per_turn = sum(len(dataclasses.replace(t, images={}).encode()) + sum(len(t.images[u.obs_ref[7:]]) for u in t.turns
                   if u.obs_ref.startswith("sha256:")) for t in ok) / len(ok)
    return figure(f"bytes per trajectory on the stream, image dedupe / none (miniwob/{task}, groups of {group_size})",
                  round(on["bytes_per_trajectory"] / off["bytes_per_trajectory"], 4), "ratio", None,
                  with_dedupe=on, without_dedupe=off, trajectories=len(ok), turns=turns,
                  per_turn_inline_bytes_per_trajectory=round(per_turn, 1),
                  ratio_to_per_turn_inline=round(on["bytes_per_trajectory"] / per_turn, 4),
                  distinct_screenshots_per_trajectory=round(sum(len(t.images) for t in ok) / len(ok), 2),
                  infra_errors=len(trs) - len(ok))


def run(a: argparse.Namespace) -> dict:
    out = {"machine": machine(), "started_unix": int(time.time()),
           "settings": {k: getattr(a, k) for k in ("quick", "concurrency", "min_episodes", "max_turns", "task",
                                                   "groups", "group_size")}, "figures": {}}
    figs = out["figures"]
    with Daemon(workers=8) as d, ScriptedServer("wait()") as inf:
        figs["actor_overhead_p99_ms"] = bench_concurrency(d.address, inf.address, a.concurrency, a.min_episodes,
                                                          a.max_turns)
    what = "bytes per trajectory, image dedupe / none"
    if a.skip_miniwob:
        figs["image_dedupe_bytes_ratio"] = skipped(what, "ratio", None, "--skip-miniwob")
    elif not os.path.exists("/usr/bin/chromium"):
        figs["image_dedupe_bytes_ratio"] = skipped(what, "ratio", None, "/usr/bin/chromium is not installed")
    else:
        with Daemon(workers=4) as d:
            figs["image_dedupe_bytes_ratio"] = bench_bytes(d, a.task, a.groups, a.group_size, a.max_turns)
    return out


def table(out: dict) -> str:
    lines = []
    f = out["figures"]["actor_overhead_p99_ms"]
    lines.append(f"{'concurrent':>10} {'episodes/s':>10} {'turns/s':>8} {'overhead p50/p99 ms':>20} "
                 f"{'cpu p50/p99 ms':>17} "
                 f"{'env p50 ms':>10} {'infer p50 ms':>12} {'infra':>5}")
    for c, r in f["levels"].items():
        lines.append(f"{c:>10} {r['episodes_per_s']:>10} {r['turns_per_s']:>8} "
                     f"{r['actor_overhead']['p50_ms']:>9} / {r['actor_overhead']['p99_ms']:<8} "
                     f"{r['actor_overhead_cpu']['p50_ms']:>7} / {r['actor_overhead_cpu']['p99_ms']:<7} "
                     f"{r['env_call']['p50_ms']:>10} {r['inference_call']['p50_ms']:>12} {r['infra_errors']:>5}")
    lines.append(f"goal {f['goal']} ms at the largest: {'PASS' if f['pass'] else 'FAIL'}")
    b = out["figures"]["image_dedupe_bytes_ratio"]
    if b["value"] is None:
        lines.append(f"image dedupe: skipped ({b['skipped']})")
    else:
        lines.append(f"bytes/trajectory: {b['with_dedupe']['bytes_per_trajectory']:.0f} with dedupe, "
                     f"{b['without_dedupe']['bytes_per_trajectory']:.0f} without -> ratio {b['value']} "
                     f"({b['per_turn_inline_bytes_per_trajectory']:.0f} if every turn carried its screenshot: "
                     f"ratio {b['ratio_to_per_turn_inline']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tars bench actor", description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="FILE", help="write every figure here as JSON")
    p.add_argument("--quick", action="store_true", help="small sizes (tests, smoke runs)")
    p.add_argument("--concurrency", help="comma-separated concurrency levels (default 1,100,1000; quick 1,20)")
    p.add_argument("--min-episodes", type=int, default=None, help="episodes per level at least (default 50; quick 4)")
    p.add_argument("--max-turns", type=int, default=6, help="step budget per episode")
    p.add_argument("--task", default="click-button", help="MiniWoB task for the bytes figure")
    p.add_argument("--groups", type=int, default=None, help="task seeds for the bytes figure (default 6; quick 1)")
    p.add_argument("--group-size", type=int, default=4, help="episodes per seed (GRPO group)")
    p.add_argument("--skip-miniwob", action="store_true", help="leave out the bytes figure (needs Chromium)")
    a = p.parse_args(argv)
    try:
        a.concurrency = sorted({int(x) for x in (a.concurrency or ("1,20" if a.quick else "1,100,1000")).split(",")})
    except ValueError:
        p.error(f"--concurrency must be comma-separated integers, got {a.concurrency!r}")
    a.min_episodes = a.min_episodes if a.min_episodes is not None else (4 if a.quick else 50)
    a.groups = a.groups if a.groups is not None else (1 if a.quick else 6)
    for name in ("min_episodes", "max_turns", "groups", "group_size"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.concurrency[0] < 1:
        p.error("--concurrency levels must be >= 1")
    if a.json and not os.path.isdir(os.path.dirname(os.path.abspath(a.json))):
        p.error(f"--json {a.json}: directory does not exist")
    return report(run(a), table, a.json)

