"""Where a decode step's time goes on a GPU: wall time against the sum of CUDA kernel time (torch.profiler with
CUPTI) for transformers' generate and the local engine, batch 64, on `tars bench inference --gpu`'s random
Qwen2-0.5B-shaped model in bf16; and the cost of one small kernel launch on this machine.

    python scripts/gpu_profile.py OUT.json        (from the repository root, on a machine with CUDA)

Figures and their reading: docs/benchmarks.md, "On a GPU"."""
from __future__ import annotations

import json
import random
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

BATCH, PROMPT, NEW = 64, 32, 32


def kernels(prof) -> tuple[int, float]:
    """(number of CUDA kernels, their summed device time in seconds) in a finished profile."""
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(ev), sum(e.device_time for e in ev) / 1e6


def timed(fn) -> tuple[float, object]:
    """fn() under the profiler, synchronised: (wall seconds, profile)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return wall, prof


def figures(wall: float, prof) -> dict:
    n, k = kernels(prof)
    return {"wall_s": wall, "kernels": n, "kernel_s": k, "gpu_busy": k / wall, "per_token_ms": 1e3 * wall / NEW}


def launch_us() -> float:
    """Microseconds per launch of a small bf16 matmul (64x896 by 896x896), back to back."""
    x = torch.randn(64, 896, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(896, 896, device="cuda", dtype=torch.bfloat16)
    for _ in range(100):
        x @ w
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(2000):
        x @ w
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0) / 2000


def main(out_path: str) -> dict:
    from inference_server.engine import SamplingParams
    from tars.bench.inference_gpu import generate_kwargs, models, prompts

    ps = prompts(random.Random(0), BATCH, PROMPT)
    out: dict = {"device": torch.cuda.get_device_name(0), "batch": BATCH, "prompt_len": PROMPT, "new_tokens": NEW}
    with tempfile.TemporaryDirectory() as d:
        hf, eng = models(d, 0, BATCH, PROMPT, NEW)
        try:
            ids = torch.tensor(ps, device="cuda")
            kw = {**generate_kwargs(NEW), "attention_mask": torch.ones_like(ids)}
            with torch.inference_mode():
                hf.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
                out["transformers"] = figures(*timed(lambda: hf.generate(ids, **kw)))
            sp = SamplingParams(max_new_tokens=NEW, temperature=1.0)
            [f.result(600) for f in [eng.submit(p, SamplingParams(max_new_tokens=4)) for p in ps]]  # warm-up
            wall, prof = timed(lambda: [f.result(600) for f in [eng.submit(p, sp) for p in ps]])
            out["engine"] = figures(wall, prof)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        finally:
            eng.close()
    out["launch_us_small_matmul"] = launch_us()
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        sys.exit("usage: python scripts/gpu_profile.py OUT.json  (needs CUDA)")
    print(json.dumps(main(sys.argv[1]), indent=1))
