"""RoPE's numbers for a core.model_config.DecoderConfig, as transformers' modeling_rope_utils computes them: the inverse
frequencies (default, linear, llama3, yarn) and the attention factor transformers multiplies cos and sin by (YaRN's;
1.0 for the others)."""
from __future__ import annotations

import math

import torch


def rope_inv_freq(c) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2], float32, computed as transformers' modeling_rope_utils does."""
    dim, base, s = c.head_dim, c.rope_theta, c.rope_scaling
    if s is None:  # the models' compute_default_rope_parameters
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    factor = s["factor"]
    if s["rope_type"] == "linear":
        return inv_freq / factor
    if s["rope_type"] == "yarn":
        return _yarn_inv_freq(s, dim, base)
    # llama3 (_compute_llama3_parameters), step for step
    low, high, old_context_len = s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def _yarn_inv_freq(s: dict, dim: int, base: float) -> torch.Tensor:
    """YaRN's inverse frequencies, as transformers' _compute_yarn_parameters computes them, step for step."""
    factor, omp = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return (dim * math.log(omp / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_scaling(c) -> float:
    """The factor transformers multiplies RoPE's cos and sin by: YaRN's attention_factor (given, or from factor,
    mscale and mscale_all_dim as _compute_yarn_parameters infers it); 1.0 for every other RoPE type."""
    s = c.rope_scaling
    if s is None or s["rope_type"] != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return s["attention_factor"]

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, mscale, mscale_all_dim = s["factor"], s.get("mscale"), s.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)
