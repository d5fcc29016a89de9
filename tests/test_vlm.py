"""core.vlm: a VL checkpoint's image facts, held to transformers' own image processor and model."""
from __future__ import annotations

import io
import json

import pytest
import torch

from core.chat import ChatTokenizer
from core.vlm import MAX_PIXELS, MIN_PIXELS, VLSpec, is_vl_dir, png_size, smart_resize
from tests.hf_dirs import make_vl_checkpoint


def _png(w: int, h: int, rgb=(10, 200, 30)) -> bytes:
    from PIL import Image

    b = io.BytesIO()
    Image.new("RGB", (w, h), rgb).save(b, "PNG")
    return b.getvalue()


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("vl")
    make_vl_checkpoint(d, max_pixels=96 * 28 * 28, min_pixels=4 * 28 * 28)
    return d


def test_an_image_too_large_to_open_is_unreadable_not_a_crash():
    """png_size's contract is ValueError for what it cannot read; a PNG header of 20000x20000 made PIL raise its
    DecompressionBombError (not an OSError), which crashed an episode's prompt (actor/uitars.py Vision.tokens)
    instead of ending it infra_error."""
    import struct
    import zlib

    def chunk(t: bytes, d: bytes) -> bytes:
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))

    head = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0))
    with pytest.raises(ValueError, match="not a readable"):
        png_size(head + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def test_spec_reads_the_checkpoint(vl_dir):
    spec = VLSpec.load(vl_dir)
    cfg = json.loads((vl_dir / "config.json").read_text())
    assert is_vl_dir(vl_dir)
    assert (spec.image_token_id, spec.vision_start_token_id, spec.vision_end_token_id) == (
        cfg["image_token_id"], cfg["vision_start_token_id"], cfg["vision_end_token_id"])
    assert (spec.min_pixels, spec.max_pixels, spec.factor) == (4 * 28 * 28, 96 * 28 * 28, 28)


@pytest.mark.parametrize("w,h", [(160, 210), (1280, 720), (64, 30), (3000, 100), (28, 28)])
def test_token_count_is_the_processors_grid(vl_dir, w, h):
    spec = VLSpec.load(vl_dir)
    pv, thw = spec.pixels([_png(w, h)])
    assert tuple(thw[0].tolist()) == spec.grid(w, h)
    assert pv.shape[0] == int(thw.prod()) and spec.image_tokens(w, h) == int(thw.prod()) // 4
    assert png_size(_png(w, h)) == (w, h)


def test_smart_resize_ui_tars_limits():
    assert smart_resize(1080, 1920, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS) == (1092, 1932)
    assert smart_resize(10, 10, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS) == (280, 280)


@pytest.mark.parametrize("h,w", [(9, 1393), (1393, 9), (13, 1000), (1000, 13), (14, 2000), (10, 1500), (1, 150),
                                 (15, 15), (1080, 1920), (27, 5000)])
def test_smart_resize_is_transformers_rule_for_thin_images(h, w):
    """The processor that makes the pixels (transformers) decides the grid, so the token count must follow its rule:
    a side under 14 px rounds to 0 there and is taken up by the min_pixels branch, where qwen_vl_utils' floor of 28
    gave 50 pads for a 9x1393 image whose grid makes 25 (the engine refused it; the learner failed mid-update)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as reference

    for lim in ((56 * 56, 28 * 28 * 1280), (MIN_PIXELS, MAX_PIXELS), (8 * 28 * 28, 400 * 28 * 28)):
        assert smart_resize(h, w, 28, *lim) == reference(h, w, 28, *lim)


def test_prompt_frames_each_image_and_the_model_takes_it(vl_dir):
    spec, tok = VLSpec.load(vl_dir), ChatTokenizer.load(vl_dir)
    n = spec.image_tokens(160, 210)
    ids = tok.first_prompt("sys", ["look", n, "then", n])
    starts = [i for i, t in enumerate(ids) if t == spec.vision_start_token_id]
    assert len(starts) == 2
    for s in starts:
        assert ids[s + 1:s + 1 + n] == [spec.image_token_id] * n and ids[s + 1 + n] == spec.vision_end_token_id
    # A page that spells the vision tokens stays text: it cannot open an image.
    assert spec.vision_start_token_id not in tok.encode("<|vision_start|><|image_pad|>")
    import transformers

    m = transformers.AutoModelForImageTextToText.from_pretrained(str(vl_dir), dtype=torch.float32).eval()
    pv, thw = spec.pixels([_png(160, 210), _png(160, 210, (200, 0, 0))])
    x = torch.tensor([ids])
    with torch.no_grad():
        out = m(input_ids=x, pixel_values=pv, image_grid_thw=thw, mm_token_type_ids=(x == spec.image_token_id).int())
    assert out.logits.shape == (1, len(ids), m.config.text_config.vocab_size)


def test_bad_directories_are_named(tmp_path, vl_dir):
    with pytest.raises(ValueError, match="not a vision-language model"):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
        VLSpec.load(tmp_path)
    import shutil

    d = tmp_path / "noproc"
    shutil.copytree(vl_dir, d)
    (d / "preprocessor_config.json").unlink()
    with pytest.raises(ValueError, match="preprocessor_config.json"):
        VLSpec.load(d)
    with pytest.raises(ValueError, match="readable"):
        VLSpec.load(vl_dir).pixels([b"not a png"])


def test_image_runs_are_the_maximal_runs_for_lists_and_arrays():
    """image_runs against a plain scan, on lists and numpy arrays, runs at either end, none, and an empty input."""
    import numpy as np

    from core.vlm import image_runs

    def scan(ids, t):
        runs, start = [], None
        for i, x in enumerate(list(ids) + [None]):
            if x == t and start is None:
                start = i
            elif x != t and start is not None:
                runs.append((start, i))
                start = None
        return runs

    rng = np.random.default_rng(0)
    cases = [[], [7], [1, 2], [7, 7, 1, 7], [1, 7, 7, 7]] + [rng.integers(5, 9, size=n).tolist() for n in range(1, 60)]
    for ids in cases:
        assert image_runs(ids, 7) == scan(ids, 7), ids
        assert image_runs(np.asarray(ids, dtype=np.int64), 7) == scan(ids, 7), ids
    assert image_runs([7, 7], 7) == [(0, 2)] and all(type(a) is int for a, _ in image_runs([1, 7], 7))
