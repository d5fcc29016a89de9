"""Micro-benchmark: tokens/s of direct LocalEngine calls vs the same load through the gRPC front (in process).

    python -m inference_server.bench [out.json]

Both runs use one engine on a tiny random model with `concurrency` requests in flight at once; the ratio
grpc/direct is the share of engine throughput that survives the front (serialisation, the event loop and the
client all compete with the scheduler thread for the GIL and the cores here, so it is a lower bound).
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time

from inference_server.client import InferenceClient
from inference_server.engine import LocalEngine, SamplingParams
from inference_server.server import InferenceServer
from tars.config import InferenceConfig
from tars.model import CausalLM, DecoderConfig


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
        rounds: int = 3, threads: int = 1) -> dict:
    dc = DecoderConfig(vocab_size=300)
    cfg = InferenceConfig(threads=threads, max_context=1024)
    eng = LocalEngine(cfg, CausalLM(dc).init_weights(0, std=0.1))
    prompts = [_prompts(concurrency, prompt_len, dc.vocab_size, seed) for seed in range(rounds + 1)]
    try:
        _direct(eng, prompts[0], 8)  # warm-up
        direct = [_direct(eng, p, max_new_tokens) for p in prompts[1:]]

        async def front() -> list[float]:
            srv = InferenceServer(cfg, eng)
            await srv.start()
            client = InferenceClient([srv.address], timeout_s=300)
            try:
                await _grpc(client, prompts[0], 8)
                return [await _grpc(client, p, max_new_tokens) for p in prompts[1:]]
            finally:
                await client.close()
                await srv.stop(grace=1.0)

        grpc_tps = asyncio.run(front())
        m = eng.metrics()
    finally:
        eng.close()
    best_d, best_g = max(direct), max(grpc_tps)
    out = {
        "model": {"hidden_size": dc.hidden_size, "layers": dc.num_hidden_layers, "vocab": dc.vocab_size},
        "concurrency": concurrency, "prompt_len": prompt_len, "max_new_tokens": max_new_tokens, "threads": threads,
        "direct_tokens_per_s": best_d, "grpc_tokens_per_s": best_g, "grpc_over_direct": best_g / best_d,
        "direct_rounds": direct, "grpc_rounds": grpc_tps, "batch_mean": m["batch_mean"], "idle_share": m["idle_share"],
    }
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1] if len(sys.argv) > 1 else None), indent=2))
