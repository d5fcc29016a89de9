"""The learner trains a Qwen2.5-VL / Qwen2-VL checkpoint with its screenshots: per-segment logprobs with each segment's
images equal transformers' own model called on that segment; gradients reach the vision tower (unless
model.freeze_vision); the weights keep the checkpoint's names; a saved directory reloads."""
from __future__ import annotations

import hashlib
import io
import json

import numpy as np
import pytest
import torch

from core.chat import ChatTokenizer
from core.config import LearnerConfig
from core.schema import Trajectory, Turn
from core.vlm import VLSpec
from learner.batch import collate
from learner.policy import TrainPolicy, read_weights
from learner.ppo import PPOTrainer
from tests.hf_dirs import make_vl_checkpoint
from tars.bench.episodes import screenshot

MAXP, MINP = 64 * 28 * 28, 4 * 28 * 28


_png = screenshot  # random pixels, one image per seed (tars/bench/episodes.py)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def vl_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    make_vl_checkpoint(d, arch=request.param, max_pixels=MAXP, min_pixels=MINP)
    return d


def _reference(d):
    import transformers

    return transformers.AutoModelForImageTextToText.from_pretrained(str(d), dtype=torch.float32,
                                                                    attn_implementation="sdpa").eval()


def vl_trajectory(d, tid="t0", sizes=((160, 210), (120, 90), (200, 140)), seed=0, ret=1.0) -> tuple[Trajectory, list]:
    """Two segments: [prompt + image 0, answer, turn + image 1, answer] then a fresh first prompt with image 2 and an
    answer. Returns the trajectory and its segments as (ids, pngs, mask) for the reference."""
    spec, tok = VLSpec.load(d), ChatTokenizer.load(d)
    pngs = [_png(w, h, seed + i) for i, (w, h) in enumerate(sizes)]
    n = [spec.image_tokens(w, h) for w, h in sizes]
    segs = []
    ids, mask = tok.first_prompt("sys", ["look", n[0]]), []
    mask = [0] * len(ids)
    a = tok.answer("click(start_box='(1,2)')")
    ids, mask = ids + a, mask + [1] * len(a)
    p = tok.next_turn(["now", n[1]])
    ids, mask = ids + p, mask + [0] * len(p)
    a = tok.answer("type(content='x')")
    ids, mask = ids + a, mask + [1] * len(a)
    segs.append((ids, pngs[:2], mask))
    ids = tok.first_prompt("sys", ["history: click, type", n[2]])
    mask = [0] * len(ids)
    a = tok.answer("finished()")
    segs.append((ids + a, pngs[2:], mask + [1] * len(a)))
    tokens = [t for s in segs for t in s[0]]
    m = [x for s in segs for x in s[2]]
    lp = np.where(np.array(m) > 0, -1.0, 0.0).astype(np.float32)
    shas = [hashlib.sha256(b).hexdigest() for b in pngs]
    tr = Trajectory(id=tid, env_id="e", outcome="terminated", tokens=np.array(tokens, np.int32), logprobs=lp,
                    versions=np.where(np.array(m) > 0, 0, -1).astype(np.int32), mask=np.array(m, np.uint8),
                    turns=[Turn("", "", {}, ret, 0, len(tokens))], ret=ret, success=ret > 0, group="g",
                    segments=[len(segs[0][0])], image_refs=shas, images=dict(zip(shas, pngs)))
    tr.validate()
    return tr, segs


def text_trajectory(d, tid="x0", ret=0.0) -> Trajectory:
    tok = ChatTokenizer.load(d)
    ids = tok.first_prompt("sys", "text only")
    a = tok.answer("wait()")
    m = [0] * len(ids) + [1] * len(a)
    return Trajectory(id=tid, env_id="e", outcome="terminated", tokens=np.array(ids + a, np.int32),
                      logprobs=np.where(np.array(m) > 0, -1.0, 0.0).astype(np.float32),
                      versions=np.where(np.array(m) > 0, 0, -1).astype(np.int32), mask=np.array(m, np.uint8),
                      turns=[Turn("", "", {}, ret, 0, len(m))], ret=ret, success=ret > 0, group="g")


