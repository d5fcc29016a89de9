"""Qwen2-VL / Qwen2.5-VL checkpoints: what the actor, the engine and the learner share about their images.

A vision-language checkpoint directory (config.json `model_type` qwen2_vl | qwen2_5_vl, plus the processor's
`preprocessor_config.json`) is read here once, as `VLSpec`:

- the special tokens a screenshot occupies in the prompt: `<|vision_start|>`, `image_tokens(w, h)` x
  `<|image_pad|>`, `<|vision_end|>` (ids from config.json); `special_ids` are those and `<|video_pad|>`: tokens of
  the input only, which the policy may still sample (actor/episode.py stops on them);
- how many `<|image_pad|>` tokens a screenshot of w x h pixels takes: the processor resizes it with `smart_resize`
  (both sides multiples of patch_size x merge_size, the area within [min_pixels, max_pixels]) and every
  merge_size x merge_size block of patches becomes one token;
- `pixels(pngs)`: the processor's `pixel_values` [patches, C*T*P*P] and `image_grid_thw` [images, 3], computed by
  `transformers.AutoImageProcessor` from the directory's own preprocessor_config.json (its PIL backend when
  torchvision is absent; whichever backend is installed, the engine and the learner of one install use the same).

`smart_resize` lives here, the one copy: the actor maps UI-TARS's absolute coordinates back to the screen with it
(actor/parsing.py), and `image_tokens` counts tokens with it; a test holds it to the processor's own grid.
"""
from __future__ import annotations

import io
import json
import math
import os
import pathlib
from dataclasses import dataclass

import numpy as np

# UI-TARS's resize limits (ui-tars action_parser.py; UI-TARS-1.5's processor): the defaults for coordinate mapping
# when a checkpoint carries no processor of its own.
IMAGE_FACTOR = 28
MIN_PIXELS = 100 * 28 * 28
MAX_PIXELS = 16384 * 28 * 28
MAX_RATIO = 200

VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def smart_resize(height: int, width: int, factor: int = IMAGE_FACTOR, min_pixels: int = 56 * 56,
                 max_pixels: int = 14 * 14 * 4 * 1280) -> tuple[int, int]:
    """(height, width) the Qwen2-VL image processor resizes an image to: both sides multiples of `factor`, the
    area within [min_pixels, max_pixels], the aspect ratio kept as well as that allows. transformers' maths (the
    same as qwen_vl_utils / ui-tars except for a side under factor/2, which qwen_vl_utils floors at factor), so
    "absolute" model coordinates can be mapped back exactly and the image's token count is the processor's."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(f"aspect ratio must be at most {MAX_RATIO}, got {max(height, width) / min(height, width):.1f}")
    # transformers' rule (its processor makes the pixels, so its grid is the one the tokens must match): no floor of
    # `factor` here; a side that rounds to 0 is taken up by the min_pixels branch (qwen_vl_utils floors it instead)
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


# The most pixels an image may have (an 8K screen has 33 M): checked from its header before it is decoded, so a
# small file that decodes to gigabytes (PIL's own limit is a warning up to 179 M pixels) is refused, not decoded.
MAX_IMAGE_PIXELS = 40_000_000


def _open(png: bytes):
    """The PIL image of PNG/JPEG bytes, not yet decoded; ValueError if unreadable or over MAX_IMAGE_PIXELS."""
    from PIL import Image, UnidentifiedImageError

    try:
        im = Image.open(io.BytesIO(png))
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"image is not a readable PNG/JPEG: {e}") from None
    if im.width * im.height > MAX_IMAGE_PIXELS:
        raise ValueError(f"image of {im.width}x{im.height} pixels: more than {MAX_IMAGE_PIXELS} (core.vlm.MAX_IMAGE_PIXELS)")
    return im


def open_rgb(png: bytes):
    """PNG/JPEG bytes -> a decoded RGB PIL image; ValueError if unreadable, cut short or too large (_open)."""
    from PIL import Image

    try:
        return _open(png).convert("RGB")
    except (OSError, SyntaxError, Image.DecompressionBombError) as e:  # a file cut short, a broken stream
        raise ValueError(f"image is not a readable PNG/JPEG: {e}") from None


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) of PNG/JPEG bytes, from the header; ValueError if unreadable or too large (_open)."""
    im = _open(png)
    return int(im.width), int(im.height)


