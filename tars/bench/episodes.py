"""Synthetic trajectories shaped like the actor's, for benchmarks and their tests (one place builds them).

    text_episodes(n, vocab, turns, prompt_len, gen_len)        random prompt ids, then generated ids, per turn
    vl_episodes(model_dir, n, images=2, size=(160, 210), ...)  a vision-language checkpoint's own chat format: per turn
                                                               a screenshot as a framed image run, then an answer

A VL trajectory binds its screenshots as the actor does (docs/vl_contract: rule 1): one framed run of
VLSpec.image_tokens(w, h) pads per image, image_refs the sha256 of each image in token order, the PNG bytes in
`images`. The first trajectory of a batch (with images >= 2) starts a second segment at its last screenshot (a fresh
first prompt, as actor.image_history does), so a step covers the per-segment path too.
"""
from __future__ import annotations

import hashlib
import io
import os

import numpy as np

SYSTEM = "You are a GUI agent. You are given a task and your action history, with screenshots."
INSTRUCTION = "Open the settings and turn on dark mode."


def text_episodes(n: int, vocab: int, turns: int, prompt_len: int, gen_len: int, seed: int = 0):
    """Multi-turn trajectories like the actor's: per turn a prompt (environment tokens) then generated tokens."""
    from core.schema import Trajectory, Turn

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        toks, mask, ts = [], [], []
        for _ in range(turns):
            p = int(rng.integers(prompt_len // 2, prompt_len + 1))
            toks += rng.integers(2, vocab, p).tolist()
            mask += [0] * p
            start = len(toks)
            toks += rng.integers(2, vocab, gen_len).tolist()
            mask += [1] * gen_len
            ts.append(Turn("", "", {}, 0.0, start, len(toks)))
        r = float(rng.random() < 0.5)
        ts[-1].reward = r
        m = np.array(mask, np.uint8)
        out.append(Trajectory(id=f"e{i}", env_id="bench", outcome="terminated", tokens=np.array(toks, np.int32),
                              logprobs=np.where(m, -1.0, 0.0).astype(np.float32), versions=np.where(m, 0, -1).astype(np.int32),
                              mask=m, turns=ts, ret=r, success=bool(r)))
    return out


def screenshot(w: int, h: int, seed: int) -> bytes:
    """A w x h RGB PNG of random pixels (each seed its own image, so no two share a sha256)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    b = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(b, "PNG")
    return b.getvalue()


def vl_episodes(model_dir: str | os.PathLike, n: int, images: int = 2, size: tuple[int, int] = (160, 210),
                gen_len: int = 8, seed: int = 0):
    """n trajectories for the VL checkpoint in model_dir, each `images` turns of [screenshot prompt, gen_len generated
    ids ending with the end-of-turn token]; the first one (images >= 2) in two segments. Generated ids are random
    ordinary tokens (never a special or added token, so no stray image run)."""
    from core.chat import ChatTokenizer
    from core.schema import Trajectory, Turn
    from core.vlm import VLSpec

    if images < 1 or gen_len < 1 or min(size) < 1:
        raise ValueError(f"vl_episodes: images ({images}), gen_len ({gen_len}) and size {size} must be >= 1")
    spec, tok = VLSpec.load(model_dir), ChatTokenizer.load(model_dir)
    special = set(tok.hf.all_special_ids) | set(tok.hf.get_added_vocab().values())
    ordinary = np.array([i for i in range(tok.vocab_size) if i not in special], np.int64)
    pads = spec.image_tokens(*size)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        toks: list[int] = []
        mask: list[int] = []
        turns, refs, pngs, segments = [], [], {}, []
        for j in range(images):
            if j == 0:
                prompt = tok.first_prompt(SYSTEM, [INSTRUCTION, pads])
            elif i == 0 and j == images - 1:  # a new segment: a fresh first prompt with the history as text
                segments.append(len(toks))
                prompt = tok.first_prompt(SYSTEM, [f"{INSTRUCTION}\nPrevious actions: {j} clicks.", pads])
            else:
                prompt = tok.next_turn(["Screenshot after the action:", pads])
            toks += prompt
            mask += [0] * len(prompt)
            start = len(toks)
            toks += rng.choice(ordinary, gen_len - 1).tolist() + [tok.eot_id]
            mask += [1] * gen_len
            turns.append(Turn("", "", {}, 0.0, start, len(toks)))
            png = screenshot(*size, seed=seed * 1_000_003 + i * images + j)
            sha = hashlib.sha256(png).hexdigest()
            refs.append(sha)
            pngs[sha] = png
        r = float(rng.random() < 0.5)
        turns[-1].reward = r
        m = np.array(mask, np.uint8)
        tr = Trajectory(id=f"v{i}", env_id="bench", outcome="terminated", tokens=np.array(toks, np.int32),
                        logprobs=np.where(m, -1.0, 0.0).astype(np.float32),
                        versions=np.where(m, 0, -1).astype(np.int32), mask=m, turns=turns, ret=r, success=bool(r),
                        segments=segments, image_refs=refs, images=pngs)
        tr.validate()
        out.append(tr)
    return out
