"""What a checkpoint's config.json may say for core.model's decoder: Hugging Face Qwen2 / Qwen2.5, Qwen3, Llama and
Mistral causal LMs.

`DecoderConfig.from_hf(dict)` (and `load_config(dir)`) accepts a config only when the decoder computes exactly what
transformers' Qwen2ForCausalLM / Qwen3ForCausalLM / LlamaForCausalLM / MistralForCausalLM compute for it (or, for
qwen2_vl / qwen2_5_vl, what their ForConditionalGeneration computes: the same Qwen2 decoder with M-RoPE, plus
transformers' own vision tower). Anything else is refused with `UnsupportedModel` naming the field: another model_type or architecture, a setting the decoder would silently ignore (a sliding window
shorter than the context, a RoPE type other than default / linear / llama3 / yarn, an activation other than SiLU, a
quantization config, ...), and any field not classified below (ACCEPTED_CONFIG_FIELDS lists every accepted name).

The same checks run whether the dict comes straight from config.json or from transformers' AutoConfig.to_dict()
(`load_config(dir, via_transformers=True)`), which renames rope_scaling / rope_theta to rope_parameters.
"""
from __future__ import annotations

import json
import os
import pathlib
from dataclasses import asdict, dataclass, field

from core.rope import rope_attention_scaling, rope_inv_freq  # noqa: F401  (re-exported: RoPE's numbers)
# Which fields are read, ignored, accepted only at a default or refused, transformers' defaults, and the
# vision-language model types (a Qwen2 decoder with M-RoPE plus transformers' own vision tower): core/model_fields.py
from core.model_fields import (  # noqa: F401  (re-exported)
    _HF_DEFAULTS, ACCEPTED_CONFIG_FIELDS, DEFAULT_ONLY_FIELDS, IGNORED_CONFIG_FIELDS, REFUSED_FIELDS, USED_CONFIG_FIELDS,
    VL_MODEL_TYPES,
)

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                 "mistral": "MistralForCausalLM",
                 "qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
SUPPORTED = ("model_type qwen2 (Qwen2ForCausalLM: Qwen2, Qwen2.5), qwen3 (Qwen3ForCausalLM), llama "
             "(LlamaForCausalLM), mistral (MistralForCausalLM, without a sliding window), qwen2_vl "
             "(Qwen2VLForConditionalGeneration) or qwen2_5_vl (Qwen2_5_VLForConditionalGeneration: Qwen2.5-VL, UI-TARS-1.5)")
# A VL config's own fields next to its decoder's: the vision tower's config (given to transformers' class as it is)
# and the special token ids (core/vlm.py reads them); text_config holds the decoder's fields (transformers 5 layout;
# the older flat layout has them at the top level).
VL_CONFIG_FIELDS = ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
VL_IGNORED_FIELDS = ("vision_token_id", "text_config")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")

class UnsupportedModel(ValueError):
    """A checkpoint the decoder would not compute faithfully: another architecture, or a config setting it lacks."""


def _refuse(what: str) -> UnsupportedModel:
    return UnsupportedModel(f"{what} (core.model implements {SUPPORTED}, RoPE types {', '.join(ROPE_TYPES)})")


