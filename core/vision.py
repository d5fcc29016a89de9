"""A small, real vision path for the plain-torch decoder: screenshots as patch embeddings at placeholder tokens.

A screenshot (PNG bytes) is downscaled to a fixed grid x grid of patch x patch RGB pixels; each patch is flattened and
linearly projected into the LM's embedding space (ViT's patch embedding without the transformer on top). The prompt
holds grid**2 `<|image|>` placeholder tokens per image; their input embeddings are replaced by the image's patch
embeddings, so the model conditions on pixels while the token sequence stays a plain list of ids (the conversation
is still only ever extended, and a turn whose image has left the prompt window keeps its placeholders as ordinary
tokens: only its text then speaks for it).

The module is optional: a checkpoint has it when its config.json carries "tars_vision" ({"grid", "patch",
"image_token_id"}), and its weights are `vision.proj.*`. Text-only checkpoints load and run as before, and an engine
given images for a text-only model ignores them.

Binding rule (the engine and the learner must agree): placeholder tokens come in runs of grid**2; the images of a
request bind, in order, to the LAST len(images) runs, so a prompt window of the last k screenshots is "send the last
k images". Earlier runs get no image.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class VisionConfig:
    grid: int = 4                 # patches per side: grid**2 placeholder tokens per image
    patch: int = 8                # pixels per patch side after downscaling
    image_token_id: int = 4       # the tokenizer's image placeholder id (core.chat.ChatTokenizer.image_id)

    @property
    def tokens(self) -> int:
        return self.grid * self.grid

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch * self.patch

    @classmethod
    def from_extra(cls, extra: dict) -> "VisionConfig | None":
        d = extra.get("tars_vision")
        if not d:
            return None
        v = cls(int(d.get("grid", 4)), int(d.get("patch", 8)), int(d.get("image_token_id", 4)))
        if v.grid < 1 or v.patch < 1:
            raise ValueError(f"tars_vision needs grid >= 1 and patch >= 1, got {d}")
        return v

    def to_extra(self) -> dict:
        return {"tars_vision": {"grid": self.grid, "patch": self.patch, "image_token_id": self.image_token_id}}


class PatchEmbed(nn.Module):
    def __init__(self, v: VisionConfig, hidden: int):
        super().__init__()
        self.v = v
        self.proj = nn.Linear(v.patch_dim, hidden)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [N, patch_dim] in [0, 1] -> embeddings [N, hidden] (centred, so a grey screen is near zero)."""
        return self.proj(patches.to(self.proj.weight.dtype) - 0.5)


def image_patches(png: bytes, v: VisionConfig) -> torch.Tensor:
    """PNG (or any PIL-readable) bytes -> [grid**2, patch_dim] float32 in [0, 1]; ValueError if unreadable or too large
    (core.vlm.MAX_IMAGE_PIXELS)."""
    from PIL import Image

    from core.vlm import open_rgb

    im = open_rgb(png)  # ValueError if unreadable or too large to decode
    side = v.grid * v.patch
    im = im.resize((side, side), Image.BILINEAR)
    x = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(side, side, 3).float() / 255.0
    # [side, side, 3] -> [grid, patch, grid, patch, 3] -> [grid, grid, patch, patch, 3] -> [grid**2, patch_dim]
    x = x.view(v.grid, v.patch, v.grid, v.patch, 3).permute(0, 2, 1, 3, 4)
    return x.reshape(v.tokens, v.patch_dim).contiguous()


def placeholder_runs(ids: list[int], v: VisionConfig) -> list[int]:
    """Start positions of the placeholder runs; ValueError if a run is not exactly grid**2 long."""
    starts, i, n = [], 0, len(ids)
    while i < n:
        if ids[i] == v.image_token_id:
            j = i
            while j < n and ids[j] == v.image_token_id:
                j += 1
            if (j - i) % v.tokens:
                raise ValueError(f"a run of {j - i} image placeholder tokens at {i}: expected multiples of {v.tokens}")
            starts.extend(range(i, j, v.tokens))
            i = j
        else:
            i += 1
    return starts


def bind(ids: list[int], images: list[bytes], v: VisionConfig) -> tuple[list[int], torch.Tensor | None]:
    """Positions [M] and patch pixels [M, patch_dim] for a request: images bind to the last len(images) runs."""
    if not images:
        return [], None
    runs = placeholder_runs(ids, v)
    if len(images) > len(runs):
        raise ValueError(f"{len(images)} images but only {len(runs)} image placeholder runs of {v.tokens} tokens")
    pos, pix = [], []
    for start, png in zip(runs[len(runs) - len(images):], images):
        pos.extend(range(start, start + v.tokens))
        pix.append(image_patches(png, v))
    return pos, torch.cat(pix)
