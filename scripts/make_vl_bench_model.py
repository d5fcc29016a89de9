"""The vision-language checkpoint the GPU checks train and profile: Qwen2-0.5B's text shape, Qwen2.5-VL's 32-layer
vision tower, random weights (std 0.02: a deep random model needs a small init to stay finite), a 2,048-token
tokenizer; ~1.0 B parameters, 4.1 GB in fp32.

    python scripts/make_vl_bench_model.py DIR          (from the repository root)
"""
import functools
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import tests.hf_dirs as h  # noqa: E402

if __name__ == "__main__":
    h.randomize = functools.partial(h.randomize, std=0.02)
    h.make_vl_checkpoint(sys.argv[1], arch="qwen2_5_vl", vocab_size=2048,
                         hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]},
                         vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, window_size=112,
                                     fullatt_block_indexes=[7, 15, 23, 31]))
    print("made", sys.argv[1])
