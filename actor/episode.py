"""One multi-turn episode, top to bottom: session -> (prompt -> generate -> parse -> step) * turns -> trajectory.

The conversation lives as token ids and is only ever extended, so every turn's prompt is a prefix-cache hit and
the learner trains on exactly the tokens the engine produced (no re-tokenisation mismatch). Every generated token
keeps its behaviour logprob and the policy version that produced it; an episode that spans a weight update simply
carries tokens of two versions. An environment or inference failure ends the episode as infra_error.

Screenshots (actor.image_history = k > 0): every turn's prompt holds the observation's text and, when it has a
screenshot, a run of <|image|> placeholders; the request carries the last k screenshots, which the engine binds to
the last k runs (core/vision.py). Older turns keep their placeholders as plain tokens, so only their text speaks for
them, and the token sequence is still only ever extended.

A truncated episode (actor.max_turns, the env's own step or time limit, or on_parse_error=stop) ends with the prompt
its next turn would have had, with mask 0, and `boot_at` pointing past it: the learner's critic reads the value of
that state there and bootstraps the return from it (core/schema.py). Nothing earlier is re-tokenised.

The context: an observation's text is clipped to actor.max_obs_tokens (with a visible marker, actor/tiny.py). Before
each generate the actor checks that the conversation + the new prompt + max_new_tokens fits the inference server's
max_context (EpisodeContext.max_context: inference.max_context of the run's config, lowered to what a server says in
an INVALID_ARGUMENT "exceeds max_context" answer, which ends the episode the same way, never retried). One that does
not fit is a truncation (truncated_by "context"), not an infra error: it ends with that prompt as its final state and
boot_at past it, like any other cut. When even the first prompt does not fit, the trajectory has no generated token
(the learner counts it and drops it). Older turns are never dropped to make room: that would re-tokenise the
conversation (docs/actor.md).

timings["actor_ms"] is the time each turn spent in this module's own code: the turn's wall time minus the awaited
env and inference calls (what `tars bench actor` reports as per-turn actor overhead); timings["actor_cpu_ms"] the
same in this thread's CPU time, which leaves out time the process spent descheduled on a busy machine (the event
loop runs other episodes during the awaits, so their CPU time is subtracted with the awaits).
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass

import grpc
import numpy as np

from actor import judge as J
from actor.envclient import EnvActionError, EnvClient, EnvInfraError, Obs
from actor.parsing import ParseError, parse_response
from actor.tiny import INVALID_NOTE, turn_ids
from core.inference_client import InferenceClient
from core import telemetry
from core.config import ActorConfig
from core.outcome import Fault, Outcome
from core.schema import Trajectory, Turn
from core.chat import ChatTokenizer
from core.v1 import common_pb2


@dataclass
class EpisodeContext:
    cfg: ActorConfig
    tok: ChatTokenizer
    infer: InferenceClient
    actor_id: str
    judge_infer: InferenceClient | None = None   # the judge's inference servers (default: the policy's)
    max_context: int = 0   # longest prompt + max_new_tokens the inference server takes (inference.max_context); 0 = unknown

    def __post_init__(self):
        if self.cfg.judge_mode not in ("off", "replace", "add"):
            raise ValueError(f"actor.judge_mode must be off, replace or add, got {self.cfg.judge_mode!r}")
        from actor.tiny import system_prompt

        system_prompt(self.cfg.system_prompt, "")  # ValueError for an unknown style, before any episode
        if self.cfg.judge_on_error not in ("infra_error", "env"):
            raise ValueError(f"actor.judge_on_error must be infra_error or env, got {self.cfg.judge_on_error!r}")


def _obs_ref(obs: Obs, images: dict) -> str:
    # The trajectory carries every screenshot it refers to; the stream sender sends each one once per learner
    # connection and refers to it by hash afterwards (core/stream/images.py).
    if not obs.images:
        return f"text:{hashlib.sha256(obs.text.encode()).hexdigest()[:16]}"
    img = obs.images[-1]
    h = hashlib.sha256(img.data).hexdigest()  # our own hash: the learner checks bytes against it
    images.setdefault(h, bytes(img.data))
    return f"sha256:{h}"


def _screenshot(obs: Obs) -> bytes:
    return bytes(obs.images[-1].data) if obs.images else b""


def _prompt(cfg: ActorConfig, tok: ChatTokenizer, obs: Obs, note: str, first: bool,
            closed: bool) -> tuple[list[int], bool]:
    """The tokens a turn appends for `obs` (the user message opens with a screenshot's placeholder run when
    screenshots are shown, then its text; the first turn's carries the system prompt) and whether the screenshot is
    shown."""
    n_img = cfg.image_tokens if cfg.image_history > 0 and _screenshot(obs) and tok.image_id >= 0 else 0
    return turn_ids(tok, cfg.system_prompt, obs.text, obs.instruction, note, first=first, closed=closed,
                    images=n_img, obs_budget=cfg.max_obs_tokens), bool(n_img)


_OVERFLOW = re.compile(r"exceeds max_context (\d+)")


def _context_overflow(e: grpc.aio.AioRpcError) -> int | None:
    """The server's max_context when `e` is its INVALID_ARGUMENT answer to a prompt that does not fit, else None."""
    m = _OVERFLOW.search(e.details() or "") if e.code() == grpc.StatusCode.INVALID_ARGUMENT else None
    return int(m.group(1)) if m else None


def _success(info_json: str) -> bool:
    try:
        return bool(json.loads(info_json or "{}").get("success", False))
    except (ValueError, AttributeError):
        return False


async def run_episode(ctx: EpisodeContext, env: EnvClient, tid: str, env_id: str, seed: int,
                      start_version: int, group: str = "") -> Trajectory:
    """One episode under an `episode` span (a trace root); the trajectory carries that span as its traceparent so
    the learner step that trains on it can link to it."""
    with telemetry.span("episode", attributes={"tars.trajectory_id": tid, "tars.env_id": env_id, "tars.seed": seed,
                                               "tars.actor": ctx.actor_id, "tars.start_version": start_version}) as sp:
        tr = await _episode(ctx, env, tid, env_id, seed, start_version, group)
        tr.traceparent = telemetry.traceparent()
        telemetry.set_attrs(sp, **{"tars.outcome": tr.outcome, "tars.return": tr.ret, "tars.success": tr.success,
                                   "tars.turns": len(tr.turns), "tars.error": tr.error or None})
    return tr


async def _episode(ctx: EpisodeContext, env: EnvClient, tid: str, env_id: str, seed: int,
                   start_version: int, group: str = "") -> Trajectory:
    cfg, tok = ctx.cfg, ctx.tok
    t_start = time.time()
    tokens: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    mask: list[int] = []
    turns: list[Turn] = []
    images: dict[str, bytes] = {}
    shown: list[bytes] = []          # screenshots of the turns whose prompt has a placeholder run, in order
    steps: list[J.Step] = []         # what the judge sees
    actor_ms: list[float] = []
    actor_cpu_ms: list[float] = []
    outcome, ret, success, error, instruction = Outcome.TRUNCATED, 0.0, False, "", ""
    fault = Fault.NONE
    cut = ""                         # what cut a truncated episode (core.schema.CUTS); set where it is cut
    note = ""
    env_s = gen_s = 0.0
    sid = ""
    closed = True                    # the last output ended with the end-of-turn token
    obs = None
    try:
        t0 = time.perf_counter()
        with telemetry.client_span("env.create", {"tars.env_id": env_id, "tars.envd": getattr(env, "address", "")}):
            sid, run_id = await env.create(env_id, seed, {k: str(v) for k, v in cfg.env_options.items()})
            obs = await env.reset(sid, run_id, seed)
        env_s += time.perf_counter() - t0
        instruction = obs.instruction
        note = ""
        for turn_i in range(cfg.max_turns):
            t_turn, waited = time.perf_counter(), 0.0
            c_turn = time.thread_time()
            try:
                with telemetry.span("turn", attributes={"tars.turn": turn_i}) as turn_span:
                    # 1. prompt: the new observation after the conversation; one that does not fit the context
                    #    cuts the episode here (it becomes the final state, appended below like any other cut)
                    prompt, with_image = _prompt(cfg, tok, obs, note, first=not tokens, closed=closed)
                    need = len(tokens) + len(prompt) + cfg.max_new_tokens
                    if ctx.max_context and need > ctx.max_context:
                        cut, error = "context", (f"context: prompt ({len(tokens) + len(prompt)} tokens) + max_new_tokens "
                                                 f"({cfg.max_new_tokens}) exceeds max_context {ctx.max_context}")
                        break
                    shot = _screenshot(obs)
                    window = ([*shown, shot] if with_image else shown)[-cfg.image_history:] if cfg.image_history > 0 else []
                    # 2. generate, sticky to one replica under this trajectory id
                    t0, c0 = time.perf_counter(), time.thread_time()
                    with telemetry.client_span("generate", {"tars.prompt_tokens": len(tokens) + len(prompt)}) as gsp:
                        try:
                            g = await ctx.infer.generate(tid, tokens + prompt, cfg.max_new_tokens,
                                                         temperature=cfg.temperature, stop_token_ids=tok.stop_ids,
                                                         timeout_s=cfg.rpc_timeout_s,
                                                         images=[common_pb2.Image(data=b) for b in window])
                        except grpc.aio.AioRpcError as e:
                            limit = _context_overflow(e)
                            if limit is None:
                                raise
                            # The server's own limit is lower than the config said (or the config did not say):
                            # the same cut, and later episodes check against it before asking.
                            ctx.max_context = min(ctx.max_context or limit, limit)
                            cut, error = "context", f"context: {e.details()}"[:500]
                            waited += (time.perf_counter() - t0) * 1000
                            c_turn += time.thread_time() - c0
                            break
                        telemetry.set_attrs(gsp, **{"tars.output_tokens": len(g.output_ids), "tars.replica": g.replica,
                                                    "tars.policy_version": max(g.versions, default=-1)})
                    c_turn += time.thread_time() - c0
                    if with_image:
                        shown.append(shot)   # the user message opens with its placeholders, then the text
                    obs_ref = _obs_ref(obs, images)
                    tokens += prompt
                    logprobs += [0.0] * len(prompt)
                    versions += [-1] * len(prompt)
                    mask += [0] * len(prompt)
                    gen_ms = (time.perf_counter() - t0) * 1000
                    gen_s += gen_ms / 1000
                    waited += gen_ms
                    start = len(tokens)
                    tokens += list(g.output_ids)
                    logprobs += list(g.logprobs)
                    versions += list(g.versions)
                    mask += [1] * len(g.output_ids)
                    closed = bool(g.output_ids) and g.output_ids[-1] == tok.eot_id
                    text = tok.decode(g.output_ids)
                    steps.append(J.Step(obs.text, text.strip(), shot))
                    # 3. parse; unparseable output gets a format penalty and, by default, another try
                    try:
                        _, actions = parse_response(text)
                        action = actions[0]
                    except ParseError as e:
                        turns.append(Turn(obs_ref, text, {}, cfg.format_penalty, start, len(tokens), 0.0, gen_ms, str(e)[:200]))
                        ret += cfg.format_penalty
                        note = INVALID_NOTE  # what the next prompt says (the bootstrap state, if this stops here)
                        if cfg.on_parse_error == "stop":
                            cut = "parse_error"
                            break
                        continue
                    # 4. step the environment
                    t0, c0 = time.perf_counter(), time.thread_time()
                    try:
                        with telemetry.client_span("env.step", {"tars.action": action.type}) as esp:
                            obs = await env.step(sid, run_id, action, raw=text)
                            telemetry.set_attrs(esp, **{"tars.reward": obs.reward, "tars.outcome": obs.outcome})
                    except EnvActionError as e:  # well-formed but not applicable here: same as a format error
                        turns.append(Turn(obs_ref, text, action.to_dict(), cfg.format_penalty, start, len(tokens), 0.0, gen_ms, str(e)[:200]))
                        ret += cfg.format_penalty
                        note = INVALID_NOTE
                        continue
                    finally:
                        c_turn += time.thread_time() - c0
                        env_ms = (time.perf_counter() - t0) * 1000
                        waited += env_ms
                    env_s += env_ms / 1000
                    note = ""
                    turns.append(Turn(obs_ref, text, action.to_dict(), obs.reward, start, len(tokens), env_ms, gen_ms))
                    telemetry.set_attrs(turn_span, **{"tars.reward": obs.reward})
                    ret += obs.reward
                    if obs.outcome == Outcome.INFRA_ERROR:
                        outcome, fault, error = Outcome.INFRA_ERROR, Fault.ENV, obs.info_json[:500]
                        break
                    if obs.outcome != Outcome.RUNNING:
                        outcome = obs.outcome
                        success = _success(obs.info_json)
                        cut = "env" if outcome == Outcome.TRUNCATED else ""
                        break
            finally:
                actor_ms.append((time.perf_counter() - t_turn) * 1000 - waited)
                actor_cpu_ms.append((time.thread_time() - c_turn) * 1000)
        else:
            cut = "max_turns"
    except EnvInfraError as e:
        outcome, fault, error = Outcome.INFRA_ERROR, Fault.ENVD, str(e)[:500]
    except grpc.aio.AioRpcError as e:  # inference failed after the client's retries
        outcome, fault, error = Outcome.INFRA_ERROR, Fault.INFERENCE, f"inference: {e.code().name}: {e.details()}"[:500]
    finally:
        if sid:
            await env.close_session(sid)
    verdict: dict = {}
    if cfg.judge_mode != "off" and outcome != Outcome.INFRA_ERROR and obs is not None:
        outcome, ret, error, verdict = await _judge(ctx, tid, instruction, steps, obs, turns, outcome, ret, error)
        if outcome == Outcome.INFRA_ERROR:  # no verdict, and judge_on_error says that is not a verdict of 0
            fault = Fault.JUDGE
    boot_at = 0
    if outcome == Outcome.TRUNCATED and obs is not None:
        # Cut by a limit, not over: the state it was cut in (the next turn's prompt) still has a value, which the
        # learner's critic reads at boot_at. Appended, never re-tokenised, like every prompt before it.
        final, _ = _prompt(cfg, tok, obs, note, first=not tokens, closed=closed)
        tokens += final
        logprobs += [0.0] * len(final)
        versions += [-1] * len(final)
        mask += [0] * len(final)
        boot_at = len(tokens)
    return Trajectory(
        id=tid, env_id=env_id, outcome=outcome,
        tokens=np.asarray(tokens, np.int32), logprobs=np.minimum(np.asarray(logprobs, np.float32), 0.0),
        versions=np.asarray(versions, np.int32), mask=np.asarray(mask, np.uint8), turns=turns,
        ret=ret, success=success, group=group, task=instruction, start_version=start_version,
        timings={"start": t_start, "end": time.time(), "env_s": env_s, "gen_s": gen_s, "actor_ms": actor_ms,
                 "actor_cpu_ms": actor_cpu_ms},
        actor=ctx.actor_id, images=images, error=error, judge=verdict,
        fault=fault, boot_at=boot_at, truncated_by=(cut or "max_turns") if outcome == Outcome.TRUNCATED else "",
    )


async def _judge(ctx: EpisodeContext, tid: str, instruction: str, steps: list, obs: Obs, turns: list[Turn],
                 outcome: Outcome, ret: float, error: str):
    """Ask the judge; returns (outcome, return, error, verdict dict) with the verdict's reward applied."""
    cfg = ctx.cfg
    try:
        v = await J.ask(ctx.judge_infer or ctx.infer, ctx.tok, cfg, tid, instruction, steps, obs.text, _screenshot(obs))
    except J.JudgeError as e:
        if cfg.judge_on_error == "infra_error":  # no verdict is not a verdict of 0
            return Outcome.INFRA_ERROR, ret, f"judge: {e}"[:500], {"error": str(e)[:200]}
        return outcome, ret, error, {"error": str(e)[:200], "fallback": "env"}
    reward = cfg.judge_weight * v.score
    if turns:
        last = turns[-1]
        if cfg.judge_mode == "replace":
            # Env rewards out, format penalties (turns with a parse error) kept, the verdict on the last turn.
            for t in turns:
                if not t.parse_error:
                    ret -= t.reward
                    t.reward = 0.0
        last.reward += reward
        ret += reward
    return outcome, ret, error, {**v.to_dict(), "reward": reward, "mode": cfg.judge_mode}
