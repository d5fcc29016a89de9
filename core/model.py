"""Hugging Face Qwen2 / Qwen2.5, Qwen3, Llama and Mistral causal LMs in plain torch: a checkpoint directory is the
model. Qwen2-VL / Qwen2.5-VL (UI-TARS-1.5) run on the same decoder with M-RoPE (3-D positions, `mrope_cos_sin`; those
of a prompt with images: core.vlm.rope_positions) and transformers' own vision tower (`visual`, from the config's
vision_config, loaded with the checkpoint's `visual.*` weights); image features replace the `<|image_pad|>` embeddings.

One implementation serves the inference engine (batched decode, per-request KV caches) and the learner (full-sequence
logprobs), so both compute the same numbers for the same weights. Parameter names, config.json and the safetensors
files follow transformers' classes, so a checkpoint loads in either direction. Which configs are accepted (and why
others are refused): core/model_config.py; the weight files (single or sharded): core/model_files.py.
"""
from __future__ import annotations

import json
import os
import pathlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.model_config import (  # noqa: F401  (re-exported: core.model is where callers look for them)
    ACCEPTED_CONFIG_FIELDS, DecoderConfig, UnsupportedModel, load_config, rope_attention_scaling, rope_inv_freq,
)
from core import vision_attention
from core.model_files import MissingWeights, init_parameters, read_weights, untied_head, write_weights  # noqa: F401


class WeightsMismatch(ValueError):
    """Weights whose names or shapes do not fit the config."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """positions [B, T], inv_freq [hd/2] fp32 -> cos, sin [B, 1, T, head_dim] (HF's rotate-half), x scale: YaRN's."""
    freqs = positions.float()[..., None] * inv_freq  # [B, T, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(dtype)[:, None], (emb.sin() * scale).to(dtype)[:, None]


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, section: list[int], dtype: torch.dtype, scale=1.0):
    """M-RoPE: positions [3, B, T] (temporal, height, width), inv_freq [hd/2] -> cos, sin [B, 1, T, head_dim]: the
    i-th chunk of `section` over the frequencies takes its angles from positions[i % 3], as transformers'
    Qwen2-VL / Qwen2.5-VL rotary embedding (apply_multimodal_rotary_pos_emb) assembles them."""
    freqs = positions.float()[..., None] * inv_freq  # [3, B, T, hd/2]
    freqs = torch.cat([m[i % 3] for i, m in enumerate(freqs.split(section, dim=-1))], dim=-1)  # [B, T, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(dtype)[:, None], (emb.sin() * scale).to(dtype)[:, None]


def vision_tower(c: DecoderConfig) -> nn.Module:
    """transformers' own vision tower of a qwen2_vl / qwen2_5_vl config (random until load_weights)."""
    if c.model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig as VC
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as VM
    else:
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig as VC
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as VM
    vc = c.extra["vision_config"]
    cfg = VC(**{k: v for k, v in vc.items() if k not in ("model_type", "architectures", "transformers_version")})
    return vision_attention.use(VM._from_config(cfg, dtype=torch.float32))  # core/vision_attention.py


# Other names a VL checkpoint may give its tensors (transformers 5's module layout) -> the checkpoint layout.
_VL_RENAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def canonical_names(sd: dict) -> dict:
    """A state dict with transformers 5's VL module names (model.language_model.*, model.visual.*) renamed to
    the checkpoint names this model uses (model.*, visual.*); other names stay."""
    if not any(k.startswith(a) for k in sd for a, _ in _VL_RENAMES):
        return sd
    out = {}
    for k, v in sd.items():
        for a, b in _VL_RENAMES:
            if k.startswith(a):
                k = b + k[len(a):]
                break
        out[k] = v
    return out


class _RopeFacts:
    """What core.vlm.rope_positions needs of a VL model (a VLSpec carries the same two facts)."""

    def __init__(self, image_token_id: int, merge_size: int):
        self.image_token_id, self.merge_size = image_token_id, merge_size


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


class Attention(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.nh * self.hd, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=c.o_bias)
        # qwen3: an RMSNorm over each head of q and k, before RoPE (None elsewhere: no failed lookup per call)
        self.q_norm, self.k_norm = ((RMSNorm(self.hd, c.rms_norm_eps), RMSNorm(self.hd, c.rms_norm_eps)) if c.qk_norm
                                    else (None, None))

    def forward(self, x, cos, sin, mask, past=None):
        B, T, _ = x.shape
        q, k = self.q_proj(x).view(B, T, self.nh, self.hd), self.k_proj(x).view(B, T, self.nkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, hd]
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if past is not None:
            k = torch.cat([past[0], k], dim=2)  # [B, Hkv, S+T, hd]
            v = torch.cat([past[1], v], dim=2)
        new = (k, v)
        if self.nkv != self.nh:
            rep = self.nh // self.nkv
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # mask [B, 1, T, S+T] bool, True = attend
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.hd)), new


