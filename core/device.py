"""Where a role's model runs and in which dtype: the settings `inference.device` / `inference.precision` (the local
inference engine) resolved to a torch.device and dtype, or refused with a ConfigError naming the setting.

    device:    auto (cuda when available, else cpu) | cpu | cuda | cuda:N
    precision: auto (bf16 on CUDA where the GPU supports it, else fp16; fp32 on the CPU) | fp32 | bf16 | fp16

The engine holds its weights in that dtype (not autocast: inference keeps no fp32 master copy). The learner's own
settings (learner.device, learner.precision: autocast with fp32 master weights) are resolved in learner/device.py.
"""
from __future__ import annotations

import torch

from core.config import ConfigError
from core.config_inference import DEVICES, device_error, precision_error  # noqa: F401 - the syntax, without torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(spec: str, what: str) -> torch.device:
    """A device setting -> torch.device; ConfigError when malformed or when it asks for CUDA that is not here."""
    if err := device_error(spec, what):
        raise ConfigError(err)
    s = spec.strip().lower()
    if s == "cpu" or (s == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ConfigError(f"{what}={spec!r} but {why} on this machine; use {what}=cpu or auto")
    n = torch.cuda.device_count()
    index = int(s.split(":", 1)[1]) if ":" in s else torch.cuda.current_device()
    if index >= n:
        raise ConfigError(f"{what}={spec!r}: cuda:{index} does not exist (this machine has {n} CUDA device(s))")
    return torch.device("cuda", index)


def resolve_precision(spec: str, device: torch.device, what: str) -> torch.dtype:
    """A precision setting -> the dtype the weights are held in on `device`; ConfigError when malformed or when
    the GPU cannot do it (bf16 on a GPU without bf16)."""
    if err := precision_error(spec, what):
        raise ConfigError(err)
    s = spec.strip().lower()
    if s == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if s == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"{what}=bf16 but {torch.cuda.get_device_name(device)} does not support bf16; "
                          f"use {what}=fp16 or fp32")
    return DTYPES[s]
