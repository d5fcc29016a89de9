"""Where the gRPC front's time goes: `tars bench inference`'s front load, sampled with sys._current_frames.

    python scripts/profile_inference_front.py [--rounds 6] [--every-ms 1] [--folded FILE]

One LocalEngine (the bench's tiny model) behind an InferenceServer in this process; the load (64 concurrent unary
Generate calls, 64 tokens each, per round) comes from tars.bench.front_client in its own process. While the gRPC
rounds run, a sampler thread records every thread's stack each --every-ms; the summary classes each sample of the
engine's scheduler thread and of the event loop, and --folded writes the stacks in the folded format that
flamegraph.pl / speedscope read. The sampler needs the GIL to take a sample, so a thread holding it for long is
under-sampled: read the shares as a lower bound of the busy time.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import subprocess
import sys
import threading
import time


def classify(names: list[str]) -> str:
    """A stack (outermost first, 'file:function') -> a coarse class for the summary."""
    s = " ".join(names)
    if "work_queue.py:wait" in s:
        return "idle (waiting for work)"
    if "scheduler.py:_prefill_step" in s:
        return "prefill"
    if "scheduler.py:_emit_all" in s or "server.py:post" in s:
        return "decode: emit tokens / finish requests"
    if "sampling.py" in s:
        return "decode: sampling"
    if "scheduler.py:_decode_step" in s:
        return "decode: model forward"
    if "select" in names[-1] or "selectors.py" in names[-1]:
        return "idle (epoll)"
    if "server.py" in s:
        return "server handlers (submit, response)"
    if "grpc" in s:
        return "grpc internals"
    if "asyncio" in s:
        return "asyncio loop"
    return "other"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--every-ms", type=float, default=1.0)
    ap.add_argument("--folded", help="write folded stacks (thread;frame;...;frame count) here")
    a = ap.parse_args(argv)

    from core.config import InferenceConfig
    from core.model import CausalLM, DecoderConfig
    from inference_server.engine import LocalEngine
    from inference_server.server import InferenceServer
    from tars.bench.inference import _prompts

    dc = DecoderConfig(vocab_size=300)
    cfg = InferenceConfig(threads=1, max_context=1024)
    eng = LocalEngine(cfg, CausalLM(dc).init_weights(0, std=0.1))
    stacks: collections.Counter = collections.Counter()
    sampling = threading.Event()
    stop = threading.Event()
    names = {}

    def sampler():
        me = threading.get_ident()
        while not stop.is_set():
            time.sleep(a.every_ms / 1e3)
            if not sampling.is_set():
                continue
            for tid, f in sys._current_frames().items():
                if tid == me:
                    continue
                st = []
                while f is not None:
                    st.append(f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_code.co_name}")
                    f = f.f_back
                stacks[(names.get(tid, str(tid)), tuple(reversed(st)))] += 1

    async def run():
        srv = InferenceServer(cfg, eng)
        await srv.start()
        for t in threading.enumerate():
            names[t.ident] = "engine" if t.name == "tars-engine" else ("loop" if t is threading.main_thread() else t.name)
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "tars.bench.front_client", srv.address,
                                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        walls = []
        try:
            for r in range(a.rounds + 1):
                job = {"prompts": _prompts(64, 32, dc.vocab_size, r), "max_new_tokens": 64 if r else 8}
                if r:
                    sampling.set()
                proc.stdin.write((json.dumps(job) + "\n").encode())
                await proc.stdin.drain()
                res = json.loads(await asyncio.wait_for(proc.stdout.readline(), 300))
                sampling.clear()
                if r:
                    walls.append(res["seconds"])
        finally:
            proc.stdin.close()
            await proc.wait()
            await srv.stop(1.0)
        return walls

    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    try:
        walls = asyncio.run(run())
    finally:
        stop.set()
        eng.close()
    by = collections.defaultdict(collections.Counter)
    for (thread, st), n in stacks.items():
        by[thread][classify(list(st))] += n
    print(f"{a.rounds} rounds of 64 x 64 tokens, {sum(walls):.2f} s of gRPC load; samples every {a.every_ms} ms")
    for thread in ("engine", "loop"):
        tot = sum(by[thread].values()) or 1
        print(f"\n{thread} thread ({tot} samples)")
        for k, n in by[thread].most_common():
            print(f"  {n / tot:6.1%}  {k}")
    if a.folded:
        with open(a.folded, "w") as f:
            for (thread, st), n in stacks.most_common():
                f.write(f"{thread};{';'.join(st)} {n}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