class MLP(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, mask, past=None):
        h, new = self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), new


class Trunk(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


def causal_mask(key_valid: torch.Tensor, T: int) -> torch.Tensor:
    """key_valid [B, S] bool (S = past + T keys, last T are the queries) -> mask [B, 1, T, S]."""
    B, S = key_valid.shape
    past = S - T
    q_pos = torch.arange(T, device=key_valid.device)[:, None] + past
    k_pos = torch.arange(S, device=key_valid.device)[None, :]
    m = (k_pos <= q_pos)[None] & key_valid[:, None, :]  # [B, T, S]
    # A fully masked row (a padding query) would give NaN in softmax: let it see itself.
    eye = (k_pos == q_pos)[None].expand(B, T, S)
    m = m | (eye & ~m.any(-1, keepdim=True))
    return m[:, None]


class CausalLM(nn.Module):
    """A Qwen2 / Qwen3 / Llama / Mistral (ForCausalLM) decoder. `value_head=True` adds a scalar head (the critic)."""

    def __init__(self, c: DecoderConfig, value_head: bool = False):
        super().__init__()
        self.config = c
        # RoPE frequencies, computed once. A plain float32 tensor, not a buffer: model.to(bfloat16) must not round
        # them (transformers keeps them in float32 too); _inv_freq_on keeps one copy per device.
        with torch.device("cpu"):   # real numbers even when the modules are built on the meta device (load_hf)
            self.inv_freq, self.rope_scale = rope_inv_freq(c), rope_attention_scaling(c)
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}
        self.model = Trunk(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.score = nn.Linear(c.hidden_size, 1) if value_head else None
        from core.vision import PatchEmbed, VisionConfig

        self.vision_config = VisionConfig.from_extra(c.extra)
        # Optional: only checkpoints whose config carries "tars_vision" have it (weights vision.proj.*).
        self.vision = PatchEmbed(self.vision_config, c.hidden_size) if self.vision_config else None
        # Qwen2-VL / Qwen2.5-VL: transformers' vision tower (weights visual.*) and M-RoPE.
        self.visual = vision_tower(c) if c.is_vl else None
        self.mrope_section = c.mrope_section
        self.rope_facts = (_RopeFacts(int(c.extra["image_token_id"]),
                                      int(c.extra["vision_config"].get("spatial_merge_size", 2))) if c.is_vl else None)

    def init_weights(self, seed: int = 0, std: float = 0.02) -> "CausalLM":
        init_parameters(self, seed, std)
        return self

    def hidden(self, input_ids, positions=None, key_valid=None, past=None, images=None, image_embeds=None,
               pixel_values=None, image_grid_thw=None):
        """input_ids [B, T]; positions [B, T] (or, for a VL model, [3, B, T]: M-RoPE's); key_valid [B, S] over
        past+new keys; past: per layer (k, v).

        images: (rows [N], columns [N], patch pixels [N, patch_dim]) -> those input positions take the patch
        embeddings instead of their token embeddings (core/vision.py); ignored by a model without the vision module.
        image_embeds: (rows [N], columns [N], embeddings [N, H]) -> those input positions take these embeddings
        (a VL model's image features computed by image_features, as the engine's prefill places them).
        pixel_values, image_grid_thw (a VL model, whole sequences, past None): the processor's output for the
        images of every `<|image_pad|>` run of the batch in order (row by row); the features fill the pads, and
        positions, when not given, are M-RoPE's as transformers computes them (vl_positions).

        Returns final hidden states [B, T, H] and the new per-layer (k, v) caches.
        """
        B, T = input_ids.shape
        S = T + (past[0][0].shape[2] if past else 0)
        x = self.model.embed_tokens(input_ids)
        if pixel_values is not None:
            if self.visual is None:
                raise ValueError("pixel_values given to a model without a vision tower")
            feats = self.image_features(pixel_values, image_grid_thw)
            mask = input_ids == self.rope_facts.image_token_id
            if int(mask.sum()) != feats.shape[0]:
                raise ValueError(f"{int(mask.sum())} <|image_pad|> tokens but {feats.shape[0]} image features")
            x = x.masked_scatter(mask[..., None].to(x.device), feats.to(x.dtype))
            if positions is None:
                positions = self.vl_positions(input_ids, image_grid_thw, key_valid)[0]
        if positions is None:
            positions = torch.arange(S - T, S, device=input_ids.device)[None].expand(B, T)
        if key_valid is None:
            key_valid = torch.ones(B, S, dtype=torch.bool, device=input_ids.device)
        if images is not None and self.vision is not None and len(images[0]):
            rows, cols, pix = images
            dev = x.device
            x = x.index_put((rows.to(dev), cols.to(dev)), self.vision(pix.to(dev)).to(x.dtype))
        if image_embeds is not None and len(image_embeds[0]):
            rows, cols, emb = image_embeds
            dev = x.device
            x = x.index_put((rows.to(dev), cols.to(dev)), emb.to(dev, x.dtype))
        inv = self._inv_freq_on.get(x.device)
        if inv is None:
            inv = self._inv_freq_on[x.device] = self.inv_freq.to(x.device)
        if self.mrope_section is not None:
            if positions.dim() == 2:  # text only: the three components are the same position
                positions = positions[None].expand(3, B, T)
            cos, sin = mrope_cos_sin(positions.to(x.device), inv, self.mrope_section, x.dtype, self.rope_scale)
        else:
            cos, sin = rope_cos_sin(positions, inv, x.dtype, self.rope_scale)
        mask = causal_mask(key_valid, T)
        new = []
        for i, layer in enumerate(self.model.layers):
            x, kv = layer(x, cos, sin, mask, past[i] if past else None)
            new.append(kv)
        return self.model.norm(x), new

    def forward(self, input_ids, positions=None, key_valid=None, past=None, pixel_values=None, image_grid_thw=None):
        h, new = self.hidden(input_ids, positions, key_valid, past, pixel_values=pixel_values,
                             image_grid_thw=image_grid_thw)
        return self.lm_head(h), new

    # ---- vision-language (qwen2_vl / qwen2_5_vl) -------------------------------------------------------
    def image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """The vision tower: pixel_values [patches, C*T*P*P], image_grid_thw [n, 3] -> one embedding per
        `<|image_pad|>` token of the n images, in order [sum of t*h*w / merge**2, hidden_size]."""
        p = next(self.visual.parameters())
        out = self.visual(pixel_values.to(p.device, p.dtype), grid_thw=image_grid_thw.to(p.device))
        return getattr(out, "pooler_output", out)

    def vl_positions(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, key_valid=None):
        """M-RoPE positions [3, B, T] and rope deltas [B] of whole sequences (padding, where key_valid says so,
        gets position 0 and is skipped), as transformers' get_rope_index: each row's image runs take the next
        grids of image_grid_thw in order (core.vlm.rope_positions)."""
        from core.vlm import image_runs, rope_positions

        B, T = input_ids.shape
        pos = torch.zeros(3, B, T, dtype=torch.long)
        deltas = torch.zeros(B, dtype=torch.long)
        grids = image_grid_thw.tolist() if image_grid_thw is not None else []
        k = 0
        for b in range(B):
            valid = key_valid[b, -T:].cpu() if key_valid is not None else torch.ones(T, dtype=torch.bool)
            ids = input_ids[b].cpu()[valid].tolist()
            n = len(image_runs(ids, self.rope_facts.image_token_id))
            p, d = rope_positions(ids, grids[k:k + n], self.rope_facts)
            k += n
            pos[:, b, valid] = p
            deltas[b] = d
        return pos.to(input_ids.device), deltas

    def token_logprobs(self, input_ids, key_valid=None, temperature: float = 1.0):
        """logprob of input_ids[:, t] given the prefix, for t >= 1 -> [B, T] (position 0 gets 0)."""
        logits, _ = self.forward(input_ids, key_valid=key_valid)
        logits = logits[:, :-1].float()
        if temperature and temperature != 1.0:
            logits = logits / temperature
        lp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        return F.pad(lp, (1, 0))

    def logprobs_at(self, input_ids, key_valid, mask, with_entropy: bool = False):
        """Logprobs of input_ids[:, t] for the positions where mask[:, t] > 0 only -> [N] (row-major order).

        The vocabulary projection runs only where it is needed (generated tokens are a small share of a
        multi-turn conversation), which is most of the cost of a full-sequence forward for a small model.
        """
        h, _ = self.hidden(input_ids, key_valid=key_valid)
        sel = mask[:, 1:] > 0                              # [B, T-1]: token t predicted from position t-1
        logits = self.lm_head(h[:, :-1][sel]).float()       # [N, V]
        lp_all = torch.log_softmax(logits, dim=-1)
        lp = lp_all.gather(-1, input_ids[:, 1:][sel][:, None]).squeeze(-1)  # [N]
        if not with_entropy:
            return lp
        return lp, -(lp_all.exp() * lp_all).sum(-1)

    def values_at(self, input_ids, key_valid, mask):
        """Critic values V(state before token t) for the positions where mask[:, t] > 0 -> [N]."""
        h, _ = self.hidden(input_ids, key_valid=key_valid)
        return self.score(h[:, :-1][mask[:, 1:] > 0]).squeeze(-1)

    # ---- HF layout -------------------------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        sd = {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith("score.")}
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        return sd

    def save_hf(self, path: str | os.PathLike, extra_files: dict[str, str] | None = None,
                max_shard_bytes: int | None = None) -> pathlib.Path:
        """Write config.json + model.safetensors (or, past max_shard_bytes, model-0000i-of-0000N.safetensors shards and
        model.safetensors.index.json) + generation_config.json (+ value_head.safetensors) into `path`, atomically."""
        from safetensors.torch import save_file

        path = pathlib.Path(path)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        # fp32 on the CPU whatever the model's device and dtype: the files are the same from a GPU learner.
        write_weights(tmp, {k: v.to("cpu", torch.float32) for k, v in self.hf_state_dict().items()}, max_shard_bytes)
        if self.score is not None:
            save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in self.score.state_dict().items()},
                      str(tmp / "value_head.safetensors"))
        (tmp / "config.json").write_text(json.dumps(self.config.to_hf(), indent=2))
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": self.config.eos_token_id, "pad_token_id": self.config.pad_token_id}))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        if path.exists():
            __import__("shutil").rmtree(path)
        os.replace(tmp, path)
        return path

    @classmethod
    def load_hf(cls, path: str | os.PathLike, value_head: bool = False, dtype=torch.float32) -> "CausalLM":
        """A checkpoint directory (config.json + model.safetensors or its sharded index) -> the model.

        The modules (decoder, VL vision tower) are built on the meta device, without memory or random init (slower
        than the read for a 7B checkpoint on a CPU); each parameter then becomes its checkpoint tensor, the vision
        tower's non-persistent buffers are computed as transformers does, and nothing is left without data.

        UnsupportedModel: the config asks for something this decoder does not implement; MissingWeights
        (a FileNotFoundError): no weights; WeightsMismatch: names or shapes that do not fit the config."""
        from safetensors.torch import load_file

        path = pathlib.Path(path)
        config = load_config(path)
        sd = canonical_names(read_weights(path))
        if config.tie_word_embeddings and untied_head(sd):  # as transformers loads it: the file's own lm_head
            config.tie_word_embeddings = False
        with torch.device("meta"):
            m = cls(config, value_head=value_head)
        try:
            m.load_weights(sd, dtype)   # each tensor straight to dtype: a bf16 model never holds an fp32 copy
            del sd
            m._materialise_rest()
        except WeightsMismatch as e:
            raise WeightsMismatch(f"{path}: {e}") from None
        if value_head:
            m.score = nn.Linear(config.hidden_size, 1)   # a new critic head unless the checkpoint has one
            if (path / "value_head.safetensors").exists():
                m.score.load_state_dict(load_file(str(path / "value_head.safetensors")))
        return m.to(dtype)

    def _materialise_rest(self) -> None:
        """After load_weights into a meta-built model: compute the vision tower's non-persistent buffers (not in any
        checkpoint) with transformers' own _init_weights; WeightsMismatch for any tensor still without data."""
        if self.visual is not None:
            for name, mod in self.visual.named_modules():
                if any(b.is_meta for b in mod.buffers(recurse=False)):
                    if any(True for _ in mod.parameters(recurse=False)):
                        continue   # a module with weights: those come from the checkpoint, never from an init
                    mod.to_empty(device="cpu", recurse=False)
                    with torch.no_grad():
                        for b in mod.buffers(recurse=False):
                            b.fill_(float("nan") if b.is_floating_point() else 0)
                    self.visual._init_weights(mod)
                    bad = [f"visual.{name}.{k}" for k, b in mod.named_buffers(recurse=False)
                           if b.is_floating_point() and not bool(torch.isfinite(b).all())]
                    if bad:
                        raise WeightsMismatch(f"the vision tower's buffers {bad} were not computed")
        left = [k for k, t in [*self.named_parameters(), *self.named_buffers()]
                if t.is_meta and not k.startswith("score.")]
        if left:
            raise WeightsMismatch(f"{len(left)} tensors neither in the weights nor computed: {left[:5]}")

    def load_weights(self, sd: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> None:
        """Copy an HF-named state dict in; WeightsMismatch lists missing, unexpected and wrongly shaped tensors.
        VL tensors may carry transformers 5's module names (canonical_names); dtype: a meta-built model's (load_hf)."""
        sd = canonical_names(sd)
        # Old Llama checkpoints carry rotary_emb.inv_freq buffers; transformers ignores them, and so do we.
        sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        params = {k: v for k, v in self.state_dict(keep_vars=True).items() if not k.startswith("score.")}
        if self.config.tie_word_embeddings:
            params.pop("lm_head.weight", None)
        missing, unexpected = sorted(set(params) - set(sd)), sorted(set(sd) - set(params))
        shapes = [f"{k}: {tuple(v.shape)} in the weights, {tuple(params[k].shape)} in the model"
                  for k, v in sd.items() if k in params and tuple(v.shape) != tuple(params[k].shape)]
        if missing or unexpected or shapes:
            parts = [f"{len(missing)} missing {missing[:5]}" if missing else "", f"{len(unexpected)} unexpected {unexpected[:5]}"
                     if unexpected else "", f"{len(shapes)} of another shape ({'; '.join(shapes[:3])})" if shapes else ""]
            raise WeightsMismatch("weights do not match the config: " + ", ".join(p for p in parts if p))
        with torch.no_grad():
            for k, v in sd.items():
                p = params[k]
                if p.is_meta:   # built on the meta device (load_hf): the tensor becomes the checkpoint's, a copy
                    new = v.to(dtype or p.dtype, copy=True)   # of its own (never a view of a mapped file)
                    torch.utils.swap_tensors(p, nn.Parameter(new, requires_grad=p.requires_grad)
                                             if isinstance(p, nn.Parameter) else new)
                else:
                    p.copy_(v.to(p.dtype))
