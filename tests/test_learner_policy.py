"""learner.policy.TrainPolicy (transformers' model class, what the learner trains) against core.model.CausalLM (what the
engine runs) on the same weights, and the HF layout it writes: transformers and the engine load it back."""
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.model import CausalLM, DecoderConfig
from learner.checkpoint import critic_state
from learner.policy import TrainPolicy

V = 97
TOL = 1e-4


def config(tie: bool = True, kv_heads: int = 8, **kw) -> DecoderConfig:
    return DecoderConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=kv_heads, rope_theta=100.0, tie_word_embeddings=tie, **kw)


def padded_batch(seed: int = 0, lengths=(40, 23, 7)):
    """Right padding (as learner.batch.collate pads), rows of different lengths, a trained-token mask inside each row."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    ids = torch.randint(1, V, (B, T), generator=g)
    valid = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    ids[~valid] = 0
    mask = (torch.rand(B, T, generator=g) < 0.5).float() * valid
    mask[:, 0] = 0
    return ids, valid, mask


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max())


@pytest.mark.parametrize("tie,kv_heads", [(True, 8), (False, 8), (False, 2)])
def test_logprobs_and_weights_match_the_engine_decoder(tmp_path, tie, kv_heads):
    """A checkpoint written by core.model, loaded by TrainPolicy.load: the same HF state dict, and the same logprobs,
    entropies and critic values over a padded batch of two lengths (fp32, <= 1e-4)."""
    dc = config(tie, kv_heads)
    ref = CausalLM(dc, value_head=True).init_weights(0, std=0.1)
    ref.save_hf(tmp_path / "m")
    pol = TrainPolicy.load(tmp_path / "m", value_head=True)
    assert pol.config.rope_theta == 100.0 and pol.config.tie_word_embeddings == tie
    a, b = ref.hf_state_dict(), pol.hf_state_dict()
    assert list(a) == list(b)  # names and order: model.embed_tokens.weight, model.layers.0.self_attn.q_proj.weight, ...
    assert ("lm_head.weight" in b) == (not tie) and not any(k.startswith("score") for k in b)
    assert max(maxdiff(a[k], b[k]) for k in a) == 0.0
    ids, valid, mask = padded_batch()
    with torch.no_grad():
        lp_ref, ent_ref = ref.logprobs_at(ids, valid, mask, with_entropy=True)
        lp, ent = pol.logprobs_at(ids, valid, mask, with_entropy=True)
        v_ref, v = ref.values_at(ids, valid, mask), pol.values_at(ids, valid, mask)
        full_ref, full = ref.token_logprobs(ids, valid), pol.token_logprobs(ids, valid)
    assert lp.shape == lp_ref.shape == (int(mask[:, 1:].sum()),)
    assert maxdiff(lp, lp_ref) <= TOL and maxdiff(ent, ent_ref) <= TOL and maxdiff(v, v_ref) <= TOL
    assert maxdiff(full[valid], full_ref[valid]) <= TOL
    assert float(v.abs().max()) > 0  # the value head was loaded, not left at zero
    # a row's logprobs do not depend on the padding of the batch it is in
    with torch.no_grad():
        alone = pol.logprobs_at(ids[2:, :7], valid[2:, :7], mask[2:, :7])
    assert maxdiff(alone, lp[-len(alone):]) <= TOL


def test_a_fresh_model_starts_from_the_engine_decoders_initial_weights():
    for dc in (config(True), config(False, 2)):
        for seed, std in ((0, 0.02), (3, 0.3)):
            a = CausalLM(dc, value_head=True).init_weights(seed, std)
            b = TrainPolicy.from_config(dc, value_head=True, seed=seed, std=std)
            sa, sb = a.state_dict(), {k.removeprefix("lm."): v for k, v in b.state_dict().items()}
            assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert TrainPolicy.from_config(config()).config == config()


def test_save_hf_loads_in_transformers_and_in_the_engine(tmp_path):
    transformers = pytest.importorskip("transformers")
    dc = config(tie=False)
    pol = TrainPolicy.from_config(dc, value_head=True, seed=1, std=0.1)
    torch.nn.init.normal_(pol.score.weight)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    (tmp_path / "tok" / "chat_template.jinja").write_text("{{ messages }}")
    out = pol.save_hf(tmp_path / "out", extra_files={"note.txt": "hi"}, tokenizer_from=tmp_path / "tok")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "value_head.safetensors", "tokenizer.json", "chat_template.jinja",
            "note.txt"} <= names
    assert not list(tmp_path.glob("out.tmp*"))  # written to a temporary directory, then renamed
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["rope_theta"] == 100.0  # the engine's reader needs the top-level key
    sd = load_file(str(out / "model.safetensors"))
    assert sd.keys() == pol.hf_state_dict().keys() and {t.dtype for t in sd.values()} == {torch.float32}
    ids, valid, mask = padded_batch(1, (30, 12))
    with torch.no_grad():
        ours = pol(ids, valid)
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        theirs = hf(input_ids=ids, attention_mask=valid.long()).logits
        engine = CausalLM.load_hf(out, value_head=True)
        eng_logits, _ = engine(ids, key_valid=valid)
    assert maxdiff(ours[valid], theirs[valid]) <= TOL and maxdiff(ours[valid], eng_logits[valid]) <= TOL
    assert engine.config.rope_theta == 100.0
    assert all(torch.equal(engine.hf_state_dict()[k], v) for k, v in pol.hf_state_dict().items())
    assert torch.equal(engine.score.weight, pol.score.weight)
    back = TrainPolicy.load(out, value_head=True)
    assert all(torch.equal(back.hf_state_dict()[k], v) for k, v in pol.hf_state_dict().items())
    assert torch.equal(back.score.weight, pol.score.weight)
    # written again over the same path: replaced whole
    pol.save_hf(out)
    assert not (out / "note.txt").exists()


def test_the_vision_module_is_kept(tmp_path):
    dc = config(extra={"tars_vision": {"grid": 2, "patch": 4, "image_token_id": 5}})
    ref = CausalLM(dc).init_weights(0, std=0.1)
    ref.save_hf(tmp_path / "m")
    pol = TrainPolicy.load(tmp_path / "m")
    assert pol.vision is not None and pol.config.extra == dc.extra
    sd = pol.hf_state_dict()
    assert {"vision.proj.weight", "vision.proj.bias"} <= set(sd)
    assert all(torch.equal(ref.hf_state_dict()[k], v) for k, v in sd.items()) and sd.keys() == ref.hf_state_dict().keys()
    pol.save_hf(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tars_vision"] == dc.extra["tars_vision"]
    engine = CausalLM.load_hf(tmp_path / "out")
    assert torch.equal(engine.vision.proj.weight, pol.vision.proj.weight)
    # images at placeholder positions: the same hidden states as the engine's decoder
    ids = torch.randint(1, V, (1, 9))
    images = (torch.tensor([0, 0]), torch.tensor([2, 3]), torch.rand(2, 48))
    with torch.no_grad():
        h_ref, _ = ref.hidden(ids, images=images)
        h = pol.hidden(ids, images=images)
    assert maxdiff(h, h_ref) <= TOL and maxdiff(h, pol.hidden(ids)) > 1e-3
    # segments (a windowed text row) with patch images: refused with a clear error, not computed wrongly
    from learner.batch import text_segments

    with pytest.raises(ValueError, match="segmented rows with tars_vision"):
        pol.hidden(ids, images=images, vl=[text_segments([5])])


def test_critic_starts_from_the_policy_trunk_with_a_zero_value_head():
    pol = TrainPolicy.from_config(config(), seed=0)
    critic = TrainPolicy.critic_from(pol)
    assert all(torch.equal(critic.hf_state_dict()[k], v) for k, v in pol.hf_state_dict().items())
    assert not critic.score.weight.any() and not critic.score.bias.any()
    assert critic.lm is not pol.lm and pol.score is None
    ids, valid, mask = padded_batch()
    assert float(critic.values_at(ids, valid, mask).abs().max()) == 0
    # a critic saved by the learner before it trained transformers' model class (core.model names) still loads
    old = CausalLM(config(), value_head=True).init_weights(2)
    critic.load_state_dict(critic_state(old.state_dict()))
    assert torch.equal(critic.lm.model.layers[0].mlp.up_proj.weight, old.model.layers[0].mlp.up_proj.weight)


def test_every_embedding_row_trains_the_padding_ids_too():
    """As the learner always did: the pad id is a real token in many vocabularies (Qwen pads with <|endoftext|>)."""
    pol = TrainPolicy.from_config(config(), seed=0)
    ids = torch.tensor([[3, pol.config.pad_token_id, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1.0]])
    pol.logprobs_at(ids, torch.ones_like(ids, dtype=torch.bool), mask).sum().backward()
    assert float(pol.lm.get_input_embeddings().weight.grad[pol.config.pad_token_id].abs().sum()) > 0


def test_bad_checkpoints_are_clear_errors(tmp_path):
    TrainPolicy.from_config(config(), seed=0).save_hf(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        TrainPolicy.load(tmp_path / "m")
    # a weight missing from the file is an error (transformers alone would initialise it at random and log a line)
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(tmp_path / "m" / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if k != "model.norm.weight"}, str(tmp_path / "m" / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        TrainPolicy.load(tmp_path / "m")
    pol = TrainPolicy.from_config(config(), seed=0)
    sd = pol.hf_state_dict()
    with pytest.raises(ValueError, match="missing .*model.norm.weight"):
        pol.load_weights({k: v for k, v in sd.items() if k != "model.norm.weight"})
    with pytest.raises(ValueError, match="unexpected .*extra"):
        pol.load_weights({**sd, "extra": torch.zeros(1)})


def test_right_padded_batches_skip_the_padding_mask_and_keep_every_valid_state():
    """A right-padded batch runs without the explicit padding mask (causal attention already keeps valid positions
    from the padding after them; SDPA then takes its causal kernel): the valid positions' hidden states and their
    gradients equal those of the masked forward. A batch that is not right-padded keeps its mask."""
    from learner.batch import right_padded

    torch.manual_seed(0)
    pol = TrainPolicy.from_config(config(), seed=0)
    ids, valid, _ = padded_batch(1, lengths=(40, 23, 7))
    assert right_padded(valid) and not right_padded(torch.tensor([[False, True, True]]))
    base = pol.lm.base_model

    def states(fn):
        pol.zero_grad()
        h = fn()
        h[valid].pow(2).mean().backward()
        return h[valid].detach(), [p.grad.clone() for p in pol.parameters() if p.grad is not None]

    h_fast, g_fast = states(lambda: pol.hidden(ids, valid))
    h_mask, g_mask = states(lambda: base(input_ids=ids, attention_mask=valid, use_cache=False).last_hidden_state)
    assert maxdiff(h_fast, h_mask) < 1e-5
    assert len(g_fast) == len(g_mask) and max(maxdiff(a, b) for a, b in zip(g_fast, g_mask)) < 1e-5
    holey = valid.clone()
    holey[0, 3] = False                          # a hole in a row: not right-padded, so the mask is applied
    h_holey = pol.hidden(ids, holey)
    h_ref = base(input_ids=ids, attention_mask=holey, use_cache=False).last_hidden_state
    assert maxdiff(h_holey[holey], h_ref[holey]) < 1e-5
    assert maxdiff(h_holey[holey], pol.hidden(ids, valid)[holey]) > 1e-4   # the hole changed what others attend to


@pytest.mark.parametrize("kind", ["llama3", "linear", "yarn", "mrope"])
def test_published_configs_carry_the_rope_in_both_transformers_spellings(tmp_path, kind):
    """transformers 5 writes a scaled or multimodal RoPE only as `rope_parameters`; transformers 4 (what SGLang and
    vLLM load a relaunched or exported checkpoint with) reads only `rope_scaling` and `rope_theta`, and without them
    builds plain RoPE: another model. save_hf writes both; transformers 5 and the engine read the result back as the
    source, and the transformers-4 fields equal the source's RoPE."""
    import transformers
    from hf_dirs import make_hf_model, make_vl_checkpoint

    src = tmp_path / "src"
    if kind == "mrope":
        make_vl_checkpoint(src)
    else:
        rope = {"llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}, "linear": {"rope_type": "linear", "factor": 2.0},
                "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}[kind]
        make_hf_model(src, "llama", rope_scaling=rope, rope_theta=50000.0)
    TrainPolicy.load(src).save_hf(tmp_path / "out")
    d = json.loads((tmp_path / "out" / "config.json").read_text())
    level = d.get("text_config", d) if kind == "mrope" else d
    rp = level["rope_parameters"]
    assert level["rope_theta"] == rp["rope_theta"] and level["rope_scaling"] == {k: v for k, v in rp.items() if k != "rope_theta"}
    if kind == "mrope":
        assert level["rope_scaling"]["mrope_section"] == [2, 1, 1]
    else:
        assert level["rope_scaling"]["rope_type"] == kind and level["rope_theta"] == 50000.0

    def rope_of(path):
        c = transformers.AutoConfig.from_pretrained(str(path))
        return getattr(c, "text_config", c).rope_parameters
    assert rope_of(tmp_path / "out") == rope_of(src)
    if kind != "mrope":
        assert DecoderConfig.from_hf(d).rope_scaling == DecoderConfig.from_hf(json.loads((src / "config.json").read_text())).rope_scaling


def test_an_export_keeps_the_tokenizers_named_chat_templates(tmp_path):
    """A tokenizer with named chat templates ({"default": ..., "tool_use": ...}) keeps the ones beside the default in
    additional_chat_templates/NAME.jinja (transformers' layout). The export copied only the top-level files: final/
    and weights/vN loaded in transformers with the default template alone, and chat_template="tool_use" failed."""
    transformers = pytest.importorskip("transformers")
    from core.bpe import rendered_corpus, train_bpe

    conv = [{"role": "user", "content": "click Save"}, {"role": "assistant", "content": "click(target='Save')"}]
    src = tmp_path / "src"
    tok = train_bpe(rendered_corpus([conv] * 20, "chatml"), 300, "chatml")
    tok.chat_template = {"default": tok.chat_template,
                         "tool_use": "{% for m in messages %}TOOL {{ m['content'] }}\n{% endfor %}"}
    tok.save_pretrained(str(src))
    assert (src / "additional_chat_templates" / "tool_use.jinja").is_file()
    pol = TrainPolicy.from_config(dataclasses.replace(config(), vocab_size=len(tok)), seed=1)
    out = pol.save_hf(tmp_path / "out", tokenizer_from=src)
    assert (out / "additional_chat_templates" / "tool_use.jinja").read_text() == \
        (src / "additional_chat_templates" / "tool_use.jinja").read_text()
    back = transformers.AutoTokenizer.from_pretrained(str(out))
    assert back.chat_template == tok.chat_template
    assert back.apply_chat_template(conv, chat_template="tool_use", tokenize=False) == \
        "TOOL click Save\nTOOL click(target='Save')\n"


def test_an_export_keeps_the_processors_files_video_included(tmp_path):
    """A vision-language checkpoint's processor comes as preprocessor_config.json (images), processor_config.json and,
    in transformers' newer layout, video_preprocessor_config.json (Qwen2.5-VL's and Qwen3-VL's video settings). The
    export (final/, weights/vN, tars sft / merge) left the video one out: a checkpoint exported by a run lost its
    video settings, which transformers then filled with defaults."""
    src = tmp_path / "src"
    pol = TrainPolicy.from_config(config(), seed=1)
    pol.save_hf(src)
    files = {"preprocessor_config.json": {"image_processor_type": "Qwen2VLImageProcessor", "max_pixels": 12845056},
             "processor_config.json": {"processor_class": "Qwen2_5_VLProcessor"},
             "video_preprocessor_config.json": {"video_processor_type": "Qwen2VLVideoProcessor", "fps": 2.0,
                                                "max_frames": 768, "temporal_patch_size": 2}}
    for name, body in files.items():
        (src / name).write_text(json.dumps(body))
    out = pol.save_hf(tmp_path / "out", tokenizer_from=src)
    for name, body in files.items():
        assert json.loads((out / name).read_text()) == body
