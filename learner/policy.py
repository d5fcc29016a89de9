"""The model the learner trains: `transformers`' own causal LM class, loaded from a Hugging Face checkpoint directory.

The inference engine runs its own decoder (core.model.CausalLM, with KV-cache batching); the learner trains the real
`transformers` model (AutoModelForCausalLM, fp32 parameters, SDPA attention), as AReaL and verl do, and writes the same
HF layout back (config.json + model.safetensors, the checkpoint's parameter names), which both the engine and
`transformers` load. `tests/test_learner_policy.py` holds the two to the same logprobs on the same weights.

TrainPolicy wraps the model with what the update needs:

    logprobs_at / values_at   the trunk (the base model) over a right-padded batch, then the vocabulary projection
                              (or the critic's value head) only at the positions that are trained on
    hf_state_dict / load_weights / save_hf / load
                              the HF layout; the critic's value head (`score`, Linear(hidden, 1)) lives beside the
                              transformers model and is saved apart, in value_head.safetensors
    config                    a core.model.DecoderConfig (pad_token_id, vocab_size, ...); transformers': `lm.config`

A checkpoint whose config.json carries "tars_vision" keeps its patch-embedding module (core/vision.py, weights
`vision.proj.*` in model.safetensors), as the engine's decoder does.

A Qwen2-VL / Qwen2.5-VL directory (core.vlm.is_vl_dir) loads as transformers' image-text-to-text class (vision tower
with core.vision_attention + language model, fp32, SDPA); `vl` is its core.vlm.VLSpec. The per-token methods take
`vl=`: per row a learner.batch.RowImages (the row's segments, each with its pixel_values / image_grid_thw; a windowed
text row's have none) and compute each segment as its own sequence (its images, M-RoPE positions), laid back in the
row's layout. hf_state_dict / load_weights speak the checkpoint's names (`model.layers.*`, `visual.*`,
`lm_head.weight`): transformers 5 holds other names in memory (`model.language_model.*`, `model.visual.*`) and its own
checkpoint conversion (transformers.core_model_loading.revert_weight_conversion, what save_pretrained applies) maps them.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import shutil

import torch
import torch.nn as nn

from core import vision_attention
from core.model import DecoderConfig
from core.model_config import padding_id
from core.model_files import both_rope_spellings, init_parameters, read_weights  # noqa: F401  (read_weights: callers import it here)
from core.vision import PatchEmbed, VisionConfig
from learner.batch import right_padded
from learner.fsdp import full, like

log = logging.getLogger("tars.learner")

ATTENTION = "sdpa"  # the same logprobs as the engine's SDPA attention (tests/test_learner_policy.py)
VALUE_HEAD_FILE = "value_head.safetensors"


def _transformers():
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    return transformers


@contextlib.contextmanager
def _no_progress_bars():
    """transformers draws a progress bar per load and save; a learner saves once per version."""
    from transformers.utils import logging as tlog

    was = tlog.is_progress_bar_enabled()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            tlog.enable_progress_bar()


def config_dict(hf_config) -> dict:
    """The transformers config as config.json holds it, with the RoPE in both transformers spellings
    (core.model_files.both_rope_spellings: the engine's DecoderConfig.from_hf and transformers 4 read rope_theta and
    rope_scaling)."""
    return both_rope_spellings(hf_config.to_dict())


@contextlib.contextmanager
def _quiet_load_report():
    """from_pretrained logs a table of missing / unexpected weights; TrainPolicy.load checks them itself."""
    lg = logging.getLogger("transformers.modeling_utils")  # (its level must stay: it gates other checks)
    drop = lambda record: "LOAD REPORT" not in str(record.msg)  # noqa: E731
    lg.addFilter(drop)
    try:
        yield
    finally:
        lg.removeFilter(drop)


def copy_tokenizer(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """The tokenizer files of model directory src into dst (core.chat.copy_tokenizer_files); the names copied."""
    from core.chat import copy_tokenizer_files

    return copy_tokenizer_files(src, dst)


def _text_config(hf_config) -> DecoderConfig:
    """A VL model's language model as a DecoderConfig (pad / eos ids, vocabulary size, widths: what the learner reads
    of `config`). The engine-side refusals of DecoderConfig.from_hf (M-RoPE, the vision fields) do not apply: the
    learner runs transformers' own class."""
    tc = hf_config.text_config
    eos = tc.eos_token_id if tc.eos_token_id is not None else getattr(hf_config, "eos_token_id", None)
    pad = padding_id(tc.pad_token_id if tc.pad_token_id is not None else getattr(hf_config, "pad_token_id", None),
                     eos, int(tc.vocab_size))
    return DecoderConfig(vocab_size=int(tc.vocab_size), hidden_size=int(tc.hidden_size),
                         intermediate_size=int(tc.intermediate_size), num_hidden_layers=int(tc.num_hidden_layers),
                         num_attention_heads=int(tc.num_attention_heads),
                         num_key_value_heads=int(tc.num_key_value_heads or tc.num_attention_heads),
                         max_position_embeddings=int(tc.max_position_embeddings), rms_norm_eps=float(tc.rms_norm_eps),
                         tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
                         bos_token_id=tc.bos_token_id, eos_token_id=list(eos) if isinstance(eos, (list, tuple)) else eos,
                         pad_token_id=int(pad))