def slow_logprobs(model, spec, segs) -> torch.Tensor:
    """transformers' model on each segment alone with its images; log_softmax; the masked tokens in token order."""
    out = []
    for ids, pngs, mask in segs:
        x = torch.tensor([ids])
        pv, thw = spec.pixels(pngs)
        with torch.no_grad():
            logits = model(input_ids=x, pixel_values=pv, image_grid_thw=thw,
                           mm_token_type_ids=(x == spec.image_token_id).int()).logits[0]
        lp = torch.log_softmax(logits[:-1].float(), -1).gather(-1, x[0, 1:, None])[:, 0]
        out.append(lp[torch.tensor(mask[1:]) > 0])
    return torch.cat(out)


def test_logprobs_bind_each_segments_images(vl_dir):
    """Two trajectories (2 segments + 3 images, and 2 segments + 3 other images) and a text one, in one batch:
    logprobs_at and entropy per segment with its images == the model called on each segment alone."""
    pol = TrainPolicy.load(vl_dir)
    ref, spec = _reference(vl_dir), pol.vl
    t0, s0 = vl_trajectory(vl_dir, "a")
    t1, s1 = vl_trajectory(vl_dir, "b", sizes=((90, 300), (56, 56), (300, 200)), seed=7)
    t2 = text_trajectory(vl_dir)
    b = collate([t0, t1, t2], pol.config.pad_token_id, pol.vl)
    assert b.images[2] is None and b.images[0].starts == [0, t0.segments[0]]
    with torch.no_grad():
        lp, ent = pol.logprobs_at(b.tokens, b.valid, b.mask, with_entropy=True, vl=b.vl(torch.arange(3)))
    x2 = torch.tensor([t2.tokens.tolist()])
    with torch.no_grad():
        l2 = torch.log_softmax(ref(input_ids=x2).logits[0, :-1], -1).gather(-1, x2[0, 1:, None])[:, 0]
    want = torch.cat([slow_logprobs(ref, spec, s0), slow_logprobs(ref, spec, s1), l2[torch.tensor(t2.mask[1:]) > 0]])
    assert lp.shape == want.shape and int(b.mask.sum()) == len(want)
    diff = float((lp - want).abs().max())
    print(f"max |logprobs_at - reference| = {diff:.2e}")
    assert diff < 1e-5
    assert torch.isfinite(ent).all() and (ent > 0).all()
    # the update's no-grad pass (pi_prox of the non-fused update) reads the same numbers, chunked by length
    from learner.batch import at, length_chunks

    trainer = PPOTrainer(pol, None, LearnerConfig(algo="grpo"), pol.config.pad_token_id)
    prox, _ = trainer._forward_old(b, length_chunks(b.widths, torch.arange(3), 64))
    assert float((at(prox, b.mask) - want).abs().max()) < 1e-5
    # The images matter: without them (the pads as plain tokens) the numbers differ.
    with torch.no_grad():
        blind = pol.logprobs_at(b.tokens, b.valid, b.mask)
    assert float((blind - want).abs().max()) > 1e-3
    # values_at reads the same layout (a critic on the same trunk)
    critic = TrainPolicy.critic_from(pol)
    torch.nn.init.normal_(critic.score.weight)
    with torch.no_grad():
        v = critic.values_at(b.tokens, b.valid, b.mask, vl=b.vl(torch.arange(3)))
        h = ref.model(input_ids=torch.tensor([s0[1][0]]), pixel_values=spec.pixels(s0[1][1])[0],
                      image_grid_thw=spec.pixels(s0[1][1])[1],
                      mm_token_type_ids=(torch.tensor([s0[1][0]]) == spec.image_token_id).int()).last_hidden_state[0]
    m1 = torch.tensor(s0[1][2][1:]) > 0
    v_ref = critic.score(h[:-1][m1])[:, 0]
    n0 = int(sum(s0[0][2][1:]))
    assert float((v[n0:n0 + len(v_ref)] - v_ref).detach().abs().max()) < 1e-5


def test_bad_image_binding_is_a_clear_error(vl_dir):
    pol = TrainPolicy.load(vl_dir)
    t, _ = vl_trajectory(vl_dir)
    t.image_refs = t.image_refs[:2]
    with pytest.raises(ValueError, match="3 framed image runs but 2 image_refs"):
        collate([t], 0, pol.vl)
    t, _ = vl_trajectory(vl_dir)
    t.images = {k: v for k, v in list(t.images.items())[:2]}
    with pytest.raises(ValueError, match="bytes are missing"):
        collate([t], 0, pol.vl)
    t, _ = vl_trajectory(vl_dir)
    t.images[t.image_refs[0]] = _png(400, 400, 0)  # another size: another pad count
    with pytest.raises(ValueError, match="pads, its image takes"):
        collate([t], 0, pol.vl)
    t, _ = vl_trajectory(vl_dir)
    with pytest.raises(ValueError, match="not a vision-language checkpoint"):
        collate([t], 0, None)


