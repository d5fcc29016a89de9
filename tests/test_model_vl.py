"""Qwen2.5-VL / Qwen2-VL checkpoints on the plain-torch decoder and the local engine, held to transformers.

Tiny random checkpoints (tests/hf_dirs.make_vl_checkpoint, small max_pixels): full-sequence logits with two images
of different sizes equal transformers' within 1e-4 (fp32); the engine's greedy tokens with images are transformers'
step-by-step argmax; the prefix cache reuses KV across a turn with the same images and never across an image that
differs; the binding rule's errors are ValueErrors; `tars serve --model VLDIR` serves a Generate RPC with images.
"""
from __future__ import annotations

import asyncio
import json
import pathlib

import pytest
import torch

from core.chat import ChatTokenizer
from core.config import InferenceConfig
from core.model import CausalLM, DecoderConfig, load_config
from core.vlm import VLSpec, rope_positions
from inference_server.engine import LocalEngine, SamplingParams
from tests.hf_dirs import make_vl_checkpoint
from tests.served import served
from tars.bench.episodes import screenshot

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


_png = screenshot  # random pixels, one image per seed (tars/bench/episodes.py)


A, B, C, A2 = _png(160, 210, 1), _png(300, 120, 2), _png(90, 140, 3), _png(160, 210, 4)  # A2: A's size, other pixels


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def vl(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param) / "ckpt"
    ref = make_vl_checkpoint(d, arch=request.param, max_pixels=64 * 28 * 28, min_pixels=4 * 28 * 28)
    return d, ref, VLSpec.load(d), ChatTokenizer.load(d)


def _prompt(spec, tok, sizes, text="click the button") -> list[int]:
    content = []
    for i, (w, h) in enumerate(sizes):
        content += [f"screen {i}", spec.image_tokens(w, h)]
    return tok.first_prompt("you are an agent", [*content, text])


def _size(png: bytes):
    from core.vlm import png_size

    return png_size(png)


def _ref_logits(ref, spec, ids, images):
    pv, thw = spec.pixels(images)
    x = torch.tensor([ids])
    with torch.no_grad():
        return ref(input_ids=x, pixel_values=pv, image_grid_thw=thw,
                   mm_token_type_ids=(x == spec.image_token_id).int()).logits[0]


def _ref_greedy(ref, spec, ids, images, n=8):
    """transformers' greedy continuation, one full forward per token: tokens and their logprobs."""
    seq, toks, lps = list(ids), [], []
    for _ in range(n):
        lp = torch.log_softmax(_ref_logits(ref, spec, seq, images)[-1].float(), -1)
        t = int(lp.argmax())
        toks.append(t)
        lps.append(float(lp[t]))
        seq.append(t)
    return toks, lps


