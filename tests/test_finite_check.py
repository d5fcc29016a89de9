"""inference_server.engine_types.finite / check_finite: the one-pass min/max check refuses exactly what
torch.isfinite(v).all() refuses (the slow reference), for every float dtype, size and position of the bad value."""
from __future__ import annotations

import pytest
import torch

from inference_server.engine_types import WeightsRefused, check_finite, finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_agrees_with_isfinite_everywhere(dtype):
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 31, 4096, 1_000_003):
        clean = (torch.randn(n, generator=g) * 3).to(dtype)
        assert finite(clean) and bool(torch.isfinite(clean).all())
        for bad in (float("nan"), float("inf"), float("-inf")):
            for pos in {0, n // 3, n - 1}:
                v = clean.clone()
                v[pos] = bad
                assert finite(v) == bool(torch.isfinite(v).all()) is False
        extremes = torch.tensor([torch.finfo(dtype).max, torch.finfo(dtype).min, 0.0], dtype=dtype)
        assert finite(extremes)                                       # the largest finite values are finite


def test_shapes_views_empty_and_integers():
    v = torch.randn(4, 6)
    v[2, 5] = float("nan")
    assert not finite(v) and not finite(v.t()) and finite(v[:2])
    assert finite(torch.empty(0)) and finite(torch.tensor([1, 2, 3]))


def test_check_finite_names_the_first_bad_tensor():
    sd = {"a": torch.ones(3), "b": torch.tensor([1.0, float("inf")]), "c": torch.tensor([float("nan")])}
    with pytest.raises(WeightsRefused, match="weight b holds non-finite"):
        check_finite(sd)
    check_finite({"a": torch.ones(3), "i": torch.arange(4)})


@pytest.mark.parametrize("src, dst", [(torch.float64, torch.float32), (torch.float32, torch.bfloat16),
                                      (torch.float32, torch.float16), (torch.float64, torch.bfloat16)])
def test_values_that_overflow_in_the_models_dtype_are_refused_like_infinities(src, dst):
    """The reference: cast to the model's dtype, then isfinite. 1e300 in float64 becomes inf in fp32; 1e39 in fp32
    becomes inf in bf16; the largest value the target holds is still fine."""
    top = torch.finfo(dst).max
    for value in (float(top) * 4, -float(top) * 4, float(top), 1.0):
        if not torch.isfinite(torch.tensor(value, dtype=src)):
            continue                                   # not representable in the source dtype either
        v = torch.tensor([0.5, value], dtype=src)
        assert finite(v, dst) == bool(torch.isfinite(v.to(dst)).all()), (value, src, dst)
    with pytest.raises(WeightsRefused, match=f"once cast to {dst}"):
        check_finite({"w": torch.tensor([float(top) * 4], dtype=src)}, dst)


def test_the_engine_refuses_an_update_that_overflows_in_its_dtype():
    from core.config import InferenceConfig
    from core.model import CausalLM, DecoderConfig
    from inference_server.engine import LocalEngine

    dc = DecoderConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, max_position_embeddings=64)
    m = CausalLM(dc).init_weights(0, std=0.1)
    e = LocalEngine(InferenceConfig(max_context=64), m)
    try:
        sd = {k: v.double() for k, v in m.state_dict().items()}
        sd["model.norm.weight"][0] = 1e300
        with pytest.raises(WeightsRefused, match="once cast"):
            e.update_weights(1, state_dict=sd)
        assert e.version == 0
    finally:
        e.close()
