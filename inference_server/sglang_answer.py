"""One SGLang /generate call of a generation: the body sent, and the answer read as a segment (its tokens, logprobs,
per-token versions, finish) or as a refusal.

Standard library only. The request path (inference_server.sglang_engine) strings segments together across aborts and
replicas; this module only builds one request and reads one answer.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from core.config_inference import SGLANG_CONTEXT_MARGIN
from inference_server.engine_types import RequestRefused, SamplingParams
from inference_server.sglang_http import token_versions

# SGLang's context refusals: "... longer than the model's context length (C tokens)." and "Requested token count
# exceeds the model's maximum context length of C tokens. ..." (the tokenizer manager's), "Input length (n tokens)
# exceeds the maximum allowed length (C - 6 tokens). ..." (the scheduler's)
_CONTEXT = re.compile(r"context length (?:\(|of )(\d+) tokens")
_INPUT = re.compile(r"maximum allowed length \((\d+) tokens\)")


# SGLang's 503s for load, not death (the scheduler's aborts of a request it will not queue: --max-queued-requests,
# SGLANG_REQ_WAITING_TIMEOUT, priority scheduling), as against a scheduler that died (503 too).
_OVERLOADED = ("The request queue is full.", "Request waiting timeout reached.",
               "The request is aborted by a higher priority request.")


def overloaded(status: int, message: str) -> bool:
    """An answer that says the server is busy (the caller should back off), not that it is dead: a 429, or a 503
    whose message is one of the scheduler's load refusals."""
    return status == 429 or (status == 503 and message.strip() in _OVERLOADED)


def _finite(entry, i: int) -> float:
    """The logprob of one output_token_logprobs entry [lp, id, text]."""
    lp = entry[0] if isinstance(entry, (list, tuple)) and entry else entry
    try:
        v = float(lp)
    except (TypeError, ValueError):
        v = math.nan
    if not math.isfinite(v):
        raise BadAnswer(f"SGLang returned logprob {lp!r} for output token {i}: not a finite number (the model's "
                        "weights or numerics are broken)")
    return v


def generate_body(rid: str, input_ids: list[int], p: SamplingParams, max_new_tokens: int) -> dict:
    """POST /generate's body: token ids in, output logprobs, top_k -1 for "off"; never ignore_eos (it turns
    stop_token_ids off too); the seed as SGLang can take it."""
    return {"rid": rid, "input_ids": input_ids, "return_logprob": True, "logprob_start_len": -1,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": p.temperature,
                                "top_p": p.top_p if p.top_p > 0 else 1.0, "top_k": p.top_k if p.top_k > 0 else -1,
                                "stop_token_ids": list(p.stop_token_ids), "ignore_eos": False, "no_stop_trim": True,
                                **({"sampling_seed": int64_seed(p.seed)} if p.seed else {})}}


def int64_seed(seed: int) -> int:
    """A tars seed (uint64) as the sampling_seed SGLang takes: its scheduler puts seeds in an int64 tensor, where one
    of 2**63 or more overflows (and takes the server down). Two's complement: one-to-one, so equal seeds stay equal
    and different ones different."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def refused(message: str) -> RequestRefused:
    """What a request SGLang refused as invalid fails with: SGLang's message; one past SGLang's context length also
    says the limit in the front's words ("exceeds max_context N"), which the actors read to fit their prompts."""
    m, i = _CONTEXT.search(message), _INPUT.search(message)
    limit = int(m.group(1)) - SGLANG_CONTEXT_MARGIN if m else int(i.group(1)) if i else None
    tail = f"; prompt + max_new_tokens exceeds max_context {limit}" if limit is not None else ""
    return RequestRefused(f"SGLang refused the request: {message[:500]}{tail}")


class BadAnswer(RuntimeError):
    """A 200 answer the engine cannot use (INTERNAL): tokens and logprobs that do not pair up, a logprob that is not a
    finite number."""


@dataclass
class Segment:
    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    kind: str                                    # finish_reason.type: stop | length | abort (| None: not finished)
    finish: dict = field(default_factory=dict)   # the whole finish_reason ({} when it is not an object)
    cached_tokens: int = 0


def read_segment(resp: dict, base_version: int) -> Segment:
    """{output_ids, meta_info{output_token_logprobs [[lp, id, None]], weight_version(s), finish_reason, cached_tokens}}
    -> Segment; BadAnswer when the logprobs do not pair up with the tokens, or one is not a finite number: NaN or inf
    (null in SGLang's orjson answers) would reach the actor and be refused by the learner's stream, the episode lost
    late; the request fails now instead."""
    meta = resp.get("meta_info") or {}
    ids = [int(t) for t in resp.get("output_ids") or []]
    lps = meta.get("output_token_logprobs") or []
    if len(lps) != len(ids):
        raise BadAnswer(f"SGLang returned {len(ids)} tokens but {len(lps)} logprobs")
    fr = meta.get("finish_reason") or {}
    kind = fr.get("type") if isinstance(fr, dict) else str(fr)
    logprobs = [_finite(x, i) for i, x in enumerate(lps)]
    return Segment(ids, logprobs, token_versions(meta, len(ids), base_version), kind,
                   fr if isinstance(fr, dict) else {}, int(meta.get("cached_tokens") or 0))