@pytest.mark.parametrize("freeze", [False, True])
def test_update_step_trains_the_vision_tower(vl_dir, freeze):
    """The learner's own update (PPOTrainer.step, GRPO, and PPO with a critic): a gradient on visual.* parameters,
    none (and not in the optimiser, the weights unchanged) with model.freeze_vision."""
    for algo in ("grpo", "ppo"):
        torch.manual_seed(0)
        pol = TrainPolicy.load(vl_dir)
        if freeze:
            pol.freeze_vision()
        critic = TrainPolicy.critic_from(pol) if algo == "ppo" else None
        if critic is not None:  # a zero value head passes no gradient to the trunk
            torch.nn.init.normal_(critic.score.weight)
        tr = PPOTrainer(pol, critic, LearnerConfig(algo=algo, lr=1e-2, warmup_steps=1), pol.config.pad_token_id)
        batch = [vl_trajectory(vl_dir, "a", ret=1.0)[0], vl_trajectory(vl_dir, "b", seed=3, ret=0.0)[0],
                 text_trajectory(vl_dir, ret=0.0)]
        vis = dict(pol.lm.model.visual.named_parameters())
        before = {k: p.detach().clone() for k, p in vis.items()}
        in_opt = {id(p) for g in tr.opt.param_groups for p in g["params"]}
        if critic is not None:  # value pretraining reads the critic per segment too
            assert np.isfinite(tr.value_pretrain_step(batch)["v_loss"])
            tr.critic_opt.zero_grad(set_to_none=True)
        m = tr.step(batch, 1)
        assert not m["policy_step_skipped"] and m["tokens"] == sum(int(t.mask.sum()) for t in batch)
        w = vis["patch_embed.proj.weight"]
        if freeze:
            assert all(p.grad is None and not p.requires_grad for p in vis.values())
            assert not any(id(p) in in_opt for p in vis.values())
            assert all(torch.equal(before[k], p) for k, p in vis.items())
            if critic is not None:
                assert all(p.grad is None for p in critic.lm.model.visual.parameters())
        else:
            assert w.grad is not None and float(w.grad.abs().sum()) > 0
            assert id(w) in in_opt and not torch.equal(before["patch_embed.proj.weight"], w)
            if critic is not None:
                cw = critic.lm.model.visual.patch_embed.proj.weight
                assert cw.grad is not None and float(cw.grad.abs().sum()) > 0


def test_checkpoint_names_and_round_trip(vl_dir, tmp_path):
    from safetensors import safe_open

    pol = TrainPolicy.load(vl_dir)
    on_disk = set()
    for f in vl_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            on_disk |= set(h.keys())
    sd = pol.hf_state_dict()
    assert set(sd) == on_disk
    assert any(k.startswith("visual.") for k in sd) and any(k.startswith("model.layers.") for k in sd)
    assert "lm_head.weight" in sd and not any(k.startswith("model.language_model") for k in sd)
    # load_weights takes the checkpoint's names (and refuses anything else)
    with torch.no_grad():
        for p in pol.lm.model.visual.parameters():
            p.add_(0.01)
    pol.load_weights(read_weights(vl_dir))
    assert all(torch.equal(v, read_weights(vl_dir)[k]) for k, v in pol.hf_state_dict().items())
    with pytest.raises(ValueError, match="missing"):
        pol.load_weights({k: v for k, v in sd.items() if not k.startswith("visual.")})
    # train a little so the saved weights differ from the source, then save and reload with transformers
    with torch.no_grad():
        for p in pol.parameters():
            p.add_(0.003 * torch.randn_like(p))
    out = pol.save_hf(tmp_path / "saved", tokenizer_from=vl_dir)
    assert (out / "preprocessor_config.json").is_file()
    saved = read_weights(out)
    assert set(saved) == on_disk
    assert json.loads((out / "config.json").read_text())["model_type"] == json.loads(
        (vl_dir / "config.json").read_text())["model_type"]
    back = _reference(out)
    t, segs = vl_trajectory(vl_dir)
    spec = pol.vl
    ids, pngs, _ = segs[0]
    x = torch.tensor([ids])
    pv, thw = spec.pixels(pngs)
    kw = dict(input_ids=x, pixel_values=pv, image_grid_thw=thw, mm_token_type_ids=(x == spec.image_token_id).int())
    with torch.no_grad():
        a = back(**kw).logits
        b = pol.lm(**kw).logits
    assert float((a - b).abs().max()) < 1e-5
    # and the learner reloads it
    again = TrainPolicy.load(out)
    assert all(torch.equal(v, pol.hf_state_dict()[k]) for k, v in again.hf_state_dict().items())


