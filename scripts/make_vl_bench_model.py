"""The vision-language checkpoints the GPU checks train and profile, random weights (std 0.02: a deep random model
needs a small init to stay finite), a 2,048-token byte-level BPE tokenizer with ChatML and Qwen's vision tokens.

    python scripts/make_vl_bench_model.py DIR [--size bench|small]     (from the repository root)

bench (default): Qwen2-0.5B's text shape and Qwen2.5-VL's 32-layer vision tower, ~1.0 B parameters, 4.1 GB in fp32
(the learner step and publish figures of docs/benchmarks.md "On a GPU").
small: a 4-layer, 512-wide text model and an 8-block, 384-wide vision tower (windowed and full attention as
Qwen2.5-VL mixes them), ~30 M parameters: the MiniWoB++ preset's run with screenshots (scripts/gpu_miniwob.sh).
"""
import argparse
import functools
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import tests.hf_dirs as h  # noqa: E402

SIZES = {
    "bench": dict(text=dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                            num_key_value_heads=2),
                  vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, window_size=112,
                              fullatt_block_indexes=[7, 15, 23, 31])),
    "small": dict(text=dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=4),
                  vision=dict(depth=8, hidden_size=384, intermediate_size=1024, num_heads=6, window_size=112,
                              fullatt_block_indexes=[3, 7])),
}

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--size", choices=sorted(SIZES), default="bench")
    a = ap.parse_args()
    h.randomize = functools.partial(h.randomize, std=0.02)
    s = SIZES[a.size]
    # head_dim 64 in both text shapes: mrope's sections (temporal, height, width) cover its 32 rotary pairs
    h.make_vl_checkpoint(a.dir, arch="qwen2_5_vl", vocab_size=2048, **s["text"],
                         rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]}, vision=s["vision"])
    print("made", a.dir, a.size)
