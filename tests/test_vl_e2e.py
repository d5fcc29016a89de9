"""A Qwen2.5-VL / Qwen2-VL checkpoint end to end through the real processes, on CPU (fp32): "the logprob-agreement test
from Bring your own checkpoint passes with images".

A real `tars serve` samples a two-segment conversation with screenshots (the images of each request bound to all
framed runs of its ids, docs/model.md); the trajectory is assembled as the stream contract says (core/schema.py:
segments, image_refs, images), goes through the stream's encode/decode, and the learner (TrainPolicy.load +
collate(vl=...) + logprobs_at) recomputes the logprob of every sampled token: each equals the engine's behaviour
logprob within 1e-4."""
from __future__ import annotations

import asyncio
import hashlib
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.hf_dirs import make_vl_checkpoint
from tests.served import served, topology_episodes
from tars.bench.episodes import screenshot

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAXP, MINP = 64 * 28 * 28, 4 * 28 * 28


_png = screenshot  # random pixels, one image per seed (tars/bench/episodes.py)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def vl_dir(request, tmp_path_factory) -> pathlib.Path:
    d = tmp_path_factory.mktemp(request.param) / "ckpt"
    make_vl_checkpoint(d, arch=request.param, max_pixels=MAXP, min_pixels=MINP)
    return d


# The process-level runs (actor episodes, `tars up`, `tars sft` + `tars eval`): Qwen2.5-VL (UI-TARS-1.5's
# architecture) in the default run, Qwen2-VL in the slow set.
@pytest.fixture(scope="module", params=["qwen2_5_vl", pytest.param("qwen2_vl", marks=pytest.mark.slow)])
def vl_run_dir(request, tmp_path_factory) -> pathlib.Path:
    d = tmp_path_factory.mktemp(request.param + "-run") / "ckpt"
    make_vl_checkpoint(d, arch=request.param, max_pixels=MAXP, min_pixels=MINP)
    return d


def _served(model: pathlib.Path, tmp: pathlib.Path, *sets: str):
    """`tars serve --model DIR` as its own process, in fp32; yields its address."""
    return served(tmp, "--model", str(model), "--set", "inference.port=0", "--set", "inference.host=127.0.0.1",
                  "--set", "inference.precision=fp32", *[a for s in sets for a in ("--set", s)])


def learner_agreement(model: pathlib.Path, trs) -> tuple[float, int]:
    """The learner's logprob of every sampled token (each segment its own sequence with its images) against the
    engine's behaviour logprob: (max abs difference, number of tokens)."""
    from learner.batch import collate
    from learner.policy import TrainPolicy

    policy = TrainPolicy.load(model).eval()
    assert policy.vl is not None
    worst, n = 0.0, 0
    for tr in trs:
        b = collate([tr], policy.config.pad_token_id, policy.vl)
        with torch.no_grad():
            lp = policy.logprobs_at(b.tokens, b.valid, b.mask, vl=b.vl(torch.arange(1))).numpy()
        # collate drops each sequence's first token from the mask (no prefix); the actor never samples one
        behaviour = tr.logprobs[tr.mask.astype(bool)]
        assert lp.shape == behaviour.shape, (lp.shape, behaviour.shape)
        worst, n = max(worst, float(np.abs(lp - behaviour).max())), n + len(lp)
    return worst, n


