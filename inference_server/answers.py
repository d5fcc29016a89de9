"""What the gRPC front answers: the engine's parameters from a request, a GenerateResponse from an output, the status
code of a failed submit or generation, a GenerateBatch item (inference_server/server.py)."""
from __future__ import annotations

import os

import grpc

from core.rpc import clip_details
from core.v1 import inference_pb2
from inference_server.engine_types import (EngineClosed, GenerateOutput, QueueFull, RequestRefused, SamplingParams,
                                          UpdateBusy, WeightLoadError, WeightsRefused)

FINISH = {"stop": inference_pb2.STOP, "length": inference_pb2.LENGTH}
# What a failed submit or generation answers (anything else: INTERNAL).
_CODES = ((ValueError, grpc.StatusCode.INVALID_ARGUMENT), (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
          (EngineClosed, grpc.StatusCode.UNAVAILABLE))
SUBMIT_ERRORS = tuple(kind for kind, _ in _CODES)  # what engine.submit raises for a request it refuses


def code_of(e: BaseException) -> grpc.StatusCode:
    return next((code for kind, code in _CODES if isinstance(e, kind)), grpc.StatusCode.INTERNAL)


def failure(e: BaseException) -> tuple[grpc.StatusCode, str]:
    """What a generation that failed after its submit answers: UNAVAILABLE for a closed engine, INVALID_ARGUMENT for
    a request its backend refused as invalid (RequestRefused, with the backend's message), RESOURCE_EXHAUSTED for one
    a backend had no room for (QueueFull), DEADLINE_EXCEEDED for one
    past the engine's own deadline, else INTERNAL."""
    if isinstance(e, EngineClosed):
        return grpc.StatusCode.UNAVAILABLE, str(e)
    if isinstance(e, RequestRefused):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, QueueFull):  # a backend's queue is full (SGLang's 503 "The request queue is full."): back off
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
    if isinstance(e, TimeoutError):  # the engine's own deadline for a generation (sglang_request_timeout_s)
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(e)
    return grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"


def outcome(fut) -> tuple[grpc.StatusCode, str]:
    """A finished engine Future that did not return an output: its status code and details."""
    return (grpc.StatusCode.CANCELLED, "request cancelled") if fut.cancelled() else failure(fut.exception())


async def abort(context, code: grpc.StatusCode, details: str) -> None:
    """Every refusal of the front goes out through here: the message is clipped (core.rpc.clip_details), since engine
    errors can echo what a client or an SGLang server wrote (a rejection's message, a path), and a status message past
    the peer's metadata limit arrives as RESOURCE_EXHAUSTED instead of its own code."""
    await context.abort(code, clip_details(details))


def batch_item(i: int, code: grpc.StatusCode, details: str = "", resp=None) -> inference_pb2.GenerateBatchItem:
    return inference_pb2.GenerateBatchItem(index=i, response=resp, code=code.value[0], error=clip_details(details))


def params(s: inference_pb2.SamplingParams) -> SamplingParams:
    # proto3 zero values: top_p 0 (unset) means "off"; max_new_tokens 0 is left to validation (INVALID_ARGUMENT), and
    # so are a negative or NaN top_p (once mapped to "off" here, they were served untruncated with OK).
    return SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p if s.top_p != 0 else 1.0,
                          top_k=s.top_k, stop_token_ids=tuple(s.stop_token_ids), seed=s.seed)


def response(out: GenerateOutput, replica: str) -> inference_pb2.GenerateResponse:
    return inference_pb2.GenerateResponse(
        output_ids=out.output_ids, logprobs=out.logprobs, versions=out.versions, finish_reason=FINISH[out.finish_reason],
        prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens, completion_tokens=len(out.output_ids),
        interruptions=out.interruptions, replica=replica)


class PathRefused(ValueError):
    """A weights path outside inference.weights_root (INVALID_ARGUMENT; the message says nothing of what is there)."""


def confine(path: str | None, root: str) -> None:
    """PathRefused unless `path` (symlinks resolved) lies under `root`; no root: any path."""
    if path and root:
        real, base = os.path.realpath(path), os.path.realpath(root)
        if os.path.commonpath([real, base]) != base:
            raise PathRefused("the weights path is outside inference.weights_root")


def update_refusal(e: BaseException, path: str | None, timeout: float) -> tuple[grpc.StatusCode, str] | None:
    """What a failed engine.update_weights answers, for the UpdateWeights RPCs and the ControlService's
    update_weights command alike; None for anything else (a bug: the caller re-raises it)."""
    if isinstance(e, (WeightsRefused, PathRefused)):  # non-finite weights, a version jump, a path outside the root
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, (ValueError, WeightLoadError)):
        return grpc.StatusCode.FAILED_PRECONDITION, str(e)
    if isinstance(e, UpdateBusy):  # it waited for another update and gave up: never installed
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(e)
    if isinstance(e, TimeoutError):  # before OSError, its base class
        return grpc.StatusCode.DEADLINE_EXCEEDED, f"update not applied within {timeout:.1f}s (it still will be)"
    if isinstance(e, OSError):  # a path that cannot even be looked at (name too long, ...)
        return grpc.StatusCode.FAILED_PRECONDITION, f"cannot read {(path or '')[:200]!r}: {e.strerror or e}"
    if isinstance(e, EngineClosed):
        return grpc.StatusCode.UNAVAILABLE, str(e)
    return None
