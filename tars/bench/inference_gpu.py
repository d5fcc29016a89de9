"""GPU figure of `tars bench inference --gpu`: local engine decode tokens/s vs `transformers` generate.

The same random-initialised Qwen2-0.5B-shaped model (24 layers, hidden 896, 14 heads / 2 KV heads, vocab 151936,
tied embeddings), bf16 on one CUDA device, `batch` prompts of `prompt_len` random tokens, `max_new_tokens` sampled
at temperature 1 with no stop token (so every row decodes the full budget in both):
- baseline: transformers AutoModelForCausalLM.generate on the batch (its static batch; KV cache on);
- figure: LocalEngine with the batch submitted at once (continuous batching, one scheduler thread), built as
  `tars serve` builds it: from the checkpoint directory with inference.device=cuda, inference.precision=bf16, so the
  engine loads its own weights there and samples there (only the [B] sampled ids and logprobs reach the host).
tokens/s = batch * max_new_tokens / wall time (prefill included in both). Goal: engine / transformers >= 3 at 64.
Without CUDA it is refused with one line (tars.bench.inference checks before any other figure runs).
"""
from __future__ import annotations

import random
import tempfile
import time

import torch

QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, max_position_embeddings=4096, rope_theta=1000000.0, tie_word_embeddings=True)


NO_CUDA = ("--gpu needs CUDA: torch.cuda.is_available() is False on this machine (torch "
           f"{torch.__version__}, built {'without CUDA' if torch.version.cuda is None else 'with CUDA ' + torch.version.cuda}); "
           "run without --gpu, or on a machine with a CUDA GPU")


def models(d: str, seed: int, batch: int, prompt_len: int, max_new_tokens: int, dev: str = "cuda"):
    """The bench's random model saved in d, then (transformers' copy of it in bf16 on dev, the LocalEngine built from
    d as `tars serve` builds it: inference.device=dev, inference.precision=bf16, room for `batch` requests)."""
    import transformers

    from core.config import InferenceConfig
    from core.model import CausalLM, DecoderConfig
    from inference_server.engine import LocalEngine

    CausalLM(DecoderConfig(**QWEN2_05B)).init_weights(seed, std=0.02).save_hf(d)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).to(dev).eval()
    eng = LocalEngine(InferenceConfig(device=dev, precision="bf16", max_context=prompt_len + max_new_tokens + 8,
                                      max_batch=batch, prefill_batch_tokens=batch * (prompt_len + 8)), d)
    return hf, eng


def prompts(rng: random.Random, batch: int, prompt_len: int) -> list[list[int]]:
    return [[rng.randrange(2, QWEN2_05B["vocab_size"]) for _ in range(prompt_len)] for _ in range(batch)]


def generate_kwargs(max_new_tokens: int) -> dict:
    """transformers generate's settings that match the engine's: exactly max_new_tokens sampled at temperature 1,
    no top-k / top-p, no stop token."""
    return dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=True, temperature=1.0,
                top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0)


def run(batches: tuple[int, ...] = (1, 64), prompt_len: int = 32, max_new_tokens: int = 128, seed: int = 0) -> dict:
    from core.config import UserError
    from inference_server.engine import SamplingParams

    if not torch.cuda.is_available():
        raise UserError(NO_CUDA)

    dev = torch.device("cuda")
    out: dict = {"model": QWEN2_05B, "prompt_len": prompt_len, "max_new_tokens": max_new_tokens,
                 "device": torch.cuda.get_device_name(0), "rows": []}
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="tars-gpu-bench-") as d:
        hf, eng = models(d, seed, max(batches), prompt_len, max_new_tokens)
        out["params"] = sum(p.numel() for p in eng.model.parameters())
        out["engine_device"], out["engine_dtype"] = str(eng.device), str(eng.dtype)
        try:
            for B in batches:
                ps = prompts(rng, B, prompt_len)
                ids = torch.tensor(ps, device=dev)
                kw = generate_kwargs(max_new_tokens)
                with torch.inference_mode():
                    hf.generate(ids, attention_mask=torch.ones_like(ids), **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    g = hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)
                    torch.cuda.synchronize()
                    hf_s = time.perf_counter() - t0
                hf_tokens = (g.shape[1] - prompt_len) * B
                sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)
                [f.result(600) for f in [eng.submit(p, SamplingParams(max_new_tokens=4)) for p in ps]]  # warm-up
                t0 = time.perf_counter()
                n = sum(len(f.result(600).output_ids) for f in [eng.submit(p, sp) for p in ps])
                ours_s = time.perf_counter() - t0
                out["rows"].append({"batch": B, "transformers_tokens_per_s": hf_tokens / hf_s, "engine_tokens_per_s": n / ours_s,
                                    "engine_over_transformers": (n / ours_s) / (hf_tokens / hf_s)})
        finally:
            eng.close()
    return out
