"""`tars bench soak`: the quickstart topology for a long stretch; RSS of every process and throughput over time.

Goals: RSS growth after warm-up < 10 % per process; throughput drift (last quarter vs first quarter after warm-up)
reported. The topology is the quickstart one (`tars up --preset quickstart`: 1 envd, 1 inference server, the
learner, 1 actor), started by tars/faults.FaultRun through tars.topology without the SFT warm start (the soak is
about the RL stage).
RSS comes from psutil when it is installed, else /proc/PID/status (VmRSS).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

from tars.faults import FaultRun

GOAL_RSS_GROWTH = 0.10


MIN_SAMPLES = 8  # after warm-up: quarters of at least two samples


def res_warm(minutes: float, warmup_frac: float) -> float:
    return warmup_frac * minutes * 60


def rss_bytes(pid: int) -> int:
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        pass
    except Exception:
        return 0
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _lines(path: pathlib.Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def analyse(samples: list[dict], warmup_s: float) -> dict:
    """samples: [{t, rss: {proc: bytes}, trajectories}] -> growth per process and throughput drift."""
    post = [s for s in samples if s["t"] >= warmup_s]
    if len(post) < MIN_SAMPLES:
        raise ValueError("too few samples after warm-up: run longer or sample more often")
    q = max(1, len(post) // 4)
    first, last = post[:q], post[-q:]
    growth = {}
    for proc in post[0]["rss"]:
        base = sum(s["rss"][proc] for s in first) / q
        end = sum(s["rss"][proc] for s in last) / q
        growth[proc] = {"rss_mb_after_warmup": round(base / 2**20, 1), "rss_mb_end": round(end / 2**20, 1),
                        "growth": round(end / base - 1, 4) if base else None}

    def rate(a: dict, b: dict) -> float:
        return (b["trajectories"] - a["trajectories"]) / max(1e-9, b["t"] - a["t"])

    r_first, r_last = rate(first[0], first[-1]), rate(last[0], last[-1])
    return {"processes": growth, "throughput_first": round(r_first, 2), "throughput_last": round(r_last, 2),
            "throughput_drift": round(r_last / r_first - 1, 4) if r_first else None,
            "max_growth": max((g["growth"] or 0) for g in growth.values()),
            "goal_rss_growth": GOAL_RSS_GROWTH}


def _inference_cache_mb(topo: FaultRun) -> float | None:
    try:
        return round(topo.status("inference", 0, timeout=2.0).get("cache_bytes", 0) / 2**20, 1)
    except Exception:
        return None


def run(minutes: float, out: str | None = None, every_s: float = 5.0, warmup_frac: float = 0.2,
        sets: list[str] = ()) -> dict:
    tmp = tempfile.TemporaryDirectory(prefix="tars-soak-") if out is None else None
    out = out or tmp.name
    topo = FaultRun(out, n_envd=1, n_actors=1, sets=["learner.batch_size=64", "actor.concurrency=128",
                                                     "learner.checkpoint.every=50", *sets])
    samples: list[dict] = []
    try:
        topo.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < minutes * 60:
            dead = [k for k, ok in topo.alive().items() if not ok]
            if dead:
                raise RuntimeError(f"{dead} died during the soak; see {out}/logs")
            samples.append({"t": round(time.monotonic() - t0, 1),
                            "rss": {name: rss_bytes(pid) for name, pid in topo.pids().items()},
                            "trajectories": _lines(topo.out / "episodes.jsonl"), "version": topo.version(),
                            # the prefix cache fills up to its bound (inference.cache_*): growth, not a leak
                            "inference_cache_mb": _inference_cache_mb(topo)})
            time.sleep(every_s)
    finally:
        topo.stop()
        if tmp is not None:
            tmp.cleanup()
    res = analyse(samples, res_warm(minutes, warmup_frac))
    res["inference_cache_mb"] = {"after_warmup": next((x["inference_cache_mb"] for x in samples
                                                        if x["t"] >= res_warm(minutes, warmup_frac)), None),
                                 "end": samples[-1]["inference_cache_mb"] if samples else None}
    res.update(minutes=minutes, sets=list(sets), samples=samples, warmup_s=warmup_frac * minutes * 60,
               ok=res["max_growth"] < GOAL_RSS_GROWTH)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tars bench soak", description=__doc__.split("\n")[0])
    ap.add_argument("--json", metavar="FILE", help="write the figures (and every sample) here as JSON")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--out", help="keep the run directory here (default: a temporary one)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--warmup", type=float, default=0.2, help="share of the run counted as warm-up")
    a = ap.parse_args(argv)
    if a.every <= 0 or not 0 <= a.warmup < 1:
        ap.error("--every must be > 0 and --warmup in [0, 1)")
    if (1 - a.warmup) * a.minutes * 60 / a.every < MIN_SAMPLES:  # refused now, not after the run
        need = MIN_SAMPLES * a.every / (1 - a.warmup) / 60
        ap.error(f"--minutes {a.minutes:g} leaves fewer than {MIN_SAMPLES} samples after warm-up at --every "
                 f"{a.every:g} s: use --minutes {need:.2f} or more (or sample more often)")
    res = run(a.minutes, a.out, a.every, a.warmup, a.set)
    print(f"{'process':<12} {'RSS MB after warm-up':>21} {'RSS MB end':>11} {'growth':>8}   goal < {GOAL_RSS_GROWTH:.0%}")
    for p, g in res["processes"].items():
        print(f"{p:<12} {g['rss_mb_after_warmup']:>21} {g['rss_mb_end']:>11} {g['growth']:>8.1%}")
    print(f"throughput {res['throughput_first']} -> {res['throughput_last']} trajectories/s "
          f"(drift {res['throughput_drift']:+.1%}); inference prefix cache {res['inference_cache_mb']} MB; "
          f"{'OK' if res['ok'] else 'RSS GOAL MISSED'}")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(res, indent=2))
    return 0 if res["ok"] else 1
