"""Tiny Hugging Face checkpoint directories built with transformers' own classes, for tests.

    model = make_hf_model(tmp_path / "ck", arch="llama", num_key_value_heads=1)

writes DIR/config.json + sharded safetensors (model-0000i-of-0000N + index) exactly as `save_pretrained` does, with
every parameter random (biases and norm weights too, so a missing bias or norm shows in the logits), and returns
the transformers model (fp32, eval mode) for reference outputs. Needs transformers (the dev extra).
"""
from __future__ import annotations

import os
import pathlib

import torch

# Small enough that a forward takes milliseconds; GQA (4 query heads over 2 key/value heads) by default.
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)


def hf_config(arch: str = "qwen2", **overrides):
    """transformers.Qwen2Config / LlamaConfig of the tiny shape, with overrides (any config.json field)."""
    import transformers

    cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[arch]
    return cls(**{**TINY, **overrides})


def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.1) -> torch.nn.Module:
    """Every parameter random: matrices and biases N(0, std), norm weights 1 + N(0, std)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * std
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    return model


def make_hf_model(dir: str | os.PathLike, arch: str = "qwen2", shard_bytes: int | str | None = 20_000, seed: int = 0,
                  **config_overrides):
    """Build a random transformers model of `arch` (qwen2 | llama) and save_pretrained it into `dir`, sharded at
    shard_bytes (None: one model.safetensors). Returns the model (fp32, eval)."""
    import transformers

    cfg = hf_config(arch, **config_overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize(model, seed).eval()
    kw = {"max_shard_size": shard_bytes} if shard_bytes is not None else {}
    model.save_pretrained(str(pathlib.Path(dir)), **kw)
    return model


def make_checkpoint(dir: str | os.PathLike, arch: str = "qwen2", shard_bytes: int | str | None = 200_000, seed: int = 0,
                    vocab_size: int = 600, **config_overrides):
    """A whole checkpoint directory as a user would bring it: make_hf_model's sharded weights plus a byte-level BPE
    tokenizer trained on the builtin tasks' conversations, with the architecture's chat template (ChatML for qwen2,
    Llama 3's for llama), and a generation_config.json naming the end-of-turn token. Returns the model."""
    import json

    from core.bpe import rendered_corpus, save_tokenizer, train_bpe
    from tars.fresh import task_corpus

    template = {"qwen2": "chatml", "llama": "llama3"}[arch]
    tok = train_bpe(rendered_corpus(task_corpus(["builtin/mixed"], episodes=400, seed=seed), template),
                    vocab_size, template)
    d = pathlib.Path(dir)
    model = make_hf_model(d, arch, shard_bytes, seed, **{
        "vocab_size": len(tok), "max_position_embeddings": 2048, "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, **config_overrides})
    save_tokenizer(tok, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id,
                                                           "pad_token_id": tok.pad_token_id}))
    return model
