"""core.model against transformers: checkpoint directories written by transformers' own Qwen2 / Llama classes load
into CausalLM and give the same logits (fp32, max abs diff <= 1e-4); ours load back into transformers; everything
the decoder does not implement is refused by name."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch

from core.config import InferenceConfig
from core.model import (ACCEPTED_CONFIG_FIELDS, CausalLM, DecoderConfig, MissingWeights, UnsupportedModel,
                        WeightsMismatch, load_config)
from core.model_config import ARCHITECTURES
from hf_dirs import TINY, make_hf_model

transformers = pytest.importorskip("transformers")

TOL = 1e-4


def llama3_rope() -> dict:  # a fresh dict each time: transformers adds keys to the one it is given
    return {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}


VARIANTS = {
    "qwen2-gqa-untied": ("qwen2", {}),
    "qwen2-gqa-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2-mha-head_dim16": ("qwen2", {"num_key_value_heads": 4, "head_dim": 16, "rope_theta": 1e6}),
    "llama-gqa": ("llama", {}),
    "llama-attention_bias": ("llama", {"attention_bias": True}),
    "llama-mlp_bias": ("llama", {"mlp_bias": True, "tie_word_embeddings": True}),
    "llama-head_dim16": ("llama", {"head_dim": 16, "num_key_value_heads": 1}),
    "llama-rope-llama3": ("llama", {"rope_scaling": llama3_rope(), "rope_theta": 500000.0}),
    "llama-rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "qwen3-gqa-untied": ("qwen3", {}),
    "qwen3-attention_bias-tied": ("qwen3", {"attention_bias": True, "tie_word_embeddings": True}),
    "qwen3-head_dim16-rope-llama3": ("qwen3", {"head_dim": 16, "num_key_value_heads": 1, "rope_scaling": llama3_rope()}),
    # YaRN as Qwen2.5's and Qwen3's model cards tell users to add it (factor, original_max_position_embeddings), and
    # with every option transformers reads (attention_factor given, or from mscale / mscale_all_dim; betas; truncate)
    "qwen2-rope-yarn": ("qwen2", {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
                                  "rope_theta": 1e6}),
    "qwen3-rope-yarn-options": ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.7,
                                                          "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False,
                                                          "original_max_position_embeddings": 32}, "head_dim": 16}),
    "llama-rope-yarn-mscale": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "mscale": 0.707,
                                                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 16}}),
    "mistral-rope-yarn": ("mistral", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}),
    "mistral-gqa": ("mistral", {"rope_theta": 1e6}),
    "mistral-head_dim16-tied": ("mistral", {"head_dim": 16, "tie_word_embeddings": True}),
}


def ids(B: int = 2, T: int = 120, seed: int = 0) -> torch.Tensor:  # up to near max_position_embeddings (128)
    return torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(tmp_path, variant):
    arch, kw = VARIANTS[variant]
    kw = {**kw, "rope_scaling": dict(kw["rope_scaling"])} if "rope_scaling" in kw else kw
    hf = make_hf_model(tmp_path, arch, **kw)
    assert (tmp_path / "model.safetensors.index.json").is_file()  # sharded, as transformers writes it
    m = CausalLM.load_hf(tmp_path).eval()
    assert m.config.model_type == arch
    # the same checks and result whether config.json is read as json or through AutoConfig
    assert load_config(tmp_path, via_transformers=True) == m.config
    x = ids()
    with torch.no_grad():
        ref = hf(x).logits
        d = max_diff(m(x)[0], ref)
        print(f"{variant}: max abs logit diff {d:.3g}")
        assert d <= TOL
        if m.config.rope_scaling:  # the test can tell: plain RoPE on the same weights is visibly different
            plain = CausalLM(DecoderConfig(**{**vars(m.config), "rope_scaling": None}))
            plain.load_weights(m.hf_state_dict())
            assert max_diff(plain(x)[0], ref) > 1e-2


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: q_norm / k_norm on the cached path too
def test_kv_cache_decode_matches_full_forward(tmp_path, arch):
    hf = make_hf_model(tmp_path, arch, head_dim=16, rope_scaling=llama3_rope(), attention_bias=True)
    m = CausalLM.load_hf(tmp_path).eval()
    x = ids(2, 40, seed=1)
    with torch.no_grad():
        full = m(x)[0][:, -1]
        h, past = m.hidden(x[:, :30])
        for t in range(30, 40):  # one token at a time on the cache, as the engine decodes
            pos = torch.full((2, 1), t)
            h, past = m.hidden(x[:, t:t + 1], pos, torch.ones(2, t + 1, dtype=torch.bool), past)
        step = m.lm_head(h[:, -1])
        ref = hf(x).logits[:, -1]
    assert max_diff(step, full) <= 1e-5
    assert max_diff(step, ref) <= TOL


def test_engine_serves_a_transformers_checkpoint_directory(tmp_path):
    from inference_server.engine import LocalEngine, SamplingParams

    hf = make_hf_model(tmp_path / "ck", "llama", rope_scaling=llama3_rope(), tie_word_embeddings=True)
    prompt = [5, 17, 33, 8, 61, 2, 9]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    eng = LocalEngine(InferenceConfig(max_context=128), str(tmp_path / "ck"))
    try:
        assert eng.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0.0)).output_ids == want
        make_hf_model(tmp_path / "v1", "llama", seed=1, rope_scaling=llama3_rope(), tie_word_embeddings=True)
        assert eng.update_weights(1, path=str(tmp_path / "v1"))["version"] == 1  # sharded directories update too
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "mistral"])
def test_save_hf_sharded_loads_in_transformers(tmp_path, arch):
    kw = ({"attention_bias": True, "head_dim": 16, "rope_scaling": llama3_rope()} if arch in ("llama", "qwen3")
          else {"head_dim": 16} if arch == "mistral" else {})
    make_hf_model(tmp_path / "src", arch, **kw)
    m = CausalLM.load_hf(tmp_path / "src")
    m.save_hf(tmp_path / "out", max_shard_bytes=20_000, extra_files={"note.txt": "hi"})
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (out / "model.safetensors").exists() and (out / "note.txt").read_text() == "hi"
    assert not list(tmp_path.glob("out.tmp*"))
    conf = json.loads((out / "config.json").read_text())
    assert conf["model_type"] == arch and conf["architectures"] == [ARCHITECTURES[arch]]
    assert DecoderConfig.from_hf(conf) == m.config
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == conf["architectures"][0]
    x = ids(2, 50)
    with torch.no_grad():
        assert max_diff(CausalLM.load_hf(out)(x)[0], hf(x).logits) <= TOL
        assert max_diff(m(x)[0], hf(x).logits) <= TOL


def test_config_round_trip_and_unsharded_default(tmp_path):
    c = DecoderConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, model_type="llama",
                      head_dim=16, attention_bias=True, mlp_bias=True, eos_token_id=[2, 3],
                      rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert DecoderConfig.from_hf(c.to_hf()) == c and c.eos_ids == (2, 3)
    CausalLM(c).init_weights(0).save_hf(tmp_path / "one")
    assert (tmp_path / "one" / "model.safetensors").is_file() and not (tmp_path / "one" / "model.safetensors.index.json").exists()
    assert CausalLM.load_hf(tmp_path / "one").config == c


def write_config(path: pathlib.Path, **fields) -> pathlib.Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(fields))
    return path


BASE = dict(TINY, model_type="qwen2", architectures=["Qwen2ForCausalLM"])


@pytest.mark.parametrize("fields,match", [
    (dict(BASE, model_type="gpt2", architectures=["GPT2LMHeadModel"]), "model_type 'gpt2' is not supported"),
    (dict(BASE, model_type="gemma", architectures=["GemmaForCausalLM"]), "model_type .gemma. is not supported"),
    (dict(BASE, model_type=None, architectures=["GemmaForCausalLM"]), "GemmaForCausalLM"),
    # Mistral's window applies to every layer, and defaults to 4096 when config.json leaves it out
    (dict(BASE, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4096), "sliding_window"),
    (dict(BASE, model_type="mistral", architectures=["MistralForCausalLM"]), "sliding_window' = 4096"),
    (dict(BASE, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None, attention_bias=True),
     "Mistral has no biases"),
    (dict(BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"], use_sliding_window=True, sliding_window=16,
          max_window_layers=0), "sliding_window"),
    (dict(BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"], mlp_bias=True), "Qwen3 has no MLP biases"),
    (dict(BASE, model_type="qwen2_vl", architectures=None), "qwen2_vl config needs its vision_config"),
    (dict(BASE, architectures=["LlamaForCausalLM"]), "does not match model_type 'qwen2'"),
    (dict(BASE, use_sliding_window=True, sliding_window=16, max_window_layers=0), "sliding_window"),
    # as long as max_position_embeddings: it still binds on longer sequences, which nothing prevents
    (dict(BASE, use_sliding_window=True, sliding_window=BASE["max_position_embeddings"], max_window_layers=0),
     "sliding_window"),
    (dict(BASE, model_type="llama", architectures=["LlamaForCausalLM"], rope_scaling={"rope_type": "foo", "factor": 2.0}),
     "rope type 'foo' is not supported"),
    (dict(BASE, rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}), "rope type 'longrope'"),
    (dict(BASE, rope_scaling={"type": "yarn", "factor": 4.0, "extrapolation": 2}), r"keys \['extrapolation'\]"),
    (dict(BASE, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "'dynamic' is not supported"),
    (dict(BASE, rope_parameters={"rope_type": "linear", "factor": 2.0, "mrope_section": [1, 1]}), "mrope_section"),
    (dict(BASE, hidden_act="gelu"), "hidden_act"),
    (dict(BASE, model_type="llama", architectures=["LlamaForCausalLM"], pretraining_tp=2), "pretraining_tp"),
    (dict(BASE, quantization_config={"quant_method": "gptq"}), "quantization_config"),
    (dict(BASE, partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(BASE, attention_bias=False), "attention_bias"),
    (dict(BASE, some_new_field=3), "'some_new_field' is not one the decoder knows"),
])
def test_unsupported_configs_are_refused_by_name(tmp_path, fields, match):
    d = write_config(tmp_path / "ck", **fields)
    with pytest.raises(UnsupportedModel, match=match) as e:
        CausalLM.load_hf(d)
    assert str(d) in str(e.value) and "qwen2" in str(e.value) and "llama" in str(e.value)
    with pytest.raises(UnsupportedModel, match=match):
        DecoderConfig.from_hf(fields)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("arch,kw,match", [
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1), "sliding_window"),
    ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "dynamic"),
    ("llama", dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                                 "original_max_position_embeddings": 64}), "longrope"),
    ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1), "sliding_window"),
    ("mistral", dict(sliding_window=64), "sliding_window"),
])
def test_refusals_are_the_same_through_autoconfig(tmp_path, arch, kw, match):
    make_hf_model(tmp_path, arch, **kw)
    for via in (False, True):
        with pytest.raises(UnsupportedModel, match=match):
            load_config(tmp_path, via_transformers=via)
    with pytest.raises(UnsupportedModel, match=match):  # transformers' normalised dict is refused the same way
        DecoderConfig.from_hf(transformers.AutoConfig.from_pretrained(tmp_path, local_files_only=True).to_dict())


def test_a_llama_config_with_a_sliding_window_is_accepted_as_transformers_ignores_it(tmp_path):
    """LlamaModel never slides (transformers ignores sliding_window on llama: the same logits with 8 and without);
    such a config was refused as 'sliding-window attention is not implemented'."""
    hf = make_hf_model(tmp_path, "llama", shard_bytes=None)
    conf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**conf, "sliding_window": 8}))
    m = CausalLM.load_hf(tmp_path).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    x = ids()
    with torch.no_grad():
        assert max_diff(m(x)[0], ref(x).logits) <= TOL and max_diff(ref(x).logits, hf(x).logits) == 0.0


def test_harmless_fields_are_accepted(tmp_path):
    # sliding window configured but on no layer: off, or above the last layer
    for kw in (dict(use_sliding_window=False, sliding_window=16), dict(use_sliding_window=False, sliding_window=None),
               dict(use_sliding_window=True, sliding_window=16, max_window_layers=2)):
        c = DecoderConfig.from_hf(dict(BASE, attention_dropout=0.1, torch_dtype="bfloat16", use_cache=False,
                                       initializer_range=0.5, transformers_version="4.43.1", rope_scaling=None, **kw))
        assert c.rope_scaling is None and c.tie_word_embeddings is False
    assert {"transformers_version", "torch_dtype", "use_cache", "attention_dropout", "max_window_layers"} <= set(ACCEPTED_CONFIG_FIELDS)
    c = DecoderConfig.from_hf(dict(BASE, rope_scaling={"type": "linear", "factor": 2}, bos_token_id=None, pad_token_id=None,
                                   eos_token_id=[7, 8], tars_vision={"grid": 2, "patch": 4}))
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0} and c.pad_token_id == 7 and c.eos_ids == (7, 8)
    assert c.extra == {"tars_vision": {"grid": 2, "patch": 4}} and c.to_hf()["tars_vision"] == {"grid": 2, "patch": 4}


def test_missing_weights_name_the_directory(tmp_path):
    d = write_config(tmp_path / "ck", **BASE)
    with pytest.raises(FileNotFoundError, match="no weights: neither model.safetensors nor") as e:
        CausalLM.load_hf(d)
    assert isinstance(e.value, MissingWeights) and str(d) in str(e.value)
    (d / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(MissingWeights, match="pytorch_model.bin"):
        CausalLM.load_hf(d)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        CausalLM.load_hf(tmp_path / "empty")
    make_hf_model(tmp_path / "sh", "qwen2")
    shard = sorted((tmp_path / "sh").glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(MissingWeights, match=f"lists shards that are not there: \\['{shard.name}'\\]"):
        CausalLM.load_hf(tmp_path / "sh")


def test_weights_that_do_not_fit_the_config(tmp_path):
    from safetensors.torch import load_file, save_file

    make_hf_model(tmp_path / "ck", "llama", shard_bytes=None)
    f = tmp_path / "ck" / "model.safetensors"
    sd = load_file(str(f))
    k = "model.layers.0.self_attn.k_proj.weight"
    save_file({**sd, k: torch.zeros(sd[k].shape[0] + 8, sd[k].shape[1])}, str(f))
    with pytest.raises(WeightsMismatch, match=r"1 of another shape \(model.layers.0.self_attn.k_proj.weight: \(24, 32\) in the "
                                              r"weights, \(16, 32\) in the model\)") as e:
        CausalLM.load_hf(tmp_path / "ck")
    assert str(tmp_path / "ck") in str(e.value)
    save_file({n: t for n, t in sd.items() if n != k}, str(f))
    with pytest.raises(WeightsMismatch, match=f"1 missing \\['{k}'\\]"):
        CausalLM.load_hf(tmp_path / "ck")
    # llama weights under a config that says attention_bias: the biases are missing, by name
    conf = json.loads((tmp_path / "ck" / "config.json").read_text())
    (tmp_path / "ck" / "config.json").write_text(json.dumps({**conf, "attention_bias": True}))
    save_file(sd, str(f))
    with pytest.raises(WeightsMismatch, match=r"missing .*bias"):
        CausalLM.load_hf(tmp_path / "ck")


# config.json of two published checkpoints (Qwen/Qwen2.5-0.5B-Instruct, meta-llama/Llama-3.2-1B-Instruct), verbatim
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
    "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.43.1",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
LLAMA32_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256}


# and of Qwen/Qwen3-4B and mistralai/Mistral-7B-Instruct-v0.3 (head_dim 128: their own, or hidden_size / heads)
QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560, "initializer_range": 0.02,
    "intermediate_size": 9728, "max_position_embeddings": 262144, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 5000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}
MISTRAL_7B_V03 = {
    "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.42.0.dev0", "use_cache": True,
    "vocab_size": 32768}


# the long-context settings Qwen2.5's and Qwen3's model cards tell users to add to config.json, verbatim
QWEN25_YARN = {**QWEN25_05B, "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}}
QWEN3_YARN = {**QWEN3_4B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}


@pytest.mark.parametrize("conf,head_dim,tied", [(QWEN25_05B, 64, True), (LLAMA32_1B, 64, True),
                                                 (QWEN3_4B, 128, True), (MISTRAL_7B_V03, 128, False),
                                                 (QWEN25_YARN, 64, True), (QWEN3_YARN, 128, True)],
                         ids=["qwen2.5-0.5b", "llama3.2-1b", "qwen3-4b", "mistral-7b-v0.3", "qwen2.5-yarn",
                              "qwen3-yarn"])
def test_published_configs_are_accepted_with_transformers_rope(tmp_path, conf, head_dim, tied):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from core.model import rope_inv_freq

    c = DecoderConfig.from_hf(conf)
    assert (c.model_type, c.tie_word_embeddings, c.head_dim) == (conf["model_type"], tied, head_dim)
    eos = conf["eos_token_id"]
    assert c.eos_ids == (tuple(eos) if isinstance(eos, list) else (eos,))
    assert load_config(write_config(tmp_path, **conf), via_transformers=True) == c
    hc = transformers.AutoConfig.from_pretrained(tmp_path, local_files_only=True)
    kind = hc.rope_parameters["rope_type"]
    if kind == "default":
        ref = transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding.compute_default_rope_parameters(hc)[0]
    else:
        ref = ROPE_INIT_FUNCTIONS[kind](hc)[0]
    assert torch.equal(rope_inv_freq(c), ref)  # bit for bit
    from core.model import rope_attention_scaling

    want = ROPE_INIT_FUNCTIONS[kind](hc)[1] if kind != "default" else 1.0
    assert rope_attention_scaling(c) == want and (kind == "yarn") == (want != 1.0)  # YaRN's attention factor


def test_load_hf_builds_on_meta_and_keeps_ties_and_the_value_head(tmp_path):
    """load_hf builds the modules without memory and fills them from the checkpoint: tied embeddings stay one tensor
    (the checkpoint has no lm_head), a saved value head comes back, and without one the new head is a real one."""
    c = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    src = CausalLM(c, value_head=True).init_weights(3, std=0.1)
    src.save_hf(tmp_path / "vh")
    m = CausalLM.load_hf(tmp_path / "vh", value_head=True)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert not [k for k, t in m.state_dict().items() if t.is_meta]
    for k, v in src.state_dict().items():
        assert torch.equal(m.state_dict()[k], v), k
    (tmp_path / "vh" / "value_head.safetensors").unlink()
    fresh = CausalLM.load_hf(tmp_path / "vh", value_head=True)
    assert not fresh.score.weight.is_meta and torch.isfinite(fresh.score.weight).all()
    x = torch.tensor([[1, 5, 9, 2]])
    assert torch.equal(fresh(x)[0], src(x)[0])


def test_a_negative_pad_id_pads_with_eos_and_one_past_the_vocabulary_is_refused(tmp_path):
    """The original LLaMA conversions say pad_token_id -1: the engine and the learner took it as the padding id and
    the learner's first padded batch failed (IndexError in the embedding). It now pads with the first eos (else 0);
    a pad id past the vocabulary, which transformers cannot build, is refused by name before any loading."""
    from learner.batch import collate
    from learner.policy import TrainPolicy
    from core.schema import Trajectory, Turn

    assert DecoderConfig.from_hf(dict(BASE, pad_token_id=-1)).pad_token_id == 2  # TINY's eos
    assert DecoderConfig.from_hf(dict(BASE, pad_token_id=-1, eos_token_id=[5, 6])).pad_token_id == 5
    assert DecoderConfig.from_hf(dict(BASE, pad_token_id=-1, eos_token_id=None)).pad_token_id == 0
    with pytest.raises(UnsupportedModel, match="'pad_token_id' = 96 is outside the vocabulary"):
        DecoderConfig.from_hf(dict(BASE, pad_token_id=96))
    make_hf_model(tmp_path / "ck", "llama", pad_token_id=-1)
    pol = TrainPolicy.load(tmp_path / "ck")
    assert pol.config.pad_token_id == 2 and CausalLM.load_hf(tmp_path / "ck").config.pad_token_id == 2

    def traj(n):
        m = np.zeros(n, np.uint8)
        m[-2:] = 1
        return Trajectory(id=f"t{n}", env_id="x", outcome="terminated", tokens=np.arange(3, 3 + n, dtype=np.int32),
                          logprobs=np.zeros(n, np.float32), versions=np.zeros(n, np.int32), mask=m,
                          turns=[Turn("text:1", "o", {}, 1.0, n - 2, n)], ret=1.0)

    b = collate([traj(5), traj(9)], pol.config.pad_token_id)  # right-padded with the pad id
    lp = pol.logprobs_at(b.tokens, b.valid, b.mask)
    assert lp.shape == (4,) and torch.isfinite(lp).all()
    with pytest.raises(UnsupportedModel, match="pad_token_id"):
        write_config(tmp_path / "bad", **dict(BASE, pad_token_id=96))
        CausalLM.load_hf(tmp_path / "bad")


def test_a_tied_config_over_a_different_lm_head_loads_untied_as_transformers_does(tmp_path):
    """tie_word_embeddings: true, but the safetensors hold an lm_head unlike the embedding: transformers unties and
    uses the file's head. The engine and the learner compute the same logits, the learner publishes the head with
    an untied config, and the engine takes that publish as an update. A head equal to the embedding stays tied."""
    from safetensors.torch import save_file

    from learner.policy import TrainPolicy

    d = tmp_path / "ck"
    m = make_hf_model(d, "qwen2", shard_bytes=None, tie_word_embeddings=True)
    sd = {k: v.contiguous() for k, v in m.state_dict().items() if k != "lm_head.weight"}
    sd["lm_head.weight"] = torch.randn_like(sd["model.embed_tokens.weight"]) * 0.1
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    x = ids()
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    engine, pol = CausalLM.load_hf(d), TrainPolicy.load(d)
    with torch.no_grad():
        want = ref(x).logits
        assert max_diff(engine(x)[0], want) < TOL and max_diff(pol(x), want) < TOL
    assert not engine.config.tie_word_embeddings and engine.lm_head.weight is not engine.model.embed_tokens.weight
    pub = pol.hf_state_dict()
    assert torch.equal(pub["lm_head.weight"], sd["lm_head.weight"])
    engine.load_weights(pub)                                    # the learner's publish fits the engine's model
    pol.save_hf(tmp_path / "pub")
    assert json.loads((tmp_path / "pub" / "config.json").read_text())["tie_word_embeddings"] is False
    with torch.no_grad():
        again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "pub"), dtype=torch.float32).eval()
        assert max_diff(again(x).logits, want) < TOL
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()  # exported with both, equal: tied
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    engine, pol = CausalLM.load_hf(d), TrainPolicy.load(d)
    assert engine.lm_head.weight is engine.model.embed_tokens.weight and "lm_head.weight" not in pol.hf_state_dict()


def test_tool_metadata_in_a_config_is_not_a_refusal():
    c = DecoderConfig.from_hf(dict(BASE, _attn_implementation_autoset=True, unsloth_version="2024.12.4",
                                   unsloth_fixed=True))
    assert c.hidden_size == BASE["hidden_size"]
    with pytest.raises(UnsupportedModel, match="not one the decoder knows"):
        DecoderConfig.from_hf(dict(BASE, attn_logit_softcapping=30.0))