@dataclass
class DecoderConfig:
    """A Qwen2 / Qwen3 / Llama / Mistral decoder's shape and options (names as in config.json)."""

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int = 0
    model_type: str = "qwen2"              # an ARCHITECTURES key: which HF architecture the weights and config follow
    head_dim: int | None = None            # None: hidden_size // num_attention_heads
    attention_bias: bool = False           # llama, qwen3: bias on q/k/v/o (qwen2: always q/k/v, no o; mistral: none)
    mlp_bias: bool = False                 # llama: bias on gate/up/down (qwen2: never)
    rope_scaling: dict | None = None       # None (plain RoPE) or {"rope_type": "linear" | "llama3" | "yarn", ...}
    mrope_section: list[int] | None = None  # qwen2_vl / qwen2_5_vl: M-RoPE's (temporal, height, width) split of head_dim/2
    extra: dict = field(default_factory=dict)  # tars_vision, or a VL model's VL_CONFIG_FIELDS

    def __post_init__(self):
        if self.model_type not in ARCHITECTURES:
            raise _refuse(f"model_type {self.model_type!r} is not supported")
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.model_type != "llama" and self.mlp_bias:
            raise _refuse(f"mlp_bias true: {self.model_type} has no MLP biases")
        if self.attention_bias and self.model_type not in ("llama", "qwen3"):
            raise _refuse(f"attention_bias true: {self.model_type}'s attention biases are fixed by its architecture")
        if self.rope_scaling is not None:
            self.rope_scaling = _rope_scaling(self.rope_scaling, self.max_position_embeddings, "rope_scaling")
        if self.is_vl:
            if self.mrope_section is None:
                self.mrope_section = [16, 24, 24]  # transformers' default
            self.mrope_section = [int(x) for x in self.mrope_section]
            if not isinstance(self.extra.get("vision_config"), dict):
                raise _refuse(f"a {self.model_type} config needs its vision_config")
            for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
                if not isinstance(self.extra.get(k), int):
                    raise _refuse(f"a {self.model_type} config needs {k}")
            if sum(self.mrope_section) != self.head_dim // 2 or len(self.mrope_section) != 3:
                raise _refuse(f"mrope_section {self.mrope_section} must be 3 numbers summing to head_dim / 2 = "
                              f"{self.head_dim // 2}")
        elif self.mrope_section is not None:
            raise _refuse(f"mrope_section on a {self.model_type} model: M-RoPE is for qwen2_vl / qwen2_5_vl only")

    @property
    def is_vl(self) -> bool:
        """A Qwen2-VL / Qwen2.5-VL checkpoint: M-RoPE and a vision tower (core/model.py)."""
        return self.model_type in VL_MODEL_TYPES

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias if self.model_type in ("llama", "qwen3", "mistral") else True  # qwen2 (and VL)

    @property
    def o_bias(self) -> bool:
        return self.attention_bias  # only llama and qwen3 may set it (__post_init__)

    @property
    def qk_norm(self) -> bool:
        """Qwen3: an RMSNorm over each head of q and k before RoPE (weights self_attn.q_norm / k_norm)."""
        return self.model_type == "qwen3"

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The end-of-sequence token ids (config.json may give one, a list, or none)."""
        e = self.eos_token_id
        return () if e is None else tuple(int(t) for t in e) if isinstance(e, (list, tuple)) else (int(e),)

    def to_hf(self) -> dict:
        """config.json for this decoder, readable by transformers 4.45+ and 5 as the same architecture."""
        d = {k: v for k, v in asdict(self).items()
             if k not in ("extra", "head_dim", "attention_bias", "mlp_bias", "mrope_section")}
        d.update(architectures=[ARCHITECTURES[self.model_type]], hidden_act="silu", torch_dtype="float32",
                 attention_dropout=0.0, initializer_range=0.02, use_cache=True)
        if self.is_vl:  # the flat layout (text fields at the top), which transformers 4 and 5 both read
            d["rope_scaling"] = {**(self.rope_scaling or {"type": "mrope"}), "mrope_section": list(self.mrope_section)}
        if self.model_type == "mistral":
            d.update(head_dim=self.head_dim, sliding_window=None)
        elif self.model_type != "llama":
            d.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_hidden_layers)
            if self.model_type == "qwen3":  # head_dim's default is 128 there, not hidden_size / heads
                d.update(head_dim=self.head_dim, attention_bias=self.attention_bias)
            elif self.head_dim != self.hidden_size // self.num_attention_heads:
                d["head_dim"] = self.head_dim
        else:
            d.update(head_dim=self.head_dim, attention_bias=self.attention_bias, mlp_bias=self.mlp_bias, pretraining_tp=1)
        d.update(self.extra)
        return d

    @classmethod
    def from_hf(cls, d: dict) -> "DecoderConfig":
        """A config.json dict (or transformers' config.to_dict()) -> DecoderConfig; UnsupportedModel if it cannot
        be computed faithfully."""
        d = dict(d)
        mt = _model_type(d)
        vl: dict = {}
        if mt in VL_MODEL_TYPES:
            d, vl = _flatten_vl(d)
        d, mrope = _split_mrope(d, mt)
        for k, v in d.items():
            if k in REFUSED_FIELDS:
                if v not in (None, {}):
                    raise _refuse(f"config field {k!r}: {REFUSED_FIELDS[k]}")
                continue
            if k in DEFAULT_ONLY_FIELDS and v not in (DEFAULT_ONLY_FIELDS[k], None):
                raise _refuse(f"config field {k!r} = {v!r} is not supported (only {DEFAULT_ONLY_FIELDS[k]!r})")
            if k not in ACCEPTED_CONFIG_FIELDS and not k.startswith("_"):  # "_attn_implementation_autoset", ...
                raise _refuse(f"config field {k!r} is not one the decoder knows (accepted: core.model_config."
                              "ACCEPTED_CONFIG_FIELDS)")
        if d.get("hidden_act", "silu") != "silu":
            raise _refuse(f"config field 'hidden_act' = {d['hidden_act']!r}: only silu is implemented")
        if d.get("pretraining_tp") not in (None, 1):
            raise _refuse(f"config field 'pretraining_tp' = {d['pretraining_tp']!r}: only 1 is implemented")
        g = {**_HF_DEFAULTS[mt], **{k: v for k, v in d.items() if v is not None}}
        n_layers, heads, max_pos = int(g["num_hidden_layers"]), int(g["num_attention_heads"]), int(g["max_position_embeddings"])
        # a VL model's decoder is Qwen2's; Qwen3 slides (or not) as Qwen2 does
        family = mt if mt in ("llama", "mistral") else "qwen2"
        _check_sliding(d, family, n_layers, max_pos)
        if mt == "mistral" and (d.get("attention_bias") or d.get("mlp_bias")):
            raise _refuse("config field 'attention_bias' / 'mlp_bias' = true on a mistral model: Mistral has no biases "
                          "(transformers ignores the fields)")
        if mt == "qwen3" and d.get("mlp_bias"):
            raise _refuse("config field 'mlp_bias' = true on a qwen3 model: Qwen3 has no MLP biases")
        if family == "qwen2" and mt != "qwen3":
            if d.get("attention_bias") is not None:
                raise _refuse("config field 'attention_bias' on a qwen2 model: Qwen2 always has q/k/v biases and no o bias "
                              "(transformers ignores the field)")
            if d.get("mlp_bias"):
                raise _refuse("config field 'mlp_bias' = true on a qwen2 model: Qwen2 has no MLP biases")
        theta, scaling = _rope_from_hf(d, max_pos)
        eos = d.get("eos_token_id", _HF_DEFAULTS[mt]["eos_token_id"])
        pad = padding_id(d.get("pad_token_id"), eos, int(g["vocab_size"]))
        kw = dict(
            vocab_size=int(g["vocab_size"]), hidden_size=int(g["hidden_size"]), intermediate_size=int(g["intermediate_size"]),
            num_hidden_layers=n_layers, num_attention_heads=heads,
            num_key_value_heads=int(g.get("num_key_value_heads", heads)), max_position_embeddings=max_pos,
            rms_norm_eps=float(g.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            tie_word_embeddings=bool(g.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id", _HF_DEFAULTS[mt]["bos_token_id"]),
            eos_token_id=list(eos) if isinstance(eos, (list, tuple)) else eos, pad_token_id=int(pad),
            model_type=mt, head_dim=int(g["head_dim"]) if g.get("head_dim") else None,
            attention_bias=bool(d.get("attention_bias") or False) if mt in ("llama", "qwen3") else False,
            mlp_bias=bool(d.get("mlp_bias") or False), rope_scaling=scaling, mrope_section=mrope,
        )
        if vl:
            kw["extra"] = vl
        if d.get("tars_vision"):  # the optional patch-embedding vision path (core/vision.py)
            kw["extra"] = {"tars_vision": dict(d["tars_vision"])}
        return cls(**kw)


def padding_id(pad, eos, vocab_size: int) -> int:
    """The id batches are padded with. Padding only needs some valid id (it is masked everywhere): the config's
    pad_token_id, else the first eos (as the tokenizer does), else 0. A negative one (-1 in the original LLaMA
    conversions) counts as none; one past the vocabulary is refused, as transformers cannot build that embedding."""
    if pad is not None and int(pad) >= vocab_size:
        raise _refuse(f"config field 'pad_token_id' = {pad} is outside the vocabulary [0, {vocab_size})")
    if pad is not None and int(pad) >= 0:
        return int(pad)
    first = (eos[0] if eos else None) if isinstance(eos, (list, tuple)) else eos
    return int(first) if first is not None and 0 <= int(first) < vocab_size else 0


def load_config(path: str | os.PathLike, via_transformers: bool = True) -> DecoderConfig:
    """DIR/config.json -> DecoderConfig (UnsupportedModel naming DIR and the field when it cannot be served).

    via_transformers: also read it through transformers.AutoConfig (local files only), as the learner will, and
    check what it makes of the file the same way."""
    path = pathlib.Path(path)
    f = path / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"{path}: no config.json here (a checkpoint directory holds config.json + model.safetensors)")
    try:
        c = DecoderConfig.from_hf(json.loads(f.read_text()))
        if via_transformers:  # after the json check, so a refusal reads the same whichever way (and comes first)
            import transformers

            c = DecoderConfig.from_hf(transformers.AutoConfig.from_pretrained(str(path), local_files_only=True).to_dict())
        return c
    except UnsupportedModel as e:
        raise UnsupportedModel(f"{path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not valid json: {e}") from None


def _flatten_vl(d: dict) -> tuple[dict, dict]:
    """A qwen2_vl / qwen2_5_vl config -> (its decoder's fields as one flat dict, its VL_CONFIG_FIELDS).

    transformers 5 nests the decoder's fields in text_config; older checkpoints (UI-TARS-1.5, Qwen2.5-VL-7B as
    published) have them at the top level. Both are read; a field in text_config wins, as in transformers."""
    text = d.get("text_config") or {}
    if not isinstance(text, dict):
        raise _refuse(f"config field 'text_config' = {text!r} is not a dict")
    flat = {k: v for k, v in d.items() if k not in VL_CONFIG_FIELDS and k not in VL_IGNORED_FIELDS}
    for k, v in text.items():
        if k in ("model_type", "architectures"):  # the text model's own (qwen2_5_vl_text): not the checkpoint's
            continue
        if k in flat and v is None:
            continue
        flat[k] = v
    vl = {k: d[k] for k in VL_CONFIG_FIELDS if d.get(k) is not None}
    return flat, vl


def _split_mrope(d: dict, mt: str) -> tuple[dict, list[int] | None]:
    """Take M-RoPE's mrope_section (and its "type": "mrope", which transformers reads as default RoPE) out of
    rope_scaling / rope_parameters -> (the config without them, the section or None)."""
    section = None
    out = dict(d)
    for name in ("rope_scaling", "rope_parameters"):
        src = d.get(name)
        if not isinstance(src, dict):
            continue
        src = dict(src)
        if "mrope_section" in src:
            section = src.pop("mrope_section")
            if src.get("type") == "mrope":
                src.pop("type")
            if src.get("rope_type") == "mrope":
                src.pop("rope_type")
        elif src.get("type") == "mrope" or src.get("rope_type") == "mrope":
            src.pop("type", None) if src.get("type") == "mrope" else src.pop("rope_type")
            section = section or [16, 24, 24]  # transformers' default section
        out[name] = src
    if mt not in VL_MODEL_TYPES:
        if section is not None:
            raise _refuse(f"M-RoPE (mrope_section) on a {mt} model: only qwen2_vl / qwen2_5_vl have it")
        return d, None
    if section is None:
        section = [16, 24, 24]
    if not isinstance(section, (list, tuple)) or not all(isinstance(x, int) for x in section):
        raise _refuse(f"config field 'mrope_section' = {section!r} is not a list of ints")
    return out, list(section)


def _model_type(d: dict) -> str:
    mt, arch = d.get("model_type"), d.get("architectures")
    if mt is not None and mt not in ARCHITECTURES:
        raise _refuse(f"model_type {mt!r} is not supported")
    if arch is not None and (not isinstance(arch, list) or len(arch) != 1 or arch[0] not in ARCHITECTURES.values()):
        raise _refuse(f"architectures {arch!r} is not supported")
    if mt is None:
        if arch is None:
            raise _refuse("config.json names no model_type or architectures")
        mt = next(k for k, v in ARCHITECTURES.items() if v == arch[0])
    if arch is not None and arch[0] != ARCHITECTURES[mt]:
        raise _refuse(f"architectures {arch!r} does not match model_type {mt!r}")
    return mt


def _check_sliding(d: dict, mt: str, n_layers: int, max_pos: int) -> None:
    """Refuse sliding-window attention on any layer: the decoder always attends to the whole context."""
    window = d.get("sliding_window")
    if mt == "qwen2":  # Qwen2Config / Qwen3Config: the window (default 4096) counts only with use_sliding_window
        window = (d["sliding_window"] if "sliding_window" in d else 4096) if d.get("use_sliding_window") else None
    elif mt == "mistral":  # MistralConfig: the window (default 4096) applies to every layer unless it is null
        window = d["sliding_window"] if "sliding_window" in d else 4096
        if window is not None:
            raise _refuse(f"config field 'sliding_window' = {window}: Mistral's sliding-window attention is not "
                          "implemented (a checkpoint with sliding_window null, as Mistral-7B-v0.3 has, is fine)")
        return
    elif mt == "llama":  # LlamaModel attends to the whole context whatever sliding_window / layer_types say
        if d.get("use_sliding_window"):
            raise _refuse("config field 'use_sliding_window' = true: llama has no sliding-window attention")
        return
    types = d.get("layer_types")
    if types is not None:
        bad = set(types) - {"full_attention", "sliding_attention"}
        if bad or len(types) != n_layers:
            raise _refuse(f"config field 'layer_types' = {types!r}: expected {n_layers} of full_attention / sliding_attention")
        sliding = "sliding_attention" in types
    else:
        mwl = d.get("max_window_layers")  # qwen2: layers from max_window_layers on (default 28) slide
        sliding = (28 if mwl is None else int(mwl)) < n_layers
    if sliding and window is not None:  # even one >= max_position_embeddings: nothing keeps sequences within that
        raise _refuse(f"config field 'sliding_window' = {window} (use_sliding_window): sliding-window attention is not "
                      "implemented (transformers applies the window to any longer sequence, and contexts are not "
                      f"bounded by max_position_embeddings {max_pos})")


_ROPE_KEYS = {"default": set(), "linear": {"factor"}, "llama3": {"factor", "low_freq_factor", "high_freq_factor"},
              "yarn": {"factor"}}
_ROPE_OPTIONAL = {"default": set(), "linear": {"original_max_position_embeddings"},  # transformers ignores it for linear
                  "llama3": {"original_max_position_embeddings"},
                  "yarn": {"original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
                           "mscale_all_dim", "truncate"}}
_YARN_OPTIONAL = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")  # numbers, or absent


def _rope_from_hf(d: dict, max_pos: int) -> tuple[float, dict | None]:
    """(rope_theta, normalised rope_scaling or None) from rope_scaling + rope_theta (transformers 4) or
    rope_parameters (transformers 5; rope_scaling wins when both are there, as in transformers)."""
    src = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(src, dict):
        raise _refuse(f"config field 'rope_parameters' = {src!r} is not a dict")
    nested = [k for k in src if k in ("full_attention", "sliding_attention")]
    if nested:  # per-layer-type RoPE: fine when every layer type has the same
        subs = [src[k] for k in nested]
        if len(nested) != len(src) or any(s != subs[0] for s in subs):
            raise _refuse(f"config field 'rope_parameters' = {src!r}: per-layer-type RoPE is not supported")
        src = subs[0] or {}
    src = dict(src)
    theta = float(src.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
    prf = src.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor")
    if prf not in (None, 1, 1.0):
        raise _refuse(f"config field 'partial_rotary_factor' = {prf!r}: only full rotary embeddings are implemented")
    if not src:
        return theta, None
    omp = d.get("original_max_position_embeddings")
    out = _rope_scaling(src, max_pos, "rope_parameters" if "rope_parameters" in d and not d.get("rope_scaling") else "rope_scaling")
    if out is not None and out["rope_type"] in ("llama3", "yarn") and omp is not None:  # a top-level value wins
        out["original_max_position_embeddings"] = int(omp)
    return theta, out


def _rope_scaling(src: dict, max_pos: int, name: str) -> dict | None:
    """Normalise one RoPE dict (without rope_theta) -> None for plain RoPE, else {"rope_type", parameters...}."""
    src = {k: v for k, v in src.items() if k not in ("rope_theta", "partial_rotary_factor")}
    kind = src.pop("rope_type", None) or src.pop("type", None) or "default"
    src.pop("type", None)
    if kind == "dynamic":
        raise _refuse(f"config field {name!r}: rope type 'dynamic' is not supported (transformers recomputes its "
                      "frequencies from the whole batch's length once it passes max_position_embeddings, which a "
                      "per-request KV cache cannot reproduce)")
    if kind not in ROPE_TYPES:
        raise _refuse(f"config field {name!r}: rope type {kind!r} is not supported")
    need, optional = _ROPE_KEYS[kind], _ROPE_OPTIONAL[kind]
    if need - set(src):
        raise _refuse(f"config field {name!r}: rope type {kind!r} needs {sorted(need - set(src))}")
    if set(src) - need - optional:
        raise _refuse(f"config field {name!r}: keys {sorted(set(src) - need - optional)} are not supported for rope type {kind!r}")
    if kind == "default":
        return None
    out = {"rope_type": kind, **{k: float(src[k]) for k in sorted(need)}}
    if not out["factor"] > 0:
        raise _refuse(f"config field {name!r}: factor must be > 0, got {out['factor']}")
    if kind in ("llama3", "yarn"):  # transformers' default: max_position_embeddings
        out["original_max_position_embeddings"] = int(src.get("original_max_position_embeddings") or max_pos)
    if kind == "yarn":
        out.update({k: float(src[k]) for k in _YARN_OPTIONAL if src.get(k) is not None})
        if src.get("truncate") is not None:
            out["truncate"] = bool(src["truncate"])
    return out
