"""LLM-as-judge: a generative outcome reward computed through the inference server.

After an episode ends, the judge model sees the task, the text history (each step's screen text and action) and the
last `judge_images` screenshots (as in the UI-TARS report: 5), and answers YES/NO or a score in [0, 1]. The verdict is
logged in the trajectory (Trajectory.judge) and turned into a reward that replaces or adds to the environment's
(actor.judge_mode). A judge that cannot be asked (inference down) or whose answer does not parse is an infrastructure
failure, not a verdict: by default the episode becomes infra_error (kept out of the loss); actor.judge_on_error=env
keeps the environment reward instead.

By default the policy judges itself: the same inference servers and tokenizer, so the judge changes with every
update and can learn to approve what the policy does. `actor.judge_model` gives it a frozen model of its own (its
tokenizer writes the prompts; `tars up` serves it on a server the learner never updates) and `actor.judge_inference`
the servers that serve it (`open_judge`).

The judge prompt is one user message in the judge model's chat template (core.chat), screenshots as image runs
inside it. A tars_vision checkpoint's runs are `actor.image_tokens` placeholders (core/vision.py). A vision-language
checkpoint's (Qwen2-VL / Qwen2.5-VL, actor/uitars.py) are sized exactly as the actor's turns size them,
`Vision.tokens` (the checkpoint's pad count for each screenshot's own size), and framed by core.chat: the request's
images are exactly the prompt's runs, in order, as the engine's binding rule (core.vlm.bind_runs) wants.
"""
from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from core.v1 import common_pb2

if TYPE_CHECKING:
    from actor.uitars import Vision
    from core.chat import ChatTokenizer
    from core.inference_client import InferenceClient

_VERDICT = re.compile(r"\b(YES|NO)\b", re.IGNORECASE)
# the whole number: "Score: 10" is not a score of 1 (a number outside [0, 1] is no score; the YES/NO reading decides)
_SCORE = re.compile(r"(?:score|reward)\s*[:=]\s*([01](?:\.\d+)?|\.\d+)(?!\.?\d)", re.IGNORECASE)
QUESTION = "Did the agent complete the task? Answer YES or NO."


class JudgeError(RuntimeError):
    """The judge gave no usable verdict (unparseable answer, or the inference call failed)."""


_OVERFLOW = re.compile(r"exceeds max_context (\d+)")


def context_limit(e: grpc.aio.AioRpcError) -> int | None:
    """The server's max_context when `e` is its INVALID_ARGUMENT answer to a prompt that does not fit, else None."""
    m = _OVERFLOW.search(e.details() or "") if e.code() == grpc.StatusCode.INVALID_ARGUMENT else None
    return int(m.group(1)) if m else None


def parse_verdict(text: str) -> tuple[str, float]:
    """'YES'/'NO' (first one wins) or 'Score: x' with x in [0, 1] -> (verdict, score). JudgeError otherwise."""
    if not isinstance(text, str):
        raise JudgeError(f"judge output is a {type(text).__name__}")
    m = _SCORE.search(text)
    if m:
        s = float(m.group(1))
        if 0.0 <= s <= 1.0:
            return f"score={s:g}", s
    m = _VERDICT.search(text)
    if m:
        yes = m.group(1).upper() == "YES"
        return ("yes", 1.0) if yes else ("no", 0.0)
    raise JudgeError(f"unparseable judge verdict: {text[:80]!r}")


@dataclass
class Step:
    """What the judge sees of one turn: the screen it acted on, its action text, the screenshot (if any)."""

    screen: str
    action: str
    image: bytes = b""


def judge_prompt(tok, instruction: str, steps: list[Step], final_screen: str, final_image: bytes,
                 n_images: int, image_tokens: int, vision: "Vision | None" = None,
                 budget: int = 0) -> tuple[list[int], list[bytes]]:
    """Token ids and the images bound to them (the last n_images screenshots, in order).

    vision: the actor's resolved Vision; for a VL checkpoint each run takes `vision.tokens(png)` pads (its image's
    own count; ValueError for an unreadable screenshot) and `image_tokens` is not used. Otherwise every run is
    `image_tokens` placeholders (tars_vision), none when the tokenizer has no placeholder token (text).
    budget (> 0): the most prompt tokens the judge's server takes; the oldest steps are left out (the prompt says how
    many), then the screens are cut, until it fits; JudgeError when not even the task and the end fit."""
    def build(drop: int, clip: int = 0):
        return _prompt(tok, instruction, steps, final_screen, final_image, n_images, image_tokens, vision, drop, clip)

    ids, images = build(0)
    if not budget or len(ids) <= budget:
        return ids, images
    # The fewest oldest steps to leave out, by bisection (the prompt shrinks as more are left out): log2(steps)
    # tokenizations of the prompt instead of one per step left out.
    lo, hi, best = 1, len(steps), None
    while lo <= hi:
        mid = (lo + hi) // 2
        got = build(mid)
        if len(got[0]) <= budget:
            best, hi = got, mid - 1
        else:
            lo = mid + 1
    if best is not None:
        return best
    drop, clip = len(steps), 0
    while True:
        ids, images = build(drop, clip)
        if len(ids) <= budget:
            return ids, images
        longest = max([len(final_screen), *(len(s.screen) for s in steps)])
        clip = (clip or longest) // 2
        if clip < 16:
            raise JudgeError(f"judge prompt: {len(ids)} tokens with no step and the screen cut; the server takes {budget}")


