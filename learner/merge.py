"""`tars merge CKPT... --weights a,b,...`: parameter interpolation theta = sum_k alpha_k theta_k.

Each CKPT is an HF-layout directory (config.json + model.safetensors: a published weights/vNNNNNN, a run's final/,
a `tars sft` output), a learner checkpoint directory (its policy/ is used) or a run directory (its ckpt/policy/).
The weights must be >= 0 and sum to 1 (within 1e-6), so the result is a point on the segment/simplex between the
models; every checkpoint must hold the same tensor names and shapes. The sum is taken in float64 and stored in the
first checkpoint's dtypes, with its config.json and generation_config.json, and the tokenizer files
(core.chat.copy_tokenizer_files) of the first checkpoint that has a tokenizer, so the output loads in transformers and
in `tars serve` like any other checkpoint. Configs are compared as transformers reads them, so a checkpoint written by
the learner (transformers' save_pretrained) and one written by core.model (the same fields, older spelling: rope_theta
at the top level) merge when they describe the same architecture.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import shutil

import torch

from core.chat import has_tokenizer
from learner.policy import copy_tokenizer


class MergeError(ValueError):
    pass


def resolve(path) -> pathlib.Path:
    p = pathlib.Path(path)
    for d in (p, p / "policy", p / "ckpt" / "policy"):
        weights = (d / "model.safetensors").is_file() or (d / "model.safetensors.index.json").is_file()
        if weights and (d / "config.json").is_file():
            return d
    raise MergeError(f"{path}: no model.safetensors (or model.safetensors.index.json) + config.json here (nor in "
                     "policy/ or ckpt/policy/)")


def parse_weights(text: str, n: int) -> list[float]:
    try:
        w = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise MergeError(f"--weights {text!r}: expected comma-separated numbers") from None
    if len(w) != n:
        raise MergeError(f"{len(w)} weights for {n} checkpoints")
    check_weights(w)
    return w


def check_weights(w: list[float]) -> None:
    if not w:
        raise MergeError("no checkpoints to merge")
    if any(not math.isfinite(a) for a in w):
        raise MergeError(f"weights must be finite: {w}")
    if any(a < 0 for a in w):
        raise MergeError(f"weights must be >= 0: {w}")
    if abs(math.fsum(w) - 1.0) > 1e-6:
        raise MergeError(f"weights must sum to 1 (within 1e-6), they sum to {math.fsum(w)!r}")


_NOT_ARCH = ("torch_dtype", "dtype", "_name_or_path", "transformers_version", "use_cache", "rope_theta")


def _arch(d: pathlib.Path) -> dict:
    """config.json as transformers reads it (one spelling for the RoPE base, defaults filled in), without the fields
    that do not change what the weights mean."""
    c = json.loads((d / "config.json").read_text())
    try:
        from transformers import AutoConfig

        norm = AutoConfig.for_model(**c).to_dict()
    except Exception:  # not a config transformers knows: compare the file as written
        norm = dict(c)
    if "rope_parameters" not in norm and "rope_theta" in norm:
        norm["rope_parameters"] = {"rope_theta": norm["rope_theta"]}
    return _without_notes(norm)


def _without_notes(c: dict) -> dict:
    """c without the _NOT_ARCH fields, in the nested configs too (a VL model's text_config and vision_config carry
    their own dtype: the learner's fp32 copy says float32 where the source says nothing)."""
    return {k: _without_notes(v) if isinstance(v, dict) and k.endswith("_config") else v for k, v in c.items()
            if k not in _NOT_ARCH}


def merge(ckpts: list, weights: list[float], out) -> dict:
    """Write the interpolated model to `out` (atomically: a temporary directory, then rename)."""
    from safetensors.torch import save_file

    from core.model import read_weights

    if len(ckpts) != len(weights):
        raise MergeError(f"{len(weights)} weights for {len(ckpts)} checkpoints")
    check_weights(weights)
    dirs = [resolve(c) for c in ckpts]
    configs = [_arch(d) for d in dirs]
    for d, c in zip(dirs[1:], configs[1:]):
        diff = sorted(k for k in set(c) | set(configs[0]) if c.get(k) != configs[0].get(k))
        if diff:
            raise MergeError(f"{d}: config.json differs from {dirs[0]} in {diff[:5]}: not the same architecture")
    acc: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for k, (d, a) in enumerate(zip(dirs, weights)):
        sd = read_weights(d)   # single or sharded
        if k == 0:
            dtypes = {n: t.dtype for n, t in sd.items()}
            for n, t in sd.items():
                if not t.is_floating_point():
                    raise MergeError(f"{d}: tensor {n} is {t.dtype}; only floating-point weights can be interpolated")
                acc[n] = t.to(torch.float64) * a
            continue
        missing, extra = sorted(set(acc) - set(sd)), sorted(set(sd) - set(acc))
        if missing or extra:
            raise MergeError(f"{d} does not match {dirs[0]}: missing {missing[:5]}, extra {extra[:5]}")
        for n, t in sd.items():
            if t.shape != acc[n].shape:
                raise MergeError(f"{d}: tensor {n} has shape {tuple(t.shape)}, {dirs[0]} has {tuple(acc[n].shape)}")
            acc[n] += t.to(torch.float64) * a
    out = pathlib.Path(out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({n: t.to(dtypes[n]).contiguous() for n, t in acc.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    copy_tokenizer(next((d for d in dirs if has_tokenizer(d)), dirs[0]), tmp)
    for name in ("config.json", "generation_config.json"):
        if (dirs[0] / name).exists():
            shutil.copyfile(dirs[0] / name, tmp / name)
    info = {"sources": [str(d) for d in dirs], "weights": weights, "tensors": len(acc)}
    (tmp / "merge.json").write_text(json.dumps(info, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return {**info, "out": str(out)}
