"""core.vision_attention: one SDPA call per vision layer gives transformers' per-window loop's values and gradients,
and the learner's and the engine's vision towers use it."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from core import vision_attention as VA

# Several images of different sizes: windows of different lengths in one layer, full-attention layers of different
# lengths too (Qwen2.5-VL), one image per sequence (Qwen2-VL).
GRID = torch.tensor([[1, 8, 12], [1, 4, 6], [1, 10, 8]])


def _tower(arch: str):
    if arch == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig as VC
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as VM
        cfg = VC(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=24, window_size=56,
                 fullatt_block_indexes=[1], patch_size=14, temporal_patch_size=2, spatial_merge_size=2)
    else:
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig as VC
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as VM
        cfg = VC(depth=2, embed_dim=32, hidden_size=24, num_heads=4, mlp_ratio=2, patch_size=14, temporal_patch_size=2,
                 spatial_merge_size=2)
    torch.manual_seed(0)
    return VM._from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")


def _run(tower, pixels):
    tower.zero_grad()
    out = tower(pixels, grid_thw=GRID)
    out = getattr(out, "pooler_output", out)
    (out ** 2).mean().backward()
    return out.detach(), [p.grad.clone() for p in tower.parameters()]


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl"])
def test_values_and_gradients_match_the_per_window_loop(arch):
    loop = _tower(arch)
    packed = VA.use(copy.deepcopy(loop))
    pixels = torch.randn(int(GRID.prod(-1).sum()), 3 * 2 * 14 * 14)
    ref_out, ref_grads = _run(loop, pixels)
    out, grads = _run(packed, pixels)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def _count_sdpa(monkeypatch) -> list[int]:
    calls = [0]
    sdpa = F.scaled_dot_product_attention

    def counted(*a, **k):
        calls[0] += 1
        return sdpa(*a, **k)
    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    return calls


def _calls(tower, monkeypatch) -> int:
    calls = _count_sdpa(monkeypatch)
    with torch.no_grad():
        tower(torch.randn(int(GRID.prod(-1).sum()), 3 * 2 * 14 * 14), grid_thw=GRID)
    monkeypatch.undo()
    return calls[0]


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl"])
def test_one_call_per_window_length_not_per_window(arch, monkeypatch):
    loop = _tower(arch)
    per_window = _calls(loop, monkeypatch)
    packed = _calls(VA.use(loop), monkeypatch)
    # Qwen2-VL: one sequence per image (3 sizes) in every layer; Qwen2.5-VL: windows of a few lengths in the windowed
    # layers (full windows, cut ones at the images' edges) and one sequence per image in the full-attention layer.
    assert per_window == (3 * len(loop.blocks) if arch == "qwen2_vl" else 31)
    assert packed == (3 * len(loop.blocks) if arch == "qwen2_vl" else 7)


def test_learner_and_engine_towers_use_it(tmp_path, monkeypatch):
    from core.model import CausalLM
    from learner.policy import TrainPolicy
    from tests.hf_dirs import make_vl_checkpoint

    make_vl_checkpoint(tmp_path, vision=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4))
    learner = TrainPolicy.load(tmp_path).lm.model.visual
    engine = CausalLM.load_hf(tmp_path).visual
    for tower in (learner, engine):
        assert tower.config._attn_implementation == VA.NAME
        assert _calls(tower, monkeypatch) == 7  # not 31, as test_one_call_per_window_length_not_per_window counts


def test_refuses_what_it_is_not_for():
    q = torch.randn(1, 2, 6, 4)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        VA.varlen_sdpa(torch.nn.Module(), q, q, q)
    cu = torch.tensor([0, 2, 6])
    with pytest.raises(ValueError, match="not causal"):
        VA.varlen_sdpa(torch.nn.Module(), q, q, q, cu_seq_lens_q=cu, is_causal=True)
    out, _ = VA.varlen_sdpa(torch.nn.Module(), q, q, q, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    ref = torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], q[:, :, a:b], q[:, :, a:b]) for a, b in ((0, 2), (2, 6))],
                    dim=2).transpose(1, 2)
    torch.testing.assert_close(out, ref)