def test_text_checkpoint_path_unchanged(tmp_path):
    """A text checkpoint: collate has no images, vl=[None,...] is the text path, and the logprobs are transformers'
    causal LM's."""
    import transformers

    from tests.hf_dirs import make_checkpoint

    make_checkpoint(tmp_path)
    pol = TrainPolicy.load(tmp_path)
    assert pol.vl is None
    rng = np.random.default_rng(0)
    trs = []
    for i, n in enumerate((9, 14)):
        m = np.array([0] * 4 + [1] * (n - 4), np.uint8)
        trs.append(Trajectory(id=f"t{i}", env_id="e", outcome="terminated",
                              tokens=rng.integers(1, pol.config.vocab_size, n).astype(np.int32),
                              logprobs=np.zeros(n, np.float32), versions=np.zeros(n, np.int32), mask=m,
                              turns=[Turn("", "", {}, 0.0, 0, n)], ret=0.0, success=False))
    b = collate(trs, pol.config.pad_token_id)
    assert b.images is None and b.vl(torch.arange(2)) is None
    with torch.no_grad():
        lp = pol.logprobs_at(b.tokens, b.valid, b.mask)
        lp2 = pol.logprobs_at(b.tokens, b.valid, b.mask, vl=[None, None])
    assert torch.equal(lp, lp2)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    want = []
    for t in trs:
        x = torch.tensor([t.tokens.tolist()], dtype=torch.long)
        with torch.no_grad():
            lps = torch.log_softmax(ref(input_ids=x).logits[0, :-1], -1).gather(-1, x[0, 1:, None])[:, 0]
        want.append(lps[torch.tensor(t.mask[1:]) > 0])
    assert float((lp - torch.cat(want)).abs().max()) < 1e-5


def test_sft_binds_images_and_text_demos_work(vl_dir, tmp_path):
    """tars sft on a VL checkpoint: stored VL trajectories train with their images (the loss is the slow reference's,
    the vision tower moves), text-only demonstrations train too, and the output reloads with its processor config."""
    from core.config import RunConfig
    from learner.data import sft_examples, write_trajectories
    from learner.sft import bind_images, run, sft_backward

    pol = TrainPolicy.load(vl_dir)
    (t0, s0), (t1, s1) = vl_trajectory(vl_dir, "a"), vl_trajectory(vl_dir, "b", seed=5)
    ex = bind_images(pol, sft_examples([t0, t1]))
    loss = sft_backward(pol, ex, pol.config.pad_token_id, 4096, torch.device("cpu"))
    ref = _reference(vl_dir)
    want = -torch.cat([slow_logprobs(ref, pol.vl, s0), slow_logprobs(ref, pol.vl, s1)]).mean()
    assert abs(float(loss) - float(want)) < 1e-5
    assert float(pol.lm.model.visual.patch_embed.proj.weight.grad.abs().sum()) > 0
    with pytest.raises(ValueError, match="bytes are missing"):
        t0.images = {}
        bind_images(pol, sft_examples([t0]))

    data = tmp_path / "sft.twl"
    write_trajectories(data, [vl_trajectory(vl_dir, "c")[0]])

    def demos(tok):
        ids = tok.first_prompt("sys", "text demo")
        a = tok.answer("wait()")
        return [(ids + a, [0] * len(ids) + [1] * len(a))]

    cfg = RunConfig()
    cfg.learner.device = "cpu"
    cfg.sft.batch_size = 2
    out = tmp_path / "out"
    m = run(cfg, str(vl_dir), str(out), [str(data)], demos=demos, steps=2, log=lambda *_: None)
    assert m["trajectories"] == 1 and m["demonstrations"] == 1
    assert (out / "preprocessor_config.json").is_file()
    a, b = read_weights(vl_dir), read_weights(out)
    assert set(a) == set(b) and not torch.equal(a["visual.patch_embed.proj.weight"], b["visual.patch_embed.proj.weight"])
    _reference(out)  # transformers loads it
    cfg.model.freeze_vision = True
    run(cfg, str(vl_dir), str(tmp_path / "frozen"), [str(data)], steps=2, log=lambda *_: None)
    c = read_weights(tmp_path / "frozen")
    assert all(torch.equal(a[k], c[k]) for k in a if k.startswith("visual."))
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])


