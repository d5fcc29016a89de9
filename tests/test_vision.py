"""The optional patch-embedding vision path (core/vision.py) through the real LocalEngine and the gRPC front."""
from __future__ import annotations

import asyncio
import io

import pytest
import torch
from PIL import Image

from core.inference_client import InferenceClient
from inference_server.engine import LocalEngine, SamplingParams
from inference_server.server import InferenceServer
from core.config import InferenceConfig
from core.model import CausalLM, DecoderConfig
from core.v1 import common_pb2
from core.vision import VisionConfig, bind, image_patches

V = VisionConfig(grid=4, patch=8, image_token_id=4)


def dc(vision: bool) -> DecoderConfig:
    return DecoderConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, extra=V.to_extra() if vision else {})


def png(color, stripe=None) -> bytes:
    im = Image.new("RGB", (120, 80), color)
    if stripe:
        im.paste(stripe, (0, 0, 60, 40))
    b = io.BytesIO()
    im.save(b, "PNG")
    return b.getvalue()


RED, BLUE = png((220, 30, 30)), png((30, 30, 220), stripe=(250, 250, 250))
PROMPT = [2, 10, 11, *[4] * V.tokens, 12, 13, 3]          # <|user|> text <image x16> text <|assistant|>
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0)


@pytest.fixture
def engine():
    made = []

    def make(vision=True, **kw):
        m = CausalLM(dc(vision)).init_weights(0, std=0.1).eval()
        e = LocalEngine(InferenceConfig(max_context=256, **kw), m)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def test_two_images_give_different_logprobs_and_the_same_image_the_same(engine):
    e = engine(cache_capacity=0)
    red1 = e.submit(PROMPT, GREEDY, images=[RED]).result(30)
    red2 = e.submit(PROMPT, GREEDY, images=[RED]).result(30)
    blue = e.submit(PROMPT, GREEDY, images=[BLUE]).result(30)
    none = e.submit(PROMPT, GREEDY).result(30)
    assert red1.logprobs == red2.logprobs
    assert blue.logprobs[0] != pytest.approx(red1.logprobs[0], abs=1e-6)
    assert none.logprobs[0] != pytest.approx(red1.logprobs[0], abs=1e-6)
    assert e.metrics()["requests"] == 4 and e.stats["images"] == 3


def test_a_text_only_checkpoint_loads_and_ignores_images(engine, tmp_path):
    m = CausalLM(dc(False)).init_weights(0, std=0.1)
    m.save_hf(tmp_path / "text")
    e = LocalEngine(InferenceConfig(max_context=256, cache_capacity=0), str(tmp_path / "text"))
    try:
        assert e.model.vision is None
        a = e.submit(PROMPT, GREEDY, images=[RED]).result(30)
        b = e.submit(PROMPT, GREEDY).result(30)
        assert a.logprobs == b.logprobs and e.stats["images_ignored"] == 1
    finally:
        e.close()


def test_vision_checkpoint_round_trips(tmp_path):
    m = CausalLM(dc(True)).init_weights(3, std=0.1)
    m.save_hf(tmp_path / "vis")
    m2 = CausalLM.load_hf(tmp_path / "vis")
    assert m2.vision is not None and m2.vision_config == V
    assert torch.equal(m2.vision.proj.weight, m.vision.proj.weight)


