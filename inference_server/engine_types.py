"""The vocabulary every inference engine shares: sampling parameters, requests, outputs, weight updates, errors.

LocalEngine (inference_server.engine), its scheduler thread (inference_server.scheduler), the queue between them
(inference_server.work_queue), the SGLang pool (inference_server.sglang_engine) and the scripted engine all speak
these types; this module imports nothing of this package (only core's GREEDY_BELOW), so any of them can depend
on it without a circle.
The gRPC front maps the errors to status codes (named in each docstring).
"""
from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch

from core.config import GREEDY_BELOW  # noqa: F401  (re-exported: the engines' greedy rule, defined once)

# GenerateOutput.finish_reason
STOP, LENGTH = "stop", "length"


class QueueFull(RuntimeError):
    """The waiting queue is at cfg.max_queue (RESOURCE_EXHAUSTED): back off and retry."""


class WeightLoadError(RuntimeError):
    """New weights could not be read or do not fit the model (FAILED_PRECONDITION)."""


class UpdateBusy(TimeoutError):
    """Another weight update held the engine past this one's deadline: this one is not installed, now or later
    (DEADLINE_EXCEEDED)."""


class RequestRefused(ValueError):
    """A backend refused a queued request as invalid (an SGLang 4xx: INVALID_ARGUMENT with the backend's message),
    where engine.validate could not know (the backend's own limits)."""


class WeightsRefused(ValueError):
    """An update no server state makes acceptable: non-finite weights, or a version jump past
    inference.max_version_jump (INVALID_ARGUMENT). The weights served before stay."""


def check_version_step(current: int, version: int, max_jump: int) -> None:
    """The one rule for an update's version, every engine: newer than `current` (ValueError, FAILED_PRECONDITION),
    and at most `max_jump` beyond it (0 = unbounded; WeightsRefused)."""
    if version <= current:
        raise ValueError(f"version {version} is not newer than the current version {current}")
    if max_jump > 0 and version - current > max_jump:
        raise WeightsRefused(f"version {version} jumps {version - current} beyond the current version {current}; "
                             f"inference.max_version_jump allows {max_jump}")


def finite(v: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """No NaN and no infinity in v, nor (with dtype) a value that becomes one when cast to dtype (1e300 in float64,
    or 1e39 for a bf16 model): one min/max pass (NaN propagates through both, an infinity is an extreme), with no
    tensor-sized temporary. isfinite(v).all() took 1.95 s over a 1 B-parameter fp32 model on 2 cores, this 0.15 s."""
    if not v.is_floating_point() or not v.numel():
        return True
    lo, hi = torch.aminmax(v)
    if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
        return False
    top = torch.finfo(dtype).max if dtype is not None and dtype.is_floating_point else None
    return top is None or max(-float(lo), float(hi)) <= top


def check_finite(state_dict: dict, dtype: torch.dtype | None = None) -> None:
    """WeightsRefused naming the first tensor that holds a NaN or an infinity (or, with dtype, a value that
    overflows to one in the model's dtype)."""
    for k, v in state_dict.items():
        if not finite(v, dtype):
            raise WeightsRefused(f"weight {k} holds non-finite values (NaN or inf"
                                 f"{f' once cast to {dtype}' if dtype is not None else ''}): refused, the served "
                                 "weights stay")


class EngineClosed(RuntimeError):
    """The engine was closed while the request was pending (UNAVAILABLE)."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0          # 0 (or under GREEDY_BELOW) = greedy
    top_p: float = 1.0                # 0 or 1 = off
    top_k: int = 0                    # 0 = off
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0                     # 0 = the engine's shared generator


def check_request(input_ids: list[int], p: SamplingParams, vocab: int | None, limit: int) -> None:
    """What either engine refuses of a request (INVALID_ARGUMENT), the same for both so that a request means the same
    whichever serves it: ValueError naming the field. vocab None: not known (ids are then only checked >= 0); limit:
    the most tokens a prompt and its max_new_tokens may take together."""
    if not input_ids:
        raise ValueError("input_ids is empty")
    for name, ids in (("input_ids", input_ids), ("stop_token_ids", p.stop_token_ids)):
        # SGLang would take a stop id outside the vocabulary and never match it: refused, as for a prompt's
        bad = next((t for t in ids if t < 0 or (vocab is not None and t >= vocab)), None)
        if bad is not None:
            raise ValueError(f"{name} contains {bad}, outside the vocabulary [0, {vocab})")
    if p.max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {p.max_new_tokens}")
    if len(input_ids) + p.max_new_tokens > limit:
        raise ValueError(f"prompt ({len(input_ids)} tokens) + max_new_tokens ({p.max_new_tokens}) exceeds "
                         f"max_context {limit}")
    if not 0 <= p.temperature < math.inf:  # inf (or NaN) would be served: inf flattens every row to uniform
        raise ValueError(f"temperature must be finite and >= 0, got {p.temperature}")
    if not 0 <= p.top_p <= 1:
        raise ValueError(f"top_p must be in [0, 1], got {p.top_p}")
    if p.top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {p.top_k}")


@dataclass
class GenerateOutput:
    output_ids: list[int]
    logprobs: list[float]             # behaviour logprob of each output token (see inference_server.sampling)
    versions: list[int]               # weight version that produced each output token
    finish_reason: str                # "stop" | "length"
    prompt_tokens: int
    cached_tokens: int                # prompt tokens served from the prefix cache
    interruptions: int                # weight updates survived while in flight
    recomputed_tokens: int            # tokens re-prefilled because a weight update invalidated the KV


# on_token(token_id, logprob, version), called in the engine's thread right after the token is sampled.
TokenCallback = Callable[[int, float, int], None]


@dataclass(eq=False)
class Request:
    """One generation of LocalEngine and its progress; mutated only by the scheduler thread once submitted."""

    input_ids: list[int]
    params: SamplingParams
    trajectory_id: str
    max_stale_versions: int
    future: Future
    on_token: TokenCallback | None = None
    stop_ids: frozenset = frozenset()
    generator: torch.Generator | None = None
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    interruptions: int = 0
    recomputed_tokens: int = 0
    kv_version: int = 0               # oldest weight version in this request's KV
    prefix_kv: list | None = None     # RowKV from the prefix cache, consumed by prefill
    prefix_len: int = 0
    t_submit: float = 0.0
    img_pos: list = field(default_factory=list)   # input positions that take patch embeddings (core/vision.py)
    img_pix: torch.Tensor | None = None            # [len(img_pos), patch_dim]
    img_key: dict | None = None                    # placeholder-run start -> image hash, for prefix-cache matching
    vl: "VLInputs | None" = None                   # a VL model's images of this request (LocalEngine._bind_images)

    def sequence(self) -> list[int]:
        return self.input_ids + self.out


@dataclass
class VLInputs:
    """A request's images for a Qwen2-VL / Qwen2.5-VL model, bound by core.vlm.bind_runs."""

    runs: list                        # (start, end) of each image's <|image_pad|> run in input_ids
    pixel_values: list                # per image: the processor's pixel_values [patches, C*T*P*P]
    grid_thw: torch.Tensor            # [n, 3]
    positions: torch.Tensor           # M-RoPE positions of input_ids [3, len(input_ids)] (core.vlm.rope_positions)
    rope_delta: int                   # a later token at sequence index j sits at j + rope_delta


@dataclass
class WeightUpdate:
    """New weights checked by the caller's thread, waiting to be installed by the scheduler between two steps."""

    version: int
    state_dict: dict
    future: Future                    # resolves to the update's info dict (see LocalEngine.update_weights)
    t0: float                         # time.monotonic() when update_weights was called, for load_ms
