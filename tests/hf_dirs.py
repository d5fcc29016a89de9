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


# What an architecture's tiny config sets beside TINY: Qwen3's head_dim defaults to 128 (here hidden / heads, as
# the others), Mistral's sliding window to 4096 (null here, as Mistral-7B-v0.3 has it; the decoder refuses a window).
ARCH_TINY = {"qwen3": dict(head_dim=8), "mistral": dict(sliding_window=None)}


def hf_config(arch: str = "qwen2", **overrides):
    """transformers' Qwen2Config / Qwen3Config / LlamaConfig / MistralConfig of the tiny shape, with overrides (any
    config.json field)."""
    import transformers

    cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config,
           "mistral": transformers.MistralConfig}[arch]
    return cls(**{**TINY, **ARCH_TINY.get(arch, {}), **overrides})


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
    """Build a random transformers model of `arch` (qwen2 | qwen3 | llama | mistral) and save_pretrained it into `dir`, sharded at
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

    template = {"qwen2": "chatml", "qwen3": "chatml", "llama": "llama3", "mistral": "llama3"}[arch]
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


# A tiny Qwen2.5-VL / Qwen2-VL: 2 text layers, a 1-block vision tower, M-RoPE sections summing to head_dim / 2.
TINY_VL_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                    rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]})
TINY_VL_VISION = {
    # two blocks, the first windowed (window 56 px: 2x2 merged patches) and the second full, as Qwen2.5-VL mixes them:
    # every VL test then runs the window attention of core/vision_attention.py, not only its unit test
    "qwen2_5_vl": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]),
    "qwen2_vl": dict(depth=1, embed_dim=32, hidden_size=32, mlp_ratio=2, num_heads=2, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2),
}


def make_vl_checkpoint(dir: str | os.PathLike, arch: str = "qwen2_5_vl", seed: int = 0, vocab_size: int = 700,
                       min_pixels: int = 100 * 28 * 28, max_pixels: int = 16384 * 28 * 28, shard_bytes=None,
                       vision: dict | None = None, **text_overrides):
    """A whole Qwen2.5-VL (or Qwen2-VL) checkpoint directory as a user would bring it, random-initialised: config.json
    and safetensors by save_pretrained, a byte-level BPE tokenizer with the vision tokens and ChatML, a
    generation_config.json, and the image processor's preprocessor_config.json (UI-TARS's resize limits by default).
    vision: vision_config overrides (e.g. depth); the merger's output width follows the text hidden_size.
    Returns the transformers model (fp32, eval)."""
    import json

    import transformers

    from core.bpe import rendered_corpus, save_tokenizer, train_bpe
    from tars.fresh import task_corpus

    tok = train_bpe(rendered_corpus(task_corpus(["builtin/mixed"], episodes=400, seed=seed), "qwen_vl"),
                    vocab_size, "qwen_vl")
    vocab = tok.get_vocab()
    d = pathlib.Path(dir)
    cls = {"qwen2_5_vl": transformers.Qwen2_5_VLConfig, "qwen2_vl": transformers.Qwen2VLConfig}[arch]
    text = {**TINY_VL_TEXT, **text_overrides, "vocab_size": len(tok), "bos_token_id": None,
            "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    out_key = "out_hidden_size" if arch == "qwen2_5_vl" else "hidden_size"  # the merger's output = the text width
    vis = {**TINY_VL_VISION[arch], out_key: text["hidden_size"], **(vision or {})}
    cfg = cls(text_config=text, vision_config=vis, image_token_id=vocab["<|image_pad|>"],
              video_token_id=vocab["<|video_pad|>"], vision_start_token_id=vocab["<|vision_start|>"],
              vision_end_token_id=vocab["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model_cls = {"qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
                 "qwen2_vl": transformers.Qwen2VLForConditionalGeneration}[arch]
    model = randomize(model_cls(cfg).to(torch.float32), seed).eval()
    kw = {"max_shard_size": shard_bytes} if shard_bytes is not None else {}
    model.save_pretrained(str(d), **kw)
    save_tokenizer(tok, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id,
                                                           "pad_token_id": tok.pad_token_id}))
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=14, merge_size=2,
                             temporal_patch_size=2).save_pretrained(str(d))
    return model