def test_config_layouts_are_accepted(vl):
    d, ref, spec, tok = vl
    c = load_config(d)
    assert c.is_vl and c.mrope_section == [2, 1, 1] and c.qkv_bias and not c.o_bias
    assert c.extra["image_token_id"] == spec.image_token_id
    # the older flat layout (text fields at the top level, as UI-TARS-1.5 / Qwen2.5-VL-7B ship) reads the same
    raw = json.loads((d / "config.json").read_text())
    flat = {**{k: v for k, v in raw.items() if k != "text_config"},
            **{k: v for k, v in raw["text_config"].items() if k not in ("model_type", "rope_parameters")},
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]}, "rope_theta": 1000000.0}
    f = DecoderConfig.from_hf(flat)
    assert (f.hidden_size, f.num_hidden_layers, f.mrope_section, f.rope_theta, f.rms_norm_eps) == (
        c.hidden_size, c.num_hidden_layers, c.mrope_section, c.rope_theta, c.rms_norm_eps)
    assert DecoderConfig.from_hf(c.to_hf()) == c
    from core.model import UnsupportedModel

    with pytest.raises(UnsupportedModel, match="mrope_section"):
        DecoderConfig.from_hf({**flat, "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 2]}})


def test_full_sequence_logits_equal_transformers(vl):
    d, ref, spec, tok = vl
    ids = _prompt(spec, tok, [_size(A), _size(B)])
    m = CausalLM.load_hf(d).eval()
    pv, thw = spec.pixels([A, B])
    want = _ref_logits(ref, spec, ids, [A, B])
    with torch.no_grad():
        got, _ = m(torch.tensor([ids]), pixel_values=pv, image_grid_thw=thw)
        flat_pos, _ = m(torch.tensor([ids]), positions=torch.arange(len(ids))[None], pixel_values=pv,
                        image_grid_thw=thw)
    diff = (got[0] - want).abs().max().item()
    print(f"{spec.model_type}: max abs logit diff {diff:.3g} over {len(ids)} tokens")
    assert diff < 1e-4
    assert (flat_pos[0] - want).abs().max().item() > 1e-3   # the 3-D positions matter
    # the positions are transformers' get_rope_index
    x = torch.tensor([ids])
    hp, hd = ref.model.get_rope_index(x, mm_token_type_ids=(x == spec.image_token_id).int(), image_grid_thw=thw)
    p, delta = rope_positions(ids, thw, spec)
    assert torch.equal(p, hp[:, 0]) and delta == int(hd)


def test_flat_config_and_transformers_5_weight_names_load_the_same_model(vl, tmp_path):
    """The flat config layout in a real directory (through transformers' AutoConfig too), and a state dict under
    transformers 5's module names (model.language_model.*, model.visual.*), give the same logits."""
    import shutil

    d, ref, spec, tok = vl
    flat_dir = tmp_path / "flat"
    shutil.copytree(d, flat_dir)
    raw = json.loads((d / "config.json").read_text())
    text = {k: v for k, v in raw.pop("text_config").items() if k not in ("model_type", "rope_parameters")}
    (flat_dir / "config.json").write_text(json.dumps({**raw, **text, "rope_theta": 1000000.0,
                                                      "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]}}))
    ids = _prompt(spec, tok, [_size(B), _size(A)])
    pv, thw = spec.pixels([B, A])
    want = _ref_logits(ref, spec, ids, [B, A])
    m = CausalLM.load_hf(flat_dir).eval()
    renamed = {("model.language_model." + k[6:] if k.startswith("model.") else "model." + k if k.startswith("visual.")
                else k): v for k, v in m.hf_state_dict().items()}
    assert any(k.startswith("model.visual.") for k in renamed)
    m2 = CausalLM(m.config).eval()
    m2.load_weights(renamed)
    with torch.no_grad():
        for model in (m, m2):
            got, _ = model(torch.tensor([ids]), pixel_values=pv, image_grid_thw=thw)
            assert (got[0] - want).abs().max().item() < 1e-4


def test_engine_greedy_with_images_equals_transformers(vl):
    d, ref, spec, tok = vl
    ids = _prompt(spec, tok, [_size(A), _size(B)])
    want, want_lp = _ref_greedy(ref, spec, ids, [A, B])
    e = LocalEngine(InferenceConfig(max_context=1024, cache_capacity=0), str(d))
    try:
        out = e.submit(ids, GREEDY, images=[A, B]).result(60)
        other = e.submit(ids, GREEDY, images=[A2, B]).result(60)
        # a weight update after the 3rd token re-prefills prompt + generated tokens (staleness budget 0): the
        # generated tokens' positions are sequence index + the request's rope delta, as in decode
        sd = e.model.hf_state_dict()
        fired = []

        def on_token(t, lp, v):
            if len(fired) == 2:
                e.update_weights(1, state_dict=sd, wait=False)
            fired.append(t)

        redo = e.submit(ids, GREEDY, max_stale_versions=0, on_token=on_token, images=[A, B]).result(60)
    finally:
        e.close()
    worst = max(abs(a - b) for a, b in zip(out.logprobs, want_lp))
    print(f"{spec.model_type}: engine greedy logprobs vs transformers: max abs diff {worst:.3g}")
    assert out.output_ids == want and worst < 1e-4
    assert other.logprobs != pytest.approx(out.logprobs, abs=1e-5)  # the pixels reach the model
    assert redo.recomputed_tokens > len(ids) and redo.output_ids == want
    assert redo.logprobs == pytest.approx(want_lp, abs=1e-4)


def test_prefix_cache_reuses_a_turn_and_never_crosses_another_image(vl):
    d, ref, spec, tok = vl
    first = _prompt(spec, tok, [_size(A), _size(B)])
    e = LocalEngine(InferenceConfig(max_context=1024, cache_block_tokens=8), str(d))
    fresh = LocalEngine(InferenceConfig(max_context=1024, cache_capacity=0), str(d))
    try:
        o1 = e.submit(first, GREEDY, "t", images=[A, B]).result(60)
        turn2 = first + o1.output_ids + tok.encode(" next screen ") + spec.image_ids(*_size(C)) + tok.encode(" go")
        o2 = e.submit(turn2, GREEDY, "t", images=[A, B, C]).result(60)
        w2 = fresh.submit(turn2, GREEDY, images=[A, B, C]).result(60)
        assert o2.cached_tokens >= len(first)
        assert o2.output_ids == w2.output_ids and o2.logprobs == pytest.approx(w2.logprobs, abs=1e-4)
        # the same tokens with another first image: the hit stops at that image's run
        runs = [i for i, t in enumerate(turn2) if t == spec.image_token_id]
        o3 = e.submit(turn2, GREEDY, "t", images=[A2, B, C]).result(60)
        w3 = fresh.submit(turn2, GREEDY, images=[A2, B, C]).result(60)
        assert o3.cached_tokens == runs[0]
        assert o3.output_ids == w3.output_ids and o3.logprobs == pytest.approx(w3.logprobs, abs=1e-4)
        assert w3.logprobs != pytest.approx(w2.logprobs, abs=1e-5)
        # and a hit that ends inside a run with the same image places that run's remaining pads
        e.close()
        e = LocalEngine(InferenceConfig(max_context=1024, cache_block_tokens=8), str(d))
        o4 = e.submit(first, GREEDY, "u", images=[A, B]).result(60)
        entry = e._sched.cache.get("u")
        cut = runs[0] + 5
        del entry.ids[cut:]  # as a block eviction leaves it: the KV of the first `cut` tokens only
        o5 = e.submit(turn2[:len(first)] + o4.output_ids, GREEDY, "u", images=[A, B]).result(60)
        w5 = fresh.submit(turn2[:len(first)] + o4.output_ids, GREEDY, images=[A, B]).result(60)
        assert o5.cached_tokens == cut
        assert o5.output_ids == w5.output_ids and o5.logprobs == pytest.approx(w5.logprobs, abs=1e-4)
    finally:
        e.close()
        fresh.close()


def test_binding_errors_are_value_errors(vl):
    d, ref, spec, tok = vl
    ids = _prompt(spec, tok, [_size(A), _size(B)])
    e = LocalEngine(InferenceConfig(max_context=1024, cache_capacity=0), str(d), start=False)
    try:
        with pytest.raises(ValueError, match="2 image runs"):
            e.submit(ids, GREEDY, images=[A])
        with pytest.raises(ValueError, match="2 image runs"):
            e.submit(ids, GREEDY)
        with pytest.raises(ValueError, match="takes"):
            e.submit(ids, GREEDY, images=[A, C])                    # C's size takes another pad count
        with pytest.raises(ValueError, match="not framed"):
            e.submit([spec.image_token_id] * spec.image_tokens(*_size(A)), GREEDY, images=[A])
        with pytest.raises(ValueError, match="readable"):
            e.submit(ids, GREEDY, images=[A, b"not a png"])
        e.submit(tok.first_prompt("sys", ["text only"]), GREEDY)     # no runs, no images: fine
    finally:
        e.close()
    m = CausalLM.load_hf(d)
    e = LocalEngine(InferenceConfig(max_context=1024, cache_capacity=0), m, start=False)  # in memory, no dir
    try:
        with pytest.raises(ValueError, match="vl=DIR"):
            e.submit(ids, GREEDY, images=[A, B])
    finally:
        e.close()
    e = LocalEngine(InferenceConfig(max_context=1024, cache_capacity=0), m, vl=d, start=False)
    e.submit(ids, GREEDY, images=[A, B])
    e.close()


def test_tars_serve_a_vl_checkpoint(vl, tmp_path):
    d, ref, spec, tok = vl
    ids = _prompt(spec, tok, [_size(A), _size(B)])
    want, want_lp = _ref_greedy(ref, spec, ids, [A, B], n=4)
    with served(tmp_path, "--model", str(d), "--set", "inference.port=0", "--set", "inference.host=127.0.0.1",
                ready_s=120) as addr:

        async def main():
            from core.v1 import common_pb2
            from core.inference_client import InferenceClient

            c = InferenceClient([addr], timeout_s=60)
            try:
                return await c.generate("t", ids, 4, temperature=0.0,
                                        images=[common_pb2.Image(data=A), common_pb2.Image(data=B)])
            finally:
                await c.close()

        r = asyncio.run(main())
    assert list(r.output_ids) == want
    assert max(abs(a - b) for a, b in zip(r.logprobs, want_lp)) < 1e-4


# ---- loading: modules built on the meta device, every tensor from the checkpoint ----------------------------------
@pytest.mark.parametrize("name", ["visual.blocks.0.mlp.down_proj.weight", "visual.merger.mlp.0.bias",
                                  "model.layers.1.self_attn.q_proj.bias", "lm_head.weight"])
def test_a_checkpoint_without_one_tensor_is_refused_naming_it(vl, tmp_path, name):
    """A tensor removed from model.safetensors is a WeightsMismatch naming it (and the directory), never a model
    with that tensor left uninitialised (the modules are built without memory before the weights load)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from core.model import WeightsMismatch

    d = tmp_path / "ck"
    shutil.copytree(vl[0], d)
    sd = load_file(str(d / "model.safetensors"))
    if name.startswith("visual.") and vl[2].model_type == "qwen2_vl":
        name = name.replace("down_proj", "fc2")   # Qwen2-VL's vision MLP is fc1 / fc2
    assert name in sd, sorted(sd)[:20]
    del sd[name]
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsMismatch, match=rf"{d}: weights do not match the config: 1 missing \['{name}'\]"):
        CausalLM.load_hf(d)


def test_loading_draws_no_random_numbers_and_computes_the_vision_buffers(vl):
    """load_hf initialises nothing at random (no normal_/uniform_ on a tensor with memory: the modules are built on
    the meta device), leaves no tensor on meta, and computes the vision tower's rotary buffers as transformers does."""
    from torch.overrides import TorchFunctionMode

    class Draws(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.drawn = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            t = args[0] if args else (kwargs or {}).get("tensor")   # torch.nn.init's take it by keyword
            if name.endswith(("normal_", "uniform_")) and isinstance(t, torch.Tensor) and not t.is_meta:
                self.drawn += t.numel()
            return func(*args, **(kwargs or {}))

    d, ref, spec, _ = vl
    with Draws() as mode:
        m = CausalLM.load_hf(d)
    assert mode.drawn == 0
    assert not [k for k, t in [*m.named_parameters(), *m.named_buffers()] if t.is_meta]
    theirs = dict(ref.named_buffers())
    for k, b in m.visual.named_buffers():
        want = theirs.get(f"model.visual.{k}", theirs.get(f"visual.{k}"))
        assert want is not None and torch.equal(b, want), k
    want = {k.replace("model.language_model.", "model."): v for k, v in ref.named_parameters()}
    assert torch.equal(m.model.layers[0].mlp.up_proj.weight, want["model.layers.0.mlp.up_proj.weight"])


def test_yarn_with_mrope_equals_transformers(tmp_path):
    """Qwen2.5-VL's long-context setting (rope_scaling {"type": "yarn", "mrope_section", "factor",
    "original_max_position_embeddings"}): YaRN's frequencies and attention factor on M-RoPE, as transformers."""
    d = tmp_path / "ckpt"
    rope = {"type": "yarn", "mrope_section": [2, 1, 1], "factor": 4.0, "original_max_position_embeddings": 32}
    ref = make_vl_checkpoint(d, max_pixels=64 * 28 * 28, min_pixels=4 * 28 * 28, rope_scaling=rope)
    spec, tok = VLSpec.load(d), ChatTokenizer.load(d)
    ids = _prompt(spec, tok, [_size(A), _size(B)])
    m = CausalLM.load_hf(d).eval()
    assert m.config.rope_scaling["rope_type"] == "yarn" and m.config.mrope_section == [2, 1, 1] and m.rope_scale > 1
    pv, thw = spec.pixels([A, B])
    with torch.no_grad():
        got, _ = m(torch.tensor([ids]), pixel_values=pv, image_grid_thw=thw)
    assert (got[0] - _ref_logits(ref, spec, ids, [A, B])).abs().max().item() < 1e-4