def _prompt(tok, instruction, steps, final_screen, final_image, n_images, image_tokens, vision, drop, clip):
    cut = (lambda t: t if not clip or len(t) <= clip else t[:clip] + "...")
    vl = vision is not None and vision.vl
    shots = [s.image for s in steps] + [final_image]
    with_image = {i for i in range(len(shots)) if shots[i]}
    keep = sorted(with_image)[-n_images:] if n_images > 0 and (vl or image_tokens > 0) else []
    if tok.image_id < 0:
        keep = []
    runs = {i: vision.tokens(shots[i]) if vl else image_tokens for i in keep}
    keep = [i for i in keep if i >= drop]  # a left-out step takes its screenshot with it
    parts: list = [f"Task: {instruction}\n"] + ([f"({drop} earlier steps not shown)\n"] if drop else [])
    for i, s in enumerate(steps):
        if i < drop:
            continue
        parts += [runs[i]] if i in runs else []
        parts.append(f"Step {i + 1}: Screen: {cut(s.screen)}\nAction: {s.action}\n")
    parts += [runs[len(steps)]] if len(steps) in runs else []
    parts.append(f"Final screen: {cut(final_screen)}\n{QUESTION}")
    return tok.first_prompt("", parts), [shots[i] for i in keep]


@dataclass
class Verdict:
    verdict: str
    score: float
    text: str
    ms: float

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "score": self.score, "text": self.text[:200], "ms": round(self.ms, 2)}


@dataclass
class JudgeModel:
    """Who judges: the inference servers asked, the tokenizer (chat template, image tokens) the prompt is written
    in, its Vision (a vision-language judge sizes each screenshot's run for its own processor), and the longest
    request its servers take (0: unknown; their "exceeds max_context N" answer then sets it)."""

    infer: "InferenceClient"
    tok: "ChatTokenizer"
    vision: "Vision | None"   # None: a text judge
    max_context: int = 0


def open_judge(cfg, tok: "ChatTokenizer", vision: "Vision | None", auth_token: str = "") -> JudgeModel | None:
    """The judge of actor config `cfg` when it has servers of its own (actor.judge_inference), else None: the policy
    judges. Its prompts are written by actor.judge_model's tokenizer, or by the policy's (`tok`, `vision`) when that
    is empty (its servers serve a copy of the policy). ValueError for a judge_model without servers or with a
    tokenizer that cannot write a chat prompt."""
    from actor.uitars import resolve
    from core.chat import open_tokenizer
    from core.inference_client import InferenceClient

    if cfg.unserved_judge:
        raise ValueError(f"actor.judge_model={cfg.judge_model!r} needs the servers that serve it: "
                         "actor.judge_inference=HOST:PORT (`tars up` starts one and fills it in)")
    if cfg.judge_mode == "off" or not cfg.judge_inference:
        return None
    addrs = [a.strip() for a in cfg.judge_inference.split(",") if a.strip()]
    if cfg.judge_model:
        tok = open_tokenizer(cfg.judge_model, cfg.judge_model, cfg.chat_template_kwargs)
        # its own checkpoint's Vision: how many screenshots the policy is shown does not matter to the judge
        vision = resolve(dataclasses.replace(cfg, image_history=0), tok)
    infer = InferenceClient(addrs, auth_token, cfg.rpc_timeout_s, cfg.retries,
                            unavailable_retry_s=cfg.unavailable_retry_s)
    return JudgeModel(infer, tok, vision)


async def ask(judge: JudgeModel, cfg, tid: str, instruction: str, steps: list[Step], final_screen: str,
              final_image: bytes) -> Verdict:
    """One judge call; raises JudgeError for an unparseable answer, an unreadable screenshot or a failed inference
    call. The prompt is fitted to judge.max_context when known; a server's "exceeds max_context N" answer sets it
    and the prompt is fitted once more, so an episode the actor windowed to its context is still judged."""
    infer, tok, vision, max_context = judge.infer, judge.tok, judge.vision, judge.max_context
    for attempt in range(2):
        budget = max(1, max_context - cfg.judge_max_new_tokens) if max_context else 0
        try:
            ids, images = judge_prompt(tok, instruction, steps, final_screen, final_image, cfg.judge_images,
                                       cfg.image_tokens, vision, budget)
        except ValueError as e:   # a screenshot whose size cannot be read: no run to size for it
            raise JudgeError(f"judge prompt: a screenshot cannot be read: {e}") from None
        t0 = time.perf_counter()
        try:
            # "judge-" first: trajectory ids must never be prefixes of each other (SGLang matches rids by prefix).
            g = await infer.generate(f"judge-{tid}", ids, cfg.judge_max_new_tokens, temperature=0.0,
                                     stop_token_ids=tok.stop_ids, images=[common_pb2.Image(data=b) for b in images],
                                     timeout_s=cfg.rpc_timeout_s)
            break
        except grpc.aio.AioRpcError as e:
            limit = context_limit(e)
            if attempt or limit is None:
                raise JudgeError(f"judge inference failed: {e.code().name}: {e.details()}") from None
            max_context = judge.max_context = limit  # kept: the next episode's prompt is fitted at once
    text = tok.decode(g.output_ids)
    verdict, score = parse_verdict(text)
    return Verdict(verdict, score, text, (time.perf_counter() - t0) * 1000)
