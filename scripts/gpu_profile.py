"""Where a decode step's time goes on the GPU: wall time vs the sum of CUDA kernel time (torch.profiler, CUPTI), for
transformers' generate and the local engine, batch 64, on the bench's Qwen2-0.5B-shaped model."""
import random, sys, tempfile, time, json
import torch
from torch.profiler import profile, ProfilerActivity
from core.config import InferenceConfig
from core.model import CausalLM, DecoderConfig
from inference_server.engine import LocalEngine, SamplingParams
from tars.bench.inference_gpu import QWEN2_05B
import transformers

B, P, N = 64, 32, 32
out = {}
rng = random.Random(0)
prompts = [[rng.randrange(2, QWEN2_05B["vocab_size"]) for _ in range(P)] for _ in range(B)]

def kern(prof):
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(ev), sum(e.device_time for e in ev) / 1e6

with tempfile.TemporaryDirectory() as d:
    CausalLM(DecoderConfig(**QWEN2_05B)).init_weights(0, std=0.02).save_hf(d)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(prompts, device="cuda")
    kw = dict(max_new_tokens=N, min_new_tokens=N, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
              eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        hf.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4}); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter(); hf.generate(ids, **kw); torch.cuda.synchronize(); w = time.perf_counter() - t0
    n, k = kern(prof)
    out["transformers"] = {"wall_s": w, "kernels": n, "kernel_s": k, "per_token_ms": 1e3 * w / N}
    eng = LocalEngine(InferenceConfig(device="cuda", precision="bf16", max_context=P + N + 8, max_batch=B,
                                      prefill_batch_tokens=B * (P + 8)), d)
    try:
        sp = SamplingParams(max_new_tokens=N, temperature=1.0)
        [f.result(600) for f in [eng.submit(p, SamplingParams(max_new_tokens=4)) for p in prompts]]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter(); [f.result(600) for f in [eng.submit(p, sp) for p in prompts]]
            torch.cuda.synchronize(); w = time.perf_counter() - t0
        n, k = kern(prof)
        out["engine"] = {"wall_s": w, "kernels": n, "kernel_s": k, "per_token_ms": 1e3 * w / N}
        top = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    finally:
        eng.close()
    # one bare matmul launch, to price a launch on this machine
    x = torch.randn(64, 896, device="cuda", dtype=torch.bfloat16); wt = torch.randn(896, 896, device="cuda", dtype=torch.bfloat16)
    for _ in range(100): x @ wt
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(2000): x @ wt
    torch.cuda.synchronize(); out["launch_us_small_matmul"] = 1e6 * (time.perf_counter() - t0) / 2000
print(json.dumps(out, indent=1))
print(top)
json.dump(out, open(sys.argv[1], "w"), indent=1)
