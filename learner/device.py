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

import torch

from core import device as core_device
from core.config import ConfigError
from core.config_inference import device_error

PRECISIONS = ("auto", "fp32", "bf16")


def resolve_device(spec: str, local_rank: int | None = None, world: int | None = None) -> torch.device:
    """learner.device -> a torch.device; ConfigError for a malformed value or CUDA that is not there.

    local_rank / world default to the launcher's LOCAL_RANK / WORLD_SIZE (0 / 1 when run directly). The syntax and
    this machine's devices are checked by core.device (the one resolver, shared with inference.device); what is the
    learner's own is the rank rule: under several processes, auto and cuda mean cuda:LOCAL_RANK."""
    s = (spec or "auto").strip().lower()
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world is None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and torch.cuda.is_available() and not device_error(s, "learner.device"):
        if ":" in s:  # every rank would share one GPU: almost surely a mistake, and NCCL refuses it
            raise ConfigError(f"learner.device={spec!r} names one GPU, but {world} processes were launched; use "
                              "cuda or auto (each process takes cuda:LOCAL_RANK)")
        if s in ("auto", "cuda"):
            s = f"cuda:{local_rank}"
    return core_device.resolve_device(s if s != (spec or "auto").strip().lower() else (spec or "auto"), "learner.device")


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
