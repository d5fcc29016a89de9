"""Where the learner's tensors live and in which precision it computes: `learner.device`, `learner.precision`.

    device:    auto (cuda when available, else cpu) | cpu | cuda | cuda:N
    precision: auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16

Under `accelerate launch` with several processes, auto and cuda mean this process's own GPU, cuda:LOCAL_RANK
(the launcher sets LOCAL_RANK), and the process group is NCCL (learner/distributed.py); on the CPU it stays gloo.

bf16 is mixed precision, not bf16 weights: parameters, gradients and optimizer state stay fp32 (the "master
weights"); only the forward passes run under torch.autocast, and the model upcasts logits to fp32 before
log_softmax, so the losses are fp32 math. bf16 on the CPU is allowed (CPU autocast): slower than fp32 on most CPUs,
but it runs the same code path as the GPU, which is how CI exercises it without a GPU.

Bad settings are refused here with a ConfigError that names the setting (e.g. cuda asked for on a machine without
CUDA), before any model is built, never as an error from deep inside torch halfway through startup.
"""
from __future__ import annotations

import contextlib
import os
import re

import torch

from core.config import ConfigError

DEVICES = "auto | cpu | cuda | cuda:N"
PRECISIONS = ("auto", "fp32", "bf16")


def resolve_device(spec: str, local_rank: int | None = None, world: int | None = None) -> torch.device:
    """learner.device -> a torch.device; ConfigError for a malformed value or CUDA that is not there.

    local_rank / world default to the launcher's LOCAL_RANK / WORLD_SIZE (0 / 1 when run directly)."""
    s = (spec or "auto").strip().lower()
    if s != "auto" and s != "cpu" and not re.fullmatch(r"cuda(:\d+)?", s):
        raise ConfigError(f"learner.device: {spec!r} is not one of {DEVICES}")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world is None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    if s == "cpu" or (s == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ConfigError(f"learner.device={spec!r} but {why} on this machine; use learner.device=cpu or auto")
    n = torch.cuda.device_count()
    if ":" in s:
        index = int(s.split(":", 1)[1])
        if world > 1:  # every rank would share one GPU: almost surely a mistake, and NCCL refuses it
            raise ConfigError(f"learner.device={spec!r} names one GPU, but {world} processes were launched; use "
                              "cuda or auto (each process takes cuda:LOCAL_RANK)")
    else:
        index = local_rank if world > 1 else torch.cuda.current_device()
    if index >= n:
        raise ConfigError(f"learner.device={spec!r}: cuda:{index} does not exist (this machine has {n} CUDA "
                          f"device(s){', LOCAL_RANK=%d' % local_rank if world > 1 else ''})")
    return torch.device("cuda", index)


def resolve_precision(spec: str, device: torch.device) -> torch.dtype | None:
    """learner.precision -> the autocast dtype (torch.bfloat16), or None for plain fp32."""
    s = (spec or "auto").strip().lower()
    if s not in PRECISIONS:
        raise ConfigError(f"learner.precision: {spec!r} is not one of {' | '.join(PRECISIONS)}")
    if s == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    if s == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"learner.precision=bf16 but {torch.cuda.get_device_name(device)} does not support bf16; "
                          "use learner.precision=fp32")
    return torch.bfloat16 if s == "bf16" else None


def autocast(device: torch.device, dtype: torch.dtype | None):
    """The context the forward passes run in: bf16 autocast, or nothing at all (fp32, bit-identical to no context)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def to_cpu(obj):
    """A (nested) state dict with every tensor moved to the CPU: what checkpoints and published weights hold."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def describe(device: torch.device, dtype: torch.dtype | None) -> str:
    return f"{device} {'bf16 autocast (fp32 master weights)' if dtype is not None else 'fp32'}"