def test_learner_logprobs_equal_the_engines_over_a_two_segment_conversation_with_screenshots(vl_dir, tmp_path):
    from core.chat import ChatTokenizer
    from core.inference_client import InferenceClient
    from core.schema import Trajectory, Turn
    from core.v1 import common_pb2
    from core.vlm import VLSpec, png_size

    spec, tok = VLSpec.load(vl_dir), ChatTokenizer.load(vl_dir)
    shots = [_png(160, 210, 1), _png(300, 120, 2), _png(90, 140, 3), _png(200, 200, 4)]

    vision_ids = {spec.image_token_id, spec.vision_start_token_id, spec.vision_end_token_id}

    def run(png: bytes) -> int:
        return spec.image_tokens(*png_size(png))

    async def conversation(addr: str):
        """Segment 1: two turns, each with a new screenshot (the second request binds both); segment 2: a fresh first
        prompt (instruction + history as text + the new screenshot), then one more turn with another screenshot."""
        c = InferenceClient([addr], timeout_s=60, retries=0)
        tokens, lps, versions, mask, turns, refs, segments = [], [], [], [], [], [], []
        try:
            plan = [(True, shots[0], "open the settings"), (False, shots[1], "now the menu"),
                    (True, shots[2], "history: click, click"), (False, shots[3], "and again")]
            seg_start, seg_images, closed = 0, [], True
            for i, (fresh, png, text) in enumerate(plan):
                if fresh:
                    if tokens:
                        segments.append(len(tokens))
                    seg_start, seg_images = len(tokens), []
                    prompt = tok.first_prompt("you are a GUI agent", [run(png), text])
                else:
                    prompt = tok.next_turn([run(png), text], closed=closed)
                seg_images.append(png)
                refs.append(hashlib.sha256(png).hexdigest())
                for seed in range(100 + 10 * i, 110 + 10 * i):
                    g = await c.generate("vl-e2e", tokens[seg_start:] + prompt, 12, temperature=1.0, seed=seed,
                                         stop_token_ids=tok.stop_ids,
                                         images=[common_pb2.Image(data=b) for b in seg_images])
                    # A random checkpoint samples the input-only vision tokens now and then (a trained one does not);
                    # an unframed <|image_pad|> would make the next request unbindable: draw again.
                    if not set(g.output_ids) & vision_ids:
                        break
                assert g.output_ids and not set(g.output_ids) & vision_ids
                tokens += prompt
                lps += [0.0] * len(prompt)
                versions += [-1] * len(prompt)
                mask += [0] * len(prompt)
                start = len(tokens)
                tokens += g.output_ids
                lps += g.logprobs
                versions += g.versions
                mask += [1] * len(g.output_ids)
                closed = g.output_ids[-1] == tok.eot_id
                turns.append(Turn(f"sha256:{refs[-1]}", tok.decode(g.output_ids), {}, 0.0, start, len(tokens)))
        finally:
            await c.close()
        return Trajectory(id="vl-e2e", env_id="builtin/screens", outcome="truncated",
                          tokens=np.asarray(tokens, np.int32), logprobs=np.asarray(lps, np.float32),
                          versions=np.asarray(versions, np.int32), mask=np.asarray(mask, np.uint8), turns=turns,
                          ret=0.0, success=False, truncated_by="max_turns", segments=segments, image_refs=refs,
                          images={r: b for r, b in zip(refs, shots)})

    with _served(vl_dir, tmp_path) as addr:
        tr = asyncio.run(conversation(addr))
    assert len(tr.segments) == 1 and len(tr.image_refs) == 4
    tr = Trajectory.decode(tr.validate().encode())   # what the learner receives from the stream
    assert tr.segments and len(tr.images) == 4
    worst, n = learner_agreement(vl_dir, [tr])
    print(f"{vl_dir.parent.name}: {n} sampled tokens, max |learner - engine| logprob {worst:.2e}")
    assert n >= 20 and worst <= 1e-4
    # The screenshots matter: the same tokens with other images give other logprobs (the test can fail).
    other = Trajectory.decode(tr.encode())
    swapped = [_png(*png_size(tr.images[r]), 99 + i) for i, r in enumerate(tr.image_refs)]
    other.image_refs = [hashlib.sha256(b).hexdigest() for b in swapped]
    other.images = dict(zip(other.image_refs, swapped))
    blind, _ = learner_agreement(vl_dir, [other])
    assert blind > 1e-3, blind


def clean(trs) -> list:
    """The episodes, none of which may have ended as an infrastructure error. A random checkpoint samples a vision
    token now and then (a trained one does not): the engine stops there and the actor ends that episode as a parse
    error (truncated_by "parse_error"), whose trajectory the learner trains on like any other."""
    for t in trs:
        assert t.outcome != "infra_error", t.error
        if any(tu.parse_error.startswith("the model wrote a vision token") for tu in t.turns):
            assert t.truncated_by == "parse_error", t.truncated_by
    return list(trs)


def _miniwob_here() -> bool:
    from envd import miniwob_chromium

    return not miniwob_chromium.missing()


@pytest.mark.skipif(not _miniwob_here(), reason="MiniWoB needs Debian chromium, chromium-driver, socat and bubblewrap")
def test_learner_logprobs_equal_the_engines_over_actor_episodes_with_segments(vl_run_dir, tmp_path):
    """Episodes of the real actor code against a real `tars envd` (MiniWoB: a screenshot every turn) and a real
    `tars serve`, image_history=2 so later turns start new segments; after the stream's encode/decode the learner's
    logprob of every sampled token equals the engine's within 1e-4."""
    from core import config as C
    from core.schema import Trajectory

    cfg = C.load(None, None, ["actor.max_turns=4", "actor.max_new_tokens=10", "actor.temperature=1.0",
                              "actor.on_parse_error=continue", "actor.image_history=2", "inference.precision=fp32",
                              "inference.max_context=4096"])
    trs = topology_episodes(cfg, tmp_path / "out", vl_run_dir, "miniwob/click-button", 3, "vl", timeout_s=60)
    trs = [Trajectory.decode(t.validate().encode()) for t in clean(trs)]
    # (an episode cut short by a vision token it wrote may end before its second segment)
    assert any(t.segments and len(t.image_refs) >= 3 for t in trs), [(t.segments, len(t.image_refs)) for t in trs]
    assert all(set(t.image_refs) <= set(t.images) for t in trs)
    worst, n = learner_agreement(vl_run_dir, trs)
    print(f"{vl_run_dir.parent.name}: {n} sampled tokens over {sum(len(t.segments) + 1 for t in trs)} segments, "
          f"max |learner - engine| logprob {worst:.2e}")
    assert n > 20 and worst <= 1e-4


