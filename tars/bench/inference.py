"""`tars bench inference`: the inference server's figures, each against a baseline measured in the same run.

    tars bench inference --json FILE [--quick] [--gpu] [--skip-front] [--skip-updates] [--skip-multiturn]

- grpc_over_direct: tokens/s of `concurrency` generations at once through the gRPC front vs LocalEngine.submit
  directly, one engine on a tiny random model. The load comes from a client in its own process
  (tars.bench.front_client), as actors' calls do; rounds alternate direct / front (in process) / front (client
  process), and the figure is the median over rounds of front / direct within the round, so a neighbour's load
  that comes and goes hits both sides alike. grpc_inprocess_over_direct is the same with the client in the
  server's process (this bench's method before: the client's serialisation then shares the server's GIL).
  The client is InferenceClient as actors use it: calls made together travel as one GenerateBatch call;
  grpc_unary_over_direct is the client process making one Generate call each (coalesce=False). Goal >= 0.9.
- update_discarded_share: tokens discarded and regenerated because of weight updates every few seconds, as a share
  of tokens sampled, partial rollouts vs restart-on-update (tars.bench.inference_rollouts). Goal <= 0.02.
- multiturn_cache_hit_share: prompt tokens of later turns served from the prefix cache (bench_rollouts).
- gpu_engine_over_transformers_b64 (--gpu, CUDA only; without CUDA --gpu is refused, exit 2):
  tars.bench.inference_gpu. Goal >= 3.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time

from core.inference_client import InferenceClient
from inference_server.engine import LocalEngine, SamplingParams
from inference_server.server import InferenceServer
from tars.bench.front_client import ClientProcess
from core.config import InferenceConfig
from core.model import CausalLM, DecoderConfig


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


def _direct(eng: LocalEngine, prompts, max_new: int) -> float:
    t0 = time.perf_counter()
    futs = [eng.submit(p, SamplingParams(max_new_tokens=max_new, temperature=1.0)) for p in prompts]
    n = sum(len(f.result(300).output_ids) for f in futs)
    return n / (time.perf_counter() - t0)


async def _grpc(client: InferenceClient, prompts, max_new: int) -> float:
    t0 = time.perf_counter()
    rs = await asyncio.gather(*(client.generate("", p, max_new, temperature=1.0, timeout_s=300) for p in prompts))
    return sum(len(r.output_ids) for r in rs) / (time.perf_counter() - t0)


def run(json_path: str | None = None, concurrency: int = 64, prompt_len: int = 32, max_new_tokens: int = 64,
        rounds: int = 3, threads: int = 1, client_process: bool = True) -> dict:
    import statistics

    dc = DecoderConfig(vocab_size=300)
    cfg = InferenceConfig(threads=threads, max_context=1024)
    eng = LocalEngine(cfg, CausalLM(dc).init_weights(0, std=0.1))
    prompts = [_prompts(concurrency, prompt_len, dc.vocab_size, seed) for seed in range(rounds + 1)]
    try:
        async def measure() -> tuple[list[float], list[float], list[float], list[float]]:
            srv = InferenceServer(cfg, eng)
            await srv.start()
            client = InferenceClient([srv.address], timeout_s=300)
            d, g, gr, gu = [], [], [], []
            try:
                async with contextlib.AsyncExitStack() as stack:  # the client processes, when asked for
                    remote = unary = None
                    if client_process:
                        remote = (await stack.enter_async_context(ClientProcess(srv.address))).rate
                        unary = (await stack.enter_async_context(ClientProcess(srv.address, unary=True))).rate
                    await asyncio.to_thread(_direct, eng, prompts[0], 8)  # warm-up, every path
                    await _grpc(client, prompts[0], 8)
                    if remote:
                        await remote(prompts[0], 8)
                        await unary(prompts[0], 8)
                    for p in prompts[1:]:
                        d.append(await asyncio.to_thread(_direct, eng, p, max_new_tokens))
                        g.append(await _grpc(client, p, max_new_tokens))
                        if remote:
                            gr.append(await remote(p, max_new_tokens))
                            gu.append(await unary(p, max_new_tokens))
            finally:
                await client.close()
                await srv.stop(grace=1.0)
            return d, g, gr, gu

        direct, grpc_tps, grpc_remote, grpc_unary = asyncio.run(measure())
        m = eng.metrics()
    finally:
        eng.close()
    med = statistics.median
    inproc = med([b / a for a, b in zip(direct, grpc_tps)])
    remote = med([b / a for a, b in zip(direct, grpc_remote)]) if grpc_remote else None
    unary = med([b / a for a, b in zip(direct, grpc_unary)]) if grpc_unary else None
    front = grpc_remote if grpc_remote else grpc_tps
    out = {
        "model": {"hidden_size": dc.hidden_size, "layers": dc.num_hidden_layers, "vocab": dc.vocab_size},
        "concurrency": concurrency, "prompt_len": prompt_len, "max_new_tokens": max_new_tokens, "threads": threads,
        "rounds": rounds, "client": "process" if grpc_remote else "in-process",
        "direct_tokens_per_s": med(direct), "grpc_tokens_per_s": med(front),
        "grpc_over_direct": remote if remote is not None else inproc, "grpc_inprocess_over_direct": inproc,
        "grpc_unary_over_direct": unary,
        "direct_rounds": direct, "grpc_rounds": front, "grpc_inprocess_rounds": grpc_tps, "grpc_unary_rounds": grpc_unary,
        "batch_mean": m["batch_mean"], "idle_share": m["idle_share"],
    }
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=2)
    return out


def _fig(name: str, value, baseline, goal: str, ok, detail: str, skipped: str = "") -> dict:
    return {"name": name, "value": value, "baseline": baseline, "goal": goal, "pass": ok, "detail": detail,
            **({"skipped": skipped} if skipped else {})}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import os

    from tars.bench import inference_rollouts as bench_rollouts

    ap = argparse.ArgumentParser(prog="tars bench inference", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE", help="write the figures here as JSON")
    ap.add_argument("--quick", action="store_true", help="small workloads (a smoke run of some seconds)")
    ap.add_argument("--gpu", action="store_true", help="also the GPU figure (local engine vs transformers); refused without CUDA")
    ap.add_argument("--skip-front", action="store_true")
    ap.add_argument("--skip-updates", action="store_true")
    ap.add_argument("--skip-multiturn", action="store_true")
    ap.add_argument("--update-every", type=float, default=2.0, help="seconds between weight updates (default 2)")
    ap.add_argument("--duration", type=float, default=12.0, help="seconds of load per update run (default 12)")
    a = ap.parse_args(argv)
    q = a.quick
    if a.gpu:
        import torch

        from core.config import UserError
        from tars.bench.inference_gpu import NO_CUDA

        if not torch.cuda.is_available():  # before the CPU figures: asked for and impossible is a user error
            raise UserError(NO_CUDA)
    out: dict = {"machine": {"cpus": os.cpu_count(), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}, "figures": []}
    figs = out["figures"]
    if not a.skip_front:
        # Quick keeps the figure's load (64 at once, 64 tokens each) and runs fewer rounds: at 16 x 16 a round
        # lasts ~20 ms and measures the latency of one RPC, not the front's share of throughput.
        f = run(None, concurrency=64, max_new_tokens=64, rounds=5 if q else 11)
        out["front"] = f
        figs.append(_fig("grpc_over_direct", f["grpc_over_direct"], 1.0, ">= 0.9", f["grpc_over_direct"] >= 0.9,
                         f"median of {f['rounds']} rounds, client in its own process: grpc {f['grpc_tokens_per_s']:.0f} tok/s, "
                         f"direct {f['direct_tokens_per_s']:.0f} tok/s; client in the server's process "
                         f"{f['grpc_inprocess_over_direct']:.3f}; one Generate call each (no coalescing) "
                         f"{f['grpc_unary_over_direct']:.3f}"))
    if not a.skip_updates:
        u = bench_rollouts.update_waste(workers=8 if q else 16, max_new_tokens=32 if q else 64,
                                        duration_s=3.0 if q else a.duration, update_every_s=0.75 if q else a.update_every,
                                        with_stale=not q)
        out["updates"] = u
        p, r = u["partial"], u["restart"]
        figs.append(_fig("update_discarded_share", p["discarded_share"], r["discarded_share"], "<= 0.02", p["discarded_share"] <= 0.02,
                         f"{p['weight_updates']} / {r['weight_updates']} updates every {u['update_every_s']} s; restart discarded "
                         f"{r['tokens_discarded']} of {r['tokens_sampled']} tokens ({r['requests_restarted']} restarts); partial "
                         f"re-prefilled {p['reprefilled_tokens']} tokens ({p['reprefilled_share']:.1%} of sampled)"
                         + (f"; with stale KV kept (max_stale_versions=1) {u['partial_stale']['reprefilled_tokens']} re-prefilled, "
                            f"{u['partial_stale']['tokens_discarded']} discarded" if u.get("partial_stale") else "")))
    if not a.skip_multiturn:
        m = bench_rollouts.multiturn_cache(episodes=4 if q else 16, turns=3 if q else 6)
        out["multiturn"] = m
        figs.append(_fig("multiturn_cache_hit_share", m["hit_share_later_turns"], m["reusable_share_later_turns"], "", None,
                         f"{m['episodes']} episodes x {m['turns']} turns on {m['replicas']} replicas; hit / reusable "
                         f"{m['hit_over_reusable']:.3f}; all turns {m['hit_share_all_turns']:.3f}"))
    if a.gpu:
        from tars.bench import inference_gpu as bench_gpu

        g = bench_gpu.run(batches=(1, 8) if q else (1, 64))
        out["gpu"] = g
        row = (g.get("rows") or [{}])[-1]
        v = row.get("engine_over_transformers")
        figs.append(_fig(f"gpu_engine_over_transformers_b{row.get('batch', 64)}", v, 1.0, ">= 3", None if v is None else v >= 3,
                         "; ".join(f"b{x['batch']}: {x['engine_tokens_per_s']:.0f} vs {x['transformers_tokens_per_s']:.0f} tok/s"
                                   for x in g.get("rows", [])), g.get("skipped", "")))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=2)
    print(table(out))
    return 0


def table(out: dict) -> str:
    def fmt(x):
        return "-" if x is None else f"{x:.4g}" if isinstance(x, float) else str(x)

    lines = ["| figure | value | baseline | goal | pass | detail |", "|---|---|---|---|---|---|"]
    for f in out["figures"]:
        lines.append(f"| {f['name']} | {fmt(f['value'])} | {fmt(f['baseline'])} | {f['goal']} | {fmt(f['pass'])} | "
                     f"{f.get('skipped') or f['detail']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