def test_prefix_cache_reuses_kv_only_while_the_image_is_the_same(engine):
    e = engine()
    ref = engine(cache_capacity=0)
    first = e.submit(PROMPT, GREEDY, "traj-a", images=[RED]).result(30)
    turn2 = [*PROMPT, *first.output_ids, 2, 20, 3]
    same = e.submit(turn2, GREEDY, "traj-a", images=[RED]).result(30)
    assert same.cached_tokens >= len(PROMPT)
    assert same.logprobs == pytest.approx(ref.submit(turn2, GREEDY, images=[RED]).result(30).logprobs, abs=1e-4)
    # The image of the first run changed: only the tokens before it can come from the cache.
    other = e.submit(turn2 + [*first.output_ids, 2, 21, 3], GREEDY, "traj-a", images=[BLUE]).result(30)
    assert other.cached_tokens == PROMPT.index(4)
    want = ref.submit(turn2 + [*first.output_ids, 2, 21, 3], GREEDY, images=[BLUE]).result(30)
    assert other.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_bad_image_requests_are_value_errors(engine):
    e = engine()
    with pytest.raises(ValueError, match="placeholder"):
        e.submit(PROMPT, GREEDY, images=[RED, BLUE])          # two images, one run
    with pytest.raises(ValueError, match="readable"):
        e.submit(PROMPT, GREEDY, images=[b"not a png"])
    with pytest.raises(ValueError, match="run of 3"):
        e.submit([2, 4, 4, 4, 3], GREEDY, images=[RED])
    pos, pix = bind(PROMPT + [2, *[4] * V.tokens, 3], [RED], V)  # binds to the LAST run
    assert pos[0] == len(PROMPT) + 1 and pix.shape == (V.tokens, V.patch_dim)
    assert image_patches(RED, V).mean(0)[0] > 0.7                  # red channel of a red screen


def test_images_travel_through_the_grpc_front():
    async def main():
        m = CausalLM(dc(True)).init_weights(0, std=0.1).eval()
        eng = LocalEngine(InferenceConfig(max_context=256, cache_capacity=0), m)
        srv = InferenceServer(InferenceConfig(host="127.0.0.1", port=0), eng)
        await srv.start()
        c = InferenceClient([srv.address], timeout_s=30)
        try:
            r = await c.generate("t", PROMPT, 4, temperature=0.0, images=[common_pb2.Image(data=RED)])
            b = await c.generate("t2", PROMPT, 4, temperature=0.0, images=[common_pb2.Image(data=BLUE)])
            return r, b, eng.stats["images"]
        finally:
            await c.close()
            await srv.stop(0.5)
            eng.close()

    r, b, n = asyncio.run(main())
    assert n == 2 and r.logprobs[0] != pytest.approx(b.logprobs[0], abs=1e-6)


def _blank_png(w: int, h: int) -> bytes:
    """A 1-bit grey PNG of w x h pixels: a few kilobytes that decode to w * h pixels (RGB: 3 bytes each)."""
    import struct
    import zlib

    def chunk(t: bytes, d: bytes) -> bytes:
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)

    z = zlib.compressobj(9)
    row = b"\0" * (1 + (w + 7) // 8)
    data = b"".join(z.compress(row) for _ in range(h)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", data) + chunk(b"IEND", b""))


def test_an_image_too_large_to_decode_is_a_value_error_before_decoding(engine):
    """A small PNG whose header says 49 M pixels was decoded whole (150 MB of RGB, then the processor's float copies);
    one of 196 M raised PIL's DecompressionBombError, which is no ValueError (an UNKNOWN gRPC error, not
    INVALID_ARGUMENT). Both are ValueErrors now, from the header; a screen-sized image still reads."""
    from core.vlm import MAX_IMAGE_PIXELS, open_rgb, png_size

    assert png_size(_blank_png(1920, 1080)) == (1920, 1080) and open_rgb(_blank_png(64, 48)).size == (64, 48)
    for w, h in ((7000, 7000), (14000, 14000)):
        big = _blank_png(w, h)
        assert len(big) < 200_000 and w * h > MAX_IMAGE_PIXELS
        for f in (png_size, open_rgb, lambda b: image_patches(b, V)):
            with pytest.raises(ValueError, match="more than|readable"):
                f(big)
        with pytest.raises(ValueError):
            engine().submit(PROMPT, GREEDY, images=[big])
    with pytest.raises(ValueError, match="readable"):
        open_rgb(_blank_png(640, 480)[:-40])  # cut short inside its data
