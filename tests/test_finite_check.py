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