def is_vl_dir(path: str | os.PathLike) -> bool:
    """Does this checkpoint directory hold a Qwen2-VL / Qwen2.5-VL model?"""
    cfg = pathlib.Path(path) / "config.json"
    try:
        return json.loads(cfg.read_text()).get("model_type") in VL_MODEL_TYPES
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class VLSpec:
    """What a VL checkpoint says about its images (see the module doc)."""

    path: str
    model_type: str
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    video_token_id: int = -1   # -1: config.json names none

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def special_ids(self) -> tuple[int, ...]:
        """The vision special tokens (<|image_pad|>, <|video_pad|>, <|vision_start|>, <|vision_end|>): input-only,
        never part of an answer. The actor stops generation on them (an answer that ends with one ends its episode
        as a parse error) and the learner embeds a sampled one as padding (learner/batch.py)."""
        ids = (self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id)
        return tuple(sorted({i for i in ids if i >= 0}))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "VLSpec":
        """ValueError naming the file when the directory is not a usable VL checkpoint."""
        p = pathlib.Path(path)
        try:
            cfg = json.loads((p / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{p}: cannot read config.json: {e}") from None
        if cfg.get("model_type") not in VL_MODEL_TYPES:
            raise ValueError(f"{p}: model_type {cfg.get('model_type')!r} is not a vision-language model "
                             f"({', '.join(VL_MODEL_TYPES)})")
        pp = p / "preprocessor_config.json"
        if not pp.is_file():
            raise ValueError(f"{p}: a {cfg['model_type']} checkpoint needs its image processor's "
                             "preprocessor_config.json")
        try:
            proc = json.loads(pp.read_text())
        except ValueError as e:
            raise ValueError(f"{pp}: not JSON: {e}") from None
        vc = cfg.get("vision_config") or {}
        size = proc.get("size") or {}
        ids = {}
        for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
            if not isinstance(cfg.get(k), int):
                raise ValueError(f"{p}/config.json: {k} is missing")
            ids[k] = int(cfg[k])
        if isinstance(cfg.get("video_token_id"), int):
            ids["video_token_id"] = int(cfg["video_token_id"])
        return cls(
            path=str(p), model_type=cfg["model_type"], **ids,
            patch_size=int(proc.get("patch_size") or vc.get("patch_size") or 14),
            merge_size=int(proc.get("merge_size") or vc.get("spatial_merge_size") or 2),
            temporal_patch_size=int(proc.get("temporal_patch_size") or vc.get("temporal_patch_size") or 2),
            min_pixels=int(proc.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
            max_pixels=int(proc.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
        )

    # ---- the prompt side ---------------------------------------------------------------------------------
    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) of the image the model sees for a w x h screenshot."""
        h, w = smart_resize(int(height), int(width), self.factor, self.min_pixels, self.max_pixels)
        return w, h

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """image_grid_thw of one w x h image: (1, patches high, patches wide)."""
        w, h = self.resized(width, height)
        return 1, h // self.patch_size, w // self.patch_size

    def image_tokens(self, width: int, height: int) -> int:
        """`<|image_pad|>` tokens one w x h screenshot takes in the prompt."""
        _, gh, gw = self.grid(width, height)
        return gh * gw // (self.merge_size ** 2)

    def image_ids(self, width: int, height: int) -> list[int]:
        """The ids of one screenshot in the prompt: vision_start, the pads, vision_end."""
        return [self.vision_start_token_id, *[self.image_token_id] * self.image_tokens(width, height),
                self.vision_end_token_id]

    # ---- the pixel side ------------------------------------------------------------------------------------
    def processor(self):
        proc = _PROCESSORS.get(self.path)
        if proc is None:
            from transformers import AutoImageProcessor

            try:
                proc = AutoImageProcessor.from_pretrained(self.path, local_files_only=True)
            except Exception as e:  # transformers raises many kinds; the message is what matters
                raise ValueError(f"{self.path}: cannot load the image processor: {type(e).__name__}: {e}") from None
            _PROCESSORS[self.path] = proc
        return proc

    def pixels(self, pngs: list[bytes]):
        """PNG/JPEG bytes -> (pixel_values float32 [sum of patches, C*T*P*P], image_grid_thw int64 [n, 3]);
        ValueError if an image is unreadable."""
        import torch

        if not pngs:
            return torch.zeros(0, 3 * self.temporal_patch_size * self.patch_size ** 2), torch.zeros(0, 3, dtype=torch.long)
        ims = [open_rgb(b) for b in pngs]
        out = self.processor()(images=ims, return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"].long()


_PROCESSORS: dict[str, object] = {}


# ---- the token side: image runs, the binding rule, M-RoPE positions ---------------------------------------
def image_runs(ids, image_token_id: int) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of `image_token_id` in ids (a list or an array), in order (end exclusive).
    The one helper for the engine, the learner's batches and SFT's answer spans."""
    is_run = np.concatenate([[False], np.asarray(ids) == image_token_id, [False]])
    edges = np.flatnonzero(is_run[1:] != is_run[:-1])
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


def bind_runs(ids, sizes: list[tuple[int, int]], spec: "VLSpec") -> list[tuple[int, int]]:
    """The binding rule (one for the engine and the learner): a request's images, in order, bind to ALL the
    framed image runs of its ids (`<|vision_start|>`, pads, `<|vision_end|>`). `sizes` are the images' (w, h).
    Returns the runs' (start, end) of the pads; ValueError when a run is not framed, when the number of images is
    not the number of runs, or when a run's pad count is not spec.image_tokens of its image."""
    runs = image_runs(ids, spec.image_token_id)
    for s, e in runs:
        if s == 0 or ids[s - 1] != spec.vision_start_token_id or e >= len(ids) or ids[e] != spec.vision_end_token_id:
            raise ValueError(f"the <|image_pad|> run at {s}..{e} is not framed by <|vision_start|> ... "
                             "<|vision_end|>")
    if len(sizes) != len(runs):
        raise ValueError(f"{len(sizes)} images for {len(runs)} image runs in input_ids: each framed run takes one "
                         "image, in order")
    for k, ((s, e), (w, h)) in enumerate(zip(runs, sizes)):
        want = spec.image_tokens(w, h)
        if e - s != want:
            raise ValueError(f"image {k} ({w}x{h}) takes {want} <|image_pad|> tokens, but its run at {s} has {e - s}")
    return runs


def rope_positions(ids, image_grid_thw, spec) -> tuple["torch.Tensor", int]:
    """M-RoPE positions of one sequence with images, as transformers' get_rope_index computes them.

    ids: the sequence (list or 1-D tensor); image_grid_thw: [n, 3] (tensor or lists), one per image run in order;
    spec: anything with image_token_id and merge_size (a VLSpec). Text tokens take 1-D positions continuing from
    the previous token's largest; a run of t x h x w patches takes (start + t, start + row, start + column) over
    its merge_size-merged grid, and the next text starts at start + max(h, w) / merge_size.
    Returns (positions [3, T] long, delta): a later token at sequence index j sits at j + delta (all three)."""
    import torch

    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    grids = image_grid_thw.tolist() if hasattr(image_grid_thw, "tolist") else [list(g) for g in (image_grid_thw or [])]
    runs = image_runs(ids, spec.image_token_id)
    if len(runs) != len(grids):
        raise ValueError(f"{len(grids)} image grids for {len(runs)} image runs")
    m = spec.merge_size
    parts, cur, prev = [], 0, 0
    for (s, e), (t, h, w) in zip(runs, grids):
        if s > prev:
            parts.append(torch.arange(cur, cur + s - prev).expand(3, -1))
            cur += s - prev
        lt, lh, lw = int(t), int(h) // m, int(w) // m
        if lt * lh * lw != e - s:
            raise ValueError(f"the image run at {s} has {e - s} tokens, its grid {t}x{h}x{w} makes {lt * lh * lw}")
        tt, hh, ww = torch.meshgrid(torch.arange(lt), torch.arange(lh), torch.arange(lw), indexing="ij")
        parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + cur)
        cur += max(int(h), int(w)) // m
        prev = e
    if len(ids) > prev:
        parts.append(torch.arange(cur, cur + len(ids) - prev).expand(3, -1))
    pos = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    delta = int(pos.max()) + 1 - len(ids) if len(ids) else 0
    return pos.long(), delta