def _cli(*args, timeout=300) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "tars.cli", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _loads_as_vl(d: pathlib.Path, model_type: str) -> None:
    import transformers

    assert (d / "preprocessor_config.json").is_file()
    m = transformers.AutoModelForImageTextToText.from_pretrained(str(d))
    assert m.config.model_type == model_type
    assert transformers.AutoTokenizer.from_pretrained(str(d)).chat_template


@pytest.mark.skipif(not _miniwob_here(), reason="MiniWoB needs Debian chromium, chromium-driver, socat and bubblewrap")
def test_a_short_up_run_with_screenshots(vl_run_dir, tmp_path):
    """`tars up --set model.path=VLDIR` on MiniWoB (a screenshot every turn, two per segment): the learner trains on
    the actors' VL trajectories through the stream, versions are published, and final/ is a VL checkpoint."""
    out = tmp_path / "up"
    _cli("up", "--out", str(out), "--quiet", "--set", f"model.path={vl_run_dir}", "--set", "sft.steps=0",
         "--set", "actor.env_ids=[miniwob/click-button]", "--set", "actor.image_history=2",
         "--set", "actor.max_turns=3", "--set", "actor.max_new_tokens=8", "--set", "actor.concurrency=4",
         "--set", "actor.on_parse_error=continue", "--set", "inference.max_context=4096",
         "--set", "learner.batch_size=4", "--set", "learner.algo=grpo", "--set", "learner.group.size=2",
         "--set", "max_versions=2", "--set", "wall_budget_s=150")
    rep = json.loads((out / "report.json").read_text())
    assert rep["policy_version"] >= 2, rep
    # No infrastructure error (a vision token the random checkpoint samples ends its episode as a parse error).
    eps = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]
    assert not [e for e in eps if e["outcome"] == "infra_error"], eps
    trained = [i for line in (out / "trained.jsonl").read_text().splitlines() for i in json.loads(line).get("ids", [])]
    # VL trajectories the learner bound and trained on: their screenshots came through the stream (a trajectory
    # whose images do not bind is kept out of the loss; the store itself is collected at each checkpoint)
    assert len(trained) >= 8 and (out / "stream.wal.images").is_dir()
    _loads_as_vl(out / "final", json.loads((vl_run_dir / "config.json").read_text())["model_type"])


@pytest.mark.skipif(not _miniwob_here(), reason="MiniWoB needs Debian chromium, chromium-driver, socat and bubblewrap")
def test_sft_on_text_demos_and_eval_with_screenshots(vl_run_dir, tmp_path):
    """`tars sft --model VLDIR` (scripted demonstrations played through the actor's episodes, tars/demos_vl.py; the
    builtin tasks of the default config show text, not screenshots) keeps a VL checkpoint; `tars eval --model` on it
    runs MiniWoB episodes with screenshots, none of which ends as an infrastructure error."""
    sft = tmp_path / "sft"
    _cli("sft", "--model", str(vl_run_dir), "--out", str(sft), "--demos", "16", "--steps", "2",
         "--set", "sft.batch_size=4", "--set", "inference.max_context=4096")   # the context the eval below serves
    _loads_as_vl(sft, json.loads((vl_run_dir / "config.json").read_text())["model_type"])
    _cli("eval", "--suite", "miniwob", "--model", str(sft), "--out", str(tmp_path / "eval"), "--episodes", "2",
         "--tasks", "miniwob/click-button", "--concurrency", "2", "--set", "actor.max_new_tokens=8",
         "--set", "actor.max_turns=3", "--set", "actor.image_history=2", "--set", "inference.max_context=4096")
    res = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert res["overall"]["episodes"] == 2, res
    eps = [json.loads(x) for x in (tmp_path / "eval" / "episodes.jsonl").read_text().splitlines()]
    assert not [e for e in eps if e["outcome"] == "infra_error"], eps
    assert any(e["steps"] >= 3 for e in eps), eps   # three screenshots: a second segment
