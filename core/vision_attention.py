"""A few attention calls per layer for transformers' Qwen2-VL / Qwen2.5-VL vision towers, instead of one per window.

Without flash-attn, transformers' vision attention splits every layer's patches into their windows (Qwen2.5-VL: 8x8
patches; full-attention layers: one image) and calls SDPA once per window: one learner step (policy and critic) over 8
trajectories with 2 screenshots of 640x400 each made 21,776 calls in its forward passes through a 32-layer tower, and
that 1 B-parameter step took 5.2 s on an H200, far above its FLOPs (docs/benchmarks.md, "On a GPU"). transformers hands
the windows' boundaries (cu_seqlens) only to an attention implementation whose name contains "flash"
(is_flash_attention_requested), so this one is registered under such a name: it batches the windows by length (one SDPA
call per distinct window length, a few a layer: no padding, no mask), which needs no flash-attn and runs on a CPU too.
Each window still attends to itself only, so the result is the per-window loop's (tests/test_vision_attention.py checks
values and gradients against it).

Only the vision tower uses it (use() sets the tower's own config); the language model keeps its attention.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "tars_flash_varlen_sdpa"  # "flash" in the name: transformers then passes cu_seqlens (see above)


def varlen_sdpa(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, cu_seq_lens_q=None,
                cu_seq_lens_k=None, is_causal=False, **kwargs):
    """query, key, value: (1, heads, tokens, head_dim) of packed sequences bounded by cu_seq_lens_q (the same for
    keys); returns ((1, tokens, heads, head_dim), None) as transformers' attention functions do."""
    if cu_seq_lens_q is None or (cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k, cu_seq_lens_q)):
        raise ValueError(f"{NAME} is for vision towers: it needs cu_seq_lens_q (and equal cu_seq_lens_k)")
    if attention_mask is not None or is_causal:
        raise ValueError(f"{NAME} takes no attention mask and is not causal")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (tokens, heads, head_dim)
    cu = cu_seq_lens_q.tolist()  # a few hundred ints; transformers' own per-window loop reads them too
    starts, lengths = torch.tensor(cu[:-1]), torch.tensor(cu[1:]) - torch.tensor(cu[:-1])
    order, outs = [], []
    for n in lengths.unique().tolist():  # windows of one length at a time: a batch with no padding and no mask
        at = (starts[lengths == n][:, None] + torch.arange(n)).to(query.device)  # (windows, n) token indices
        o = F.scaled_dot_product_attention(q[at].transpose(1, 2), k[at].transpose(1, 2), v[at].transpose(1, 2),
                                           dropout_p=dropout if module.training else 0.0, scale=scaling)
        outs.append(o.transpose(1, 2).reshape(-1, o.shape[1], o.shape[3]))  # (windows * n, heads, head_dim)
        order.append(at.reshape(-1))
    out = torch.cat(outs)[torch.argsort(torch.cat(order))]  # back in token order
    return out.unsqueeze(0), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_sdpa)


def use(tower: torch.nn.Module) -> torch.nn.Module:
    """Make a vision tower (transformers' Qwen2-VL / Qwen2.5-VL `visual`) attend with varlen_sdpa; returns it."""
    register()
    tower.config._attn_implementation = NAME
    return tower