class TrainPolicy(nn.Module):
    """A transformers causal LM (`lm`) + the optional critic value head (`score`) + the optional vision module; or a
    transformers Qwen2-VL / Qwen2.5-VL model with `vl` its core.vlm.VLSpec."""

    def __init__(self, lm, value_head: bool = False, vl=None):
        super().__init__()
        self.lm = lm
        self.vl = vl
        self._ckpt_names: dict[str, str] | None = None  # in-memory name -> checkpoint name (VL models)
        self.config = _text_config(lm.config) if vl is not None else DecoderConfig.from_hf(config_dict(lm.config))
        # Today's learner trains every embedding row, the padding id's included (a real token in many vocabularies:
        # Qwen pads with <|endoftext|>); nn.Embedding's padding_idx would freeze that row. Forward is unaffected.
        emb = lm.get_input_embeddings()
        if getattr(emb, "padding_idx", None) is not None:
            emb.padding_idx = None
        hidden = self.config.hidden_size if vl is not None else lm.config.hidden_size
        self.score = nn.Linear(hidden, 1) if value_head else None
        self.vision_config = VisionConfig.from_extra(self.config.extra)
        self.vision = PatchEmbed(self.vision_config, hidden) if self.vision_config else None

    # ---- building ----------------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, dc: DecoderConfig, value_head: bool = False, seed: int | None = None,
                    std: float = 0.02) -> "TrainPolicy":
        """A fresh model for `dc` (tests, benches). With a seed, the same initial weights as
        core.model.CausalLM(dc).init_weights(seed, std) (same names, same order); without one, transformers' own."""
        t = _transformers()
        d = dc.to_hf()
        hf_config = t.AutoConfig.for_model(**d)
        lm = t.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation=ATTENTION)
        m = cls(lm, value_head=value_head)
        if seed is not None:
            m.init_weights(seed, std)
        return m

    @classmethod
    def load(cls, path: str | os.PathLike, value_head: bool = False) -> "TrainPolicy":
        """An HF checkpoint directory (config.json + safetensors) in fp32, offline. The architecture is checked by
        core.model.DecoderConfig.from_hf first, so an unsupported model is the core's clear error."""
        from core.vlm import VLSpec, is_vl_dir

        p = pathlib.Path(path)
        vl = VLSpec.load(p) if is_vl_dir(p) else None  # ValueError naming the file without a processor config
        if vl is None:
            DecoderConfig.from_hf(json.loads((p / "config.json").read_text()))
        t = _transformers()
        auto = t.AutoModelForImageTextToText if vl is not None else t.AutoModelForCausalLM
        with _no_progress_bars(), _quiet_load_report():  # missing and unexpected weights are checked below
            lm, info = auto.from_pretrained(str(p), local_files_only=True, dtype=torch.float32,
                                            attn_implementation=ATTENTION, output_loading_info=True)
        if vl is not None:
            vision_attention.use(lm.model.visual)  # one SDPA call per window length, not per window
        if lm.config.tie_word_embeddings and lm.lm_head.weight is not lm.get_input_embeddings().weight:
            # transformers untied them: the file's lm_head differs from the embedding (core.model.untied_head).
            # Say so in the config too, or the publish would drop the head this model trains.
            lm.config.tie_word_embeddings = False
            log.warning("%s: lm_head.weight differs from the embedding: loaded untied, as transformers does", p)
        m = cls(lm, value_head=value_head, vl=vl)
        # transformers initialises a missing weight at random and says so in a log line: an error here.
        tied = {"lm_head.weight"} if lm.config.tie_word_embeddings else set()
        missing = sorted(set(info.get("missing_keys") or ()) - tied)
        if missing or info.get("mismatched_keys"):
            raise ValueError(f"{p}: weights do not match the model: missing {missing[:5]}, "
                             f"mismatched {list(info.get('mismatched_keys') or ())[:5]}")
        unexpected = [k for k in info.get("unexpected_keys") or ()
                      if not (m.vision is not None and k.startswith("vision."))]
        if unexpected:
            log.warning("%s: weights the model does not use: %s", p, sorted(unexpected)[:5])
        if m.vision is not None:  # not a transformers parameter: read from the same file
            sd = read_weights(p)
            m.vision.load_state_dict({k[len("vision."):]: v for k, v in sd.items() if k.startswith("vision.")})
        if value_head and (p / VALUE_HEAD_FILE).is_file():
            from safetensors.torch import load_file

            m.score.load_state_dict(load_file(str(p / VALUE_HEAD_FILE)))
        return m

    @classmethod
    def critic_from(cls, policy: "TrainPolicy") -> "TrainPolicy":
        """The critic: the policy's architecture and trunk weights, with a zero-initialised value head."""
        import copy

        critic = cls(copy.deepcopy(policy.lm), value_head=True, vl=policy.vl)
        if policy.vision is not None:
            critic.vision.load_state_dict(policy.vision.state_dict())
        nn.init.zeros_(critic.score.weight)
        nn.init.zeros_(critic.score.bias)
        return critic.to(next(policy.parameters()).device)

    def vision_parameters(self) -> list[nn.Parameter]:
        """The vision tower's parameters (a VL model's `visual`; the tars_vision patch embedding); [] for text."""
        if self.vl is not None:
            return list(self.lm.model.visual.parameters())
        return list(self.vision.parameters()) if self.vision is not None else []

    def freeze_vision(self) -> "TrainPolicy":
        """model.freeze_vision: the vision tower gets no gradient (requires_grad False); the optimisers take
        trainable_parameters() only, so it is not in them either."""
        for p in self.vision_parameters():
            p.requires_grad_(False)
        return self

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def init_weights(self, seed: int = 0, std: float = 0.02) -> "TrainPolicy":
        """core.model.CausalLM.init_weights on the same names in the same order (core.model_files.init_parameters)."""
        init_parameters(self, seed, std)
        return self

    # ---- forward -----------------------------------------------------------------------------------------------
    def hidden(self, input_ids: torch.Tensor, key_valid: torch.Tensor | None = None, images=None,
               vl=None) -> torch.Tensor:
        """Final hidden states [B, T, H] of the base model. input_ids [B, T], right-padded; key_valid [B, T] bool
        (False = padding; right padding needs no mask: learner.batch.right_padded). Positions are 0..T-1 in every row,
        as the engine numbers a sequence's tokens. images: (rows [N], columns [N], patch pixels [N, patch_dim]) ->
        those positions take the patch embeddings (core/vision.py; ignored by a model without it). vl: per row a
        learner.batch.RowImages (its segments, a VL model's images) or None: _segment_hidden."""
        if vl is not None and any(r is not None for r in vl):
            if images is not None and len(images[0]):  # the actor never windows such a conversation (docs/actor.md)
                raise ValueError("segmented rows with tars_vision screenshot patches are not supported")
            return self._segment_hidden(input_ids, key_valid, vl)
        key_valid = None if key_valid is not None and right_padded(key_valid) else key_valid  # SDPA's causal kernel
        base = self.lm.base_model
        if images is not None and self.vision is not None and len(images[0]):
            rows, cols, pix = images
            x = self.lm.get_input_embeddings()(input_ids)
            dev = x.device
            x = x.index_put((rows.to(dev), cols.to(dev)), self.vision(pix.to(dev)).to(x.dtype))
            out = base(inputs_embeds=x, attention_mask=key_valid, use_cache=False)
        else:
            out = base(input_ids=input_ids, attention_mask=key_valid, use_cache=False)
        return out.last_hidden_state

    def _segment_hidden(self, input_ids: torch.Tensor, key_valid: torch.Tensor | None, rows) -> torch.Tensor:
        """[B, T, H] in the rows' token layout, each segment of each row its own sequence (a text checkpoint's have no
        images): its tokens from position 0, its images' pixel_values / image_grid_thw, transformers' M-RoPE positions
        (mm_token_type_ids marks the image pads; a vision token the policy sampled, RowImages.stray, goes in as the pad
        id). Segments go through the model together, right-padded, packed longest first into forwards of at most the
        chunk's own padded size (B x T); their images concatenated in row order. Padding positions stay 0."""
        B, T = input_ids.shape
        dev = input_ids.device
        lens = key_valid.sum(1).tolist() if key_valid is not None else [T] * B
        pieces = []  # (row, start, end, pixels or None)
        for r in range(B):
            L, ri = int(lens[r]), rows[r]
            starts = list(ri.starts) if ri is not None else [0]
            for k, s in enumerate(starts):
                e = min(starts[k + 1] if k + 1 < len(starts) else L, L)
                if e > s:
                    pieces.append((r, s, e, ri.pixels[k] if ri is not None else None))
        pieces.sort(key=lambda p: p[2] - p[1], reverse=True)
        groups, cur = [], []
        for p in pieces:  # the first piece of a group is its longest
            if cur and not getattr(self, "one_vl_forward", False) and (len(cur) + 1) * (cur[0][2] - cur[0][1]) > B * T:
                groups.append(cur)
                cur = []
            cur.append(p)
        if cur:
            groups.append(cur)
        out = None
        trunk = self.lm.model if self.vl is not None else self.lm.base_model  # a text row's segments: no images
        for g in groups:
            W = g[0][2] - g[0][1]
            ids = torch.full((len(g), W), self.config.pad_token_id, dtype=torch.long, device=dev)
            att = torch.zeros(len(g), W, dtype=torch.long, device=dev)
            for j, (r, s, e, _) in enumerate(g):
                ids[j, :e - s] = input_ids[r, s:e]
                att[j, :e - s] = 1
                ids[j, [t - s for t in (rows[r].stray if rows[r] else ()) if s <= t < e]] = self.config.pad_token_id
            pix = [p[3] for p in g if p[3] is not None and p[3][1].shape[0]]
            kw = {}
            if pix:
                vis = self.lm.model.visual
                kw = dict(pixel_values=torch.cat([pv for pv, _ in pix]).to(dev, vis.dtype),
                          image_grid_thw=torch.cat([thw for _, thw in pix]).to(dev),
                          mm_token_type_ids=(ids == self.vl.image_token_id).int())
                if not getattr(self, "hf_rope_index", False):  # True: transformers' own (a benchmark's baseline)
                    kw["position_ids"] = self._segment_positions(ids, g).to(dev)
            h = trunk(input_ids=ids, attention_mask=att, use_cache=False, **kw).last_hidden_state
            if out is None:
                out = h.new_zeros(B, T, h.shape[-1])
            rr = torch.cat([torch.full((e - s,), r, dtype=torch.long) for r, s, e, _ in g]).to(dev)
            cc = torch.cat([torch.arange(s, e) for _, s, e, _ in g]).to(dev)
            jj = torch.cat([torch.full((e - s,), j, dtype=torch.long) for j, (_, s, e, _) in enumerate(g)]).to(dev)
            pp = torch.cat([torch.arange(e - s) for _, s, e, _ in g]).to(dev)
            out = out.index_put((rr, cc), h[jj, pp])
        if out is None:  # no tokens at all
            out = trunk(input_ids=input_ids, attention_mask=key_valid, use_cache=False).last_hidden_state
        return out

    def _segment_positions(self, ids: torch.Tensor, group) -> torch.Tensor:
        """M-RoPE positions [3, G, W] of a group of right-padded segments (ids [G, W], as _segment_hidden lays them
        out), computed on the CPU by core.vlm.rope_positions, the engine's copy of transformers' get_rope_index.
        Given to the model, they spare its get_rope_index, which walks every sequence and image in Python with
        device syncs for each on a GPU. Padding keeps position 0."""
        from core.vlm import rope_positions

        host = ids.cpu()
        pos = torch.zeros(3, *host.shape, dtype=torch.long)
        for j, (_, s, e, px) in enumerate(group):
            grids = px[1].tolist() if px is not None else []
            pos[:, j, :e - s] = rope_positions(host[j, :e - s].tolist(), grids, self.vl)[0]
        return pos

    def forward(self, input_ids: torch.Tensor, key_valid: torch.Tensor | None = None, vl=None) -> torch.Tensor:
        """Logits [B, T, V] at every position."""
        return self.lm.lm_head(self.hidden(input_ids, key_valid, vl=vl))

    def token_logprobs(self, input_ids, key_valid=None, temperature: float = 1.0, vl=None) -> torch.Tensor:
        """logprob of input_ids[:, t] given the prefix, for t >= 1 -> [B, T] (position 0 gets 0)."""
        logits = self.forward(input_ids, key_valid, vl=vl)[:, :-1].float()
        if temperature and temperature != 1.0:
            logits = logits / temperature
        lp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        return nn.functional.pad(lp, (1, 0))

    def logprobs_at(self, input_ids, key_valid, mask, with_entropy: bool = False, vl=None, temperature: float = 1.0):
        """Logprobs of input_ids[:, t] for the positions where mask[:, t] > 0 only -> [N] (row-major order), and
        their entropies with with_entropy.

        The vocabulary projection runs only where it is needed (generated tokens are a small share of a multi-turn
        conversation); log_softmax in fp32. vl: a VL model's images per row (hidden). temperature: of the policy
        that samples, log_softmax(logits / T) as the engine reports its behaviour logprobs (0 = greedy: T = 1)."""
        h = self.hidden(input_ids, key_valid, vl=vl)
        sel = mask[:, 1:] > 0                                   # [B, T-1]: token t predicted from position t-1
        logits = self.lm.lm_head(h[:, :-1][sel]).float()        # [N, V]
        if temperature and temperature != 1.0:
            logits = logits / temperature
        lp_all = torch.log_softmax(logits, dim=-1)
        lp = lp_all.gather(-1, input_ids[:, 1:][sel][:, None]).squeeze(-1)
        if not with_entropy:
            return lp
        return lp, -(lp_all.exp() * lp_all).sum(-1)

    def values_at(self, input_ids, key_valid, mask, vl=None) -> torch.Tensor:
        """Critic values V(state before token t) for the positions where mask[:, t] > 0 -> [N]."""
        h = self.hidden(input_ids, key_valid, vl=vl)
        return self.score(h[:, :-1][mask[:, 1:] > 0]).squeeze(-1)

    # ---- HF layout ---------------------------------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameter names as in the checkpoint (model.layers.0.self_attn.q_proj.weight, ...): no lm_head.weight
        when the embeddings are tied, no value head; vision.proj.* with the vision module. Sharded: gathered whole."""
        if getattr(self, "_gathered", None) is not None:
            return self._gathered
        sd = {k: full(v).detach().contiguous() for k, v in self.lm.state_dict().items()}
        if self.vl is not None:  # transformers' in-memory names -> the checkpoint's
            names = self.checkpoint_names()
            sd = {names[k]: v for k, v in sd.items()}
        if self.lm.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        if self.vision is not None:
            sd.update({f"vision.{k}": full(v).detach().contiguous() for k, v in self.vision.state_dict().items()})
        return sd

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in (all of them, no more): the inverse of hf_state_dict."""
        sd = dict(sd)
        if self.lm.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        own = self._hf_tensors()
        missing, unexpected = set(own) - set(sd), set(sd) - set(own)
        if missing or unexpected:
            raise ValueError(f"weights do not match the model: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
        with torch.no_grad():
            for k, v in sd.items():  # (a sharded parameter takes its shard of the whole tensor)
                own[k].copy_(like(own[k], v.to(own[k].dtype)))

    def _hf_tensors(self) -> dict[str, torch.Tensor]:
        """HF name -> the parameter (or persistent buffer) itself, for the names hf_state_dict writes."""
        names = set(self.hf_state_dict())
        rename = self.checkpoint_names() if self.vl is not None else {}
        own = {rename.get(k, k): v for k, v in self.lm.named_parameters()}
        own.update({rename.get(k, k): v for k, v in self.lm.named_buffers() if rename.get(k, k) in names})
        if self.vision is not None:
            own.update({f"vision.{k}": v for k, v in self.vision.named_parameters()})
        return {k: v for k, v in own.items() if k in names}

    def checkpoint_names(self) -> dict[str, str]:
        """A VL model's in-memory state-dict name -> the name save_pretrained writes (and the engine loads): the
        model's own checkpoint conversion mapping, reverted as save_pretrained reverts it."""
        if self._ckpt_names is None:
            from transformers.core_model_loading import revert_weight_conversion

            mem = self.lm.state_dict()
            by_id = {id(v): k for k, v in mem.items()}
            out = revert_weight_conversion(self.lm, dict(mem))
            names = {by_id[id(v)]: k for k, v in out.items() if id(v) in by_id}
            if len(names) != len(mem) or len(set(names.values())) != len(names):
                raise ValueError(f"{type(self.lm).__name__}: the checkpoint conversion is not a renaming of every "
                                 "weight; this model cannot be trained here")
            self._ckpt_names = names
        return self._ckpt_names

    def save_hf(self, path: str | os.PathLike, extra_files: dict[str, str] | None = None,
                tokenizer_from: str | os.PathLike | None = None) -> pathlib.Path:
        """config.json + model.safetensors (+ value_head.safetensors) into `path`, atomically (a temporary directory,
        then a rename). Tensors are written fp32 on the CPU whatever the model's device. tokenizer_from: a directory
        whose tokenizer files (core.chat.copy_tokenizer_files) go in too; extra_files: name -> text."""
        from safetensors.torch import save_file

        path = pathlib.Path(path)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            sd = {k: v.to("cpu", torch.float32).contiguous() for k, v in self.hf_state_dict().items()}
            with _no_progress_bars():
                self.lm.save_pretrained(str(tmp), state_dict=sd)
            cj = tmp / "config.json"  # readable by transformers 4 (SGLang relaunched on it) as the same model
            cj.write_text(json.dumps(both_rope_spellings(json.loads(cj.read_text())), indent=2, sort_keys=True) + "\n")
            if self.score is not None:
                save_file({k: v.detach().to("cpu", torch.float32).contiguous()
                           for k, v in self.score.state_dict().items()}, str(tmp / VALUE_HEAD_FILE))
            if tokenizer_from is not None:
                copy_tokenizer(tokenizer_from, tmp)
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text)
            aside = path.with_name(path.name + f".old{os.getpid()}")
            if path.is_dir():  # the old one stays whole until the new one is in place (a rename each)
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(path, aside)
            os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed write (full disk, occupied path) leaves no half copy
            raise
        shutil.rmtree(aside, ignore_errors=True)
        return path