def test_learner_keeps_unbindable_images_out_of_the_loss(vl_dir):
    """A trajectory whose images do not bind to its runs is counted and masked at admission (the learner's own
    check), never a failed update; a good one is admitted."""
    import collections
    import types

    from core.config_learner import GroupConfig
    from learner.admission import Admission
    from learner.batch import binding_error
    from learner.staleness import StalenessManager

    spec = VLSpec.load(vl_dir)
    stal = StalenessManager(batch_size=8, eta=100)
    stal.try_admit(3)
    counters = collections.Counter()
    consumed = []
    adm = Admission(types.SimpleNamespace(mark_consumed=consumed.extend), stal, max_lag=8, group=GroupConfig(),
                    episodes=io.StringIO(), archive=None, counters=counters, check=lambda tr: binding_error(tr, spec))
    good, _ = vl_trajectory(vl_dir, "good")
    bad, _ = vl_trajectory(vl_dir, "bad")
    bad.images[bad.image_refs[1]] = _png(300, 40, 1)  # not the size its run was framed for
    assert adm.admit(good, 0) and not adm.admit(bad, 0)
    assert counters["unbound_images"] == 1 and consumed == ["bad"] and adm.take_masked() == ["bad"]
    assert "pads, its image takes" in binding_error(bad, spec)
    assert "not a vision-language" in binding_error(good, None)
    assert binding_error(text_trajectory(vl_dir), None) is None


def stray_trajectory(d, tid="s0", token="<|image_pad|>", sizes=((160, 210), (120, 90))):
    """The actor's trajectory of an answer that ends with a vision token it sampled (actor/episode.py): truncated by
    parse_error, the bootstrap prompt (with its screenshot) after it. Returns it and its one segment as the
    reference's (ids with the stray token's input replaced by the pad id, pngs, mask)."""
    spec, tok = VLSpec.load(d), ChatTokenizer.load(d)
    pngs = [_png(w, h, 3 + i) for i, (w, h) in enumerate(sizes)]
    n = [spec.image_tokens(w, h) for w, h in sizes]
    ids = tok.first_prompt("sys", ["look", n[0]])
    mask = [0] * len(ids)
    a = tok.answer("click(start_box='(1,2)')")
    ids, mask = ids + a, mask + [1] * len(a)
    p = tok.next_turn(["now", n[1]])
    ids, mask = ids + p, mask + [0] * len(p)
    a = tok.encode("Thought: the") + [tok.hf.convert_tokens_to_ids(token)]
    ids, mask = ids + a, mask + [1] * len(a)
    stray = len(ids) - 1
    p = tok.next_turn([n[1]], closed=False)   # the state it was cut in, for the critic
    ids, mask = ids + p, mask + [0] * len(p)
    pngs.append(pngs[1])
    shas = [hashlib.sha256(b).hexdigest() for b in pngs]
    m = np.array(mask, np.uint8)
    tr = Trajectory(id=tid, env_id="e", outcome="truncated", tokens=np.array(ids, np.int32),
                    logprobs=np.where(m > 0, -1.0, 0.0).astype(np.float32), versions=np.where(m > 0, 0, -1).astype(np.int32),
                    mask=m, turns=[Turn("", "", {}, 0.0, 0, stray + 1)], ret=-0.1, group="g", boot_at=len(ids),
                    truncated_by="parse_error", image_refs=shas, images=dict(zip(shas, pngs)))
    tr.validate()
    x = list(ids)
    x[stray] = TrainPolicy.load(d).config.pad_token_id
    return tr, [(x, pngs, mask)], stray


@pytest.mark.parametrize("token", ["<|image_pad|>", "<|vision_start|>", "<|video_pad|>"])
def test_a_sampled_vision_token_trains_exactly(vl_dir, token):
    """A trajectory whose last generated token is a vision token the policy sampled (no framed run, no image) is
    collated, not dropped: its logprobs equal transformers' on the segment with that token's input replaced by the
    pad id, the target the real id; the critic reads its bootstrap state."""
    from learner.batch import binding_error

    pol = TrainPolicy.load(vl_dir)
    ref, spec = _reference(vl_dir), pol.vl
    assert set(spec.special_ids) == {spec.image_token_id, spec.vision_start_token_id, spec.vision_end_token_id,
                                     ChatTokenizer.load(vl_dir).hf.convert_tokens_to_ids("<|video_pad|>")}
    tr, segs, stray = stray_trajectory(vl_dir, token=token)
    good, s0 = vl_trajectory(vl_dir, "good")
    assert binding_error(tr, spec) is None
    b = collate([tr, good], pol.config.pad_token_id, pol.vl)
    assert b.images[0].stray == [stray] and int(b.tokens[0, stray]) == ChatTokenizer.load(vl_dir).hf.convert_tokens_to_ids(token)
    with torch.no_grad():
        lp = pol.logprobs_at(b.tokens, b.valid, b.mask, vl=b.vl(torch.arange(2)))
        ids, pngs, mask = segs[0]
        x = torch.tensor([ids])
        pv, thw = spec.pixels(pngs)
        logits = ref(input_ids=x, pixel_values=pv, image_grid_thw=thw,
                     mm_token_type_ids=(x == spec.image_token_id).int()).logits[0]
        real = torch.tensor(tr.tokens.astype(np.int64))
        want = torch.log_softmax(logits[:-1].float(), -1).gather(-1, real[1:, None])[:, 0][torch.tensor(mask[1:]) > 0]
    want = torch.cat([want, slow_logprobs(ref, spec, s0)])
    assert lp.shape == want.shape
    assert float((lp - want).abs().max()) < 1e-5
    # the critic's bootstrap value is read past the stray token
    critic = TrainPolicy.critic_from(pol)
    vm = b.mask.clone()
    vm[b.boot > 0] = 1
    with torch.no_grad():
        v = critic.values_at(b.tokens, b.valid, vm, vl=b.vl(torch.arange(2)))
    assert torch.isfinite(v).all()


def test_a_sampled_vision_token_before_the_end_is_a_binding_error(vl_dir):
    """Exactness needs the sampled vision token to be the last generated one (nothing trained attends to it): a
    conversation that went on past it is not bound."""
    from learner.batch import binding_error

    spec = VLSpec.load(vl_dir)
    tr, _, stray = stray_trajectory(vl_dir)
    tr.mask[-1] = 1
    assert "is not its last generated token" in binding_error(tr, spec)
    with pytest.raises(ValueError, match="is not its last generated token"):
        collate([tr], 0, spec)


def test_sft_trains_on_a_trajectory_ending_in_a_sampled_vision_token(vl_dir, tmp_path):
    """`tars sft --data` binds a stored trajectory the way the learner does: a vision token the policy sampled as
    its last generated token is no image run (it was "4 framed image runs but 3 image_refs" and SFT stopped)."""
    from core.config import RunConfig
    from learner.data import sft_examples, write_trajectories
    from learner.sft import bind_images, run

    tr, _, stray = stray_trajectory(vl_dir)
    good, _ = vl_trajectory(vl_dir, "good")
    pol = TrainPolicy.load(vl_dir)
    ex = bind_images(pol, sft_examples([tr]))
    assert ex[0][2].stray == [stray] and ex[0][1][stray] == 1       # bound, and the token keeps its loss
    # as the actor records it: the answer holding the vision token is a turn that did not parse (out of the SFT
    # loss), and the binding still knows the token was generated
    gen = np.flatnonzero(tr.mask)
    runs = np.split(gen, np.flatnonzero(np.diff(gen) > 1) + 1)
    tr.turns = [Turn("", "", {"type": "click"}, 0.0, int(runs[0][0]), int(runs[0][-1]) + 1),
                Turn("", "", {}, -0.1, int(runs[1][0]), stray + 1, parse_error="the model wrote a vision token")]
    (ex,) = bind_images(pol, sft_examples([tr]))
    assert ex[2].stray == [stray] and ex[1][stray] == 0 and sum(ex[1]) == len(runs[0]) - (runs[0][0] in tr.segments)
    write_trajectories(tmp_path / "trajectories.twl", [good, tr])
    cfg = RunConfig()
    cfg.learner.device = "cpu"
    cfg.sft.batch_size = 2
    m = run(cfg, str(vl_dir), str(tmp_path / "out"), [str(tmp_path / "trajectories.twl")], steps=1, log=lambda *_: None)
    assert m["trajectories"] == 2
